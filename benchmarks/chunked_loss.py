"""The training peak of a causal language model's loss with ``chunked_loss`` against without, side by side: each run
in a process of its own (a Llama of 2 blocks, 256 wide, a 32,000-token vocabulary; 4 rows of 512 tokens; 3 AdamW
steps), measuring its peak (the peak RSS on a CPU host, CUDA's peak allocation on a GPU), what it held before fit()
(the model, its data, the libraries), and seconds a step after the first.

On a CPU each run's glibc is given a fixed mmap threshold (``MALLOC_MMAP_THRESHOLD_``, unless ``--glibc-default``):
by default glibc raises it to the largest block freed so far, after which every smaller tensor comes from its heap
and what is freed stays resident, so the peak RSS measures glibc's retention more than what a step allocates (a GPU's
caching allocator reuses its blocks instead).

    python benchmarks/chunked_loss.py                       # about a minute on a 2-core CPU
    python benchmarks/chunked_loss.py --vocab 128256 --tokens 1024 --chunks 256 1024 4096
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def held_bytes() -> int:
    """What this process holds now: CUDA's allocation on a GPU, the resident set on a CPU."""
    if torch.cuda.is_available():
        return torch.cuda.memory_allocated()
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_bytes() -> int:
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated()
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def child(args: argparse.Namespace) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    from trainer import TrainConfig, Trainer

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=args.tokens,
    )
    model = LlamaForCausalLM(config)
    ids = torch.randint(0, args.vocab, (4 * (args.steps + 1), args.tokens))
    rows = [{"input_ids": row, "labels": row} for row in ids]
    settings = {"chunked_loss": args.chunk > 0, "loss_chunk_tokens": max(args.chunk, 1)}
    train = TrainConfig(output_dir=args.out, batch_size=4, max_steps=args.steps, log_every=1, shuffle=False, **settings)
    trainer = Trainer(model, train, train_data=rows)
    before = held_bytes()
    started = []

    class Clock:
        def on_step_end(self, trainer: Trainer) -> None:
            started.append(time.perf_counter())

    trainer.callbacks.append(Clock())
    trainer.fit()
    step_s = (started[-1] - started[0]) / (len(started) - 1)
    print(json.dumps({"peak": peak_bytes(), "before": before, "step_s": step_s}))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--chunks", type=int, nargs="+", default=[1024, 256], help="loss_chunk_tokens to try")
    parser.add_argument("--glibc-default", action="store_true", help="leave glibc's mmap threshold dynamic")
    parser.add_argument("--chunk", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default="runs/bench-chunked")
    args = parser.parse_args()
    if args.chunk is not None:
        return child(args)
    rows = {}
    for chunk in [0, *args.chunks]:
        command = [sys.executable, __file__, "--chunk", str(chunk), "--vocab", str(args.vocab)]
        command += ["--tokens", str(args.tokens), "--steps", str(args.steps), "--out", f"{args.out}/{chunk}"]
        fixed = {} if args.glibc_default else {"MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}
        done = subprocess.run(command, capture_output=True, text=True, check=True, env={**os.environ, **fixed})
        rows[chunk] = json.loads(done.stdout.strip().splitlines()[-1])
    base = rows[0]
    where = (
        "CUDA"
        if torch.cuda.is_available()
        else f"CPU, glibc's mmap threshold {'dynamic' if args.glibc_default else 'fixed'}"
    )
    print(f"vocab {args.vocab}, 4 x {args.tokens} tokens, {where}")
    print(f"{'loss':>22} {'peak MiB':>9} {'x':>5} {'training MiB':>13} {'x':>5} {'s/step':>7} {'x':>5}")
    for chunk, row in rows.items():
        name = "model's own" if chunk == 0 else f"chunked, {chunk} tokens"
        rise, base_rise = row["peak"] - row["before"], base["peak"] - base["before"]
        print(
            f"{name:>22} {row['peak'] / 2**20:9.0f} {row['peak'] / base['peak']:5.2f} {rise / 2**20:13.0f} "
            f"{rise / base_rise:5.2f} {row['step_s']:7.3f} {row['step_s'] / base['step_s']:5.2f}"
        )


if __name__ == "__main__":
    main()
