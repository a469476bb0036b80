"""What every process measured between two logs, and the one gather that makes it the job's.

Each process keeps its own log window: each micro-batch's loss tensor as it is, on the device (summed only when the
trainer logs: no device work, and no waiting for it, on steps that do not log), the first step whose loss was not
finite (``nan_policy: raise``, folded in with the sum), counts and timings on the host. At a log every rank's window
becomes one row, and one gather of the rows is all the processes agree on: the loss, the throughput, the stragglers,
whether some rank asked to stop (``trainer.should_stop``), and the first non-finite loss. The main process then adds
the global view: the mean loss across ranks, global throughput, and the fastest and slowest rank's step time, data
wait and forward pass, with the rank the others waited for.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any, Iterable, Iterator, Optional

import torch
from accelerate.utils import find_batch_size

from trainer.parallel.gradients import whole

# "no bad step yet": larger than any step, so the first bad step is a minimum.
NONE = 2**62

# One row of a rank's window, in this order, gathered from every rank at each log.
# loss_sum / loss_weight is the window's mean loss: weights are a micro-batch's counted tokens (or its loss_fn's
# count), else 1 (trainer.weighing). stop: this rank's trainer.should_stop. lr: the log step's. first_bad: its first
# non-finite step. grad_norm: the log step's gradient norm before clipping (NOT_MEASURED: none; NaN stays NaN).
WINDOW_FIELDS = (
    "loss_sum",
    "micro_batches",
    "examples",
    "tokens",
    "steps",
    "seconds",
    "data_wait",
    "forward",
    "stop",
    "lr",
    "loss_weight",
    "first_bad",
    "grad_norm",
)
# The row's grad_norm on a step that measured none (a norm is never negative)
NOT_MEASURED = -1.0
# Losses kept before they are folded into one sum on the device (memory stays flat)
FOLD_EVERY = 1024


class LogWindow:
    """What this process did since the last log (see the module docstring)."""

    def __init__(self, device: torch.device, figures: Optional[LoggedFigures] = None):
        self._device = device
        # The figures logged with this window (``trainer.log``'s, the experts' load).
        self.figures = figures
        self.restart()

    def add(
        self, loss: torch.Tensor, step: int, batch: Any, *, examples: int | torch.Tensor, weight: int | torch.Tensor = 1
    ) -> None:
        """Count one micro-batch of optimizer step ``step``: its loss (weighed: ``weight`` x its mean), examples
        (``examples_in``: a number, or a device count), and tokens when it carries ``input_ids``."""
        self._losses.append(loss)
        self._steps.append(step)
        if isinstance(weight, torch.Tensor):
            self._weights.append(weight)
        else:
            self._host_weight += weight
        if isinstance(examples, torch.Tensor):
            self._device_examples.append(examples)
        else:
            self.examples += examples
        # A long window: one sum per FOLD_EVERY steps keeps memory flat.
        if len(self._losses) >= FOLD_EVERY:
            self._fold()
        self.micro_batches += 1
        # Dict, BatchEncoding.
        if isinstance(batch, Mapping) and isinstance(batch.get("input_ids"), torch.Tensor):
            # Shape metadata: no device sync.
            self.tokens += batch["input_ids"].numel()

    def stepped(self) -> None:
        """One optimizer step done."""
        self.steps += 1

    def forward_took(self, seconds: float) -> None:
        """A forward pass's host time: this rank's own work before the gradients' all-reduce."""
        self.forward += seconds

    def timed(self, batches: Iterable) -> Iterator:
        """Yield from ``batches``, adding the seconds spent waiting for each one to ``data_wait``."""
        iterator = iter(batches)
        while True:
            asked = time.perf_counter()
            try:
                batch = next(iterator)
            except StopIteration:
                return
            self.data_wait += time.perf_counter() - asked
            yield batch

    def first_bad_step(self) -> torch.Tensor:
        """The first step of this window whose loss was not finite (``NONE``: none), on the device."""
        self._fold()
        return self._first_bad

    def row(self, stop: bool = False, lr: Any = 0.0, grad_norm: Optional[torch.Tensor] = None) -> torch.Tensor:
        """This window as one row (``WINDOW_FIELDS``), on the device, ready to gather: everything a log reads back
        from the device (the loss, the gradient norm, a tensor lr) rides the gather's one read."""
        self._fold()
        seconds = time.perf_counter() - self._since
        host = [
            self.micro_batches,
            self.examples,
            self.tokens,
            self.steps,
            seconds,
            self.data_wait,
            self.forward,
            float(stop),
        ]
        # (a CPU tensor: no device to wait for)
        lr_on_host = not torch.is_tensor(lr) or lr.device.type == "cpu"
        host_part = self._to_device(torch.tensor([*host, float(lr)] if lr_on_host else host, dtype=torch.float64))
        # The device's counts (flattened batches) added.
        examples = host_part[1:2] + self._folded_examples
        host_part = torch.cat([host_part[:1], examples, host_part[2:]])
        device_lr = [] if lr_on_host else [lr.detach().reshape(1).double()]
        weight = self._folded_weight.view(1) + self._host_weight
        if grad_norm is None:
            norm = torch.full((1,), NOT_MEASURED, dtype=torch.float64, device=self._device)
        else:
            # Its whole value (a sharded norm's is a collective, no host read).
            norm = whole(grad_norm).detach().reshape(1).double()
        return torch.cat(
            [self._folded.view(1), host_part, *device_lr, weight, self._first_bad.double().view(1), norm]
        ).view(1, -1)

    def _to_device(self, host: torch.Tensor) -> torch.Tensor:
        """A host tensor copied to the device without waiting for the device's queued work: a blocking copy to a
        GPU waits for the whole step to finish, a second host synchronisation at every log."""
        if self._device.type == "cuda":
            return host.pin_memory().to(self._device, non_blocking=True)
        return host.to(self._device)

    def _fold(self) -> None:
        """The kept losses (and device weights) into their sums, and their first non-finite step, on the device."""
        if self._losses:
            losses = torch.stack([loss.reshape(()) for loss in self._losses]).double()
            self._folded = self._folded + losses.sum()
            steps = torch.tensor(self._steps, device=losses.device)
            self._first_bad = torch.minimum(self._first_bad, torch.where(torch.isfinite(losses), NONE, steps).min())
        if self._weights:
            weights = torch.stack([weight.reshape(()) for weight in self._weights]).double()
            self._folded_weight = self._folded_weight + weights.sum()
        if self._device_examples:
            self._folded_examples = self._folded_examples + torch.stack(self._device_examples).double().sum()
        self._losses, self._steps, self._weights, self._device_examples = [], [], [], []

    def restart(self) -> None:
        self._losses: list[torch.Tensor] = []
        self._steps: list[int] = []
        # Device counts (tokens); weights of 1 are counted on the host.
        self._weights: list[torch.Tensor] = []
        # Flattened batches' documents, counted on the device.
        self._device_examples: list[torch.Tensor] = []
        self._folded_examples = torch.zeros((), dtype=torch.float64, device=self._device)
        self._host_weight = 0
        self._folded = torch.zeros((), dtype=torch.float64, device=self._device)
        self._folded_weight = torch.zeros((), dtype=torch.float64, device=self._device)
        self._first_bad = torch.full((), NONE, dtype=torch.long, device=self._device)
        self.micro_batches = self.examples = self.tokens = self.steps = 0
        self.data_wait = self.forward = 0.0
        self._since = time.perf_counter()


