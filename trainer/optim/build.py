"""Optimizer and learning-rate schedule from a TrainConfig (used when the user passes none)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch

from trainer.config import TrainConfig
from trainer.errors import ConfigError
from trainer.optim import schedules
from trainer.optim.muon import MuonWithAdamW, muon_parameters

# Transformers' own patterns.
NORM_NAMES = re.compile(r"bias|layernorm|rmsnorm|(?:^|\.)norm(?:$|\.)|_norm(?:$|\.)")


def build_optimizer(model: torch.nn.Module, config: TrainConfig) -> torch.optim.Optimizer:
    """sgd / adam / adamw / muon (trainer.optim.muon) over the model's trainable parameters, ``weight_decay`` on
    those ``decayed`` names.

    Adam and AdamW use torch's fused kernel when every parameter is already on a CUDA device (one kernel per
    step instead of several per parameter); the Trainer moves the model to its device first for that reason.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    groups = parameter_groups(model, config)
    if config.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=config.lr, momentum=config.momentum, weight_decay=config.weight_decay)
    fused = bool(params) and all(p.device.type == "cuda" for p in params)
    adam = dict(betas=config.betas, eps=config.eps, weight_decay=config.weight_decay, fused=fused or None)
    if config.optimizer == "muon":
        hidden = muon_parameters(model, decayed(model))
        named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
        taken = [p for name, p in named if name in hidden]
        rest = [{**g, "params": [p for p in g["params"] if all(p is not t for t in taken)]} for g in groups]
        muon = [{"params": taken, "weight_decay": config.weight_decay}] if taken else []
        return MuonWithAdamW(muon, [g for g in rest if g["params"]], lr=config.lr, adamw=adam)
    optimizer_class = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW}[config.optimizer]
    return optimizer_class(groups, lr=config.lr, **adam)


def parameter_groups(model: torch.nn.Module, config: TrainConfig) -> list[dict]:
    """The trainable parameters as the optimizer's groups: with ``weight_decay`` > 0, one group that decays and one
    that does not (unless ``decay_biases_and_norms``); else one."""
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    if config.weight_decay == 0 or config.decay_biases_and_norms:
        return [{"params": [p for _, p in named]}]
    decay = decayed(model)
    groups = [
        {"params": [p for name, p in named if name in decay]},
        {"params": [p for name, p in named if name not in decay], "weight_decay": 0.0},
    ]
    # A model of biases alone: one group.
    return [group for group in groups if group["params"]]


def decayed(model: torch.nn.Module) -> set[str]:
    """Names of the parameters weight decay applies to, by transformers' Trainer's rule: all but biases and the
    weights of normalisation layers (torch's LayerNorm, GroupNorm, BatchNorm..., or a module whose class or name
    says norm, such as LlamaRMSNorm). Shrinking a norm's gain or a bias toward 0 is not the regularisation decay
    is for; nanoGPT and most LM recipes leave them alone too. (transformers' own rule is a method of its Trainer,
    whose import costs a process about a second; tests/optim/test_optim.py checks both name the same parameters.)"""
    names = set()
    for module_name, module in model.named_modules():
        is_norm = isinstance(module, NORM_TYPES) or "Norm" in type(module).__name__
        for param_name, _ in module.named_parameters(recurse=False):
            name = f"{module_name}.{param_name}" if module_name else param_name
            if not is_norm and not NORM_NAMES.search(name.lower()):
                names.add(name)
    return names


NORM_TYPES = (
    torch.nn.LayerNorm,
    torch.nn.GroupNorm,
    torch.nn.modules.batchnorm._NormBase,
    torch.nn.RMSNorm,
    torch.nn.LocalResponseNorm,
)


def build_scheduler(optimizer: torch.optim.Optimizer, config: TrainConfig, total_steps: int):
    """``config.lr_scheduler`` after ``warmup_steps`` of linear warm-up (transformers' ``get_scheduler``'s
    schedules, ``trainer.optim.schedules``), with ``min_lr_ratio`` and ``lr_scheduler_kwargs``; stepped once per
    optimizer step. Each is a LambdaLR (the lr a closed form of the step: a resume recomputes it from this run's
    settings, ``trainer.checkpoint.policy``)."""
    from torch.optim.lr_scheduler import LambdaLR

    if config.lr_scheduler == "constant" and config.warmup_steps == 0 and not config.lr_scheduler_kwargs:
        return LambdaLR(optimizer, schedules.no_schedule)
    name = "constant_with_warmup" if config.lr_scheduler == "constant" else config.lr_scheduler
    try:
        settings = schedule_settings(config, name)
        factor = schedules.factor(
            name, optimizer.defaults["lr"], warmup=config.warmup_steps, total=total_steps, settings=settings
        )
    except ValueError as err:
        raise ConfigError(f"lr_scheduler {config.lr_scheduler}: {err}") from None
    return LambdaLR(optimizer, factor)


# min_lr_ratio's name in each.
FLOOR = {"cosine_with_min_lr": "min_lr_rate", "warmup_stable_decay": "min_lr_ratio", "nanogpt": "min_lr_rate"}


