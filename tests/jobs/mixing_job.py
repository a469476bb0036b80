"""Two training sets mixed by weight (trainer.data.mixing): ``a`` (30 examples) and ``b`` (10), weighed 0.5 each
for the first 6 steps, then 0.75 and 0.25: an epoch of 40 (5 steps of 8) draws half of each at first (b's each
twice), then 6 of a's and 2 of b's a step; 2 epochs, a checkpoint every 2 steps, a log every step.
``--crash_at N``: rank 1 dies after step N (the first attempt), and a rerun resumes. ``--streams``: the two as
datasets streams, interleaved, 0.5 each. ``--size_a N``: ``a`` has N examples; ``--weights JSON``: other
data_weights. The main process writes
``<output_dir>/mixing.json``: each log's step, loss and shares (``data/a``, ``data/b``)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from scenarios import CrashAfter, Examples, TinyClassifier

from trainer import TrainConfig, Trainer


class Shares:
    """Each log's figures, as fit() hands them to on_log (the trainer's own data/<name> among them)."""

    def __init__(self):
        self.rows = []

    def on_log(self, trainer, metrics) -> None:
        self.rows.append({key: metrics[key] for key in ("step", "train_loss", "data/a", "data/b") if key in metrics})


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--batch_size", type=int, default=4)
    parser.add_argument("--crash_at", type=int, default=0)
    parser.add_argument("--streams", action="store_true")
    parser.add_argument("--size_a", type=int, default=30)
    parser.add_argument("--weights", type=json.loads, default=None)
    args = parser.parse_args()
    sets = {"a": Examples(args.size_a, seed=2), "b": Examples(10, seed=3)}
    if args.streams:
        from datasets import Dataset

        sets = {
            name: Dataset.from_dict({"x": part.x.tolist(), "labels": part.labels.tolist()})
            .with_format("torch")
            .to_iterable_dataset(num_shards=2)
            for name, part in sets.items()
        }
    config = TrainConfig(
        output_dir=args.output_dir,
        epochs=2,
        max_steps=6 if args.streams else None,
        batch_size=args.batch_size,
        optimizer="adamw",
        lr=1e-2,
        save_every=2,
        log_every=1,
        resume="auto",
        # Streams take one weight each.
        data_weights=args.weights
        or ({"a": 0.5, "b": 0.5} if args.streams else {"a": [[0, 0.5], [6, 0.75]], "b": [[0, 0.5], [6, 0.25]]}),
    )
    shares = Shares()
    torch.manual_seed(0)
    callbacks = [shares] + ([CrashAfter(args.crash_at, 1)] if args.crash_at else [])
    trainer = Trainer(TinyClassifier(), config, train_data=sets, callbacks=callbacks)
    result = trainer.fit()
    if trainer.accelerator.is_main_process:
        Path(args.output_dir, "mixing.json").write_text(json.dumps({"rows": shares.rows, "result": result}))


if __name__ == "__main__":
    main()