def examples_in(batch: Any) -> int | torch.Tensor:
    """The examples a micro-batch holds: its rows; for a flattened batch (``DataCollatorWithFlattening``: one row of
    documents end to end, ``position_ids`` restarting at 0 at each) its documents, counted on the device (a number
    read back would be a host synchronisation at every step)."""
    if isinstance(batch, Mapping):
        ids, positions = batch.get("input_ids"), batch.get("position_ids")
        if (
            isinstance(ids, torch.Tensor)
            and isinstance(positions, torch.Tensor)
            and ids.dim() == 2
            and ids.shape[0] == 1
        ):
            # (one row that does not start at 0 is one example)
            return (positions == 0).sum().clamp(min=1)
    return find_batch_size(batch)


class LoggedFigures:
    """What a user logs between two logs (``trainer.log``): each name's mean over its calls. Tensors are kept as
    they are, on the device, and read only when the trainer logs (a host sync it makes anyway)."""

    def __init__(self, reserved: tuple[str, ...]):
        # The trainer's own figures: a user's of the same name would hide them.
        self.reserved = reserved
        self._sums: dict[str, Any] = {}
        self._counts: dict[str, int] = {}

    def add(self, values: Mapping[str, Any]) -> None:
        for name, value in values.items():
            if not isinstance(name, str) or name in self.reserved or name.startswith(("rank/", "global/", "eval/")):
                raise ValueError(f"trainer.log: {name!r} is a figure the trainer logs itself; name yours otherwise")
            if isinstance(value, torch.Tensor):
                if value.numel() != 1:
                    raise ValueError(f"trainer.log: {name!r} is a tensor of shape {tuple(value.shape)}; log one number")
                value = value.detach().reshape(()).double()
            elif isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"trainer.log: {name!r} is {value!r}; log a number or a one-element tensor")
            self._sums[name] = self._sums.get(name, 0.0) + value
            self._counts[name] = self._counts.get(name, 0) + 1

    def take(self) -> dict[str, float]:
        """Each figure's mean since the last take, as numbers; then empty. The tensors of each device are read in
        one go: a round trip each otherwise."""
        totals = {name: total for name, total in self._sums.items() if not torch.is_tensor(total)}
        # A figure of a sharded model's: whole.
        tensors = {name: whole(total) for name, total in self._sums.items() if torch.is_tensor(total)}
        by_device: dict[torch.device, list[str]] = {}
        for name, total in tensors.items():
            by_device.setdefault(total.device, []).append(name)
        for names in by_device.values():
            totals.update(zip(names, torch.stack([tensors[name] for name in names]).tolist(), strict=True))
        means = {name: float(totals[name]) / self._counts[name] for name in self._sums}
        self._sums, self._counts = {}, {}
        return means


