"""What a checkpoint holds, as a registry of parts that save and load themselves, and writing and reading one.

A part is any object with ``state_dict()`` / ``load_state_dict()`` (torch's ``Stateful`` protocol), registered by
name, as torchtitan's ``CheckpointManager`` holds its ``states``. Those the Trainer registers:

- ``model``: the weights and optimizer state (``trainer.checkpoint.model_part``: DDP's files or FSDP2's shards, each
  read into either);
- ``accelerate``: what ``Accelerator.save_state`` writes besides: the schedule, the fp16 loss scaler, every rank's
  random state (and, under DDP, the model and optimizer files);
- ``train``: where training stands (``trainer.loop.state``); ``data``: a stream's position per process
  (``trainer.data.streams``); ``best``: keep_best's record (``trainer.loop.callbacks.KeepBest``);
- ``callbacks``: every callback with ``state_dict`` (``EarlyStopping``'s patience, a user's own);
- ``ema`` (with ``ema_decay``): the average of the weights (``trainer.optim.ema``, files of its own); ``microbatch``
  (with ``auto_microbatch``): how the micro-batches are cut (``trainer.loop.microbatch``).

Parts whose state is plain data go into ``trainer_state.json`` under their names; parts that write files (those
with ``save(folder)`` and ``load(folder, state)``) write them into the checkpoint folder. Where and how a
checkpoint is committed, verified and found again is the store's (``trainer.checkpoint.store``), the same for every
part. Nothing loaded runs code: JSON, safetensors, ``torch.load(weights_only=True)`` and DCP read safely.
"""

from __future__ import annotations

import contextlib
import pickle
import shutil
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch
from accelerate import Accelerator

from trainer.checkpoint import store as checkpoint
from trainer.checkpoint.background import BackgroundSaves, background_saves
from trainer.checkpoint.policy import RunSetup, group_settings, random_states
from trainer.checkpoint.store import checkpoint_root, root_cause, staging_folder, write_failed
from trainer.data.streams import StreamPositions
from trainer.errors import CheckpointError, Refusal
from trainer.loop.callbacks import stateful
from trainer.telemetry.console import say


