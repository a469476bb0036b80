"""Naming the rank a stalled job is waiting for (docs/troubleshooting.md). The loop notes where this rank is (the step
and its phase; under FSDP2, the sharded blocks entered); a thread publishes the note to the job's rendezvous store
every few seconds and, once this rank has made no progress for ``stall_warning_s``, reads every rank's note and says
which rank the others wait for, and at which step. If the launcher is gone and the rank is stuck, it ends the
process with one line. On the hot path: an attribute assignment per phase; the store traffic is the thread's.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
from typing import TYPE_CHECKING, Any, Iterator, Optional

import torch

from trainer.console import warn
from trainer.errors import PREEMPTED_EXIT

if TYPE_CHECKING:
    from trainer.launch.run import Run

# What a rank can be doing, in the order one optimizer step goes through them (a resume before the first). The rank
# furthest behind in this order is the one the others wait for: "backward" and later phases hold collectives.
PHASES = ("resume", "data", "forward", "backward", "optimizer", "log", "evaluate", "checkpoint")
# Phases that may rightly go long without a mark of progress (no block or step boundary inside them).
LONG_PHASES = ("resume", "evaluate", "checkpoint")


class StallReporter:
    """Watches this rank's progress; reports a stall once every rank has waited, from the lowest-numbered one."""

    def __init__(self, run: Run, *, warning_s: float, grace_s: float = 180.0):
        self.rank, self.world = run.rank, run.world
        self.warning_s, self.grace_s = warning_s, grace_s
        # The process that started this one: torch's elastic agent (accelerate launch, torchrun) hosts the store.
        self._launcher = os.getppid() if "TORCHELASTIC_RUN_ID" in os.environ else None
        self.where = (0, "data")
        # Sharded blocks entered in this phase.
        self.blocks = 0
        self._changed = time.monotonic()
        self._stop = threading.Event()
        self._host = socket.gethostname()
        # The store every rank already reached at rendezvous: no new port, no new connection to set up.
        store = torch.distributed.distributed_c10d._get_default_store()
        self._store = torch.distributed.PrefixStore("trainer-progress/", store)
        self._thread: Any = None

    @contextlib.contextmanager
    def watching(self, phase: Optional[str] = None) -> Iterator[None]:
        """The thread watches while the context lasts (``fit()``, or a resume: ``phase`` "resume", noted for the
        context's length), then is stopped and joined: a daemon thread still inside a store call when the interpreter
        shuts down is killed in C++ code, which aborts the process. Inside a context already watched, only the phase
        is noted."""
        before = self.where
        if phase is not None:
            self.at(before[0], phase)
        try:
            if self._thread is not None and self._thread.is_alive():
                yield
            else:
                with self._thread_running():
                    yield
        finally:
            if phase is not None:
                self.at(*before)

    @contextlib.contextmanager
    def _thread_running(self) -> Iterator[None]:
        self._stop.clear()
        self._changed = time.monotonic()
        interval = min(5.0, max(0.2, self.warning_s / 4))
        self._thread = threading.Thread(target=self._watch, args=(interval,), name="trainer-stall", daemon=True)
        self._thread.start()
        try:
            yield
        finally:
            self._stop.set()
            self._thread.join()

    def at(self, step: int, phase: str) -> None:
        """The training loop is now in ``phase`` of optimizer step ``step`` (the step being computed)."""
        self.where, self.blocks = (step, phase), 0
        self._changed = time.monotonic()

    def entered(self) -> None:
        """The forward pass entered one more sharded block (FSDP2 gathers its weights there, with every rank):
        progress, as a long evaluation under FSDP2 makes it."""
        self.blocks += 1
        self._changed = time.monotonic()

    def _watch(self, interval: float) -> None:
        reported = None
        while not self._stop.wait(interval):
            (step, phase), blocks, changed = self.where, self.blocks, self._changed
            stalled_s = time.monotonic() - changed
            if self._launcher is not None and os.getppid() != self._launcher:
                # And no more store calls: the store went with the launcher.
                self._end_if_stuck(stalled_s)
                continue
            if self._store is None:
                continue
            note = {
                "step": step,
                "phase": phase,
                "blocks": blocks,
                "host": self._host,
                "since": time.time() - stalled_s,
            }
            try:
                self._store.set(str(self.rank), json.dumps(note))
                if self._stop.is_set():
                    return
                if stalled_s >= self.warning_s and reported != changed and self._reported(stalled_s):
                    reported = changed
            # The store went away (the job is ending, or the launcher died): nothing to publish.
            except Exception:
                self._store = None

    def _end_if_stuck(self, stalled_s: float) -> None:
        """The launcher is gone: its SIGTERM's checkpoint needs a step boundary this rank has stopped reaching."""
        step, phase = self.where
        if stalled_s < (max(self.warning_s, self.grace_s) if phase in LONG_PHASES else self.warning_s):
            return
        inside = f" (sharded block {self.blocks})" if self.blocks else ""
        warn(
            f"the launcher (pid {self._launcher}) is gone and rank {self.rank} has made no progress for "
            f"{stalled_s:.0f} s ({phase} at step {step}{inside}): the job is stalled and nothing else will end it, so "
            "this process ends now, without a checkpoint; rerun to resume from the last one"
        )
        os._exit(PREEMPTED_EXIT)

    def _reported(self, stalled_s: float) -> bool:
        """Said (by this rank, or left to the one that says it), or False: not every rank has waited yet."""
        notes = {}
        for rank in range(self.world):
            # get() would block on a rank that never published.
            if self._store.check([str(rank)]):
                notes[rank] = json.loads(self._store.get(str(rank)))
        now = time.time()
        said_by = speaker(notes, now=now, warning_s=self.warning_s)
        if said_by == self.rank:
            warn(report(notes, self.world, now=now, stalled_s=stalled_s))
        return said_by is not None


