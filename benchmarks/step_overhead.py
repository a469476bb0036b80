"""What the Trainer adds per step where the step itself costs almost nothing: a 64-128-1 MLP, SGD, batch 32, 2,000
steps on one CPU process, against a raw Accelerate loop and a raw PyTorch loop doing the same work.

    python benchmarks/step_overhead.py              # 5 rounds, about 2 minutes on a 2-core CPU
    python benchmarks/step_overhead.py --rounds 9 --steps 4000
    python benchmarks/step_overhead.py --baseline ../main-before   # + the Trainer of another checkout, in turn
    python benchmarks/step_overhead.py --schedule --rounds 3 --steps 400   # warm-up + cosine lr in every variant

Each variant runs in a fresh process, round after round in turn (raw PyTorch, raw Accelerate, ours), so that the
machine's drift touches all three alike. Steady step time: the median of the step-to-step times after 200 warm-up
steps (the median shrugs off the odd pause of a shared VM). Start-up: from the process's launch to the end of its
first step (imports, building the loop, the first batch). Every variant: the same model, data and seed; plain SGD at
a constant lr; the loss read on the host every 50 steps (the Trainer's log_every=50); one CPU thread. With
``--schedule``, 10 warm-up steps and a cosine lr: the raw loops take transformers' ``get_cosine_schedule_with_warmup``
as such loops do, the Trainer ``lr_scheduler: cosine``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WARMUP, LOG_EVERY, BATCH = 200, 50, 32
VARIANTS = {"torch": "raw PyTorch loop", "accelerate": "raw Accelerate loop", "ours": "our Trainer"}


def build(steps: int):
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 1))
    x = torch.randn(steps * BATCH, 64)
    data = torch.utils.data.TensorDataset(x, x[:, :1] * 0.5 + 0.1)
    return model, data


def mse(model, batch):
    import torch

    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)


def raw_schedule(optimizer, steps: int):
    """``--schedule``: transformers' warm-up + cosine, as a hand-written loop takes it; else none."""
    if not os.environ.get("BENCH_SCHEDULE"):
        return None
    from transformers import get_cosine_schedule_with_warmup

    return get_cosine_schedule_with_warmup(optimizer, 10, steps)


def run_torch(model, data, steps: int, tick) -> None:
    import torch

    loader = torch.utils.data.DataLoader(data, batch_size=BATCH, shuffle=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    hand_written_loop(
        model, loader, optimizer, lambda loss: loss.backward(), steps, tick, raw_schedule(optimizer, steps)
    )


def run_accelerate(model, data, steps: int, tick) -> None:
    import torch
    from accelerate import Accelerator

    accelerator = Accelerator()
    loader = torch.utils.data.DataLoader(data, batch_size=BATCH, shuffle=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    hand_written_loop(model, loader, optimizer, accelerator.backward, steps, tick, raw_schedule(optimizer, steps))


def hand_written_loop(model, loader, optimizer, backward, steps: int, tick, schedule=None) -> None:
    """The loop as a user writes it, given torch's or accelerate's backward (and an lr schedule, or none)."""
    for step, batch in enumerate(loader, 1):
        loss = mse(model, batch)
        backward(loss)
        optimizer.step()
        if schedule is not None:
            schedule.step()
        optimizer.zero_grad()
        if step % LOG_EVERY == 0:
            loss.item()
        tick()
        if step == steps:
            return


def run_ours(model, data, steps: int, tick, root: Path = ROOT) -> None:
    sys.path.insert(0, str(root))
    from trainer import TrainConfig, Trainer

    class Tick:
        def on_step_end(self, trainer):
            tick()

    schedule = {"lr_scheduler": "cosine", "warmup_steps": 10} if os.environ.get("BENCH_SCHEDULE") else {}
    config = TrainConfig(
        output_dir=tempfile.mkdtemp(),
        max_steps=steps,
        batch_size=BATCH,
        optimizer="sgd",
        lr=0.01,
        log_every=LOG_EVERY,
        **schedule,
    )
    Trainer(model, config, train_data=data, loss_fn=mse, callbacks=[Tick()]).fit()


def run_baseline(model, data, steps: int, tick) -> None:
    """Our Trainer as another checkout has it (``--baseline``): an A/B of a change, round by round."""
    run_ours(model, data, steps, tick, root=Path(os.environ["BENCH_BASELINE"]))


def worker(variant: str, steps: int) -> None:
    ends: list[float] = []
    model, data = build(steps)
    globals()[f"run_{variant}"](model, data, steps, lambda: ends.append(time.perf_counter()))
    gaps = [b - a for a, b in zip(ends[WARMUP:-1], ends[WARMUP + 1 :], strict=True)]
    first_step_end = time.time() - (time.perf_counter() - ends[0])
    result = {
        "step_s": statistics.median(gaps),
        "mean_step_s": statistics.fmean(gaps),
        "startup_s": first_step_end - float(os.environ["BENCH_LAUNCHED_AT"]),
    }
    print("RESULT " + json.dumps(result), flush=True)


def measure(variant: str, steps: int, baseline: str = "", schedule: bool = False) -> dict:
    env = {
        **os.environ,
        "BENCH_LAUNCHED_AT": repr(time.time()),
        "OMP_NUM_THREADS": "1",
        "WANDB_MODE": "disabled",
        "BENCH_BASELINE": baseline,
        "BENCH_SCHEDULE": "1" if schedule else "",
    }
    out = subprocess.run(
        [sys.executable, __file__, "--worker", variant, "--steps", str(steps)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    line = next(line for line in out.stdout.splitlines() if line.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--baseline", default="", help="another checkout of this project: its Trainer runs too")
    parser.add_argument("--schedule", action="store_true", help="10 warm-up steps and a cosine lr in every variant")
    parser.add_argument("--worker", choices=[*VARIANTS, "baseline"])
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker, args.steps)
    if args.baseline:
        VARIANTS["baseline"] = f"Trainer of {Path(args.baseline).name}"

    rounds: list[dict[str, dict]] = []
    for number in range(1, args.rounds + 1):
        baseline = str(Path(args.baseline).resolve()) if args.baseline else ""
        rounds.append({variant: measure(variant, args.steps, baseline, args.schedule) for variant in VARIANTS})
        figures = ", ".join(f"{v} {1e6 * r['step_s']:.0f} us" for v, r in rounds[-1].items())
        print(f"round {number}: {figures}", flush=True)

    print(
        f"\n{args.steps} steps, {args.rounds} rounds; speed = raw Accelerate's step time / this one's "
        "(above 1: faster than raw Accelerate)"
    )
    print(f"{'':20} {'step (median)':>14} {'speed vs raw Accelerate':>26} {'start-up':>10} {'vs raw Accelerate':>18}")
    for variant, label in VARIANTS.items():
        speed = [r["accelerate"]["step_s"] / r[variant]["step_s"] for r in rounds]
        startup = [r[variant]["startup_s"] - r["accelerate"]["startup_s"] for r in rounds]
        step_us = 1e6 * statistics.median(r[variant]["step_s"] for r in rounds)
        print(
            f"{label:20} {step_us:>11.0f} us {statistics.median(speed):>10.3f} ({min(speed):.3f}-{max(speed):.3f})"
            f" {statistics.median(r[variant]['startup_s'] for r in rounds):>9.2f}s"
            f" {statistics.median(startup):>+17.2f}s"
        )
    out = ROOT / "runs" / "benchmarks"
    out.mkdir(parents=True, exist_ok=True)
    (out / "step_overhead.json").write_text(json.dumps(rounds, indent=1))


if __name__ == "__main__":
    main()
