"""A tiny Llama (97 tokens of vocabulary, rows padded to 20 with labels -100) trained 4 SGD steps with its own loss
and with ``chunked_loss`` (7 tokens a chunk: uneven, and chunks wholly of padding), on every process of the launch:
rank 0 writes each run's losses and evaluation losses to ``<out>/chunked.json``, and fit() its weights to
``<out>/<full|chunked>/final``.

    accelerate launch --config_file accelerate_configs/fsdp.yaml --num_processes 2 tests/jobs/chunked.py --out runs/c
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from trainer import TrainConfig, Trainer  # noqa: E402

VOCAB = 97


def build() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return LlamaForCausalLM(config)


def rows() -> list[dict]:
    generator = torch.Generator().manual_seed(1)
    made = []
    for _ in range(32):
        n = int(torch.randint(5, 20, (1,), generator=generator))
        ids = torch.randint(0, VOCAB, (20,), generator=generator)
        labels, mask = ids.clone(), torch.ones(20, dtype=torch.long)
        labels[n:], mask[n:] = -100, 0
        made.append({"input_ids": ids, "labels": labels, "attention_mask": mask})
    return made


class Evaluations:
    """Each evaluation's loss."""

    def __init__(self):
        self.losses: list[float] = []

    def on_evaluate(self, trainer: Trainer, metrics: dict) -> None:
        self.losses.append(metrics["eval_loss"])


def runs(out: str, **settings) -> dict:
    """Each run's losses and evaluation losses, by name."""
    data, found = rows(), {}
    for name, chunked in (("full", False), ("chunked", True)):
        config = TrainConfig(
            output_dir=f"{out}/{name}",
            batch_size=4,
            max_steps=4,
            optimizer="sgd",
            lr=0.5,
            log_every=1,
            eval_every=2,
            shuffle=False,
            chunked_loss=chunked,
            loss_chunk_tokens=7,
            **settings,
        )
        evaluations = Evaluations()
        trainer = Trainer(build(), config, train_data=data, eval_data=data[:8], callbacks=[evaluations])
        trainer.fit()
        history = trainer.log_history
        found[name] = {
            "losses": [row["train_loss"] for row in history if "train_loss" in row],
            "eval": evaluations.losses,
            "main": trainer.accelerator.is_main_process,
        }
    return found


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    found = runs(args.out)
    if found["full"]["main"]:
        Path(args.out, "chunked.json").write_text(json.dumps(found))


if __name__ == "__main__":
    main()