class Checkpointer:
    """Saves and loads this run's checkpoints under ``<output_dir>/checkpoints``; every method on every rank.

    Args:
        accelerator: the run's Accelerator (who is the main process, and its barriers).
        output_dir, keep_last: where checkpoints go, and how many are kept (``trainer.checkpoint.store``).
        background: the saves written while training goes on (``save_async``), or None.
        setup: how the run is set up (``trainer.checkpoint.policy.RunSetup``): each checkpoint records it, a resume
            compares it.
        parts: the registered parts, by name (``register`` adds more).
    """

    def __init__(
        self,
        accelerator: Accelerator,
        output_dir: str,
        keep_last: int,
        background: Optional[BackgroundSaves],
        setup: RunSetup,
        parts: dict[str, Any],
    ):
        self.accelerator, self.output_dir, self.keep_last = accelerator, output_dir, keep_last
        self.root = checkpoint_root(output_dir)
        self.background, self.setup = background, setup
        self.parts: dict[str, Any] = dict(parts)
        self.last: Optional[Path] = None  # the newest checkpoint committed (or resumed from)
        self._lock: Any = None  # the output_dir's lock, held by the main process while it lives

    @classmethod
    def for_run(
        cls,
        config: Any,
        accelerator: Accelerator,
        setup: RunSetup,
        model: Any,
        scheduler: Any,
        state: Any,
        best: Any,
        callbacks: list,
        stream: Any,
        host: Any,
    ) -> "Checkpointer":
        """The Trainer's checkpoints: its parts registered (see the module docstring)."""
        acc = accelerator
        parts = {
            "model": model,
            "accelerate": AccelerateState(acc, scheduler),
            "train": state,
            "best": best,
            "callbacks": CallbackStates(callbacks, acc.process_index, acc.device, stateful),
        }
        if stream is not None:
            parts["data"] = StreamPositions(stream, state, acc.process_index, host)
        saves = background_saves(
            config.save_async,
            model.format != "DDP",
            acc.is_main_process,
            acc.num_processes,
            host,
            config.collective_timeout_s,
        )
        return cls(acc, config.output_dir, config.keep_last, saves, setup, parts)

    def register(self, name: str, part: Any) -> None:
        """Add a part: anything with ``state_dict()`` / ``load_state_dict()`` (its state, plain data, goes into
        ``trainer_state.json`` under ``name``), or with ``save(folder, in_background)`` / ``load(folder, state)``
        (its own files in the checkpoint folder), or both. Register it before the resume (the constructor's)."""
        self.parts[name] = part

    def save(self, step: int, wait: bool = True) -> Path:
        """Step ``step``'s checkpoint, written by every rank and committed by the main process (the ``best``
        pointer follows keep_best's record, a part of it). With background saves and ``wait=False``, the shards are
        written while training goes on and committed later (``wait``); the folder it will be is returned."""
        self.wait()  # one save in flight at a time
        acc = self.accelerator
        state = {"run": self.setup.record(), "sharding": self.parts["model"].format}  # the weights' format
        state.update(
            {
                name: part.state_dict()
                for name, part in self.parts.items()
                if callable(getattr(part, "state_dict", None))
            }
        )
        staging = staging_folder(self.root, step)
        if acc.is_main_process:
            if staging.exists():
                shutil.rmtree(staging)  # left by a crash during an earlier save
            staging.mkdir(parents=True)
        acc.wait_for_everyone()
        in_background = self.background is not None and not wait
        try:
            for part in self.parts.values():
                if callable(getattr(part, "save", None)):
                    part.save(staging, in_background=in_background)
                    acc.wait_for_everyone()  # the folder exists, each part's files are on disk
        except BaseException as err:  # torch.distributed.checkpoint's failure is a BaseException, not an Exception
            if not isinstance(err, Exception) and root_cause(err)[0] is None:
                raise  # KeyboardInterrupt, SystemExit: not a failed write
            raise write_failed(staging, self.root, err) from None
        keep_last = self.keep_last
        if in_background:
            future = self.parts["model"].save_async(staging, self.background.group)
            self.background.start(future, staging, lambda: checkpoint.commit(staging, state, keep_last))
            return checkpoint.final_folder(self.root, step)
        if acc.is_main_process:
            checkpoint.commit(staging, state, keep_last)
        acc.wait_for_everyone()
        self.last = checkpoint.final_folder(self.root, step)
        return self.last

    def of_step(self, step: int, save: Callable[[], Path]) -> Path:
        """A committed checkpoint of step ``step`` (a preemption's): the one saved there, or one ``save`` writes."""
        self.wait()  # a checkpoint written in the background is committed first
        return self.last if self.last == checkpoint.final_folder(self.root, step) else save()

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

    def resume_point(self, find: Callable[[], Optional[Path]]) -> Optional[Path]:
        """The checkpoint to continue from, chosen by the main process with ``find`` (which may set a damaged
        checkpoint aside) once it holds the output_dir's lock, and shared with every rank, as is a refusal (the
        output_dir is locked, holds checkpoints a run without resume would overwrite, ...): every rank raises it,
        the first process alone prints it. The main process has checked the contents of the one it chose."""
        from accelerate.utils import broadcast_object_list

        chosen: list[Any] = [None]
        if self.accelerator.is_main_process:
            try:
                self._lock = checkpoint.lock_output_dir(self.output_dir)  # held while this process lives
                found = find()
            except Refusal as refusal:  # sent to every rank, which all refuse: none waits for a peer that left
                found = refusal
            chosen = [str(found) if isinstance(found, Path) else found]
        broadcast_object_list(chosen, from_process=0)
        if isinstance(chosen[0], Refusal):
            raise chosen[0]
        return Path(chosen[0]) if chosen[0] is not None else None

    def read(self, path: Path, verified: bool = False) -> dict[str, Any]:
        """Checkpoint ``path``'s state, once it is checked whole: its files' sizes on every rank, their contents
        (CRC-32) on the main process unless it has just ``verified`` them (reading every byte once is enough)."""
        checkpoint.verify(path, contents=self.accelerator.is_main_process and not verified)
        return checkpoint.read_state(path)

    def damage(self, path: Path) -> Optional[str]:
        """Why checkpoint ``path`` is not whole (checked by the main process, contents included), on every rank;
        None when it is."""
        from accelerate.utils import broadcast_object_list

        found: list[Optional[str]] = [None]
        if self.accelerator.is_main_process:
            try:
                checkpoint.verify(path)
            except CheckpointError as err:
                found = [checkpoint.without_alternatives(err)]
        broadcast_object_list(found, from_process=0)
        return found[0]

    def resume(self, path: Path, verified: bool = False) -> Optional[CheckpointError]:
        """Continue from checkpoint ``path``: every part back, the position moved to this run's split of the same
        global batch, this run's changed settings applied (``trainer.checkpoint.policy``), said in a line or two.
        Returns why ``fit()`` cannot go on from it (another global batch, a setting the saved state cannot go on
        under), or None; the weights are loaded either way, for ``evaluate()`` and ``predict()``."""
        state = self.read(path, verified)
        batches, resplit, misfit, refused = self.setup.judge(state, path)
        own_settings = group_settings(self.setup.optimizer)  # this run's; the checkpoint's replace them
        self.load(path, state, skip=("data",) if misfit or refused else (), refused=refused)  # data: another split's
        position = self.parts["train"]
        position.batches_into_epoch = batches
        self.last = path
        saved_processes, processes = state["run"]["world_size"], self.accelerator.num_processes
        if misfit or refused:  # fit() says why when it is called; evaluate() and predict() go on with the weights
            say(f"loaded {path} for evaluate() and predict() only: step {position.step}, epoch {position.epoch}")
            return misfit or refused
        say(
            f"resumed from {path}: step {position.step}, epoch {position.epoch}, batch {batches}{resplit}"
            f"{random_states(saved_processes, processes)}"
        )
        applied = self.setup.apply_changes(state["run"], position.step, own_settings)
        if applied:
            say(applied)
        return None

    def load(
        self, path: Path, state: dict[str, Any], skip: tuple[str, ...] = (), refused: Optional[CheckpointError] = None
    ) -> None:
        """Every registered part but those in ``skip`` back from checkpoint ``path`` (its ``state``): the files
        first (a failure to fit is said as one line, or as ``refused`` when a changed setting explains it), then the
        plain data."""
        try:
            for name, part in self.parts.items():
                if callable(getattr(part, "load", None)) and name not in skip:
                    part.load(path, state)
        except (pickle.UnpicklingError, EOFError) as err:  # torch.load(weights_only=True) refused it, or it ends early
            detail = " ".join(str(err).split())[:600]
            raise CheckpointError(
                f"checkpoint {path} holds a file that cannot be loaded safely (nothing in it was "
                f"run): {type(err).__name__}: {detail}. Resume from another checkpoint "
                f"(resume=<path>), or delete this one"
            ) from None
        except (RuntimeError, LookupError, ValueError, OSError) as err:
            if isinstance(err, Refusal):
                raise
            if refused is not None:  # the optimizer state does not load for the reason it names
                raise refused from err
            detail = " ".join(str(err).split())[:2000]  # torch's size-mismatch report spans many lines
            raise CheckpointError(f"checkpoint {path} does not fit this run: {detail}") from err
        for name, part in self.parts.items():
            if name in state and name not in skip and callable(getattr(part, "load_state_dict", None)):
                part.load_state_dict(state[name])


