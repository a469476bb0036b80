"""What a process reports while it trains: its log window, the figures a user logs, ``log_history``, and its sinks
(``trainer.telemetry.sinks``). At each log the rows of every rank's window, gathered once, become this rank's own
figures (``rank/*``), the job's (``global/*``, stored by the main process) and the step's metrics that the callbacks see
(``on_log``), ``log_history`` keeps, and the main process says as the step line.
"""

from __future__ import annotations

import contextlib
import time
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional

import torch

from trainer.console import STEP_FIGURES, say, step_line
from trainer.errors import Preempted
from trainer.state import TrainState
from trainer.telemetry.progress import Progress
from trainer.telemetry.sinks import close_all, open_sinks
from trainer.telemetry.window import NOT_MEASURED, WINDOW_FIELDS, LoggedFigures, LogWindow, memory_gb, summarize

if TYPE_CHECKING:
    from trainer.launch.run import Run


class Telemetry:
    """This process's reporting; its sinks are opened once the run's id is known (``open``)."""

    def __init__(self, run: Run, *, utilisation: Any = None):
        self.run, self.accelerator = run, run.accelerator
        # The data-parallel processes: a tensor-parallel group reads one batch.
        self.replicas = run.dp.size
        # MFU, where the model's FLOPs and the device's peak are known (trainer.telemetry.mfu).
        self.utilisation = utilisation
        # trainer.log's, until the next log.
        self.figures = LoggedFigures(reserved=(*STEP_FIGURES, "grad_norm"))
        self.window = LogWindow(run.device, figures=self.figures)
        self.sinks: list[Any] = []
        # Progress to the job's scheduler, where one listens (trainer.telemetry.progress).
        self.progress: Optional[Progress] = None
        self.log_history: list[dict[str, Any]] = []

    def open(self, run_id: str, *, step: int = 0) -> None:
        """This rank's sinks; ``run_id`` names its wandb run (a resume passes the checkpoint's: the run goes on from
        ``step``)."""
        self.sinks = open_sinks(self.run, run_id=run_id, resumed_at=step)
        self.progress = Progress.from_env(main=self.accelerator.is_main_process, step=step)

    def add(self, values: dict[str, Any]) -> None:
        """Figures for this rank's next log (``Trainer.log``)."""
        self.figures.add(values)

    @property
    def steps_unlogged(self) -> int:
        """Steps taken since the last log."""
        return self.window.steps

    def forget_unlogged(self) -> None:
        """The steps since the last log dropped from the next (a spike's rollback undid them)."""
        self.window.restart()

    def first_bad_step(self) -> torch.Tensor:
        """This rank's first step with a non-finite loss since the last log (``trainer.loop.nonfinite.NONE``: none)."""
        return self.window.first_bad_step()

    def gather(self, stop: bool, lr: Any = 0.0, grad_norm: Optional[torch.Tensor] = None) -> list[dict[str, float]]:
        """Every rank's window since the last log (``WINDOW_FIELDS``, by name), gathered once: the one agreement of
        a log step, and its only host synchronisation. ``stop``: this rank's ``trainer.should_stop``; ``lr`` and
        ``grad_norm``: the step's (the norm a device tensor, or None when not measured)."""
        rows = self.accelerator.gather(self.window.row(stop=stop, lr=lr, grad_norm=grad_norm)).tolist()
        self.window.restart()
        return [dict(zip(WINDOW_FIELDS, row, strict=True)) for row in rows]

    def log(
        self,
        rows: list[dict[str, float]],
        *,
        state: TrainState,
        total_steps: int,
        on_log: Callable[[dict[str, Any]], None],
        progress: Any,
    ) -> dict[str, float]:
        """The step's figures from the gathered ``rows``: each rank logs its own, the main process adds the global
        view and the stragglers. Returns the global view."""
        acc = self.accelerator
        table = [[row[key] for key in WINDOW_FIELDS] for row in rows]
        own, global_view = summarize(table, acc.process_index, self.replicas)
        mine = rows[acc.process_index]
        metrics = {
            "step": state.step,
            "epoch": round(state.epoch_progress, 4),
            "train_loss": global_view["global/train_loss"],
            "lr": mine["lr"],
            "examples_per_s": global_view["global/examples_per_s"],
        }
        if "global/tokens_per_s" in global_view:
            metrics["tokens_per_s"] = global_view["global/tokens_per_s"]
        if self.utilisation is not None:
            mfu = self.utilisation.of(metrics.get("tokens_per_s"), metrics["examples_per_s"])
            if mfu is not None:
                metrics["mfu"] = global_view["global/mfu"] = mfu
        # Before clipping, the same on every rank (NaN when not finite)
        if mine["grad_norm"] != NOT_MEASURED:
            metrics["grad_norm"] = global_view["global/grad_norm"] = mine["grad_norm"]
        # trainer.log's: this rank's own.
        metrics.update(self.figures.take())
        self.log_history.append(metrics)
        own.update({"rank/lr": metrics["lr"], "rank/epoch": metrics["epoch"], "rank/memory_gb": memory_gb(acc.device)})
        if acc.is_main_process:
            progress.set_postfix(
                loss=f"{metrics['train_loss']:.4g}",
                lr=f"{metrics['lr']:.3g}",
                ex_s=f"{metrics['examples_per_s']:.4g}",
                refresh=False,
            )
        # Before the line: figures a callback adds go on it (gpt2.py: MFU).
        on_log(metrics=metrics)
        added = {key: value for key, value in metrics.items() if key not in self.figures.reserved}
        shown = global_view if acc.is_main_process else {}
        # Yours stored as the trainer's are.
        self.write({**own, **shown, **added}, state.step)
        if self.progress is not None:
            self.progress.update(state.step, total_steps, metrics)
        say(step_line(metrics, total_steps))
        return global_view

    def result(self, state: TrainState, *, started: float, skipped: int, stopped: Optional[str]) -> dict[str, Any]:
        """What ``fit()`` returns of its training: the step and epoch reached, the last log's loss (NaN when no step
        was trained), the seconds since ``started``, the steps ``nan_policy: skip`` skipped, and why it stopped early
        (None when it ran to the end)."""
        return {
            "global_step": state.step,
            "epoch": state.epoch_progress,
            "train_loss": self.log_history[-1]["train_loss"] if self.log_history else float("nan"),
            "train_runtime_s": time.perf_counter() - started,
            "skipped_steps": skipped,
            "stopped": stopped,
        }

    def log_evaluation(self, metrics: dict[str, float], step: int) -> None:
        """An evaluation's figures (the same reduced ones on every rank: the main process's sinks hold them)."""
        if self.accelerator.is_main_process:
            self.write({f"eval/{key.removeprefix('eval_')}": value for key, value in metrics.items()}, step)

    def write(self, values: dict[str, Any], step: int) -> None:
        for sink in self.sinks:
            sink.log(values, step)

    @contextlib.contextmanager
    def closing(self) -> Iterator[None]:
        """Around ``fit()``: the sinks end as it ends, ``finished``, ``preempted`` (the reason said) or ``failed``
        (an exception on this rank, its wandb run marked failed with the error in it, before it propagates)."""
        try:
            yield
        except Preempted as preempted:
            self.close("preempted", preempted.message)
            say(preempted.message)
            raise
        except BaseException as err:
            try:
                self.close("failed", err)
            # The full disk that failed a checkpoint fails the metrics file too: the error.
            except Exception as also:
                # That ended the run is the one raised.
                say(f"{also} (while ending the run after the error below)")
            raise
        self.close("finished")

    def close(self, status: str, detail: Any = None) -> None:
        """End every sink: ``finished``, ``failed`` (``detail``: the exception) or ``preempted`` (why)."""
        if self.progress is not None:
            self.progress.finish(status)
            self.progress = None
        close_all(self.sinks, status, detail)
