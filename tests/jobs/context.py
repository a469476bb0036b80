"""A tiny Llama (4 heads, 2 KV heads) trained 3 SGD steps on every process of the launch, on padded rows or packed
documents (``--packed``: transformers' ``DataCollatorWithFlattening``), with ``--chunked`` in chunks (chunked_loss);
the launch's parallelism_config decides the layout (``cp_size`` for context parallelism). Rank 0 writes the losses,
an evaluation and a prediction to ``<out>/context.json``, and fit() the weights to ``<out>/final``.

    accelerate launch --config_file accelerate_configs/fsdp.yaml --num_processes 2 --parallelism_config_cp_size 2 \\
        tests/jobs/context.py --out runs/cp
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
# The tiny Llama of the chunked loss's job (sdpa attention, transformers' default).
from chunked import VOCAB, build  # noqa: E402
from packing import padded as padded_to  # noqa: E402

from trainer import TrainConfig, Trainer  # noqa: E402


def documents() -> list[dict]:
    generator = torch.Generator().manual_seed(1)
    lengths = torch.randint(3, 19, (24,), generator=generator).tolist()
    return [{"input_ids": torch.randint(0, VOCAB, (n,), generator=generator).tolist()} for n in lengths]


def padded(rows: list[dict]) -> dict:
    """Each document in its own row, padded to 19 tokens (odd: the trainer pads to a multiple of cp_size)."""
    return padded_to(rows, length=19)


def main() -> None:
    from transformers import DataCollatorWithFlattening

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--packed", action="store_true")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--resume", default=None)
    parser.add_argument("--save-every", type=int, default=None)
    parser.add_argument("--optimizer", default="sgd")
    parser.add_argument("--chunked", action="store_true", help="chunked_loss, 5 tokens a chunk")
    args = parser.parse_args()
    config = TrainConfig(
        output_dir=args.out,
        batch_size=args.batch_size,
        max_steps=args.steps,
        lr=0.5,
        optimizer=args.optimizer,
        log_every=1,
        shuffle=False,
        save_every=args.save_every,
        resume=args.resume,
        chunked_loss=args.chunked,
        loss_chunk_tokens=5,
    )
    collate = DataCollatorWithFlattening() if args.packed else padded
    data = documents()
    trainer = Trainer(build(), config, train_data=data, eval_data=data[:8], collate_fn=collate)
    trainer.fit()
    evaluation = trainer.evaluate()
    # Padded rows alone: a packed batch's prediction is one row of every document.
    first = (lambda model, batch: model(**batch).logits[:, :, :4]) if not args.packed else None
    logits = trainer.predict(data[:6], predict_fn=first) if first else torch.zeros(0)
    if trainer.accelerator.is_main_process:
        found = {
            "losses": [row["train_loss"] for row in trainer.log_history if "train_loss" in row],
            "eval_loss": evaluation["eval_loss"],
            "logits": logits.tolist(),
            "banner": trainer.describe(),
        }
        Path(args.out, "context.json").write_text(json.dumps(found))


if __name__ == "__main__":
    main()
