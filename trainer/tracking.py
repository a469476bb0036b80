"""What every process measured, written where a person can look at it (wandb groups, one run per process).

Each rank appends its own figures to ``<output_dir>/metrics/rank<k>.jsonl``, always. With ``wandb_project`` set (or
``WANDB_PROJECT`` in the environment, as wandb's own convention), each rank also logs to its own wandb run,
``<experiment>-rank<k>``, all in one group named after the experiment, so every worker's loss, speed, memory and
errors can be looked at on their own or side by side; with ``tensorboard: true`` each rank writes TensorBoard
events to ``<output_dir>/tensorboard/rank<k>`` (one log dir, a run per rank). Accelerate's trackers cannot do
this: they log from the main process only. Figures a user logs (``trainer.log``, or added to ``metrics`` in
``on_log``) go everywhere the built-in ones go.

At every log the main process adds the global view (mean loss across ranks, global throughput, eval metrics) and
the stragglers: the fastest and slowest rank's step time, data wait and forward pass, and which rank the others
waited for.
Nothing here adds a collective: the trainer gathers every rank's window once per log, as it must for the loss.

wandb never stops training: no API key, no network or an outage means one message and offline logging. wandb is
imported only when a project is set, TensorBoard only when asked for.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
import traceback
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Iterable, Iterator

import torch
from accelerate import Accelerator

from trainer.config import ConfigError, TrainConfig
from trainer.nonfinite import FOLD_EVERY
from trainer.preemption import PREEMPTED_EXIT
from trainer.refusal import Refusal

# One row of a rank's window, in this order, gathered from every rank at each log.
# loss_sum / loss_weight is the window's mean loss: weights are a micro-batch's counted tokens (or its loss_fn's
# count), else 1 (trainer.accumulation).
WINDOW_FIELDS = ("loss_sum", "micro_batches", "examples", "tokens", "steps", "seconds", "data_wait", "forward",
                 "stop", "loss_weight")  # stop: this rank's trainer.should_stop, riding on the same gather (trainer.py)


class MetricsError(Refusal, OSError):
    """A rank's metrics file cannot be written (a full disk, a read-only output_dir)."""

    job_wide = False  # each rank writes its own file (on its own node's disk, maybe): each says so


class LoggedFigures:
    """What a user logs between two logs (``trainer.log``): each name's mean over its calls. Tensors are kept as
    they are, on the device, and read only when the trainer logs (a host sync it makes anyway)."""

    def __init__(self, reserved: tuple[str, ...]):
        self.reserved = reserved  # the trainer's own figures: a user's of the same name would hide them
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
        """Each figure's mean since the last take, as numbers; then empty."""
        means = {name: float(total) / self._counts[name] for name, total in self._sums.items()}
        self._sums, self._counts = {}, {}
        return means


class StepWindow:
    """What this process did since the last log. Each micro-batch's loss tensor is kept as it is, on the device, and
    summed only when the trainer logs: no device work, and no waiting for it, on steps that do not log. Counts and
    timings are host numbers."""

    def __init__(self, device: torch.device):
        self._device = device
        self.restart()

    def add(self, loss: torch.Tensor, batch: Any, examples: int, weight: int | torch.Tensor = 1) -> None:
        """Count one micro-batch: its loss (weighed: ``weight`` x its mean), examples, and tokens when it carries
        ``input_ids``."""
        self._losses.append(loss)
        if isinstance(weight, torch.Tensor):
            self._weights.append(weight)
        else:
            self._host_weight += weight
        if len(self._losses) >= FOLD_EVERY:  # a long window: one sum per FOLD_EVERY steps keeps memory flat
            self._folded = self._folded + self._sum(self._losses)
            self._folded_weight = self._folded_weight + self._sum(self._weights)
            self._losses, self._weights = [], []
        self.micro_batches += 1
        self.examples += examples
        if isinstance(batch, Mapping) and isinstance(batch.get("input_ids"), torch.Tensor):  # dict, BatchEncoding
            self.tokens += batch["input_ids"].numel()  # shape metadata: no device sync

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

    def row(self, stop: bool = False) -> torch.Tensor:
        """This window as one row (``WINDOW_FIELDS``), on the device, ready to gather."""
        seconds = time.perf_counter() - self._since
        host = [self.micro_batches, self.examples, self.tokens, self.steps, seconds, self.data_wait, self.forward,
                float(stop)]  # fmt: skip
        host_part = torch.tensor(host, dtype=torch.float64, device=self._device)
        loss_sum = (self._folded + self._sum(self._losses)).view(1)
        weight = (self._folded_weight + self._sum(self._weights)).view(1) + self._host_weight
        return torch.cat([loss_sum, host_part, weight]).view(1, -1)

    def _sum(self, values: list[torch.Tensor]) -> torch.Tensor:
        if not values:
            return torch.zeros((), dtype=torch.float64, device=self._device)
        return torch.stack([value.reshape(()) for value in values]).double().sum()

    def restart(self) -> None:
        self._losses: list[torch.Tensor] = []
        self._weights: list[torch.Tensor] = []  # device counts (tokens); weights of 1 are counted on the host
        self._host_weight = 0
        self._folded = torch.zeros((), dtype=torch.float64, device=self._device)
        self._folded_weight = torch.zeros((), dtype=torch.float64, device=self._device)
        self.micro_batches = self.examples = self.tokens = self.steps = 0
        self.data_wait = self.forward = 0.0
        self._since = time.perf_counter()


