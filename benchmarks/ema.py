"""What an average of the weights (``ema_decay``) costs: the Trainer's step time and each process's peak memory with
and without it, on a GPT-2 (4 layers, width 256, vocab 8192: 5.3M parameters), AdamW, batch 8 of 128 tokens, one
CPU process. Each variant runs in a fresh process, round after round in turn, so the machine's drift touches both.

    python benchmarks/ema.py                 # 3 rounds, about 3 minutes on a 2-core CPU
    python benchmarks/ema.py --rounds 5 --steps 60

Step time: the median time from one step's end to the next's, after 5 warm-up steps; peak: the process's peak
RSS (VmHWM), a CPU process's device memory. Expected: the update is one fused ``lerp_`` over the weights (AdamW's
step touches four tensors of that size, the EMA two), and the average one more copy of the weights (4 bytes a
parameter beside the 16 of weights, gradients and AdamW state).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WARMUP = 5


def child(ema: bool, steps: int) -> None:
    import torch
    from step_times import StepEnds, small_gpt2

    from trainer import TrainConfig, Trainer

    torch.set_num_threads(1)
    model, rows = small_gpt2((steps + WARMUP) * 8)
    ends = StepEnds()

    with tempfile.TemporaryDirectory() as out:
        config = TrainConfig(
            output_dir=out,
            batch_size=8,
            optimizer="adamw",
            lr=1e-4,
            max_steps=WARMUP + steps,
            log_every=1000,
            shuffle=False,
            ema_decay=0.999 if ema else None,
        )
        Trainer(model, config, train_data=rows, callbacks=[ends]).fit()
    seconds = ends.median(WARMUP)
    peak_kib = int(
        next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith("VmHWM")).split()[1]
    )
    print(json.dumps({"step_s": seconds, "peak_mib": peak_kib / 1024}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--child", choices=["with", "without"])
    args = parser.parse_args()
    if args.child:
        return child(args.child == "with", args.steps)
    results: dict[str, list[dict]] = {"without": [], "with": []}
    for _ in range(args.rounds):
        for variant in results:
            out = subprocess.run(
                [sys.executable, __file__, "--child", variant, "--steps", str(args.steps)],
                capture_output=True,
                text=True,
                check=True,
                cwd=ROOT,
                env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)},
            )
            results[variant].append(json.loads(out.stdout.strip().splitlines()[-1]))
    step = {v: statistics.median(r["step_s"] for r in runs) for v, runs in results.items()}
    peak = {v: statistics.median(r["peak_mib"] for r in runs) for v, runs in results.items()}
    print("| | step (ms) | peak (MiB) |\n| --- | --- | --- |")
    for variant in results:
        print(f"| {variant} ema_decay | {step[variant] * 1e3:.1f} | {peak[variant]:.0f} |")
    print(f"| ratio with / without | {step['with'] / step['without']:.3f} | {peak['with'] / peak['without']:.3f} |")


if __name__ == "__main__":
    main()
