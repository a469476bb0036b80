"""A small MLP compiled whole (``compile: true``) trained on one process, a checkpoint every 2 steps; it writes torch's
own counts of FX graphs taken from its cache and compiled afresh to ``<out>/graphs.json`` and fit() the weights to
``<out>/final``. Run with a fresh ``TORCHINDUCTOR_CACHE_DIR``: then only a checkpoint's graphs can be cache hits.

    TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) python tests/jobs/compiled_resume.py --out runs/c --steps 2
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from trainer import TrainConfig, Trainer  # noqa: E402
from trainer.checkpoint.compiled import graph_cache_hits  # noqa: E402


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inner, self.outer = torch.nn.Linear(8, 32), torch.nn.Linear(32, 1)

    def forward(self, x, y):
        return {"loss": ((self.outer(torch.relu(self.inner(x))) - y) ** 2).mean()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--resume", default=None)
    args = parser.parse_args()
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(1)
    data = [{"x": torch.randn(8, generator=generator), "y": torch.randn(1, generator=generator)} for _ in range(64)]
    config = TrainConfig(
        output_dir=args.out, max_steps=args.steps, batch_size=4, save_every=2, compile=True, resume=args.resume
    )
    Trainer(Net(), config, train_data=data).fit()
    Path(args.out, "graphs.json").write_text(json.dumps(graph_cache_hits()))


if __name__ == "__main__":
    main()
