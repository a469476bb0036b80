"""A loss spike rolled back (``spike_policy: rollback``): a small MLP on 96 examples read in order, 4 a step on any
process count, a checkpoint every 4 steps; examples 36-39 (step 10's batch) are poisoned, their loss 50 times the
rest's (``--poison 36-51``: steps 10 to 13's). ``--drop 32-39``: those examples left out of the data and no spike
policy, the run a rollback should equal.

    python tests/jobs/spikes.py --out runs/s [--steps 16] [--lr_factor 0.5] [--save_every 4] [--resume auto]
    accelerate launch --num_processes 2 tests/jobs/spikes.py --out runs/s2
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from trainer import TrainConfig, Trainer  # noqa: E402


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inner, self.outer = torch.nn.Linear(8, 16), torch.nn.Linear(16, 1)

    def forward(self, x, y, poison):
        loss = ((self.outer(torch.tanh(self.inner(x))) - y) ** 2).mean()
        return {"loss": loss * (1 + 49 * poison.max())}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--save_every", type=int, default=4)
    parser.add_argument("--lr_factor", type=float, default=None)
    parser.add_argument("--drop", default=None)
    parser.add_argument("--resume", default=None)
    parser.add_argument("--poison", default="36-39")
    args = parser.parse_args()
    first, last = map(int, args.poison.split("-"))
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(1)
    data = [
        {
            "x": torch.randn(8, generator=generator),
            "y": torch.randn(1, generator=generator),
            "poison": float(first <= i <= last),
        }
        for i in range(96)
    ]
    if args.drop:
        first, last = map(int, args.drop.split("-"))
        data = data[:first] + data[last + 1 :]
    config = TrainConfig(
        output_dir=args.out,
        max_steps=args.steps,
        batch_size=4 // int(os.environ.get("WORLD_SIZE", "1")),
        shuffle=False,
        lr=1e-2,
        lr_scheduler="cosine",
        save_every=args.save_every,
        keep_last=10,
        log_every=1,
        spike_policy=None if args.drop else "rollback",
        spike_lr_factor=args.lr_factor,
        resume=args.resume,
    )
    Trainer(Net(), config, train_data=data).fit()


if __name__ == "__main__":
    main()
