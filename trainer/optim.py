"""Optimizer and learning-rate schedule from a TrainConfig (used when the user passes none)."""

from __future__ import annotations

import torch

from trainer.config import TrainConfig


def build_optimizer(model: torch.nn.Module, config: TrainConfig) -> torch.optim.Optimizer:
    """sgd / adam / adamw over the model's trainable parameters; weight decay applies to all of them.

    Adam and AdamW use torch's fused kernel when every parameter is already on a CUDA device (one kernel per
    step instead of several per parameter); the Trainer moves the model to its device first for that reason.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    if config.optimizer == "sgd":
        return torch.optim.SGD(params, lr=config.lr, momentum=config.momentum, weight_decay=config.weight_decay)
    optimizer_class = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW}[config.optimizer]
    fused = bool(params) and all(p.device.type == "cuda" for p in params)
    return optimizer_class(params, lr=config.lr, betas=config.betas, eps=config.eps, weight_decay=config.weight_decay,
                           fused=fused or None)  # fmt: skip


def build_scheduler(optimizer: torch.optim.Optimizer, config: TrainConfig, total_steps: int):
    """constant / linear / cosine, each after ``warmup_steps`` of linear warm-up; stepped once per optimizer step.

    A constant lr without warm-up is torch's ConstantLR (factor 1): the rest are transformers' schedules, whose
    import costs half a second at start-up that a constant lr need not pay.
    """
    if config.lr_scheduler == "constant" and config.warmup_steps == 0:
        return torch.optim.lr_scheduler.ConstantLR(optimizer, factor=1.0, total_iters=0)
    from transformers import get_scheduler

    name = "constant_with_warmup" if config.lr_scheduler == "constant" else config.lr_scheduler
    return get_scheduler(name, optimizer, num_warmup_steps=config.warmup_steps, num_training_steps=total_steps)