def speaker(notes: dict[int, dict], *, now: float, warning_s: float) -> int | None:
    """The rank that reports the stall: the lowest, once every rank heard from has made no progress for
    ``warning_s``; None before. Every rank reads the same notes alike, so one report per stall. (The lowest of the
    ranks waiting so far is not one rank: the stalled rank, first to wait, spoke before the others had waited long,
    and then they did too, as seen on a loaded host.)"""
    if notes and all(now - note["since"] >= warning_s for note in notes.values()):
        return min(notes)
    return None


def report(notes: dict[int, dict], world: int, now: float, *, stalled_s: float) -> str:
    """The stall in words: where every rank is, and which one(s) the others wait for."""

    def position(note: dict) -> tuple[int, int, int]:
        return note["step"], PHASES.index(note["phase"]), note.get("blocks", 0)

    def doing(note: dict) -> str:
        if note["phase"] == "resume":
            return "resuming from a checkpoint"
        blocks = note.get("blocks", 0)
        inside = f" (sharded block {blocks})" if blocks else ""
        return f"{note['phase']} at step {note['step']}{inside}"

    silent = [r for r in range(world) if r not in notes]
    ranks = ", ".join(
        f"rank {r} ({n['host']}) {doing(n)} since {now - n['since']:.0f} s" for r, n in sorted(notes.items())
    )
    line = f"stalled for {stalled_s:.0f} s: {ranks}."
    if silent:
        return line + f" Never heard from rank(s) {', '.join(map(str, silent))}: waiting for them."
    behind = min(position(n) for n in notes.values())
    laggards = [r for r, n in notes.items() if position(n) == behind]
    if len(laggards) == len(notes):
        first = next(iter(notes.values()))
        return (
            line + f" Every rank is at the same place ({doing(first)}): a long {first['phase']} or a slow "
            "collective (network?), rather than one rank."
        )
    return line + f" Waiting for rank(s) {', '.join(map(str, laggards))} ({doing(notes[laggards[0]])})."


class NoStalls:
    """One process, or no ``stall_warning_s``: nobody to wait for."""

    def at(self, step: int, phase: str) -> None:
        pass

    def entered(self) -> None:
        pass

    @contextlib.contextmanager
    def watching(self, phase: Optional[str] = None) -> Iterator[None]:
        yield


def stall_reporter(run: Run) -> StallReporter | NoStalls:
    """A ``StallReporter`` when there are other ranks to wait for and ``stall_warning_s`` is set (its ``grace_s``:
    how long a long evaluation or save may go on once the launcher is gone: ``preemption_grace_s``)."""
    config = run.config
    if run.world == 1 or config.stall_warning_s is None:
        return NoStalls()
    return StallReporter(run, warning_s=config.stall_warning_s, grace_s=config.preemption_grace_s)
