"""Every way the trainer refuses bad input, in one place; known refusals end a job with one line, not a traceback.

Bad input the trainer recognises (a config key that does not exist, checkpoints that a run without ``resume`` would
overwrite, a checkpoint that does not fit, data too small for the world, a NaN loss) raises a ``Refusal``
whose message names the culprit and the fix. A program may catch it like any exception. Uncaught, the hook
installed when ``trainer`` is imported prints ``trainer: <message>`` and the process exits with status 1, as
after any uncaught exception; every other exception keeps its traceback. A refusal that every rank raises alike
(``job_wide``) is printed by the job's first process only, not once per process.

Two ends of a job are not errors and are ``SystemExit``s instead: ``Preempted`` (status 75, "try again") and
``LaunchMismatch`` (a launch this host cannot honour).
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Iterator

# Sysexits' EX_TEMPFAIL: a temporary failure, to be tried again.
PREEMPTED_EXIT = 75


class Refusal(Exception):
    """Bad input, fully explained by the message. ``job_wide``: every rank meets it the same way, so one line from
    the first process is enough (the class's default unless given)."""

    job_wide = True

    def __init__(self, *args, job_wide: bool | None = None):
        super().__init__(*args)
        if job_wide is not None:
            self.job_wide = job_wide


class ConfigError(Refusal, ValueError):
    """A TrainConfig value, key or file is wrong; the message names the culprit."""


class DataError(Refusal, ValueError):
    """The data cannot be loaded as configured; the message says what to pass instead."""

    # One process's share can be the problem: each process that meets it says so.
    job_wide = False


class CheckpointError(Refusal, RuntimeError):
    """A checkpoint is missing, torn, unsafe, or does not fit this run; the message names it."""


class ExportError(Refusal, RuntimeError):
    """An export's destination cannot take it (not empty, inside the checkpoint, not writable); the message says."""


class StreamPositionError(CheckpointError):
    """A checkpoint mid-stream of a stream that cannot resume there."""


class NonFiniteLoss(Refusal, FloatingPointError):
    """A training loss was NaN or infinite under nan_policy='raise', or an evaluation's loss was."""


class LossSpike(Refusal, FloatingPointError):
    """Under spike_policy='rollback', a loss spike with no checkpoint to go back to, or spikes that keep coming."""


class LossFnError(Refusal, TypeError):
    """``loss_fn`` returned something other than a scalar tensor."""


class EvaluationError(Refusal, ValueError):
    """``metrics_fn`` or ``predict_fn`` returned what an evaluation cannot use, or there is nothing to evaluate."""


class PeerLost(Refusal, RuntimeError):
    """Another process of the job ended (its own error says why) while this one waited for it in a collective."""

    # The processes left behind each say it, after the one that failed has said its own.
    job_wide = False


# What gloo says when the process at the other end of a collective is gone.
PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "remote worker crashing")
# What gloo and NCCL say when collective_timeout_s passed with another process not there.
TIMED_OUT = ("Timed out waiting", "Watchdog caught collective operation timeout")


@contextlib.contextmanager
def peer_loss_in_a_line() -> Iterator[None]:
    """Around ``fit()``: the error a collective raises when another process ended, or did not arrive before
    ``collective_timeout_s``, becomes one line, not a second traceback beside that process's own."""
    try:
        yield
    except RuntimeError as err:
        text = " ".join(str(err).split())
        timed_out = any(sign in text for sign in TIMED_OUT)
        if isinstance(err, Refusal) or not (timed_out or any(sign in text for sign in PEER_GONE)):
            raise
        # gloo's source path and advice left out.
        detail = text.split("] ", 1)[-1].split(". This is typically")[0]
        if timed_out:
            raise PeerLost(
                f"a collective ended at collective_timeout_s, another process not there ({detail}): the stall "
                "report above names the rank it waited for; rerun to resume from the last checkpoint"
            ) from err
        raise PeerLost(
            f"another process of the job ended while this one waited for it in a collective ({detail}): "
            "its own error, above, is the cause"
        ) from err


class UnusedParameters(Refusal, RuntimeError):
    """DDP found parameters that took no part in the previous step's loss."""


class MetricsError(Refusal, OSError):
    """A rank's metrics file cannot be written (a full disk, a read-only output_dir)."""

    # Each rank writes its own file (on its own node's disk, maybe): each says so.
    job_wide = False


class OutOfMemory(Refusal, RuntimeError):
    """A micro-batch of one example does not fit in the device's memory (``auto_microbatch``)."""


class ShardingError(Refusal, ValueError):
    """An FSDP config this trainer cannot honour as asked; the message says what to change."""


class WorldSizeMismatch(Refusal, RuntimeError):
    """The launcher started K processes but the Accelerator sees a different number."""

    # Each process sees its own world.
    job_wide = False


class LaunchMismatch(SystemExit):
    """A launch this host cannot honour. A refusal, not a bug: the first process of the machine prints the
    message alone (no traceback, not once per rank) and every process exits with status 1."""


class Preempted(SystemExit):
    """Raised by fit() on every rank after the preemption checkpoint is committed; exits with PREEMPTED_EXIT."""

    def __init__(self, message: str):
        super().__init__(PREEMPTED_EXIT)
        self.message = message


def install_hook() -> None:
    """Uncaught refusals print one line; everything else goes to the hook that was there before."""
    previous = sys.excepthook
    if getattr(previous, "prints_refusals", False):
        return

    def hook(kind, err, traceback):
        if not isinstance(err, Refusal):
            return previous(kind, err, traceback)
        rank = int(os.environ.get("RANK", "0"))
        if rank == 0 or not err.job_wide:
            where = f"[rank {rank}] " if rank and not err.job_wide else ""
            sys.stderr.write(f"trainer: {where}{err}\n")
            sys.stderr.flush()
        else:
            wait_for_the_first_process()

    hook.prints_refusals = True
    sys.excepthook = hook


# How long a process waits for the first one to say why the job ends, before the process group exists.
FIRST_PROCESS_WAIT_S = 10.0


def wait_for_the_first_process() -> None:
    """Another process's part when the first process alone says why the job ends (a job-wide refusal, a launch this
    host cannot honour) and no process group holds them together yet: exiting at once, it would have torch's elastic
    agent end the job, the first process with it, its line unsaid (seen under load). So it waits for the launcher to
    end it once the first process has said it and exited, 10 s at most. With the group up, the ranks leave together
    anyway (``launch/host.py``)."""
    import signal
    import time

    distributed = sys.modules.get("torch.distributed")
    if distributed is not None and distributed.is_available() and distributed.is_initialized():
        return
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the launcher's word ends it, whatever the trainer had set
    time.sleep(FIRST_PROCESS_WAIT_S)
