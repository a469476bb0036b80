"""What a checkpoint holds, as a registry of parts that save and load themselves, and saving and resuming one
(docs/checkpoints.md).

A part is any object with ``state_dict()`` / ``load_state_dict()`` (torch's ``Stateful`` protocol), by name, as
torchtitan's ``CheckpointManager`` holds its ``states``: its state, plain data, goes into ``trainer_state.json``. A
part with ``save(folder, in_background=...)`` / ``load(folder, state)`` writes files of its own into the checkpoint
folder (``trainer.checkpoint.parts``). Where a checkpoint is committed and found is the storage's
(``trainer.checkpoint.storage``: a folder on the disk, or a bucket), never asked which. Nothing loaded runs code.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional

from trainer.checkpoint import integrity, store
from trainer.checkpoint.background import BackgroundSaves
from trainer.checkpoint.best import KeepBest
from trainer.checkpoint.failures import agreed_failure, read_part
from trainer.checkpoint.policy import RunSetup, group_settings, random_states
from trainer.checkpoint.storage import storage_for
from trainer.checkpoint.store import checkpoint_root, staging_folder, warn_of_a_slow_save, write_failed
from trainer.console import say
from trainer.errors import CheckpointError, Refusal

if TYPE_CHECKING:
    from trainer.launch.run import Run

# The resume proof's (trainer.tools.resume_proof): every process ends as in a crash once this step's checkpoint is
# committed; a resume leaves out the data position (its control, which must come out different).
CRASH_AFTER, WITHHOLD = "TRAINER_CRASH_AFTER_CHECKPOINT", "TRAINER_RESUME_WITHHOLD"


class Checkpointer:
    """Saves and loads this run's checkpoints under ``<output_dir>/checkpoints``; every method on every rank.

    Args:
        run: the job.
        parts: what a checkpoint holds, by name (the module docstring; None: none), ``model`` and ``train`` too.
        setup: how the run is set up (``trainer.checkpoint.policy.RunSetup``): each checkpoint records it, a resume
            compares it.
        best: ``keep_best``'s record (a part too), which the ``best`` pointer follows.
        watch: the stall reporter's ``watching`` (``trainer.telemetry.stall``): a resume that waits is reported
            as a step that waits is.
    """

    def __init__(
        self, run: Run, *, parts: dict[str, Any], setup: RunSetup, best: KeepBest, watch: Optional[Callable] = None
    ):
        self.run, self.setup, self.best = run, setup, best
        self.watch = watch or (lambda phase: contextlib.nullcontext())
        self.parts = {name: part for name, part in parts.items() if part is not None}
        # Refused at the start, on every rank, rather than at the first checkpoint.
        store.check_writable(run.config.output_dir)
        # Where the checkpoints are written (in object storage: staged for the upload, downloaded to resume).
        self.root = checkpoint_root(run.config.output_dir)
        self.storage = storage_for(run, self.root)
        # The saves written while training goes on (save_async), or None.
        self.background = BackgroundSaves(run) if run.config.save_async else None
        # The newest checkpoint committed (or resumed from).
        self.last: Optional[Path | str] = None
        # The output_dir's lock, held by the main process while it lives.
        self._lock: Any = None

    def start(self) -> Optional[CheckpointError]:
        """The main process locks the output_dir and finds the checkpoint ``resume`` asks for (setting a damaged one
        aside); every rank resumes from it (``resume``'s answer) or starts fresh, or raises the main process's
        refusal (a locked output_dir, checkpoints a run without resume would overwrite, ...)."""
        with self.watch("resume"):
            return self._start()

    def _start(self) -> Optional[CheckpointError]:
        path = self.storage.fetched(self.run.main_decides(self._find))
        if path is None:
            if self.run.config.resume == "auto":
                say(f"resume='auto': no checkpoint in {self.storage.where}: starting fresh")
            return None
        answer = self.resume(path, verified=True)
        self.last = self.storage.resumed(path)
        return answer

    def _find(self) -> Optional[str]:
        config = self.run.config
        self._lock = store.lock_output_dir(config.output_dir)
        found = self.storage.resume_point(config.resume)
        return None if found is None else str(found)

    def save(self, step: int, *, wait: bool = True, evaluated: Optional[tuple] = None) -> Path | str:
        """Step ``step``'s checkpoint, written by every rank and committed by the main process (the ``best``
        pointer follows keep_best's record, a part of it). With background saves and ``wait=False``, the shards are
        written while training goes on and committed later (``wait``); its folder (URL, in a bucket) is returned.
        ``evaluated``: the latest evaluation, ``(step, metrics)``, judged by keep_best when it is this step's."""
        # One save in flight at a time.
        self.wait()
        run, started = self.run, time.monotonic()
        if self.best.figure is not None and evaluated is not None and evaluated[0] == step:
            # The record this checkpoint holds, which the best pointer follows.
            self.best.judge(*evaluated)
        state = {"run": self.setup.record()}
        state.update(
            {
                name: part.state_dict()
                for name, part in self.parts.items()
                if callable(getattr(part, "state_dict", None))
            }
        )
        staging = staging_folder(self.root, step)

        # Every rank learns whether the folder could be made (a read-only disk), then writes into it.
        run.main_decides(functools.partial(store.make_staging, staging))
        self.storage.stage(staging)
        in_background = self.background is not None and not wait
        for part in self.parts.values():
            if callable(getattr(part, "save", None)):
                # Every rank's files are on disk, or every rank says the first rank's failure.
                failed = agreed_failure(run, functools.partial(part.save, staging, in_background=in_background))
                if failed is not None:
                    rank = failed.rank if failed.alone else None
                    raise write_failed(staging, self.root, failed.error, rank=rank) from None
        if in_background:
            group = self.background.group
            future = self.parts["model"].save_async(staging, group)
            commit, on_main = self.storage.committer(staging, state, write=future, group=group)
            self.background.start(future, staging, commit, on_main=on_main)
            return self.storage.final(step)
        self.last = self.storage.commit(staging, state)
        if os.environ.get(CRASH_AFTER) == str(step):
            os.kill(os.getpid(), signal.SIGKILL)
        warn_of_a_slow_save(run.config, time.monotonic() - started)
        return self.last

    def of_step(self, step: int, save: Callable[[], Path | str]) -> Path | str:
        """A committed checkpoint of step ``step`` (a preemption's): the one saved there, or one ``save`` writes."""
        self.wait()  # a checkpoint written in the background is committed first
        return self.last if self.last == self.storage.final(step) else save()

    @contextlib.contextmanager
    def cleaned_up_on_error(self) -> Iterator[None]:
        """Around ``fit()``: when an error ends it, a checkpoint still being written in the background is not left
        half-written on the disk (a full disk would stay full), and the line says so."""
        try:
            yield
        except BaseException:
            said = self.background.abandon() if self.background is not None else None
            if said:
                say(said)
            raise

    def wait(self) -> None:
        """Until the checkpoint written in the background is committed."""
        committed = self.background.wait() if self.background is not None else None
        if committed is not None:
            self.last = committed

    def read(self, path: Path, verified: bool = False) -> dict[str, Any]:
        """Checkpoint ``path``'s state, once it is checked whole: its files' sizes on every rank, their contents
        (CRC-32) on the main process unless it has just ``verified`` them (reading every byte once is enough)."""
        integrity.verify(path, contents=self.run.main and not verified)
        return integrity.read_state(path)

    def load_best(self, step: int) -> None:
        """At the end of ``fit()``, with ``load_best_at_end``: the best evaluation's weights (and their average) back
        in the model, said in a line (``KeepBest.load_best``)."""
        record = self.best.best if self.best.loads_at(step) else None
        best, damage = self.storage.best(record)
        self.best.load_best(best, step, load_weights=self._load_weights, damage=damage)

    def best_checkpoint(self) -> Optional[Path | str]:
        """With keep_best: the checkpoint of the best evaluation so far (its URL in object storage), else None."""
        return self.storage.best_name(self.best.best)

    def _load_weights(self, path: Path) -> None:
        state = self.read(path, verified=True)
        self.parts["model"].load_weights(path)
        if "ema" in self.parts:
            self.parts["ema"].load(path, state)

    def resume(self, path: Path, *, verified: bool = False) -> Optional[CheckpointError]:
        """Continue from checkpoint ``path``: every part back, the position moved to this run's split of the same
        global batch, this run's changed settings applied (``trainer.checkpoint.policy``), said in a line or two.
        Returns why ``fit()`` cannot go on from it (another global batch, a setting the saved state cannot go on
        under), or None; the weights are loaded either way, for ``evaluate()`` and ``predict()``."""
        with self.watch("resume"):
            return self._resume(path, verified)

    def roll_back(self, path: Path) -> None:
        """Every part but a stream's position back from this run's checkpoint ``path``, in the same process
        (``spike_policy: rollback``, which sets the data's position itself)."""
        with self.watch("resume"):
            self.load(path, self.read(Path(path), verified=True), skip=("data",))

    def _resume(self, path: Path, verified: bool) -> Optional[CheckpointError]:
        state = self.read(path, verified)
        judged = self.setup.judge(state, path)
        # Why fit() cannot go on from it (another global batch, a setting), or None.
        cannot = judged.misfit or judged.refused
        # This run's; the checkpoint's replace them.
        own_settings = group_settings(self.setup.optimizer)
        # data: another split's position.
        withheld = os.environ.get(WITHHOLD) == "data"
        self.load(path, state, skip=("data",) if cannot or withheld else (), refused=judged.refused)
        position = self.parts["train"]
        position.continue_at(0 if withheld else judged.batches)
        if withheld:
            say(f"{WITHHOLD}=data: the data position is left out of this resume (the epoch is read from its start)")
        self.last = path
        saved_processes, processes = state["run"]["world_size"], self.run.world
        # fit() says why when it is called; evaluate() and predict() go on with the weights.
        if cannot:
            say(f"loaded {path} for evaluate() and predict() only: step {position.step}, epoch {position.epoch}")
            return cannot
        say(
            f"resumed from {path}: step {position.step}, epoch {position.epoch}, batch {judged.batches}{judged.resplit}"
            f"{random_states(saved_processes, processes)}"
        )
        # Lowered by spike rollbacks (trainer.loop.spikes): this run's lr at the same scale.
        scale = getattr(self.parts.get("spikes"), "lr_scale", 1.0)
        own_settings = [
            {**group, **{k: group[k] * scale for k in ("lr", "initial_lr") if k in group}} for group in own_settings
        ]
        applied = self.setup.apply_changes(state["run"], position.step, own_settings)
        if applied:
            say(applied)
        return None

    def load(
        self,
        path: Path,
        state: dict[str, Any],
        *,
        skip: tuple[str, ...] = (),
        refused: Optional[CheckpointError] = None,
    ) -> None:
        """Every registered part but those in ``skip`` back from checkpoint ``path`` (its ``state``): the files
        first (a failure to fit is said as one line), then the plain data. ``refused``: this run's settings cannot
        go on with the saved optimizer state, so the model's weights alone are loaded (for evaluate and predict).
        Every rank agrees on each part before the next is read: a part read by every rank together (the average's
        DCP read) must not wait for a rank that stopped at the one before (a callback's file refused on that rank)."""
        for name, part in self.parts.items():
            if name == "model" and refused is not None:
                self._agreed(path, functools.partial(part.load_weights, path), refused=refused)
            elif callable(getattr(part, "load", None)) and name not in skip:
                self._agreed(path, functools.partial(part.load, path, state), refused=refused)
        self._agreed(path, functools.partial(self._load_states, path, state, skip=skip), refused=refused)

    def _agreed(self, path: Path, attempt: Callable[[], None], *, refused: Optional[CheckpointError]) -> None:
        """``attempt()`` on every rank, and on every rank the first failing rank's failure raised."""
        failed = agreed_failure(self.run, functools.partial(read_part, path, attempt, refused=refused))
        if failed is not None:
            # The same words on every rank, said once by the first process: which rank could not load what, where
            # the others could (a refusal of its own kind; anything else, DCP's failure say, as a CheckpointError).
            err = failed.error
            kind = type(err) if isinstance(err, Refusal) else CheckpointError
            raise kind(f"{err} (rank {failed.rank})" if failed.alone else str(err), job_wide=True) from None

    def _load_states(self, path: Path, state: dict[str, Any], *, skip: tuple[str, ...]) -> None:
        """The plain-data parts' states, from ``trainer_state.json``."""
        for name, part in self.parts.items():
            if name in state and name not in skip and callable(getattr(part, "load_state_dict", None)):
                try:
                    part.load_state_dict(state[name])
                # Written by hand or damaged: said before anything uses it.
                except (TypeError, ValueError, LookupError, AttributeError) as err:
                    if isinstance(err, Refusal):
                        raise
                    raise CheckpointError(
                        f"checkpoint {path}: the {name!r} state in {integrity.STATE_FILE} cannot be used "
                        f"({type(err).__name__}: {err}). Resume from another checkpoint (resume=<path>)"
                    ) from None
