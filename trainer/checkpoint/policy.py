"""What a resume may do: where in the data it continues when the same global batch is split otherwise, and
what it does with each setting changed since its checkpoint (refused by name, or applied from the next step and
said). Plain rules, tested in-process (docs/internals.md#what-a-resume-may-do, docs/checkpoints.md).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, Optional

import torch

from trainer.errors import CheckpointError

if TYPE_CHECKING:
    from trainer.launch.run import Run
    from trainer.optim.build import Optimization

NOT_COMPARED = ("output_dir", "resume", "batch_size", "gradient_accumulation_steps")
# (data_weights: the order of a mixture of training sets, trainer.data.mixing)
ORDER_OF_THE_EPOCH = ("seed", "shuffle", "drop_last", "data_weights")


def changed_settings(saved: dict[str, Any], now: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """``{field: (saved value, this run's)}`` for each compared field that differs and the checkpoint recorded."""
    # As JSON keeps them: tuples as lists, keys as strings.
    plain = lambda value: json.loads(json.dumps(value, default=str))  # noqa: E731
    return {
        key: (saved[key], value)
        for key, value in now.items()
        if key in saved and key not in NOT_COMPARED and plain(saved[key]) != plain(value)
    }


def refusal(
    saved: dict[str, Any],
    now: dict[str, Any],
    path: Path,
    *,
    mid_epoch: bool,
    built_optimizer: bool,
    saved_class: Optional[str],
    optimizer_class: str,
) -> Optional[CheckpointError]:
    """Why this run (config ``now``) cannot train on from checkpoint ``path`` (config ``saved``), or None."""
    changes = changed_settings(saved, now)

    def refused(why: str, keep: str) -> CheckpointError:
        return CheckpointError(
            f"checkpoint {path}: {why}. Resume with {keep}, or start a new run in another "
            "output_dir (python -m trainer.export takes its weights alone)"
        )

    def listed(keys: list[str]) -> str:
        return ", ".join(f"{key} {changes[key][0]} -> {changes[key][1]}" for key in keys)

    if built_optimizer and "optimizer" in changes:
        old, new = changes["optimizer"]
        return refused(
            f"it was written with optimizer {old}, and this run has {new}: the saved optimizer state "
            f"cannot go on as {new}'s",
            f"optimizer {old}",
        )
    if saved_class is not None and saved_class != optimizer_class:
        return refused(
            f"its optimizer was {saved_class}, and this run's is {optimizer_class}: the saved optimizer "
            f"state cannot go on as {optimizer_class}'s",
            f"the optimizer class {saved_class}",
        )
    grouping = [key for key in ("weight_decay", "decay_biases_and_norms") if key in changes]
    if built_optimizer and grouping and _one_group(saved) != _one_group(now):
        return refused(
            f"{listed(grouping)} changes the optimizer's parameter groups (with weight decay, biases and "
            "norm weights are a group of their own), and the saved optimizer state is per group",
            " and ".join(f"{key} {changes[key][0]}" for key in grouping),
        )
    order = [key for key in ORDER_OF_THE_EPOCH if key in changes]
    if order == ["seed"] and not now["shuffle"]:
        # An epoch read in order does not depend on the seed.
        order = []
    if mid_epoch and order:
        return refused(
            f"{listed(order)} changes the order of examples in the epoch it stopped in: some examples "
            "would be read twice and others never",
            " and ".join(f"{key} {changes[key][0]}" for key in order)
            + " until the epoch ends (a checkpoint at an epoch's end takes any)",
        )
    return None


def resized_mid_epoch(saved: dict[str, int], now: dict[str, int], path: Path) -> CheckpointError:
    """The refusal of a resume mid-epoch whose training sets do not have the sizes the checkpoint recorded."""
    sizes = lambda sizes: ", ".join(f"{name} {count}" for name, count in sizes.items())  # noqa: E731
    return CheckpointError(
        f"checkpoint {path}: the training data has changed size since it was written ({sizes(saved)} examples "
        f"then, {sizes(now)} now), in the epoch it stopped in: its order is drawn from the sizes, so some examples "
        "would be read twice and others never. Resume with the data it was written with until the epoch ends (a "
        "checkpoint at an epoch's end takes any), or start a new run in another output_dir"
    )


def _one_group(config: dict[str, Any]) -> bool:
    """Whether a config's optimizer (trainer.optim) has a single parameter group."""
    return config.get("weight_decay", 0) == 0 or bool(config.get("decay_biases_and_norms"))


def group_settings(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """This run's optimizer settings per parameter group (lr, betas, eps, ...), before a checkpoint's replace them."""
    return [{key: value for key, value in group.items() if key != "params"} for group in optimizer.param_groups]


def apply_settings(
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    settings: list[dict[str, Any]],
    *,
    step: int,
    moved: tuple[bool, bool],
    built_scheduler: bool,
) -> tuple[float, float]:
    """After a checkpoint was loaded: this run's optimizer settings back in place of the saved ones and, for a
    schedule built from the config (a LambdaLR: trainer.optim), the lr recomputed at ``step`` from this run's base
    lr and schedule (a user's scheduler keeps its saved state). Returns the next step's lr under the checkpoint's
    settings and under this run's. ``moved``: whether the checkpoint's schedule was stepped, and this run's is (a
    constant lr without warm-up is not: its position is the step reached, its state left as an uninterrupted run's)."""
    groups = optimizer.param_groups
    saved_lr = groups[0]["lr"]
    for group, own in zip(groups, settings, strict=True):
        group.update({key: value for key, value in own.items() if key not in ("lr", "initial_lr") or built_scheduler})
    if built_scheduler:
        at = scheduler.last_epoch if moved[0] else step
        base_lrs = [group["initial_lr"] for group in groups]
        lrs = [base * schedule(at) for base, schedule in zip(base_lrs, scheduler.lr_lambdas, strict=True)]
        for group, lr in zip(groups, lrs, strict=True):
            group["lr"] = lr
        at = at if moved[1] else scheduler.last_epoch
        scheduler.load_state_dict({**scheduler.state_dict(), "base_lrs": base_lrs, "last_epoch": at, "_last_lr": lrs})
    return saved_lr, groups[0]["lr"]


def said(changes: dict[str, tuple[Any, Any]], step: int, lrs: tuple[float, float]) -> str:
    """The one line for the changes a resume applies ("" when none)."""
    words = [f"{key} {old} -> {new}" for key, (old, new) in changes.items()]
    if not math.isclose(lrs[0], lrs[1], rel_tol=1e-9):
        words.append(f"so the next step's lr is {lrs[1]:.4g}, not {lrs[0]:.4g}")
    if not words:
        return ""
    return f"changed since the checkpoint, applied from step {step + 1}: {', '.join(words)}"


class Resumption(NamedTuple):
    """A resume judged: the micro-batch of the epoch to read next, what a change of split means for it (words), and
    why ``fit()`` cannot go on from the checkpoint's position (another global batch) or under this run's settings."""

    batches: int
    resplit: str
    misfit: Optional[CheckpointError]
    refused: Optional[CheckpointError]


@dataclass(frozen=True)
class Split:
    """How a run splits its global batch: data-parallel processes x batch_size x gradient_accumulation_steps."""

    processes: int
    batch_size: int
    accumulation: int

    @property
    def global_batch(self) -> int:
        return self.processes * self.batch_size * self.accumulation

    def __str__(self) -> str:
        return (
            f"{self.processes} process(es) x batch {self.batch_size} x accumulation {self.accumulation} = "
            f"{self.global_batch} global"
        )


def resumed_position(run: dict[str, Any], batches: int, now: Split, *, path: Path, streaming: bool) -> tuple[int, str]:
    """The micro-batch of the checkpoint's epoch this run reads next (the checkpoint read ``batches`` of it, split
    as its ``run`` part says), and what a change of split means for it (the module docstring's rule)."""
    saved = Split(run["world_size"], run["batch_size"], run["gradient_accumulation_steps"])
    if saved == now:
        return batches, ""
    if streaming:
        raise CheckpointError(
            f"checkpoint {path} was written with {saved}, this run has {now}: a stream's position "
            "is kept per process, so resume it with the same processes, batch_size and "
            "gradient_accumulation_steps"
        )
    if saved.global_batch != now.global_batch:
        raise CheckpointError(
            f"checkpoint {path} was written with {saved}; this run has {now}. Every later step "
            f"would differ from the run's: keep {saved.global_batch} global "
            f"({_keeping(saved.global_batch, now)}), or start a new run in another "
            "output_dir"
        )
    steps_into_epoch = batches // saved.accumulation
    return steps_into_epoch * now.accumulation, f"; split {saved} -> {now}: the same global batch, the same examples"


def _keeping(global_batch: int, now: Split) -> str:
    """A split of ``global_batch`` over this run's processes, said as the settings to use."""
    if global_batch % now.processes:
        return f"{global_batch} does not split over {now.processes} processes: launch a divisor of it"
    per_process = global_batch // now.processes
    if per_process % now.accumulation == 0:
        return f"batch_size {per_process // now.accumulation} with gradient_accumulation_steps {now.accumulation}"
    return f"batch_size {per_process} with gradient_accumulation_steps 1"


def random_states(saved_processes: int, processes: int) -> str:
    """What a resume on more processes than wrote the checkpoint does for the new ranks' random state."""
    if processes <= saved_processes:
        return ""
    new = ", ".join(map(str, range(saved_processes, processes)))
    return (
        f"; rank(s) {new} had no saved random state (the checkpoint has {saved_processes} processes'): "
        "they start from seed + rank, as at a fresh start"
    )


class RunSetup:
    """How this run is set up, as far as its checkpoints go: what each records of it (``run``), what a resume
    compares with it, and the optimizer and (torch) scheduler a resume applies this run's settings to."""

    def __init__(self, run: Run, optimization: Optimization, *, data: Any = None):
        self.config, self.optimization = run.config, optimization
        # data: the Trainer's loaders (trainer.data.loaders), if any. A stream's position is kept per process; the
        # sizes of the training sets are what an epoch's order is drawn from.
        self.streaming = getattr(data, "stream", None) is not None
        self.sizes: Optional[dict[str, int]] = getattr(data, "sizes", None)
        # A Trainer for evaluate() and predict() alone trains with none of its settings.
        self.trains = data is None or getattr(data, "train", None) is not None
        # The data-parallel processes, and the launch's mixed precision (no, bf16, fp16).
        self.processes, self.mixed_precision = run.dp.size, run.accelerator.mixed_precision
        self.optimizer, self.scheduler = optimization.optimizer, optimization.scheduler

    @property
    def split(self) -> Split:
        return Split(self.processes, self.config.batch_size, self.config.gradient_accumulation_steps)

    def record(self) -> dict[str, Any]:
        return {
            "world_size": self.split.processes,
            "batch_size": self.split.batch_size,
            "gradient_accumulation_steps": self.split.accumulation,
            "config": self.config.to_dict(),
            "optimizer_class": type(self.optimizer).__name__,
            "mixed_precision": self.mixed_precision,
            "data_sizes": self.sizes,
        }

    def judge(self, state: dict[str, Any], path: Path) -> Resumption:
        """What a resume from checkpoint ``state`` (at ``path``) does, and what it refuses."""
        run, batches = state["run"], state["train"]["batches_into_epoch"]
        misfit = None
        try:
            batches, resplit = resumed_position(run, batches, self.split, path=path, streaming=self.streaming)
        # The weights still serve evaluate() and predict(); fit() refuses.
        except CheckpointError as err:
            misfit, resplit = err, ""
        settings = refusal(
            run.get("config", {}),
            self.config.to_dict(),
            path,
            mid_epoch=batches > 0,
            built_optimizer=self.optimization.built_optimizer,
            saved_class=run.get("optimizer_class"),
            optimizer_class=type(self.optimizer).__name__,
        )
        resized = run.get("data_sizes") and self.sizes and run["data_sizes"] != self.sizes
        if settings is None and batches > 0 and resized:
            settings = resized_mid_epoch(run["data_sizes"], self.sizes, path)
        return Resumption(batches, resplit, misfit, settings)

    def apply_changes(self, run: dict[str, Any], step: int, own_settings: list[dict[str, Any]]) -> str:
        """This run's settings where they differ from the checkpoint's (its ``run``), from the next step on; the
        line that says so ('' when none)."""
        saved = run.get("config", {})
        moved = saved.get("lr_scheduler", "constant") != "constant" or saved.get("warmup_steps", 0) > 0
        built, moves = self.optimization.built_scheduler, self.optimization.schedule_moves
        lrs = apply_settings(
            self.optimizer, self.scheduler, own_settings, step=step, moved=(moved, moves), built_scheduler=built
        )
        lines = [said(changed_settings(saved, self.config.to_dict()), step, lrs) if self.trains else ""]
        # Older checkpoints did not record it.
        written = run.get("mixed_precision", self.mixed_precision)
        # The weights and the optimizer state are fp32 either way: it goes on.
        if written != self.mixed_precision:
            lines.append(
                f"mixed precision {written} -> {self.mixed_precision} (the launch's accelerate config) from "
                f"step {step + 1}: the weights and optimizer state go on, the figures after differ from "
                "what the first launch would have computed"
            )
        return "\n".join(line for line in lines if line)
