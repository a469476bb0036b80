"""Known refusals end a job with one clear line, not a traceback.

Bad input the trainer recognises (a config key that does not exist, checkpoints that a run without ``resume`` would
overwrite, a checkpoint that does not fit, data too small for the world, a NaN loss) raises a :class:`Refusal`
whose message names the culprit and the fix. A program may catch it like any exception. Uncaught, the hook
installed when ``trainer`` is imported prints ``trainer: <message>`` and the process exits with status 1, as
after any uncaught exception; every other exception keeps its traceback. A refusal that every rank raises alike
(``job_wide``) is printed by the job's first process only, not once per process.
"""

from __future__ import annotations

import os
import sys


class Refusal(Exception):
    """Bad input, fully explained by the message. ``job_wide``: every rank meets it the same way, so one line from
    the first process is enough (the class's default unless given)."""

    job_wide = True

    def __init__(self, *args, job_wide: bool | None = None):
        super().__init__(*args)
        if job_wide is not None:
            self.job_wide = job_wide


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def install_hook() -> None:
    """Uncaught refusals print one line; everything else goes to the hook that was there before."""
    previous = sys.excepthook
    if getattr(previous, "prints_refusals", False):
        return

    def hook(kind, err, traceback):
        if not isinstance(err, Refusal):
            return previous(kind, err, traceback)
        rank = _rank()
        if rank == 0 or not err.job_wide:
            where = f"[rank {rank}] " if rank and not err.job_wide else ""
            sys.stderr.write(f"trainer: {where}{err}\n")
            sys.stderr.flush()

    hook.prints_refusals = True
    sys.excepthook = hook
