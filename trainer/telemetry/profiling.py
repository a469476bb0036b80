"""``profile_steps: "10-12"``: where the time of those optimizer steps goes, as a ``torch.profiler`` trace on every
rank, ``<output_dir>/profile/rank<k>/trace.json`` (open it in https://ui.perfetto.dev or ``chrome://tracing``).

Every rank traces the same steps, so the traces line up: a rank that waits in the gradient all-reduce while another
still computes shows it there. The host's operators always, and on a GPU its kernels and copies too; each optimizer
step is one ``ProfilerStep#N`` span. The step before the first is the profiler's warm-up (its start-up cost
stays out of the traced steps), and tracing costs time while it runs: leave those steps' figures out of a
comparison. Kineto's marker lines (``USDT: ... profiler_start``), two a rank, are left out of the console.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Optional

import torch

from trainer.config.reading import steps_of
from trainer.console import say

if TYPE_CHECKING:
    from trainer.launch.run import Run


class StepProfiler:
    """A callback: starts ``torch.profiler`` before step ``first``, marks each step, and writes the trace after
    step ``last``."""

    def __init__(self, steps: tuple[int, int], folder: Path, device: torch.device):
        self.first, self.last = steps
        self.folder, self.device = folder, device
        self.profile: Optional[torch.profiler.profile] = None

    @classmethod
    def for_run(cls, run: Run) -> list["StepProfiler"]:
        """The callbacks ``profile_steps`` asks for: this one, or none."""
        config = run.config
        if config.profile_steps is None:
            return []
        folder = Path(config.output_dir) / "profile" / f"rank{run.rank}"
        return [cls(steps_of(config.profile_steps), folder, run.device)]

    def on_train_begin(self, trainer: Any) -> None:
        self._start_before(trainer.global_step + 1)

    def on_step_end(self, trainer: Any) -> None:
        step = trainer.global_step
        if self.profile is not None:
            with without_markers():
                self.profile.step()
            if step >= self.last:
                self._write(step)
        self._start_before(step + 1)

    def on_train_end(self, trainer: Any, result: Any = None) -> None:
        # Stopped early, inside the window: what was traced is written.
        if self.profile is not None:
            self._write(trainer.global_step)

    def _start_before(self, step: int) -> None:
        # The step before the first warms the profiler up, where there is one (a run started, or resumed, at the
        # first step to trace has none).
        warmup = int(step == self.first - 1)
        if step != self.first - warmup or self.profile is not None:
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        # A schedule, so that each step is a ProfilerStep span of its own.
        steps = self.last - self.first + 1
        with warnings.catch_warnings():
            # Said when there is no warm-up step: nothing the user can change.
            warnings.filterwarnings("ignore", message="Profiler won't be using warmup")
            schedule = torch.profiler.schedule(wait=0, warmup=warmup, active=steps, repeat=1)
        self.profile = torch.profiler.profile(activities=activities, schedule=schedule, on_trace_ready=self._export)
        with without_markers():
            self.profile.start()

    def _export(self, profile: torch.profiler.profile) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        profile.export_chrome_trace(str(self.folder / "trace.json"))

    def _write(self, step: int) -> None:
        profile, self.profile = self.profile, None
        # The trace is written once its last step ends (stopped early: here)
        with without_markers():
            profile.stop()
        steps = f"step {self.first}" if step == self.first else f"steps {self.first}-{step}"
        say(
            f"profile: {steps} traced on every rank, into {self.folder.parent}/rank<k>/trace.json (open one in "
            "https://ui.perfetto.dev)"
        )


@contextlib.contextmanager
def without_markers() -> Iterator[None]:
    """Kineto (the profiler's C++ side) writes a ``USDT:`` marker line to stderr as a trace starts and stops, on
    every rank: noise to a user. While it runs, stderr goes to a file; every other line is written back after."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            kept = [line for line in held.read().splitlines(keepends=True) if not line.startswith(b"USDT:")]
            if kept:
                os.write(2, b"".join(kept))
