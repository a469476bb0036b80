"""What each process holds of the model's weights, gradients and AdamW state, DDP against FSDP2, at 1, 2 and 4
processes: the trainer's own runs (a GPT-2 built from a config, two steps), each process measuring the tensors it
holds after a step; on a GPU also the peak memory the step allocated.

    python benchmarks/memory.py                        # 6 runs of torchrun, about 2 minutes on a 2-core CPU
    python benchmarks/memory.py --layers 12 --width 768 --processes 1 2 4 8      # GPT-2 124M, on a node of GPUs

FSDP2 holds about 1/K of DDP's 16 bytes a parameter (4 of weights, 4 of gradients, 8 of AdamW state) on each of
K processes; what it cannot shard (nothing here) and the unsharded weights of the block being computed come on top.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

FSDP2_ENV = {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP"}


def local_bytes(tensors) -> int:
    """Bytes of the parts of ``tensors`` this process holds (a sharded tensor's shard)."""
    total = 0
    for tensor in tensors:
        tensor = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        total += tensor.numel() * tensor.element_size()
    return total


class Measure:
    """After the first step: the optimizer state; gradients are the trainable weights' size (zeroed by then)."""

    def __init__(self):
        self.figures = {}

    def on_step_end(self, trainer) -> None:
        if self.figures:
            return
        parameters = [p for p in trainer.model.parameters()]
        state = [v for s in trainer.optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim()]
        self.figures = {"weights": local_bytes(parameters),
                        "gradients": local_bytes(p for p in parameters if p.requires_grad),
                        "optimizer": local_bytes(state)}  # fmt: skip
        if torch.cuda.is_available():
            self.figures["peak"] = torch.cuda.max_memory_allocated()


def worker(args) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    from trainer import TrainConfig, Trainer

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=args.layers, n_embd=args.width, n_head=args.width // 64,
                                       vocab_size=args.vocab, n_positions=args.seq_len))  # fmt: skip
    tokens = torch.randint(0, args.vocab, (64, args.seq_len))
    data = [{"input_ids": row, "labels": row} for row in tokens]
    measure = Measure()
    config = TrainConfig(output_dir=args.out, max_steps=2, batch_size=args.batch_size, log_every=2,
                         preemption_signals="")  # fmt: skip
    trainer = Trainer(model, config, train_data=data, callbacks=[measure])
    trainer.fit()
    from accelerate.utils import gather_object

    rows = gather_object([measure.figures])
    if trainer.accelerator.is_main_process:
        print("MEASURED " + json.dumps({"parameters": sum(p.numel() for p in model.parameters()), "ranks": rows}))


def run(kind: str, processes: int, args) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled", **(FSDP2_ENV if kind == "FSDP2" else {})}
    out = Path(args.out) / f"{kind}-{processes}"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(processes),
               __file__, "--worker", "--out", str(out), "--layers", str(args.layers), "--width", str(args.width),
               "--vocab", str(args.vocab), "--seq-len", str(args.seq_len), "--batch-size", str(args.batch_size)]
    result = subprocess.run(command, env=env, capture_output=True, text=True)
    line = next((line for line in result.stdout.splitlines() if line.startswith("MEASURED ")), None)
    if line is None:
        raise SystemExit(f"{kind} x {processes} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return json.loads(line.removeprefix("MEASURED "))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--processes", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=10_000)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--out", default="runs/benchmark-memory")
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    mib = 2**20
    print("| processes | kind | weights MiB | gradients MiB | AdamW state MiB | total MiB | vs DDP | peak GPU MiB |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for processes in args.processes:
        ddp_total = None
        for kind in ("DDP", "FSDP2"):
            measured = run(kind, processes, args)
            rank0 = measured["ranks"][0]
            total = rank0["weights"] + rank0["gradients"] + rank0["optimizer"]
            ddp_total = ddp_total or total
            peak = f"{rank0['peak'] / mib:,.0f}" if "peak" in rank0 else "-"
            print(f"| {processes} | {kind} | {rank0['weights'] / mib:,.1f} | {rank0['gradients'] / mib:,.1f} | "
                  f"{rank0['optimizer'] / mib:,.1f} | {total / mib:,.1f} | {total / ddp_total:.2f} | {peak} |",
                  flush=True)  # fmt: skip
    print(f"(rank 0 of each run; GPT-2 {measured['parameters']:,} parameters)")


if __name__ == "__main__":
    main()
