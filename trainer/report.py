"""What the main process says about a run: the start banner and the step line of each log."""

from __future__ import annotations

from typing import Any, Optional

import torch
from accelerate.data_loader import get_sampler

from trainer import sharding
from trainer.distributed import num_machines

STEP_FIGURES = ("step", "epoch", "train_loss", "lr", "examples_per_s", "tokens_per_s")  # the rest: a callback's


def step_line(metrics: dict[str, Any], total_steps: int) -> str:
    """``step 300/300 | loss 4.746 | lr 0.0002 | 53.4 examples/s | 6,834 tokens/s``, then any figure logged with
    ``trainer.log`` or added to ``metrics`` in ``on_log`` (``| MFU 41.5%``); ``grad_norm`` is in the logs only."""
    line = (f"step {metrics['step']}/{total_steps} | loss {metrics['train_loss']:.6g} | lr {metrics['lr']:.4g} | "
            f"{metrics['examples_per_s']:.1f} examples/s")  # fmt: skip
    if "tokens_per_s" in metrics:
        line += f" | {metrics['tokens_per_s']:,.0f} tokens/s"
    for key, value in metrics.items():
        if key not in STEP_FIGURES and key != "grad_norm":  # logged, not said: the line stays short
            line += f" | {key} {value:.4g}" if isinstance(value, float) else f" | {key} {value}"
    return line


def examples_per_epoch(loader: Any) -> Optional[int]:
    """The examples this process reads per epoch (its sampler's share), or None when unknown (a stream)."""
    try:
        return len(get_sampler(loader))
    except TypeError:
        return None


def banner(trainer: Any) -> str:
    """What a run is about to do, said once at the start of ``fit()``: processes, device, the global batch and how
    its loss is weighed, steps, optimizer and schedule."""
    acc, cfg = trainer.accelerator, trainer.config
    steps = f"max_steps={cfg.max_steps}" if cfg.max_steps else f"{cfg.epochs} epochs"
    threads = f", {torch.get_num_threads()} CPU threads per process" if acc.device.type == "cpu" else ""
    per_epoch = trainer.steps_per_epoch if trainer.steps_per_epoch else "unknown"
    weighs = "; the loss weighs every counted token alike" if trainer.weighing.counts_tokens else ""
    global_batch, short, batches = trainer.global_batch_size, "", trainer.batches_per_epoch
    share = examples_per_epoch(trainer.train_loader)
    if share is not None and share < cfg.batch_size * cfg.gradient_accumulation_steps:  # one step takes them all
        global_batch = share * acc.num_processes
        short = (f"\n        | an epoch has {share} examples per process in {batches} batch(es), fewer than batch x "
                 f"accumulation: each step takes them all, {global_batch} global")  # fmt: skip
    kind = sharding.FULLY_SHARDED if trainer.sharded else acc.distributed_type.value
    if cfg.activation_checkpointing and not trainer.sharded:  # a sharded model's line below says it
        kind += ", activation checkpointing"
    sharded = f"        | {trainer.sharded.describe()}\n" if trainer.sharded else ""
    return (
        f"trainer | {acc.num_processes} process(es) on {num_machines(acc)} machine(s), device {acc.device.type} "
        f"({kind}){threads}, mixed precision {acc.mixed_precision}\n{sharded}"
        f"        | batch {cfg.batch_size} per process x {acc.num_processes} processes x "
        f"{cfg.gradient_accumulation_steps} accumulation = {global_batch} global{weighs}{short}\n"
        f"        | {per_epoch} optimizer steps per epoch, {trainer.total_steps} in all ({steps}); "
        f"{trainer.optimization}"
    )
