"""The learning-rate schedules of ``lr_scheduler``: transformers' (``get_scheduler``), each a LambdaLR whose factor is
a closed form of the step, written out here with transformers' arithmetic, operation for operation; and nanoGPT's.

Why not call transformers: its ``transformers.optimization`` imports its Trainer's utilities, and those import PEFT
wherever PEFT is installed. Measured on a 2-core host: 3.6 s of every process's start with PEFT installed, 0.5 s
without, for a few lines of arithmetic. ``tests/optim/test_optim.py`` checks every schedule and setting here against
transformers' own ``get_scheduler``, step by step, for equality of the floats.

Each factor is a ``functools.partial`` of a module function, as transformers builds them: a LambdaLR saves no
state for it, and a checkpoint of either loads into the other.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable

# Each schedule's own settings (lr_scheduler_kwargs), by transformers' names, with its defaults; None: none.
SETTINGS: dict[str, dict[str, Any]] = {
    "constant_with_warmup": {},
    "linear": {},
    "cosine": {"num_cycles": 0.5},
    "cosine_with_min_lr": {"num_cycles": 0.5, "min_lr": None, "min_lr_rate": None},
    "warmup_stable_decay": {
        "num_decay_steps": None,
        "num_stable_steps": None,
        "warmup_type": "linear",
        "decay_type": "cosine",
        "min_lr_ratio": 0.0,
        "num_cycles": 0.5,
    },
    "polynomial": {"lr_end": 1e-7, "power": 1.0},
    "inverse_sqrt": {"timescale": None},
    # nanoGPT's get_lr (train.py), not transformers': tested against nanoGPT's own function.
    "nanogpt": {"lr_decay_steps": None, "min_lr_rate": 0.0},
}
# warmup_stable_decay's warmup_type and decay_type.
SHAPES = ("linear", "cosine", "1-sqrt")


def factor(name: str, lr: float, warmup: int, *, total: int, settings: dict[str, Any]) -> Callable[[int], float]:
    """The multiplier of ``lr`` at each step for schedule ``name`` (a key of SETTINGS) with its ``settings``
    (checked by the caller: names among SETTINGS[name]); ValueError for settings transformers refuses too."""
    given = {**SETTINGS[name], **settings}
    if name == "constant_with_warmup":
        return functools.partial(_constant, num_warmup_steps=warmup)
    if name == "linear":
        return functools.partial(_linear, num_warmup_steps=warmup, num_training_steps=total)
    if name == "cosine":
        return functools.partial(
            _cosine, num_warmup_steps=warmup, num_training_steps=total, num_cycles=given["num_cycles"]
        )
    if name == "cosine_with_min_lr":
        if given["min_lr"] is not None and given["min_lr_rate"] is not None:
            raise ValueError("set one of min_lr and min_lr_rate, not both")
        rate = given["min_lr"] / lr if given["min_lr"] is not None else given["min_lr_rate"]
        return functools.partial(
            _cosine, num_warmup_steps=warmup, num_training_steps=total, num_cycles=given["num_cycles"], min_lr_rate=rate
        )
    if name == "warmup_stable_decay":
        for key in ("warmup_type", "decay_type"):
            if given[key] not in SHAPES:
                raise ValueError(f"{key} {given[key]!r} is not one of {', '.join(SHAPES)}")
        stable = given["num_stable_steps"]
        if stable is None:
            stable = total - warmup - given["num_decay_steps"]
        return functools.partial(
            _warmup_stable_decay,
            num_warmup_steps=warmup,
            num_stable_steps=stable,
            num_decay_steps=given["num_decay_steps"],
            warmup_type=given["warmup_type"],
            decay_type=given["decay_type"],
            min_lr_ratio=given["min_lr_ratio"],
            num_cycles=given["num_cycles"],
        )
    if name == "polynomial":
        if not lr > given["lr_end"]:
            raise ValueError(f"lr_end ({given['lr_end']}) must be smaller than the lr ({lr})")
        return functools.partial(
            _polynomial,
            num_warmup_steps=warmup,
            num_training_steps=total,
            lr_end=given["lr_end"],
            power=given["power"],
            lr_init=lr,
        )
    if name == "nanogpt":
        decay = given["lr_decay_steps"] if given["lr_decay_steps"] is not None else total
        if not decay > warmup:
            raise ValueError(f"lr_decay_steps ({decay}) must be more than warmup_steps ({warmup})")
        return functools.partial(_nanogpt, warmup=warmup, decay_steps=decay, min_lr_rate=given["min_lr_rate"])
    timescale = given["timescale"] if given["timescale"] is not None else warmup or 10_000
    return functools.partial(_inverse_sqrt, num_warmup_steps=warmup, timescale=timescale)


def no_schedule(step: int) -> float:
    """A constant lr without warm-up."""
    return 1.0


def _warming(step: int, warmup: int) -> float:
    return float(step) / float(max(1, warmup))


def _constant(step: int, *, num_warmup_steps: int) -> float:
    if step < num_warmup_steps:
        return float(step) / float(max(1.0, num_warmup_steps))
    return 1.0


def _linear(step: int, *, num_warmup_steps: int, num_training_steps: int) -> float:
    if step < num_warmup_steps:
        return _warming(step, num_warmup_steps)
    return max(0.0, float(num_training_steps - step) / float(max(1, num_training_steps - num_warmup_steps)))


def _cosine(
    step: int, *, num_warmup_steps: int, num_training_steps: int, num_cycles: float, min_lr_rate: float = 0.0
) -> float:
    if step < num_warmup_steps:
        return _warming(step, num_warmup_steps)
    progress = float(step - num_warmup_steps) / float(max(1, num_training_steps - num_warmup_steps))
    value = 0.5 * (1.0 + math.cos(math.pi * float(num_cycles) * 2.0 * progress))
    return max(0, value * (1 - min_lr_rate) + min_lr_rate)


def _nanogpt(step: int, *, warmup: int, decay_steps: int, min_lr_rate: float) -> float:
    """nanoGPT's get_lr over lr: a warm-up from lr / (warmup + 1), a cosine to the floor over ``decay_steps``
    (which may end before the run), then the floor."""
    if step < warmup:
        return (step + 1) / (warmup + 1)
    if step > decay_steps:
        return min_lr_rate
    ratio = (step - warmup) / (decay_steps - warmup)
    coeff = 0.5 * (1.0 + math.cos(math.pi * ratio))
    return min_lr_rate + coeff * (1.0 - min_lr_rate)


def _polynomial(
    step: int, *, num_warmup_steps: int, num_training_steps: int, lr_end: float, power: float, lr_init: float
) -> float:
    if step < num_warmup_steps:
        return _warming(step, num_warmup_steps)
    if step > num_training_steps:
        # (LambdaLR multiplies by lr_init)
        return lr_end / lr_init
    remaining = 1 - (step - num_warmup_steps) / (num_training_steps - num_warmup_steps)
    return ((lr_init - lr_end) * remaining**power + lr_end) / lr_init


def _inverse_sqrt(step: int, *, num_warmup_steps: int, timescale: int) -> float:
    if step < num_warmup_steps:
        return _warming(step, num_warmup_steps)
    shift = timescale - num_warmup_steps
    return 1.0 / math.sqrt((step + shift) / timescale)


def _warmup_stable_decay(
    step: int,
    *,
    num_warmup_steps: int,
    num_stable_steps: int,
    num_decay_steps: int,
    warmup_type: str,
    decay_type: str,
    min_lr_ratio: float,
    num_cycles: float,
) -> float:
    if step < num_warmup_steps:
        progress = _warming(step, num_warmup_steps)
        if warmup_type == "linear":
            value = progress
        elif warmup_type == "cosine":
            value = 0.5 * (1.0 - math.cos(math.pi * progress))
        # 1-sqrt.
        else:
            value = 1.0 - math.sqrt(1.0 - progress)
        return max(0.0, value * (1.0 - min_lr_ratio) + min_lr_ratio)
    if step < num_warmup_steps + num_stable_steps:
        return 1.0
    if step < num_warmup_steps + num_stable_steps + num_decay_steps:
        progress = float(step - num_warmup_steps - num_stable_steps) / float(max(1, num_decay_steps))
        if decay_type == "linear":
            value = 1.0 - progress
        elif decay_type == "cosine":
            value = 0.5 * (1.0 + math.cos(math.pi * float(num_cycles) * 2.0 * progress))
        # 1-sqrt.
        else:
            value = 1.0 - math.sqrt(progress)
        return max(0.0, value * (1.0 - min_lr_ratio) + min_lr_ratio)
    return min_lr_ratio
