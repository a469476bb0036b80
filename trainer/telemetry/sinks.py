"""Where every process's figures are written, behind one small protocol (``log``, ``close``): each rank's metrics
file, its wandb run in the experiment's group, TensorBoard; adding a tracker is one class here
(docs/internals.md#sinks, docs/metrics.md).
"""

from __future__ import annotations

import json
import os
import socket
import time
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Protocol

from trainer.console import warn
from trainer.errors import PREEMPTED_EXIT, ConfigError, MetricsError

if TYPE_CHECKING:
    from trainer.launch.run import Run


class Sink(Protocol):
    def log(self, values: dict[str, Any], step: int) -> None: ...

    def close(self, status: str, detail: Any = None) -> None: ...


class MetricsFile:
    """This rank's ``<output_dir>/metrics/rank<k>.jsonl``: a JSON row per log, and how the run ended if not well."""

    def __init__(self, output_dir: str, rank: int):
        self.rank = rank
        self.path = Path(output_dir) / "metrics" / f"rank{rank}.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def log(self, values: dict[str, Any], step: int) -> None:
        self._append({"step": step, "time": time.time(), "rank": self.rank, **values})

    def close(self, status: str, detail: Any = None) -> None:
        # The file that cannot be written is the error.
        if status == "failed" and not isinstance(detail, MetricsError):
            self._append({"time": time.time(), "rank": self.rank, "error": _traceback(detail)})
        elif status == "preempted":
            self._append({"time": time.time(), "rank": self.rank, "preempted": detail})

    def _append(self, row: dict[str, Any]) -> None:
        try:
            with open(self.path, "a") as f:
                f.write(json.dumps(row) + "\n")
        # A full disk, a read-only or vanished output_dir: said in one line, not a traceback.
        except OSError as err:
            raise MetricsError(
                f"cannot write the metrics of rank {self.rank} to {self.path}: "
                f"{type(err).__name__}: {err.strerror or err}"
            ) from None


class TensorBoardRun:
    """Rank k's TensorBoard writer, ``<output_dir>/tensorboard/rank<k>``: ``tensorboard --logdir
    <output_dir>/tensorboard`` shows every rank as a run. A run resumed at step N purges what the run before logged
    after N (the steps it replays), so that TensorBoard shows each step once."""

    def __init__(self, output_dir: str, rank: int, *, resumed_at: int = 0):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise ConfigError(
                "tensorboard: true needs the tensorboard package: pip install tensorboard (or "
                '"accelerate-ddp-trainer[tensorboard]")'
            ) from None
        folder = Path(output_dir) / "tensorboard" / f"rank{rank}"
        try:
            self.writer = SummaryWriter(log_dir=str(folder), purge_step=resumed_at + 1 if resumed_at else None)
        # <output_dir>/tensorboard is a file, a read-only folder, a full disk.
        except OSError as err:
            raise MetricsError(
                f"tensorboard: true, but rank {rank} cannot write its events to {folder}: "
                f"{type(err).__name__}: {err.strerror or err}"
            ) from None

    def log(self, values: dict[str, Any], step: int) -> None:
        # Closed by a fit() before.
        if self.writer is None:
            return
        for name, value in values.items():
            # A figure said in words ("MFU": "41.5%") is the files' alone.
            if isinstance(value, (int, float)):
                self.writer.add_scalar(name, value, step)
        # Logs are seconds apart: every figure on disk as soon as it is logged.
        self.writer.flush()

    def close(self, status: str, detail: Any = None) -> None:
        writer, self.writer = self.writer, None
        if writer is not None:
            writer.close()