class AccelerateState:
    """The ``accelerate`` part: what ``Accelerator.save_state`` writes, read back with accelerate's own loader.
    Under DDP that includes the model and optimizer (given to ``prepare``), which the ``model`` part reads."""

    def __init__(self, accelerator: Accelerator, scheduler: Any):
        self.accelerator, self.scheduler = accelerator, scheduler

    def save(self, folder: Path, in_background: bool = False) -> None:
        self.accelerator.save_state(str(folder), safe_serialization=True)  # accelerate decides who writes what

    def load(self, folder: Path, state: dict[str, Any]) -> None:
        from accelerate.checkpointing import load_accelerator_state

        acc = self.accelerator
        load_accelerator_state(
            str(folder),
            models=[],
            optimizers=[],
            schedulers=[self.scheduler],
            dataloaders=[],
            process_index=acc.process_index,
            scaler=acc.scaler,
            map_location="cpu",
        )


class CallbackStates:
    """The ``callbacks`` part: every callback with ``state_dict`` (``trainer.loop.callbacks.stateful``), each rank's in
    a file of its own (their state may hold tensors: ``torch.load(weights_only=True)`` reads it back). A rank the
    checkpoint had not gets the first rank's."""

    def __init__(self, callbacks: list, rank: int, device: torch.device, named: Callable[[list], dict[str, Any]]):
        self.callbacks, self.rank, self.named = callbacks, rank, named
        self.device = "cpu" if device.type == "cpu" else device  # where loaded tensors go (not "cpu:0")

    def save(self, folder: Path, in_background: bool = False) -> None:
        states = {name: callback.state_dict() for name, callback in self.named(self.callbacks).items()}
        if states:
            torch.save(states, folder / f"callback_states_{self.rank}.pt")

    def load(self, folder: Path, state: dict[str, Any]) -> None:
        file = folder / f"callback_states_{self.rank}.pt"
        file = file if file.is_file() else folder / "callback_states_0.pt"
        if not file.is_file():
            return
        saved = torch.load(file, map_location=self.device, weights_only=True)
        for name, callback in self.named(self.callbacks).items():
            if name in saved:
                callback.load_state_dict(saved[name])