def summarize(rows: list[list[float]], rank: int) -> tuple[dict[str, float], dict[str, float]]:
    """Every rank's window (``WINDOW_FIELDS`` rows) -> (this rank's own figures, the global view).

    A rank's step time is wall time, which the gradient all-reduce makes nearly equal on every rank. What tells a
    straggler apart is the part of a step each rank does alone before that all-reduce: waiting for data and the
    forward pass. The slowest rank is the one with the most of it: the others waited for it.
    """
    windows = [dict(zip(WINDOW_FIELDS, row, strict=True)) for row in rows]
    per_rank = [_rank_figures(w) for w in windows]
    alone = [f["rank/data_wait_s"] + f["rank/forward_s"] for f in per_rank]
    seconds = max(w["seconds"] for w in windows)
    total = {key: sum(w[key] for w in windows) for key in ("loss_sum", "loss_weight", "examples", "tokens")}
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
    import psutil  # accelerate's own dependency

    return psutil.Process().memory_info().rss / 2**30


class Tracker:
    """This rank's metrics file and, with ``wandb_project`` set, its wandb run in the experiment's group.

    Args:
        config: the run's TrainConfig (``output_dir``, ``experiment_name``, ``wandb_project``).
        accelerator: this process's Accelerator (rank, world size).
        run_id: the job's run id, shared by every rank; rank k's wandb run is ``<run_id>-rank<k>``. A resumed job
            passes the id stored in its checkpoint, so each rank continues its own run.
    """

    def __init__(self, config: TrainConfig, accelerator: Accelerator, run_id: str):
        self.rank = accelerator.process_index
        self.run_id = run_id
        self.metrics_file = Path(config.output_dir) / "metrics" / f"rank{self.rank}.jsonl"
        self.metrics_file.parent.mkdir(parents=True, exist_ok=True)
        project = config.wandb_project or os.environ.get("WANDB_PROJECT")  # wandb's own variable turns it on too
        self.wandb_run = _start_wandb_run(config, project, accelerator, run_id) if project else None
        self.tensorboard = _start_tensorboard(config, self.rank) if config.tensorboard else None

    def log(self, values: dict[str, float], step: int) -> None:
        """Append ``values`` at optimizer step ``step`` to this rank's file and its wandb run."""
        self._append({"step": step, "time": time.time(), "rank": self.rank, **values})
        if self.tensorboard is not None:
            for name, value in values.items():
                if isinstance(value, (int, float)):  # a figure said in words ("MFU": "41.5%") is the files' alone
                    self.tensorboard.add_scalar(name, value, step)
            self.tensorboard.flush()  # logs are seconds apart: every figure on disk as soon as it is logged
        if self.wandb_run is not None:
            try:
                self.wandb_run.log(values, step=step)
            except Exception as err:  # wandb must never stop training
                _warn(f"wandb logging failed on rank {self.rank} ({err}); the metrics go on in {self.metrics_file}")
                self.wandb_run = None

    def fail(self, error: BaseException) -> None:
        """End this rank's run marked as failed, with the error in it: called before the exception leaves."""
        text = "".join(traceback.format_exception(error)).strip()
        if not isinstance(error, MetricsError):  # the file that cannot be written is the error
            self._append({"time": time.time(), "rank": self.rank, "error": text})
        self._close_tensorboard()
        if self.wandb_run is not None:
            self.wandb_run.summary["error"] = f"{type(error).__name__}: {error}"
            self.wandb_run.summary["traceback"] = text
            self._finish(exit_code=1)

    def finish(self) -> None:
        self._close_tensorboard()
        if self.wandb_run is not None:
            self._finish(exit_code=0)

    def preempted(self, reason: str) -> None:
        """End this rank's run as preempted (wandb's own state for it), to be resumed under the same id."""
        self._append({"time": time.time(), "rank": self.rank, "preempted": reason})
        self._close_tensorboard()
        if self.wandb_run is not None:
            try:
                self.wandb_run.mark_preempting()
            except Exception as err:
                _warn(f"wandb could not mark rank {self.rank}'s run preempting: {err}")
            self._finish(exit_code=PREEMPTED_EXIT)

    def _append(self, row: dict[str, Any]) -> None:
        try:
            with open(self.metrics_file, "a") as f:
                f.write(json.dumps(row) + "\n")
        except OSError as err:  # a full disk, a read-only or vanished output_dir: said in one line, not a traceback
            raise MetricsError(f"cannot write the metrics of rank {self.rank} to {self.metrics_file}: "
                               f"{type(err).__name__}: {err.strerror or err}") from None  # fmt: skip

    def _close_tensorboard(self) -> None:
        writer, self.tensorboard = self.tensorboard, None
        if writer is not None:
            writer.close()

    def _finish(self, exit_code: int) -> None:
        run, self.wandb_run = self.wandb_run, None
        try:
            run.finish(exit_code=exit_code)
        except Exception as err:
            _warn(f"wandb could not close rank {self.rank}'s run: {err}")


