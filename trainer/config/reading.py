"""A config's values from outside: YAML files and ``key=value`` overrides, each key checked against TrainConfig's
fields (an unknown key names the closest valid ones, or the accelerate config that sets it) and each value against
its field's type, every mistake a ``ConfigError`` naming the key (docs/project.md).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
import typing
from pathlib import Path
from typing import Any

import yaml

from trainer.errors import ConfigError


class _StrictLoader(yaml.SafeLoader):
    """PyYAML's safe loader, except that a key given twice is an error (PyYAML keeps the last one silently)."""

    def construct_mapping(self, node, deep=False):
        seen = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                lines = f"lines {seen[key] + 1} and {key_node.start_mark.line + 1}"
                raise ConfigError(f"key '{key}' is given twice ({lines}): keep one")
            seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


def read_yaml(path: str | Path) -> dict[str, Any]:
    """A YAML config file's mapping; a missing or empty file, a repeated key, bad YAML or anything but a mapping
    is a ConfigError naming the file."""
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"config file {path} is a folder: pass a YAML file of TrainConfig keys")
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    text = path.read_text()
    try:
        values = yaml.load(text, Loader=_StrictLoader)
    except ConfigError as err:
        raise ConfigError(f"{path}: {err}") from None
    except yaml.YAMLError as err:
        # One line: where, and what PyYAML found there (not its picture of the line).
        mark, problem = getattr(err, "problem_mark", None), getattr(err, "problem", None) or str(err)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise ConfigError(f"{path}: not valid YAML{where}: {' '.join(str(problem).split())}") from None
    if values is None:
        raise ConfigError(
            f"{path} is empty: list the TrainConfig keys that differ from the defaults, or do not pass a config file"
        )
    if not isinstance(values, dict):
        raise ConfigError(f"{path}: expected a mapping of TrainConfig keys, got {type(values).__name__}")
    return values


# What transformers' TrainingArguments (and habit) call some keys: a misspelling of these suggests ours.
OTHER_NAMES = {
    "learning_rate": "lr",
    "num_train_epochs": "epochs",
    "per_device_train_batch_size": "batch_size",
    "train_batch_size": "batch_size",
    "lr_scheduler_type": "lr_scheduler",
    "logging_steps": "log_every",
    "eval_steps": "eval_every",
    "save_steps": "save_every",
    "save_total_limit": "keep_last",
    "resume_from_checkpoint": "resume",
    "adam_epsilon": "eps",
    "grad_clip": "max_grad_norm",
    "gradient_accumulation": "gradient_accumulation_steps",
    "warmup": "warmup_steps",
}


# Settings other trainers take in their config that the accelerate config at launch decides here.
LAUNCH_SETTINGS = {
    "mixed_precision": "accelerate_configs/bf16.yaml or fp16.yaml",
    "bf16": "accelerate_configs/bf16.yaml",
    "fp16": "accelerate_configs/fp16.yaml",
    "fsdp": "accelerate_configs/fsdp.yaml",
    "fsdp_config": "accelerate_configs/fsdp.yaml",
    "deepspeed": "accelerate_configs/fsdp.yaml: this trainer shards with FSDP2",
}


def check_keys(cls: type, values: dict[str, Any], source: str) -> None:
    """An unknown key is an error naming the closest valid ones, or the accelerate config that sets it."""
    valid = [f.name for f in dataclasses.fields(cls)]
    for key in values:
        if key in LAUNCH_SETTINGS and key not in valid:
            raise ConfigError(
                f"{source}: '{key}' is not a TrainConfig key: the accelerate config chosen at launch "
                f"sets it, for every process alike (launch with {LAUNCH_SETTINGS[key]})"
            )
        if key not in valid:
            names = {**{name: name for name in valid}, **{k: v for k, v in OTHER_NAMES.items() if v in valid}}
            close = difflib.get_close_matches(str(key).lower(), list(names), n=3, cutoff=0.5)
            # Only those near the closest: max_step is max_steps, not save_every.
            ratios = [difflib.SequenceMatcher(None, str(key).lower(), name).ratio() for name in close]
            close = [name for name, ratio in zip(close, ratios, strict=True) if ratio >= ratios[0] - 0.15]
            # Another trainer's name: ours.
            close = list(dict.fromkeys(names[name] for name in close))
            # The closest keys when there are some; else where all of them are listed (53 keys in a line: unread).
            every = "The keys are TrainConfig's fields: help(trainer.TrainConfig)."
            hint = f"Did you mean: {', '.join(close)}?" if close else every
            raise ConfigError(f"{source}: unknown key '{key}'. {hint}")


