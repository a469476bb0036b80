"""Preemption: a signal becomes a checkpoint at an optimizer step every rank agrees on (one small asynchronous
all-reduce on the host group, no step waits for it), then a clean exit with status 75; Slurm requeue; under Ray Train,
its notice that a node is about to be reclaimed becomes a checkpoint at once, training going on until Ray restarts the
job from it (docs/internals.md#preemption, docs/checkpoints.md).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch
import torch.distributed as dist

from trainer.console import warn
from trainer.errors import PREEMPTED_EXIT, Preempted

if TYPE_CHECKING:
    from trainer.launch.run import Run

# Slurm signals every process of the job and the launcher forwards its own copy; a terminal's Ctrl-C reaches the
# launcher and the workers alike. Copies this close to the first are the same event, not a second signal.
SAME_EVENT_S = 2.0
# How often the ranks compare notes, in seconds of training: each comparison costs a few hundred microseconds of
# CPU (measured: benchmarks/preemption_check.py), nothing against a second, and a signal gives tens of seconds.
CHECK_EVERY_S = 1.0


class PreemptionWatch:
    """Notes the configured signals while fit() runs (its final export too); ``agreed()`` at each optimizer step says
    whether to stop, ``stop()`` then commits the checkpoint of that step (``save_at(step)``, which also serves Ray
    Train's notice of a preemption)."""

    def __init__(self, run: Run, *, save_at: Callable[[int], Any]):
        self.run, self.signals = run, [getattr(signal, name) for name in run.config.signal_names]
        # Under Ray Train: its preemption notice (a barrier of Ray's, asked at every check on every rank), and the
        # checkpoint of a step it asks for, once.
        self._notice = ray_notice()
        self._save_at, self._noticed = save_at, False
        self.grace_s = run.config.preemption_grace_s
        group = run.host
        # The first signal's number, 0 until one arrives.
        self.received = 0
        self._first_at = 0.0
        self._previous: dict[int, object] = {}
        # The host group (None: one process)
        self._group = group if self.signals else None
        self._flag = torch.zeros(1, dtype=torch.int32)
        self._pending: Optional[dist.Work] = None
        # Steps between checks.
        self.check_every = 1
        # A signal the ranks agreed on out of turn (agree_now), for agreed() to return.
        self._agreed = 0
        # From the next check on (a check issued at the old pace is read at it)
        self._next_every = 1

    def __enter__(self) -> "PreemptionWatch":
        # Only the main thread may set handlers.
        if threading.current_thread() is threading.main_thread():
            for number in self.signals:
                self._previous[number] = signal.signal(number, self._on_signal)
        return self

    def __exit__(self, kind, error, traceback) -> None:
        if kind is None and self.received:
            # After the last step's check: the run ended (final/ written) within the grace; said, not silent.
            warn(
                f"{signal.Signals(self.received).name} received after the last step: the run was finished first "
                "(final/ written); nothing is left to resume"
            )
        launched = "TORCHELASTIC_RUN_ID" in os.environ
        for number, handler in self._previous.items():
            # Preempted under a launcher: the checkpoint is committed, and the launcher sends SIGTERM to the workers
            # still winding down once a first one has exited. Ignored (Python resets its own handlers as it
            # finalizes, not SIG_IGN), every worker ends with status 75 rather than some killed by it.
            ignore = kind is Preempted and launched and number == signal.SIGTERM
            signal.signal(number, signal.SIG_IGN if ignore else handler)
        self._previous.clear()
        pending, self._pending = self._pending, None
        # Every rank issued the same reductions; let the last one land before teardown.
        if pending is not None:
            if kind is None:
                pending.wait()
            # Leaving on an error: a peer may be gone, so wait a little, and never raise over the error.
            else:
                try:
                    pending.wait(timedelta(seconds=10))
                except Exception:
                    pass

    def _on_signal(self, number: int, frame) -> None:
        if self.received and time.monotonic() - self._first_at < SAME_EVENT_S:
            # The same event's other copy.
            return
        # A second signal: no more waiting.
        if self.received:
            warn(f"second signal ({signal.Signals(number).name}): exiting now")
            os._exit(PREEMPTED_EXIT)
        self.received, self._first_at = number, time.monotonic()
        deadline = threading.Timer(self.grace_s, self._out_of_time)
        deadline.daemon = True
        deadline.start()

    def _out_of_time(self) -> None:
        warn(
            f"still not done {self.grace_s:g} s after {signal.Signals(self.received).name} (preemption_grace_s): "
            "exiting now"
        )
        os._exit(PREEMPTED_EXIT)

    def pace(self, seconds_per_step: float) -> None:
        """Check every CHECK_EVERY_S after the next check; pass a figure every rank has alike (the log's gather)."""
        self._next_every = max(1, int(CHECK_EVERY_S / max(seconds_per_step, 1e-9)))

    def agreed(self, step: int) -> int:
        """The signal any rank had received by the previous check (0: none); the same answer on every rank."""
        if self._notice is not None and not step % self.check_every:
            self._heed_notice(step)
        if self._group is None or self._agreed:
            return self._agreed or self.received
        if step % self.check_every:
            return 0
        self.check_every = self._next_every
        seen = 0
        if self._pending is not None:
            self._pending.wait()
            seen = int(self._flag.item())
        if not seen:
            self._flag[0] = self.received
            self._pending = dist.all_reduce(self._flag, op=dist.ReduceOp.MAX, group=self._group, async_op=True)
        else:
            self._pending = None
        return seen

    def stop(self, signal_number: int, step: int, *, total_steps: int) -> Preempted:
        """What every rank does once the ranks agreed on a signal: commit a checkpoint of the step reached (whatever
        save_every says), requeue the job under Slurm (``slurm_requeue``, the main process once the checkpoint is
        committed), and return the ``Preempted`` to leave ``fit()`` with (status 75)."""
        started, run = time.monotonic(), self.run
        saved = self._save_at(step)
        requeued = ""
        if run.config.slurm_requeue:
            if run.main:
                requeued = f"; {requeue_slurm_job()}"
            # No rank leaves (and gets the others signalled) before the requeue.
            run.barrier()
        name = signal.Signals(signal_number).name
        return Preempted(
            f"trainer: preempted ({name}) at step {step} of {total_steps}: checkpoint {saved} committed in "
            f"{time.monotonic() - started:.1f} s{requeued}; exiting with status {PREEMPTED_EXIT}. Start the "
            "job again with resume='auto' to continue."
        )

    def _heed_notice(self, step: int) -> None:
        """Ray Train's notice that a node of the job is to be reclaimed (the same on every rank): a checkpoint of this
        step, once, as Ray asks; training goes on, and when the node is gone Ray restarts the job, which resumes
        from it (``resume: auto``) rather than from the last periodic checkpoint."""
        if self._noticed or (info := self._notice()) is None:
            return
        self._noticed = True
        left = f", {info.deadline_ms / 1000 - time.time():.0f} s before the deadline" if info.deadline_ms else ""
        saved = self._save_at(step)
        warn(
            f"Ray Train: node(s) of this job will be preempted (ranks {info.preempted_ranks}): "
            f"checkpoint {saved} of step {step} committed{left}; training goes on until Ray restarts the job from it",
            main_only=True,
        )

    def agree_now(self) -> bool:
        """Compare notes now, waiting for the answer: before a periodic save, which may take longer than the
        launcher's or Slurm's grace. Call it on every rank at the same step; True when some rank has had a signal
        (``agreed()`` then returns it at once), so that the preemption's checkpoint is the next save."""
        if self._group is None or self._agreed:
            self._agreed = self._agreed or self.received
            return bool(self._agreed)
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.wait()
        if not self._flag.item():
            self._flag[0] = self.received
            dist.all_reduce(self._flag, op=dist.ReduceOp.MAX, group=self._group)
        self._agreed = int(self._flag.item())
        return bool(self._agreed)


def ray_notice() -> Optional[Callable[[], Any]]:
    """``ray.train.get_preemption_info`` in a worker of Ray Train, else None (Ray is never imported for it)."""
    if "ray.train" not in sys.modules:
        return None
    import ray.train

    try:
        ray.train.get_context()
    # Not in a Ray Train worker.
    except Exception:
        return None
    return ray.train.get_preemption_info


def requeue_slurm_job() -> str:
    """Ask Slurm to requeue this job (the first process, after the checkpoint is committed); what happened."""
    # An array task's own id too: requeue takes it as is.
    job = os.environ.get("SLURM_JOB_ID")
    if not job:
        return "not under Slurm: no requeue"
    started = time.monotonic()
    try:
        # A session of its own: torch's launcher, shutting down on the same signal, signals each worker's whole
        # process group, and would kill scontrol mid-request.
        done = subprocess.run(
            ["scontrol", "requeue", job], capture_output=True, text=True, timeout=30, start_new_session=True
        )
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"scontrol requeue {job} failed: {err}"
    if done.returncode != 0:
        said = (done.stderr or done.stdout).strip()
        if done.returncode < 0:
            said = f"scontrol was killed by {signal.Signals(-done.returncode).name}"
        return f"scontrol requeue {job} failed: {said}"
    return f"job {job} requeued ({time.monotonic() - started:.1f} s)"
