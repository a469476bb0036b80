"""What a resume does with the settings that changed since its checkpoint was written.

A checkpoint keeps the whole TrainConfig; a resume compares every field with this run's, and each change is one of:

- **refused**, naming both values, when the saved state cannot go on under it: the optimizer (its saved state is
  another algorithm's moments; the class is compared too, whoever built it), whether weight decay splits the
  parameters into two groups (``weight_decay`` to or from 0, ``decay_biases_and_norms``), and in the middle of an
  epoch the ``seed`` (of a shuffled epoch), ``shuffle`` and ``drop_last``: the epoch's order of examples, partly read,
  would change under it, some examples read twice and others never. ``fit()`` refuses; the weights still load for
  ``evaluate()`` and ``predict()``;
- **applied from the next step and said in one line**, otherwise: the schedule is recomputed at the step reached from
  this run's ``lr``, ``lr_scheduler``, ``warmup_steps`` and ``max_steps`` / ``epochs`` together (never the saved
  base lr under a new schedule), the optimizer's other settings (``betas``, ``eps``, ``momentum``,
  ``weight_decay``) are this run's, and clipping, cadences (log, eval, save, keep_last) and the rest are read as set.

How the global batch is split (processes, ``batch_size``, ``gradient_accumulation_steps``) is
``trainer.resume.resumed_position``'s rule; where the run writes (``output_dir``, ``resume``) is not compared.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Optional

import torch

from trainer.checkpoint import CheckpointError

NOT_COMPARED = ("output_dir", "resume", "batch_size", "gradient_accumulation_steps")
ORDER_OF_THE_EPOCH = ("seed", "shuffle", "drop_last")


def changed_settings(saved: dict[str, Any], now: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """``{field: (saved value, this run's)}`` for every compared field that differs (a checkpoint written before a
    field existed leaves it out)."""
    plain = lambda value: list(value) if isinstance(value, tuple) else value  # noqa: E731  (JSON keeps lists)
    return {key: (saved[key], value) for key, value in now.items()
            if key in saved and key not in NOT_COMPARED and plain(saved[key]) != plain(value)}  # fmt: skip


def refusal(saved: dict[str, Any], now: dict[str, Any], path: Path, mid_epoch: bool, built_optimizer: bool,
            saved_class: Optional[str], optimizer_class: str) -> Optional[CheckpointError]:  # fmt: skip
    """Why this run (config ``now``) cannot train on from checkpoint ``path`` (config ``saved``), or None."""
    changes = changed_settings(saved, now)

    def refused(why: str, keep: str) -> CheckpointError:
        return CheckpointError(f"checkpoint {path}: {why}. Resume with {keep}, or start a new run in another "
                               "output_dir (python -m trainer.export takes its weights alone)")  # fmt: skip

    def listed(keys: list[str]) -> str:
        return ", ".join(f"{key} {changes[key][0]} -> {changes[key][1]}" for key in keys)

    if built_optimizer and "optimizer" in changes:
        old, new = changes["optimizer"]
        return refused(f"it was written with optimizer {old}, and this run has {new}: the saved optimizer state "
                       f"cannot go on as {new}'s", f"optimizer {old}")  # fmt: skip
    if saved_class is not None and saved_class != optimizer_class:
        return refused(f"its optimizer was {saved_class}, and this run's is {optimizer_class}: the saved optimizer "
                       f"state cannot go on as {optimizer_class}'s", f"the optimizer class {saved_class}")  # fmt: skip
    grouping = [key for key in ("weight_decay", "decay_biases_and_norms") if key in changes]
    if built_optimizer and grouping and _one_group(saved) != _one_group(now):
        return refused(f"{listed(grouping)} changes the optimizer's parameter groups (with weight decay, biases and "
                       "norm weights are a group of their own), and the saved optimizer state is per group",
                       " and ".join(f"{key} {changes[key][0]}" for key in grouping))  # fmt: skip
    order = [key for key in ORDER_OF_THE_EPOCH if key in changes]
    if order == ["seed"] and not now["shuffle"]:
        order = []  # an epoch read in order does not depend on the seed
    if mid_epoch and order:
        return refused(f"{listed(order)} changes the order of examples in the epoch it stopped in: some examples "
                       "would be read twice and others never", " and ".join(f"{key} {changes[key][0]}" for key in order)
                       + " until the epoch ends (a checkpoint at an epoch's end takes any)")  # fmt: skip
    return None


def _one_group(config: dict[str, Any]) -> bool:
    """Whether a config's optimizer (trainer.optim) has a single parameter group."""
    return config.get("weight_decay", 0) == 0 or bool(config.get("decay_biases_and_norms"))


def group_settings(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """This run's optimizer settings per parameter group (lr, betas, eps, ...), before a checkpoint's replace them."""
    return [{key: value for key, value in group.items() if key != "params"} for group in optimizer.param_groups]


def apply_settings(optimizer: torch.optim.Optimizer, scheduler: Any, settings: list[dict[str, Any]], step: int,
                   schedule_moved: bool, built_scheduler: bool) -> tuple[float, float]:  # fmt: skip
    """After a checkpoint was loaded: this run's optimizer settings back in place of the saved ones and, for a
    schedule built from the config, the lr recomputed at ``step`` from this run's base lr and schedule (a user's
    scheduler keeps its saved state). Returns the next step's lr under the checkpoint's settings and under this
    run's. ``schedule_moved``: whether the checkpoint's own schedule was stepped (a constant lr without warm-up is
    not, so its position is the step reached)."""
    groups = optimizer.param_groups
    saved_lr = groups[0]["lr"]
    for group, own in zip(groups, settings, strict=True):
        group.update({key: value for key, value in own.items()
                      if key not in ("lr", "initial_lr") or built_scheduler})  # fmt: skip
    if built_scheduler:
        if not schedule_moved:
            scheduler.last_epoch = step
        scheduler.base_lrs = [group["initial_lr"] for group in groups]
        if isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR):  # transformers': a closed form of the step
            pairs = zip(scheduler.base_lrs, scheduler.lr_lambdas, strict=True)
            lrs = [base * schedule(scheduler.last_epoch) for base, schedule in pairs]
        else:  # ConstantLR
            lrs = scheduler._get_closed_form_lr()
        for group, lr in zip(groups, lrs, strict=True):
            group["lr"] = lr
        scheduler._last_lr = [group["lr"] for group in groups]
    return saved_lr, groups[0]["lr"]


def said(changes: dict[str, tuple[Any, Any]], step: int, lrs: tuple[float, float]) -> str:
    """The one line for the changes a resume applies ("" when none)."""
    words = [f"{key} {old} -> {new}" for key, (old, new) in changes.items()]
    if not math.isclose(lrs[0], lrs[1], rel_tol=1e-9):
        words.append(f"so the next step's lr is {lrs[1]:.4g}, not {lrs[0]:.4g}")
    if not words:
        return ""
    return f"changed since the checkpoint, applied from step {step + 1}: {', '.join(words)}"