def _start_tensorboard(config: TrainConfig, rank: int):
    """Rank k's TensorBoard writer, ``<output_dir>/tensorboard/rank<k>``: ``tensorboard --logdir
    <output_dir>/tensorboard`` shows every rank as a run."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise ConfigError('tensorboard: true needs the tensorboard package: pip install tensorboard (or '
                          '"accelerate-ddp-trainer[tensorboard]")') from None  # fmt: skip
    return SummaryWriter(log_dir=str(Path(config.output_dir) / "tensorboard" / f"rank{rank}"))


def _start_wandb_run(config: TrainConfig, project: str, accelerator: Accelerator, run_id: str):
    """Rank k's run ``<experiment>-rank<k>`` in the group ``<experiment>``; offline when wandb cannot reach its
    server (no API key, no network, an outage), with one message from the main process."""
    import wandb

    rank, world = accelerator.process_index, accelerator.num_processes
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    where = {"rank": rank, "local_rank": accelerator.local_process_index,
             "node_rank": int(os.environ.get("GROUP_RANK", rank // max(local_world, 1))),
             "host": socket.gethostname(), "world_size": world}  # fmt: skip
    settings = {"silent": not accelerator.is_main_process}  # wandb's banners once per job, not once per rank
    if "WANDB_INIT_TIMEOUT" not in os.environ:
        settings["init_timeout"] = 30  # wandb's 90 s is long for a job that will log offline anyway
    init = dict(project=project, group=config.experiment_name, job_type="train",
                name=f"{config.experiment_name}-rank{rank}", id=f"{run_id}-rank{rank}", resume="allow",
                dir=config.output_dir, config={**config.to_dict(), **where},
                settings=wandb.Settings(**settings))  # fmt: skip
    try:
        return wandb.init(**init)
    except Exception as err:  # wandb.Error for a missing key or a timeout; anything else must not stop us either
        if accelerator.is_main_process:
            first_line = (str(err).strip().splitlines() or [type(err).__name__])[0]
            _warn(f"wandb is unreachable ({first_line}); every rank logs offline under {config.output_dir}/wandb "
                  "(`wandb sync` uploads it later)")  # fmt: skip
    wandb.teardown()  # the failed attempt's service still holds the run id
    try:
        return wandb.init(**init, mode="offline")
    except Exception as err:
        _warn(f"wandb cannot log even offline on rank {rank} ({err}); the metrics go on in <output_dir>/metrics")
        return None


def new_run_id(accelerator: Accelerator) -> str:
    """A fresh id for this job, drawn on the main process and shared with every rank."""
    from accelerate.utils import broadcast_object_list

    ids = [os.urandom(4).hex() if accelerator.is_main_process else None]
    if accelerator.num_processes > 1:
        broadcast_object_list(ids, from_process=0)
    return ids[0]


def _warn(text: str) -> None:
    sys.stderr.write(f"trainer: {text}\n")
    sys.stderr.flush()


def read_metrics(output_dir: str | Path) -> dict[int, list[dict[str, Any]]]:
    """Every rank's logged rows from ``<output_dir>/metrics``, by rank; for a step logged twice (a run resumed
    from a checkpoint older than its crash) the later row wins."""
    ranks: dict[int, list[dict[str, Any]]] = {}
    for path in sorted(Path(output_dir, "metrics").glob("rank*.jsonl")):
        rows: dict[int, dict[str, Any]] = {}
        for line in path.read_text().splitlines():
            row = json.loads(line)
            if "step" in row:
                rows[row["step"]] = {**rows.get(row["step"], {}), **row}
        ranks[int(path.stem.removeprefix("rank"))] = [rows[step] for step in sorted(rows)]
    return ranks