def schedule_settings(config: TrainConfig, name: str) -> dict[str, Any]:
    """The schedule's own settings: ``lr_scheduler_kwargs`` checked by name against the schedule's (transformers'
    names, ``trainer.optim.schedules.SETTINGS``), and ``min_lr_ratio`` under the name the schedule gives it
    (polynomial's ``lr_end`` is an lr). Refused by name."""
    settings = dict(config.lr_scheduler_kwargs)
    if config.min_lr_ratio is not None:
        ratio = config.min_lr_ratio
        # Polynomial: an lr.
        key, value = (FLOOR[name], ratio) if name in FLOOR else ("lr_end", ratio * config.lr)
        if key in settings:
            raise ConfigError(f"min_lr_ratio and lr_scheduler_kwargs.{key} both set the floor: keep one")
        settings[key] = value
    taken = set(schedules.SETTINGS[name])
    for key in settings:
        if key not in taken:
            raise ConfigError(
                f"lr_scheduler_kwargs: {key!r} is not a setting of {config.lr_scheduler} (its "
                f"settings: {', '.join(sorted(taken)) or 'none'})"
            )
    if name == "cosine_with_min_lr" and not {"min_lr", "min_lr_rate"} & set(settings):
        raise ConfigError("lr_scheduler cosine_with_min_lr needs its floor: min_lr_ratio (say 0.1, nanoGPT's)")
    if name == "warmup_stable_decay" and "num_decay_steps" not in settings:
        raise ConfigError(
            "lr_scheduler warmup_stable_decay needs lr_scheduler_kwargs.num_decay_steps: the steps "
            "of its final decay (say a tenth or a fifth of the run)"
        )
    return settings


def describe(
    optimizer: torch.optim.Optimizer,
    lr_scheduler: Any,
    config: TrainConfig,
    *,
    built_optimizer: bool,
    built_scheduler: bool,
) -> str:
    """The start banner's words for the optimizer and the schedule: the config's, or the classes a user passed."""
    if built_optimizer:
        words = f"{config.optimizer} lr {config.lr:g}"
        if isinstance(optimizer, MuonWithAdamW):
            muon = sum(len(g["params"]) for g in optimizer.param_groups if g["muon"])
            words += f" (Muon on {muon} hidden weight matrices, AdamW on the rest)"
        if config.weight_decay:
            groups = optimizer.param_groups
            tensors = sum(len(group["params"]) for group in groups)
            decays = sum(len(group["params"]) for group in groups if group["weight_decay"])
            where = (
                f"{decays} of {tensors} tensors (not biases or norm weights)"
                if decays < tensors
                else f"all {tensors} tensors"
            )
            words += f", weight decay {config.weight_decay:g} on {where}"
    # The lr before any schedule scaled it (a warm-up starts it near 0)
    else:
        group = optimizer.param_groups[0]
        words = f"your {type(optimizer).__name__} (lr {group.get('initial_lr', group['lr']):g})"
    if not built_scheduler:
        return f"{words}, your {type(lr_scheduler).__name__}"
    warmup = f" after {config.warmup_steps} warm-up steps" if config.warmup_steps else ""
    floor = f" down to {config.min_lr_ratio:g} x lr" if config.min_lr_ratio is not None else ""
    settings = "".join(f", {key} {value}" for key, value in config.lr_scheduler_kwargs.items())
    return f"{words}, {config.lr_scheduler} schedule{warmup}{floor}{settings}"


@dataclass(frozen=True)
class Optimization:
    """A run's optimizer and schedule, and how they came to be, for the banner and a resume."""

    optimizer: torch.optim.Optimizer
    scheduler: Any
    # The banner's words (describe).
    words: str
    # From the config, not the user's: a resume applies this run's settings to them.
    built_optimizer: bool
    built_scheduler: bool
    # Whether stepping the scheduler changes the lr: a constant lr without warm-up built here is never stepped (each
    # step costs tens of microseconds, which a small model's step notices). A user's is always stepped.
    schedule_moves: bool


def build(
    model: torch.nn.Module,
    config: TrainConfig,
    *,
    optimizer: Any,
    lr_scheduler: Any,
    total_steps: int,
) -> Optimization:
    """The user's optimizer and schedule, or the config's in place of each one not given (over ``model``'s
    parameters as they are now: after sharding, on the device). Either may be a factory, called here:
    ``optimizer(parameter_groups)`` (the config's weight-decay groups) and ``lr_scheduler(optimizer, total_steps)``."""
    built = (optimizer is None, lr_scheduler is None)
    if is_factory(optimizer, torch.optim.Optimizer):
        optimizer = optimizer(parameter_groups(model, config))
    optimizer = optimizer or build_optimizer(model, config)
    if is_factory(lr_scheduler, torch.optim.lr_scheduler.LRScheduler):
        lr_scheduler = lr_scheduler(optimizer, total_steps)
    moves = (
        lr_scheduler is not None
        or config.lr_scheduler != "constant"
        or config.warmup_steps > 0
        or bool(config.lr_scheduler_kwargs)
    )
    lr_scheduler = lr_scheduler or build_scheduler(optimizer, config, total_steps)
    words = describe(optimizer, lr_scheduler, config, built_optimizer=built[0], built_scheduler=built[1])
    return Optimization(optimizer, lr_scheduler, words, *built, schedule_moves=moves)


def is_factory(given: Any, built: type) -> bool:
    """Whether ``given`` is a function that builds a ``built`` (a class or a lambda), not one already built."""
    return given is not None and callable(given) and not isinstance(given, built)


def prebuilt(optimizer: Any, lr_scheduler: Any) -> bool:
    """Whether the user passed an optimizer or schedule already built (over the parameters as they were then)."""
    return (
        optimizer is not None
        and not is_factory(optimizer, torch.optim.Optimizer)
        or lr_scheduler is not None
        and not is_factory(lr_scheduler, torch.optim.lr_scheduler.LRScheduler)
    )
