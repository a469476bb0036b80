"""Checkpoints written while training goes on (``save_async: true``): the step waits only while the weights and
optimizer state are copied to CPU memory; DCP writes them in the background (docs/checkpoints.md).

The same guarantees as a checkpoint written in the step: written into ``.tmp-step-N`` and committed (manifest,
rename, ``latest``) only once every process's files are on disk (DCP gathers every process's result before it writes
its index, on the main process, which then commits from its own thread). One save is in flight at a time: the next
save, a preemption and the end of ``fit()`` first wait for it, and every process learns there whether it failed. Its
collectives run on a gloo group of their own, never the training group's (sharing it hung, as in torchtitan's).
"""

from __future__ import annotations

import errno
import shutil
import threading
from concurrent.futures import Future
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch

from trainer.checkpoint.failures import root_cause
from trainer.checkpoint.store import write_failed
from trainer.errors import CheckpointError

if TYPE_CHECKING:
    from trainer.launch.run import Run


class BackgroundSave:
    """The checkpoint being written: this process's write, and on the main process the thread that commits it (on
    every process, for a bucket: ``commit`` then waits for the write itself, agreeing with the others)."""

    def __init__(self, future: Future, staging: Path, commit: Optional[Callable[[], Any]], *, everywhere: bool = False):
        self.future, self.staging, self.everywhere = future, staging, everywhere
        self.error: Optional[BaseException] = None
        # What the commit returned: the checkpoint's folder, or its URL.
        self.committed: Any = None
        self._thread = None
        if commit is not None:
            self._thread = threading.Thread(
                target=self._commit_when_written, args=(commit,), daemon=True, name="trainer-checkpoint-commit"
            )
            self._thread.start()

    def _commit_when_written(self, commit: Callable[[], Path]) -> None:
        try:
            if not self.everywhere:
                self.future.result()
            self.committed = commit()
        # Told to every process at the next wait.
        except BaseException as err:
            self.error = err

    def wait(self, timeout_s: Optional[float] = None) -> Optional[BaseException]:
        if self._thread is not None:
            self._thread.join(timeout_s)
        else:
            try:
                self.future.result(timeout_s)
            except BaseException as err:
                self.error = err
        return self.error


class BackgroundSaves:
    """At most one checkpoint written in the background; ``wait()`` on every process before anything that needs it
    committed. Every process learns the others' errors over ``run``'s host group."""

    def __init__(self, run: Run):
        self.run, self.main = run, run.main
        # The writes' own collectives, from their own thread: never a group the main thread uses too. A gloo group
        # even for one process: DCP's background save refuses a group without a CPU backend (NCCL on one GPU).
        self.group = writers_group(run.world, run.config.collective_timeout_s)
        self.in_flight: Optional[BackgroundSave] = None

    def start(self, future: Future, staging: Path, commit: Callable[[], Any], *, on_main: bool = False) -> None:
        """``on_main``: ``commit`` runs on the main process once the write is done (a disk's rename), else on every
        process, waiting for the write itself (a bucket's uploads)."""
        chosen = None if on_main and not self.main else commit
        self.in_flight = BackgroundSave(future, staging, chosen, everywhere=not on_main)

    def wait(self) -> Optional[Path]:
        """Until the checkpoint in flight is committed; its folder (on every process), or None when there was none.
        A failed write on any process is raised on every one, its unfinished folder removed."""
        if self.in_flight is None:
            return None
        save, self.in_flight = self.in_flight, None
        error, mine = save.wait(), None
        # The rank that failed, and its own error (torch's wraps it in every rank's traceback)
        if error is not None:
            failing, cause = root_cause(error)
            mine = (failing if failing is not None else torch.distributed.get_rank(), type(cause).__name__, str(cause))
        failed = sorted(found for found in self.run.gather(mine) if found)
        if failed:
            rank, kind, text = failed[0]
            # A bucket's failure, said already in its words.
            if kind == "CheckpointError":
                raise CheckpointError(text)
            if self.main:
                cause = OSError(errno.ENOSPC, text) if "No space left" in text else RuntimeError(f"{kind}: {text}")
                raise write_failed(save.staging, save.staging.parent, cause, rank=rank)
            raise CheckpointError(f"checkpoint {save.staging.name} could not be written (rank {rank}: {kind}: {text})")
        return save.committed or save.staging.parent / save.staging.name.removeprefix(".tmp-")

    def abandon(self, timeout_s: float = 60.0) -> Optional[str]:
        """After an error ends the run: this process's write in flight waited for (a while: the other processes
        may be gone, so nothing collective), and on the main process its folder removed unless it was committed.
        What became of it, said by the main process (None when nothing was in flight)."""
        if self.in_flight is None:
            return None
        save, self.in_flight = self.in_flight, None
        save.wait(timeout_s)
        step = save.staging.name.removeprefix(".tmp-")
        if not self.main or not save.staging.exists():
            return None
        shutil.rmtree(save.staging, ignore_errors=True)
        return f"the checkpoint {step} being written in the background was not committed: its folder was removed"


def writers_group(world_size: int, timeout_s: Optional[float] = None) -> Any:
    """A gloo group of every process for the background writes (collective, once), or None without a process group
    (one process, nothing to agree with). Its collectives give up after ``timeout_s`` (the config's
    ``collective_timeout_s``), not torch's 30 minutes."""
    if world_size == 1 and not torch.distributed.is_initialized():
        return None
    timeout = {} if timeout_s is None else {"timeout": timedelta(seconds=timeout_s)}
    return torch.distributed.new_group(backend="gloo", **timeout)
