"""How long a mid-epoch resume takes before its first new step, by position in a 1,000,000-example epoch.

    python benchmarks/resume_skip.py            # one process, CPU; about a minute

For each position (0%, 50%, 90% of the epoch) it writes a checkpoint there, then times a fresh Trainer resuming
from it: construction + load_state, and fit() up to the end of its first new optimizer step. It also counts how
many examples the resumed run read before that step: two batches (the step's, and the one accelerate's loader
reads ahead), whatever the position, since skipped examples are never loaded.
Beside it, in the same process, the time to reach the same batch with accelerate's ``skip_first_batches`` (walks
the batch sampler's indices) and by reading and discarding the batches (what a naive resume does).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch
from accelerate import skip_first_batches
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from trainer import TrainConfig, Trainer  # noqa: E402


class CountingData(Dataset):
    """``size`` synthetic examples made on demand; counts how many were read."""

    def __init__(self, size: int, dim: int = 16):
        self.size, self.dim, self.reads = size, dim, 0

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> torch.Tensor:
        self.reads += 1
        return torch.full((self.dim,), float(i % 97) / 97)


def loss_fn(model, batch):
    return model(batch).pow(2).mean()


class FirstStep:
    def on_step_end(self, trainer) -> None:
        if not hasattr(self, "at"):
            self.at = time.perf_counter()


def config_for(output_dir, resume=None, max_steps=None, batch_size=32) -> TrainConfig:
    return TrainConfig(
        output_dir=str(output_dir),
        epochs=1,
        max_steps=max_steps,
        batch_size=batch_size,
        optimizer="sgd",
        lr=0.01,
        shuffle=True,
        log_every=10**9,
        resume=resume,
    )


def time_resume(root: Path, size: int, fraction: float, batch_size: int) -> dict:
    batches = int(size // batch_size * fraction)
    out = root / f"at-{fraction:.2f}"
    writer = Trainer(
        torch.nn.Linear(16, 1), config_for(out, batch_size=batch_size), train_data=CountingData(size), loss_fn=loss_fn
    )
    writer.global_step = writer.batches_into_epoch = batches  # stand where a run that far in would stand
    checkpoint = writer.save_checkpoint()

    data, first_step = CountingData(size), FirstStep()
    started = time.perf_counter()
    trainer = Trainer(
        torch.nn.Linear(16, 1),
        config_for(out, str(checkpoint), batches + 1, batch_size),
        train_data=data,
        loss_fn=loss_fn,
        callbacks=[first_step],
    )
    constructed = time.perf_counter()
    trainer.fit()
    return {
        "position": fraction,
        "skipped_batches": batches,
        "construct_and_load_s": constructed - started,
        "to_first_step_s": first_step.at - started,
        "examples_read": data.reads,
    }


def time_baselines(size: int, fraction: float, batch_size: int) -> dict:
    skip = int(size // batch_size * fraction)
    loader = DataLoader(CountingData(size), batch_size=batch_size, shuffle=True)
    started = time.perf_counter()
    next(iter(skip_first_batches(loader, skip)))
    skip_s = time.perf_counter() - started
    data = CountingData(size)
    loader = DataLoader(data, batch_size=batch_size, shuffle=True)
    started = time.perf_counter()
    batches = iter(loader)
    for _ in range(skip + 1):
        next(batches)
    return {
        "skip_first_batches_s": skip_s,
        "read_and_discard_s": time.perf_counter() - started,
        "read_and_discard_examples": data.reads,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", type=int, default=1_000_000)
    parser.add_argument("--batch_size", type=int, default=32)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="resume-skip-"))
    print(f"{args.size:,} examples, batch {args.batch_size}, one process")
    print(
        "position | skipped batches | construct+load s | to first new step s | examples read | "
        "skip_first_batches s | read-and-discard s"
    )
    for fraction in (0.0, 0.5, 0.9):
        ours = time_resume(root, args.size, fraction, args.batch_size)
        base = time_baselines(args.size, fraction, args.batch_size)
        print(
            f"{fraction:>7.0%} | {ours['skipped_batches']:>15,} | {ours['construct_and_load_s']:>16.3f} | "
            f"{ours['to_first_step_s']:>19.3f} | {ours['examples_read']:>13,} | "
            f"{base['skip_first_batches_s']:>20.3f} | {base['read_and_discard_s']:>18.3f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
