"""Each process's peak with context parallelism against FSDP2 alone, side by side: a Llama (4 blocks, 256 wide, 8
heads, 4 KV heads, a 1,024-token vocabulary) on rows of 2,048 tokens, one row per process-group a step, 2 processes:
FSDP2 over 2 (each process computes a whole row) and CP 2 (each computes half of one row). Each launch's processes
measure their peak (the peak RSS on a CPU host, CUDA's peak allocation on a GPU), what they held before fit(), and
tokens a second after the first step; the largest over the processes is shown.

    python benchmarks/context.py                   # about a minute on a 2-core CPU
    python benchmarks/context.py --tokens 8192     # longer rows

On a CPU glibc is given a fixed mmap threshold, as benchmarks/chunked_loss.py says why.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from chunked_loss import held_bytes, peak_bytes  # noqa: E402


def child(args: argparse.Namespace) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    from trainer import TrainConfig, Trainer

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=1024,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=args.tokens,
        attn_implementation="sdpa",
    )
    ids = torch.randint(0, 1024, (8, args.tokens))
    rows = [{"input_ids": row, "labels": row} for row in ids]
    train = TrainConfig(output_dir=args.out, batch_size=1, max_steps=args.steps, log_every=1, shuffle=False)
    measured_fit(Trainer(LlamaForCausalLM(config), train, train_data=rows), tokens_a_row=args.tokens)


def measured_fit(trainer: Any, *, tokens_a_row: int) -> None:
    """``trainer.fit()`` (one row per data-parallel process a step), then the main process prints every process's
    peak, what it held before, and tokens a second after the first step, after ``RESULT``."""
    before, ends = held_bytes(), []

    class Clock:
        def on_step_end(self, trainer: Any) -> None:
            ends.append(time.perf_counter())

    trainer.callbacks.append(Clock())
    trainer.fit()
    tokens_s = trainer.run.dp.size * tokens_a_row * (len(ends) - 1) / (ends[-1] - ends[0])
    found = trainer.run.gather({"peak": peak_bytes(), "before": before, "tokens_s": tokens_s})
    if trainer.run.main:
        print("RESULT " + json.dumps(found))


def launched(name: str, command: list[str], settings: dict[str, str]) -> dict[str, float]:
    """``command`` run (glibc's mmap threshold fixed, one thread a process): the largest peak and training rise over
    its processes, and the main process's tokens a second."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(128 * 1024), "OMP_NUM_THREADS": "1", **settings}
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    result = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if not result:
        sys.exit(f"{name} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    found = json.loads(result[-1][len("RESULT ") :])
    return {
        "peak": max(p["peak"] for p in found),
        "training": max(p["peak"] - p["before"] for p in found),
        "tokens_s": found[0]["tokens_s"],
    }


def print_rows(rows: dict[str, dict[str, float]], title: str) -> None:
    """The rows, each against the first."""
    base, width = next(iter(rows.values())), max(len(name) for name in rows)
    print(f"{title}, {'CUDA' if torch.cuda.is_available() else 'CPU'}")
    print(f"{'layout':>{width}} {'peak MiB':>9} {'x':>5} {'training MiB':>13} {'x':>5} {'tokens/s':>9} {'x':>5}")
    for name, row in rows.items():
        ratios = [row[key] / base[key] for key in ("peak", "training", "tokens_s")]
        print(
            f"{name:>{width}} {row['peak'] / 2**20:9.0f} {ratios[0]:5.2f} {row['training'] / 2**20:13.0f} "
            f"{ratios[1]:5.2f} {row['tokens_s']:9.0f} {ratios[2]:5.2f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default="runs/bench-context")
    args = parser.parse_args()
    if args.child:
        return child(args)
    rows = {}
    for name, sizes in (("FSDP2 over 2", {}), ("CP 2", {"PARALLELISM_CONFIG_CP_SIZE": "2"})):
        settings = dict(
            ACCELERATE_USE_PARALLELISM_CONFIG="true", PARALLELISM_CONFIG_DP_SHARD_SIZE="1" if sizes else "2"
        )
        command = ["accelerate", "launch", "--config_file", str(ROOT / "accelerate_configs" / "fsdp.yaml")]
        command += ["--num_processes", "2", __file__, "--child", "--tokens", str(args.tokens)]
        command += ["--steps", str(args.steps), "--out", f"{args.out}/{len(rows)}"]
        rows[name] = launched(name, command, {**settings, **sizes})
    print_rows(rows, f"rows of {args.tokens} tokens, 2 processes")


if __name__ == "__main__":
    main()
