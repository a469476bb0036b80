"""A tiny GPT-2 (tied embeddings, AdamW, a cosine schedule, dropout) trained 4 steps on 2 processes, checkpointed
every 2, through the public API alone, so that one version of the trainer can write what another reads:

    accelerate launch --config_file accelerate_configs/multi_gpu.yaml tests/jobs/legacy_job.py OUT [--resume CKPT]
    accelerate launch --config_file accelerate_configs/fsdp.yaml tests/jobs/legacy_job.py OUT [--resume CKPT] [--ddp]

``tests/fixtures/ddp-checkpoint-v1/`` holds step 2 of this job as the trainer wrote DDP checkpoints before every
strategy wrote DCP (``model.safetensors``, ``optimizer.bin``). Its numbers are those of the machine and releases
that wrote it; tests/checkpoint/test_checkpoint.py compares a resume with an uninterrupted run of the same environment.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
from transformers import GPT2Config, GPT2LMHeadModel

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from trainer import TrainConfig, Trainer  # noqa: E402


def model_and_data() -> tuple[torch.nn.Module, list[dict]]:
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=16, n_positions=8, n_embd=8, n_layer=1, n_head=2))
    g = torch.Generator().manual_seed(1)
    return model, [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 16, (32, 8), generator=g)]


def config_of(out: str, resume: str | None = None, batch_size: int = 2) -> TrainConfig:
    return TrainConfig(
        output_dir=out,
        batch_size=batch_size,
        gradient_accumulation_steps=2,
        max_steps=4,
        save_every=2,
        keep_last=4,
        lr=0.01,
        weight_decay=0.1,
        lr_scheduler="cosine",
        warmup_steps=1,
        log_every=1,
        resume=resume,
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--resume", default=None)
    parser.add_argument("--ddp", action="store_true", help="under an FSDP launch: this job as DDP")
    args = parser.parse_args()
    # Several jobs may run in one process (tests/jobs/run_many.py): the launch's environment is put back after this one.
    saved = dict(os.environ)
    if args.ddp:
        os.environ.pop("ACCELERATE_USE_FSDP", None)
    try:
        model, rows = model_and_data()
        Trainer(model, config_of(args.out, args.resume), train_data=rows).fit()
    finally:
        os.environ.clear()
        os.environ.update(saved)


if __name__ == "__main__":
    main()
