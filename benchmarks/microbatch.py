"""What ``auto_microbatch`` costs while nothing runs out: the Trainer's step time with and without it, on a GPT-2
(4 layers, width 256, vocab 8192: 5.3M parameters), AdamW, 2 micro-batches of 4 x 128 tokens a step, 2 processes
over gloo, sharded (FSDP2) and DDP. Each variant is a launch of its own, round after round in turn, so the machine's
drift touches all of them.

    python benchmarks/microbatch.py                 # 3 rounds, about 4 minutes on a 2-core CPU
    python benchmarks/microbatch.py --rounds 5 --steps 40

Step time: rank 0's median time from one step's end to the next's, after 5 warm-up steps. Expected: under DDP the
gradient all-reduce waits for the window's last backward (no overlap) and one host all-reduce follows each piece;
sharded, one host all-reduce comes before each of FSDP2's all-gathers and reduce-scatters (3 a block a micro-batch)
and every micro-batch reduce-scatters its own gradients, as ``reduce_every_micro_batch`` does.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WARMUP = 5


def child(auto: bool, steps: int) -> None:
    from step_times import StepEnds, small_gpt2

    from trainer import TrainConfig, Trainer

    model, rows = small_gpt2((steps + WARMUP) * 16)
    ends = StepEnds()

    with tempfile.TemporaryDirectory() as out:
        config = TrainConfig(
            output_dir=out,
            batch_size=4,
            gradient_accumulation_steps=2,
            optimizer="adamw",
            lr=1e-4,
            max_steps=WARMUP + steps,
            log_every=1000,
            shuffle=False,
            auto_microbatch=auto,
        )
        trainer = Trainer(model, config, train_data=rows, callbacks=[ends])
        trainer.fit()
    if trainer.accelerator.is_main_process:
        seconds = ends.median(WARMUP)
        print(json.dumps({"step_s": seconds}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--child", choices=["with", "without"])
    args = parser.parse_args()
    if args.child:
        return child(args.child == "with", args.steps)
    variants = [(config, auto) for config in ("fsdp.yaml", "cpu.yaml") for auto in ("without", "with")]
    results: dict[tuple, list[float]] = {variant: [] for variant in variants}
    for _ in range(args.rounds):
        for config, auto in variants:
            command = [
                "accelerate",
                "launch",
                "--config_file",
                str(ROOT / "accelerate_configs" / config),
                "--num_processes",
                "2",
                __file__,
                "--child",
                auto,
                "--steps",
                str(args.steps),
            ]
            out = subprocess.run(
                command,
                capture_output=True,
                text=True,
                check=True,
                cwd=ROOT,
                env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)},
            )
            results[config, auto].append(json.loads(out.stdout.strip().splitlines()[-1])["step_s"])
    step = {variant: statistics.median(times) for variant, times in results.items()}
    print("| | without (ms) | with auto_microbatch (ms) | ratio |\n| --- | --- | --- | --- |")
    for config, name in (("fsdp.yaml", "FSDP2"), ("cpu.yaml", "DDP")):
        without, with_ = step[config, "without"], step[config, "with"]
        print(f"| {name}, 2 processes | {without * 1e3:.1f} | {with_ * 1e3:.1f} | {with_ / without:.3f} |")


if __name__ == "__main__":
    main()
