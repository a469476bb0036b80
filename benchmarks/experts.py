"""Expert parallelism against FSDP2 alone, side by side, on one mixture of experts: a Qwen3-MoE (4 blocks, 256 wide,
8 experts of 1,024, top 2, a 4,096-token vocabulary, AdamW) on rows of 512 tokens, one row per process a step, 4
processes: FSDP2 over 4 (every expert all-gathered on every process, each block) and EP 2 x FSDP2 (each process
computes 4 whole experts, each sharded over 2, the tokens sent to them all-to-all). Each launch's processes measure
their peak (the peak RSS on a CPU host, CUDA's peak allocation on a GPU), what they held before fit(), and tokens a
second after the first step; the largest over the processes is shown.

    python benchmarks/experts.py                   # a few minutes on a 2-core CPU
    python benchmarks/experts.py --processes 2     # EP 2 over 2 against FSDP2 over 2

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

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from chunked_loss import held_bytes, peak_bytes  # noqa: E402


def child(args: argparse.Namespace) -> None:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from trainer import TrainConfig, Trainer

    torch.manual_seed(0)
    config = Qwen3MoeConfig(
        vocab_size=4096,
        hidden_size=256,
        intermediate_size=1024,
        moe_intermediate_size=1024,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=32,
        num_experts=8,
        num_experts_per_tok=2,
        output_router_logits=True,
        max_position_embeddings=args.tokens,
    )
    ids = torch.randint(0, 4096, (4 * args.processes * args.steps, args.tokens))
    rows = [{"input_ids": row, "labels": row} for row in ids]
    train = TrainConfig(
        output_dir=args.out, batch_size=1, max_steps=args.steps, log_every=1, shuffle=False, ep_size=args.ep
    )
    trainer = Trainer(Qwen3MoeForCausalLM(config), train, train_data=rows)
    before, ends = held_bytes(), []

    class Clock:
        def on_step_end(self, trainer: Trainer) -> None:
            ends.append(time.perf_counter())

    trainer.callbacks.append(Clock())
    trainer.fit()
    tokens_s = trainer.run.dp.size * args.tokens * (len(ends) - 1) / (ends[-1] - ends[0])
    found = trainer.run.gather({"peak": peak_bytes(), "before": before, "tokens_s": tokens_s})
    if trainer.run.main:
        print("RESULT " + json.dumps(found))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--processes", type=int, default=4)
    parser.add_argument("--ep", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default="runs/bench-experts")
    args = parser.parse_args()
    if args.child:
        return child(args)
    rows = {}
    names = {f"FSDP2 over {args.processes}": 1, f"EP 2 x FSDP2 over {args.processes}": 2}
    for name, ep in names.items():
        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(128 * 1024), "OMP_NUM_THREADS": "1"}
        command = ["accelerate", "launch", "--config_file", str(ROOT / "accelerate_configs" / "fsdp.yaml")]
        command += ["--num_processes", str(args.processes), __file__, "--child", "--tokens", str(args.tokens)]
        command += ["--steps", str(args.steps), "--processes", str(args.processes), "--ep", str(ep)]
        command += ["--out", f"{args.out}/{len(rows)}"]
        done = subprocess.run(command, capture_output=True, text=True, env=env)
        result = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
        if not result:
            sys.exit(f"{name} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
        found = json.loads(result[-1][len("RESULT ") :])
        rows[name] = {
            "peak": max(p["peak"] for p in found),
            "training": max(p["peak"] - p["before"] for p in found),
            "tokens_s": found[0]["tokens_s"],
        }
    base = next(iter(rows.values()))
    print(f"rows of {args.tokens} tokens, {args.processes} processes, {'CUDA' if torch.cuda.is_available() else 'CPU'}")
    print(f"{'layout':>22} {'peak MiB':>9} {'x':>5} {'training MiB':>13} {'x':>5} {'tokens/s':>9} {'x':>5}")
    for name, row in rows.items():
        ratios = [row[key] / base[key] for key in ("peak", "training", "tokens_s")]
        print(
            f"{name:>22} {row['peak'] / 2**20:9.0f} {ratios[0]:5.2f} {row['training'] / 2**20:13.0f} "
            f"{ratios[1]:5.2f} {row['tokens_s']:9.0f} {ratios[2]:5.2f}"
        )


if __name__ == "__main__":
    main()
