"""A user's script as the resume proof runs it, unchanged: its TrainConfig built in code (AdamW, a schedule, a stateful
callback), what the proof sets reaching it through TRAINER_OVERRIDES. ``--counter``: the loss is scaled by how many
forwards this process has run, a counter the script keeps itself, which a resume starts again from 0. ``--unseeded``:
the model's first weights are drawn without a seed.

    python -m trainer.check --resume-proof tests/jobs/proof_script.py [--counter]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from trainer import TrainConfig, Trainer  # noqa: E402

FORWARDS = [0]


class Net(torch.nn.Module):
    def __init__(self, counter: bool):
        super().__init__()
        self.inner, self.outer, self.counter = torch.nn.Linear(8, 16), torch.nn.Linear(16, 1), counter

    def forward(self, x, y):
        FORWARDS[0] += 1
        scale = 1 + 0.1 * FORWARDS[0] if self.counter else 1.0
        return {"loss": scale * ((self.outer(torch.tanh(self.inner(x))) - y) ** 2).mean()}


class ExamplesSeen:
    """A stateful callback: the examples trained on, kept in every checkpoint."""

    def __init__(self):
        self.seen = 0

    def on_step_end(self, trainer: Trainer) -> None:
        self.seen += trainer.global_batch_size

    def state_dict(self) -> dict:
        return {"seen": self.seen}

    def load_state_dict(self, state: dict) -> None:
        self.seen = state["seen"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--counter", action="store_true")
    parser.add_argument("--unseeded", action="store_true")
    args = parser.parse_args()
    torch.manual_seed(torch.seed() if args.unseeded else 0)
    generator = torch.Generator().manual_seed(1)
    data = [{"x": torch.randn(8, generator=generator), "y": torch.randn(1, generator=generator)} for _ in range(96)]
    config = TrainConfig(
        output_dir="runs/proof", max_steps=100, batch_size=4, lr=1e-2, lr_scheduler="cosine", warmup_steps=2
    )
    Trainer(Net(args.counter), config, train_data=data, callbacks=[ExamplesSeen()]).fit()


if __name__ == "__main__":
    main()