def summarize(
    rows: list[list[float]],
    rank: int,
    replicas: Optional[int] = None,
) -> tuple[dict[str, float], dict[str, float]]:
    """Every rank's window (``WINDOW_FIELDS`` rows) -> (this rank's own figures, the global view). The job's examples
    and tokens are the ``replicas``' (the data-parallel processes; all by default): processes that share a batch
    (a tensor-parallel group) each count it.

    A rank's step time is wall time, which the gradient all-reduce makes nearly equal on every rank. What tells a
    straggler apart is the part of a step each rank does alone before that all-reduce: waiting for data and the
    forward pass. The slowest rank is the one with the most of it: the others waited for it.
    """
    windows = [dict(zip(WINDOW_FIELDS, row, strict=True)) for row in rows]
    per_rank = [_rank_figures(w) for w in windows]
    alone = [f["rank/data_wait_s"] + f["rank/forward_s"] for f in per_rank]
    seconds = max(w["seconds"] for w in windows)
    share = (replicas or len(rows)) / len(rows)
    total = {key: sum(w[key] for w in windows) * share for key in ("loss_sum", "loss_weight", "examples", "tokens")}
    global_view = {
        "global/train_loss": total["loss_sum"] / total["loss_weight"] if total["loss_weight"] else 0.0,
        "global/examples_per_s": total["examples"] / seconds,
        "global/step_time_min_s": min(f["rank/step_time_s"] for f in per_rank),
        "global/step_time_max_s": max(f["rank/step_time_s"] for f in per_rank),
        "global/data_wait_min_s": min(f["rank/data_wait_s"] for f in per_rank),
        "global/data_wait_max_s": max(f["rank/data_wait_s"] for f in per_rank),
        "global/forward_min_s": min(f["rank/forward_s"] for f in per_rank),
        "global/forward_max_s": max(f["rank/forward_s"] for f in per_rank),
        "global/slowest_rank": alone.index(max(alone)),
    }
    if total["tokens"]:
        global_view["global/tokens_per_s"] = total["tokens"] / seconds
    return per_rank[rank], global_view


def _rank_figures(window: dict[str, float]) -> dict[str, float]:
    steps, seconds = max(window["steps"], 1), max(window["seconds"], 1e-9)
    figures = {
        "rank/loss": window["loss_sum"] / window["loss_weight"] if window["loss_weight"] else 0.0,
        "rank/step_time_s": seconds / steps,
        "rank/data_wait_s": window["data_wait"] / steps,
        "rank/forward_s": window["forward"] / steps,
        "rank/examples_per_s": window["examples"] / seconds,
    }
    if window["tokens"]:
        figures["rank/tokens_per_s"] = window["tokens"] / seconds
    return figures


def memory_gb(device: torch.device) -> float:
    """This process's memory: the CUDA allocator's peak on a GPU, the resident set size otherwise."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    # Accelerate's own dependency.
    import psutil

    return psutil.Process().memory_info().rss / 2**30
