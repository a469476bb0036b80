"""Gradient accumulation under FSDP2, both ways: the gradients reduced once at the window's end (the default: each
process holds the whole model's unsharded gradients through the window, DDP's float order) against
``reduce_every_micro_batch: true`` (a reduce-scatter per micro-batch, the gradients sharded all along). Each
process's peak memory (peak RSS on a CPU host, where a process's memory is its device's; the CUDA peak on a GPU)
and the median step time, the two ways alternated round by round in separate launches of the same script.

    python benchmarks/accumulation.py                          # 2 processes, GPT-2 of 24M parameters, 2 rounds
    python benchmarks/accumulation.py --layers 12 --width 768 --vocab 50257 --processes 8 --rounds 3   # on GPUs

The model is built on the meta device, so that what the peak adds above the shards is the window's gradients and
the activations, not a whole model built on the CPU first.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from memory import FSDP2_ENV, launch_measured, peak_bytes  # noqa: E402


class StepTimes:
    def __init__(self):
        self.times, self.last = [], None

    def on_step_end(self, trainer) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        now = time.perf_counter()
        if self.last is not None:
            self.times.append(now - self.last)
        self.last = now


def worker(args) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    from trainer import TrainConfig, Trainer

    config = GPT2Config(
        n_layer=args.layers, n_embd=args.width, n_head=args.width // 64, vocab_size=args.vocab, n_positions=args.seq_len
    )
    with torch.device("meta"):
        model = GPT2LMHeadModel(config)
    tokens = torch.randint(0, args.vocab, (args.steps * args.accumulation * 16, args.seq_len))
    data = [{"input_ids": row, "labels": row} for row in tokens]
    times = StepTimes()
    train = TrainConfig(
        output_dir=args.out,
        max_steps=args.steps,
        batch_size=args.batch_size,
        gradient_accumulation_steps=args.accumulation,
        log_every=args.steps,
        preemption_signals="",
        reduce_every_micro_batch=args.every,
    )
    trainer = Trainer(model, train, train_data=data, callbacks=[times])
    trainer.fit()
    from accelerate.utils import gather_object

    rows = gather_object([{"peak": peak_bytes(), "step_s": statistics.median(times.times)}])
    if trainer.accelerator.is_main_process:
        print("MEASURED " + json.dumps(rows))


def run(every: bool, args, round_: int) -> list[dict]:
    flags = [
        "--out",
        str(Path(args.out) / f"{every}-{round_}"),
        "--layers",
        str(args.layers),
        "--width",
        str(args.width),
        "--vocab",
        str(args.vocab),
        "--seq-len",
        str(args.seq_len),
        "--batch-size",
        str(args.batch_size),
        "--accumulation",
        str(args.accumulation),
        "--steps",
        str(args.steps),
        *(["--every"] if every else []),
    ]
    return launch_measured(__file__, args.processes, flags, FSDP2_ENV, "accumulation")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--every", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=10_000)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--accumulation", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", default="runs/benchmark-accumulation")
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    mib, where = 2**20, "GPU" if torch.cuda.is_available() else "RSS"
    print(f"| round | gradients | peak {where} MiB (largest rank) | median step s | peak vs at the end | step vs |")
    print("| --- | --- | --- | --- | --- | --- |")
    for round_ in range(args.rounds):
        measured = {every: run(every, args, round_) for every in (False, True)}
        figures = {
            every: (max(r["peak"] for r in rows), max(r["step_s"] for r in rows)) for every, rows in measured.items()
        }
        for every, (peak, step) in figures.items():
            words = "reduce-scattered every micro-batch" if every else "reduced at the window's end"
            print(
                f"| {round_ + 1} | {words} | {peak / mib:,.0f} | {step:.3f} | {peak / figures[False][0]:.2f} | "
                f"{step / figures[False][1]:.2f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