class WandbRun:
    """Rank k's wandb run ``<experiment>-rank<k>`` (id ``<run_id>-rank<k>``: a resumed job continues it) in the
    group ``<experiment>``; offline when wandb cannot reach its server (no API key, no network, an outage), with
    one message from the main process."""

    def __init__(self, run: Run, *, project: str, run_id: str):
        import wandb

        config, accelerator = run.config, run.accelerator
        rank, world = accelerator.process_index, accelerator.num_processes
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        where = {
            "rank": rank,
            "local_rank": accelerator.local_process_index,
            "node_rank": int(os.environ.get("GROUP_RANK", rank // max(local_world, 1))),
            "host": socket.gethostname(),
            "world_size": world,
        }
        # Wandb's banners once per job, not once per rank.
        settings = {"silent": not accelerator.is_main_process}
        if "WANDB_INIT_TIMEOUT" not in os.environ:
            # Wandb's 90 s is long for a job that will log offline anyway.
            settings["init_timeout"] = 30
        init = dict(
            project=project,
            group=config.experiment_name,
            job_type="train",
            name=f"{config.experiment_name}-rank{rank}",
            id=f"{run_id}-rank{rank}",
            resume="allow",
            dir=config.output_dir,
            config={**config.to_dict(), **where},
            settings=wandb.Settings(**settings),
        )
        self.rank, self.run = rank, None
        try:
            self.run = wandb.init(**init)
            return
        # wandb.Error for a missing key or a timeout; anything else must not stop us either.
        except Exception as err:
            if accelerator.is_main_process:
                first_line = (str(err).strip().splitlines() or [type(err).__name__])[0]
                warn(
                    f"wandb is unreachable ({first_line}); every rank logs offline under {config.output_dir}/wandb "
                    "(`wandb sync` uploads it later)"
                )
        # The failed attempt's service still holds the run id.
        wandb.teardown()
        try:
            self.run = wandb.init(**init, mode="offline")
        except Exception as err:
            warn(f"wandb cannot log even offline on rank {rank} ({err}); the metrics go on in <output_dir>/metrics")

    def log(self, values: dict[str, Any], step: int) -> None:
        if self.run is None:
            return
        try:
            self.run.log(values, step=step)
        # Wandb must never stop training.
        except Exception as err:
            warn(f"wandb logging failed on rank {self.rank} ({err}); the metrics go on in <output_dir>/metrics")
            self.run = None

    def close(self, status: str, detail: Any = None) -> None:
        run, self.run = self.run, None
        if run is None:
            return
        exit_code = {"finished": 0, "failed": 1, "preempted": PREEMPTED_EXIT}[status]
        try:
            if status == "failed":
                run.summary["error"] = f"{type(detail).__name__}: {detail}"
                run.summary["traceback"] = _traceback(detail)
            elif status == "preempted":
                # Wandb's own state for it: to be resumed under the same id.
                run.mark_preempting()
            run.finish(exit_code=exit_code)
        except Exception as err:
            warn(f"wandb could not close rank {self.rank}'s run: {err}")


def open_sinks(run: Run, *, run_id: str, resumed_at: int = 0) -> list[Sink]:
    """This rank's sinks: its metrics file, and wandb and TensorBoard when the config asks (``resumed_at``: the
    step a resumed run goes on from)."""
    config, rank = run.config, run.rank
    sinks: list[Sink] = [MetricsFile(config.output_dir, rank)]
    # Wandb's own variable turns it on too.
    project = config.wandb_project or os.environ.get("WANDB_PROJECT")
    if project:
        sinks.append(WandbRun(run, project=project, run_id=run_id))
    if config.tensorboard:
        sinks.append(TensorBoardRun(config.output_dir, rank, resumed_at=resumed_at))
    return sinks


def close_all(sinks: list[Sink], status: str, detail: Any = None) -> None:
    """Close every sink (the later ones even when an earlier one fails), then raise the first failure."""
    failure: Optional[BaseException] = None
    for sink in sinks:
        try:
            sink.close(status, detail)
        except Exception as err:
            failure = failure or err
    if failure is not None:
        raise failure


def new_run_id(run: Run) -> str:
    """A fresh id for this job, drawn on the main process and shared with every rank."""
    return run.main_decides(lambda: os.urandom(4).hex())


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


def _traceback(error: BaseException) -> str:
    return "".join(traceback.format_exception(error)).strip()