def built_from_yaml(cls: type, path: Path, overrides: list[str] | tuple[str, ...]) -> Any:
    """``cls`` (TrainConfig) from YAML file ``path`` and ``key=value`` overrides; a mistake names the file, or the
    override that made it."""
    values = read_yaml(path)
    check_keys(cls, values, str(path))
    for item in overrides:
        check_keys(cls, parse_overrides([item]), f"override {item!r}")
    try:
        return cls.from_dict({**values, **parse_overrides(overrides)})
    except ConfigError as err:
        # Each message opens with the key it is about.
        key = str(err).split(maxsplit=1)[0] if str(err) else ""
        blamed = [item for item in overrides if item.partition("=")[0].strip() == key]
        raise ConfigError(f"{f'override {blamed[-1]!r}' if blamed else path}: {err}") from None


# What a tool that runs a script gives every TrainConfig the script builds, over the script's own values (the resume
# proof's output_dir, max_steps, save_every): a YAML mapping, TRAINER_OVERRIDES='{max_steps: 6, save_every: 2}'.
ENV_OVERRIDES = "TRAINER_OVERRIDES"


def env_overrides(cls: type) -> dict[str, Any]:
    """``TRAINER_OVERRIDES``'s keys and values, checked against ``cls``'s fields; {} when it is not set."""
    text = os.environ.get(ENV_OVERRIDES, "").strip()
    try:
        values = yaml.load(text, Loader=_StrictLoader) if text else {}
    except (ConfigError, yaml.YAMLError) as err:
        raise ConfigError(
            f"{ENV_OVERRIDES} is not a YAML mapping of TrainConfig keys: {' '.join(str(err).split())}"
        ) from None
    if not isinstance(values, dict):
        raise ConfigError(f"{ENV_OVERRIDES} must be a mapping of TrainConfig keys, got {text!r}")
    check_keys(cls, values, ENV_OVERRIDES)
    return values


def parse_overrides(overrides: list[str] | tuple[str, ...]) -> dict[str, Any]:
    """``["lr=1e-3", "betas=[0.9, 0.95]"]`` -> ``{"lr": "1e-3", "betas": [0.9, 0.95]}`` (values parsed as YAML)."""
    parsed = {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"override '{item}' is not of the form key=value")
        parsed[key.strip()] = yaml.safe_load(raw) if raw.strip() else None
    return parsed


def check_choice(key: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{key} must be one of {', '.join(choices)}; got {value!r}")


def coerce(key: str, value: Any, annotation: Any) -> Any:
    """Return ``value`` as the field's type, or raise a ConfigError naming ``key``.

    Strict, with three deliberate leniencies: an int where a float is expected, a numeric string for a float
    (PyYAML reads ``1e-3`` as a string because it lacks a dot), and a path (``pathlib.Path``, as
    ``trainer.best_checkpoint`` is) for a string.
    """
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    # Optional[X].
    if origin is typing.Union and type(None) in args:
        if value is None:
            return None
        (annotation,) = [a for a in args if a is not type(None)]
        origin, args = typing.get_origin(annotation), typing.get_args(annotation)

    def wrong() -> ConfigError:
        expected = getattr(annotation, "__name__", str(annotation))
        return ConfigError(f"{key} must be {expected}, got {value!r} ({type(value).__name__})")

    if origin is tuple:
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            raise wrong()
        return tuple(coerce(f"{key}[{i}]", v, a) for i, (v, a) in enumerate(zip(value, args, strict=True)))
    if annotation is bool:
        if not isinstance(value, bool):
            raise wrong()
        return value
    if annotation is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise wrong()
        return value
    if annotation is float:
        if isinstance(value, str):
            try:
                value = float(value)
            except ValueError:
                raise wrong() from None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise wrong()
        # YAML's .nan / .inf: torch would fail late, or train on nonsense.
        if not math.isfinite(value):
            raise ConfigError(f"{key} must be a finite number, got {value!r}")
        return float(value)
    if annotation is str:
        value = os.fspath(value) if isinstance(value, os.PathLike) else value
        if not isinstance(value, str):
            raise wrong()
        return value
    if annotation is dict:
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise wrong()
        return dict(value)
    raise TypeError(f"TrainConfig field {key} has an unsupported annotation {annotation!r}")


RANGE = re.compile(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?")


def steps_of(text: str) -> tuple[int, int]:
    """``"10-12"`` -> (10, 12), ``"10"`` -> (10, 10); a ConfigError naming ``profile_steps`` otherwise."""
    match = RANGE.fullmatch(text)
    first, last = (int(match.group(1)), int(match.group(2) or match.group(1))) if match else (0, 0)
    if not match or first < 1 or last < first:
        raise ConfigError(
            f"profile_steps must be an optimizer step or a range of them, say '10-12' (or null for "
            f"no trace); got {text!r}"
        )
    return first, last
