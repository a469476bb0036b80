"""``profile_steps: "10-12"``: where the time of those optimizer steps goes, as a ``torch.profiler`` trace on every
rank, ``<output_dir>/profile/rank<k>/trace.json`` (open it in https://ui.perfetto.dev or ``chrome://tracing``).

Every rank traces the same steps, so the traces line up: a rank that waits in the gradient all-reduce while another
still computes shows it there. The host's operators always, and on a GPU its kernels and copies too; each optimizer
step is one ``ProfilerStep#N`` span. The steps before the first run untraced (a warm step, not the start-up), and
tracing costs time while it runs: leave the figures of those steps out of a comparison.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import torch

from trainer.config.reading import steps_of
from trainer.telemetry.console import say


class StepProfiler:
    """A callback: starts ``torch.profiler`` before step ``first``, marks each step, and writes the trace after
    step ``last``."""

    def __init__(self, steps: tuple[int, int], folder: Path, device: torch.device):
        self.first, self.last = steps
        self.folder, self.device = folder, device
        self.profile: Optional[torch.profiler.profile] = None

    @classmethod
    def for_run(cls, run: Any) -> list["StepProfiler"]:
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
            self.profile.step()
            if step >= self.last:
                self._write(step)
        self._start_before(step + 1)

    def on_train_end(self, trainer: Any, result: Any = None) -> None:
        # Stopped early, inside the window: what was traced is written.
        if self.profile is not None:
            self._write(trainer.global_step)

    def _start_before(self, step: int) -> None:
        if step != self.first or self.profile is not None:
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        # A schedule, so that each step is a ProfilerStep span of its own.
        steps = self.last - self.first + 1
        self.profile = torch.profiler.profile(
            activities=activities,
            schedule=torch.profiler.schedule(wait=0, warmup=0, active=steps, repeat=1),
            on_trace_ready=self._export,
        )
        self.profile.start()

    def _export(self, profile: torch.profiler.profile) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        profile.export_chrome_trace(str(self.folder / "trace.json"))

    def _write(self, step: int) -> None:
        profile, self.profile = self.profile, None
        # The trace is written once its last step ends (stopped early: here)
        profile.stop()
        steps = f"step {self.first}" if step == self.first else f"steps {self.first}-{step}"
        say(
            f"profile: {steps} traced on every rank, into {self.folder.parent}/rank<k>/trace.json (open one in "
            "https://ui.perfetto.dev)"
        )
