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
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from context import launched, measured_fit, print_rows  # noqa: E402


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
    measured_fit(Trainer(Qwen3MoeForCausalLM(config), train, train_data=rows), tokens_a_row=args.tokens)


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
    for name, ep in ((f"FSDP2 over {args.processes}", 1), (f"EP 2 x FSDP2 over {args.processes}", 2)):
        command = ["accelerate", "launch", "--config_file", str(ROOT / "accelerate_configs" / "fsdp.yaml")]
        command += ["--num_processes", str(args.processes), __file__, "--child", "--tokens", str(args.tokens)]
        command += ["--steps", str(args.steps), "--processes", str(args.processes), "--ep", str(ep)]
        rows[name] = launched(name, command + ["--out", f"{args.out}/{len(rows)}"], {})
    print_rows(rows, f"rows of {args.tokens} tokens, {args.processes} processes")


if __name__ == "__main__":
    main()
