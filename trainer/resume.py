"""The Trainer's checkpoints: what one holds of where training stands, writing it, continuing from it, and the
exported model. Where checkpoints live and how they are committed and verified is ``trainer.checkpoint``'s.

A mixin of :class:`trainer.Trainer`, which supplies the state it reads (``accelerator``, ``config``, the step and the
position in the data, the stream, the best evaluation).
"""

from __future__ import annotations

import json
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from accelerate.utils import broadcast_object_list, gather_object

from trainer import changes, checkpoint, sharded_state, sharding
from trainer.callbacks import improves
from trainer.checkpoint import CheckpointError, checkpoint_root, find_resume_point
from trainer.config import ConfigError
from trainer.console import no_library_progress_bars_off_a_terminal
from trainer.preemption import PREEMPTED_EXIT, Preempted, requeue_slurm_job
from trainer.refusal import Refusal


class Checkpoints:
    """save_checkpoint / load_checkpoint / save_model and the resume point, for the Trainer."""

    def save_checkpoint(self, wait: bool = True) -> Path:
        """A full-state checkpoint (model, optimizer, scheduler, scaler, every rank's RNG, where training stands)
        under ``<output_dir>/checkpoints/step-<N>``; call it on every rank. A non-finite loss stops it first.

        With ``save_async`` and ``wait=False`` (the periodic saves of ``fit()``), the shards are written in the
        background and committed later (``wait_for_checkpoint``); the folder it will be is returned."""
        self.wait_for_checkpoint()  # one save in flight at a time
        self.nonfinite.check(str(self.last_checkpoint or ""))
        epoch, batches = self.epoch, self.batches_into_epoch
        if self.batches_per_epoch and batches >= self.batches_per_epoch:
            epoch, batches = epoch + 1, 0  # the epoch is finished: the next step starts the next one
        state = {
            "global_step": self.global_step, "epoch": epoch, "batches_into_epoch": batches,
            "world_size": self.accelerator.num_processes, "batch_size": self.config.batch_size,
            "gradient_accumulation_steps": self.config.gradient_accumulation_steps, "config": self.config.to_dict(),
            "run_id": self.run_id,  # rank k's wandb run is <run_id>-rank<k>: a resume continues it
            "sharding": self._sharding_name, "optimizer_class": self._optimizer_class,
        }  # fmt: skip
        if self.stream is not None:  # where each process's part of the stream stands, as JSON
            state["streams"] = self._stream_positions(batches)
        best = self._best_so_far()
        state["best"] = self.best
        root = checkpoint_root(self.config.output_dir)
        if self.background_saves is not None and not wait:
            staging = checkpoint.write(self.accelerator, root, self.global_step, self._write_config)
            self.accelerator.wait_for_everyone()  # the rest of the checkpoint is on disk
            future = sharded_state.save_async(self.model, self.optimizer, staging, self.background_saves.group)
            keep_last = self.config.keep_last
            self.background_saves.start(future, staging, lambda: checkpoint.commit(staging, state, keep_last, best))
            return checkpoint.final_folder(root, self.global_step)
        self.last_checkpoint = checkpoint.save(self.accelerator, root, self.global_step, state, self.config.keep_last,
                                               best=best, write_more=self._write_weights_and_config)  # fmt: skip
        return self.last_checkpoint

    def wait_for_checkpoint(self) -> None:
        """Until the checkpoint written in the background (``save_async``) is committed; every rank."""
        committed = self.background_saves.wait() if self.background_saves is not None else None
        if committed is not None:
            self.last_checkpoint = committed

    def _write_weights_and_config(self, folder: Path) -> None:
        """Into a checkpoint being written, on every rank: a sharded model's shards; a transformers model's config
        (``python -m trainer.export`` makes a loadable model of any checkpoint)."""
        if self.sharded:
            sharded_state.save(self.model, self.optimizer, folder)
        self._write_config(folder)

    def _write_config(self, folder: Path) -> None:
        if self.accelerator.is_main_process:
            from trainer.export import save_model_config  # not at import: `python -m trainer.export` runs it

            save_model_config(self.unwrapped_model, folder)

    def _stream_positions(self, batches: int) -> list[Any]:
        """Every process's stream position after ``batches`` batches of this epoch, on every process."""
        position = self.stream.position(batches) if batches else None
        positions = gather_object([position]) if self.accelerator.num_processes > 1 else [position]
        try:
            json.dumps(positions)
        except (TypeError, ValueError) as err:
            raise CheckpointError(f"train_data ({self.stream.name})'s state_dict() cannot be saved as JSON ({err}): "
                                  "return plain numbers, strings, lists and dicts from it") from None  # fmt: skip
        return positions

    def _agreed_resume_point(self) -> Optional[Path]:
        """The checkpoint to continue from, chosen by the main process (which also takes the output_dir's lock, and
        sets a damaged checkpoint aside when resume is 'auto') and shared with every rank, as is a refusal (the
        output_dir is locked, holds checkpoints a run without resume would overwrite, ...): every rank raises it,
        the first process alone prints it."""
        chosen: list[Any] = [None]
        if self.accelerator.is_main_process:
            try:
                self._lock = checkpoint.lock_output_dir(self.config.output_dir)  # held while this process lives
                found = find_resume_point(self.config)
            except Refusal as refusal:  # sent to every rank, which all refuse: none waits for a peer that left
                found = refusal
            chosen = [str(found) if isinstance(found, Path) else found]
            if found is None and self.config.resume == "auto":  # a relative output_dir from another directory...
                where = checkpoint_root(self.config.output_dir).resolve()
                self._say(f"resume='auto': no checkpoint in {where}: starting fresh")
        if self.accelerator.num_processes > 1:
            broadcast_object_list(chosen, from_process=0)
        if isinstance(chosen[0], Refusal):
            raise chosen[0]
        return Path(chosen[0]) if chosen[0] is not None else None

    def _preempt(self, signal_number: int, window: Any, progress: Any) -> None:
        """A signal reached some rank: every rank logs what this window holds, commits a checkpoint of the step
        reached (whatever save_every says), then leaves fit() by raising Preempted (exit status 75)."""
        name = signal.Signals(signal_number).name
        started = time.monotonic()
        if window.steps:
            self._log(window, progress)
        self.wait_for_checkpoint()  # a checkpoint written in the background is committed first
        saved = self.last_checkpoint
        if saved is None or checkpoint.step_of(saved) != self.global_step:
            saved = self.save_checkpoint()
        requeue = ""
        if self.config.slurm_requeue:
            if self.accelerator.is_main_process:
                requeue = f"; {requeue_slurm_job()}"
            self.accelerator.wait_for_everyone()  # no rank leaves (and gets the others signalled) before the requeue
        raise Preempted(f"trainer: preempted ({name}) at step {self.global_step} of {self.total_steps}: checkpoint "
                        f"{saved} committed in {time.monotonic() - started:.1f} s{requeue}; exiting with status "
                        f"{PREEMPTED_EXIT}. Start the job again with resume='auto' to continue.")  # fmt: skip

    @property
    def _sharding_name(self) -> str:
        return sharding.FULLY_SHARDED if self.sharded else "DDP"

    @property
    def best_checkpoint(self) -> Optional[Path]:
        """With ``keep_best``: the checkpoint of the best evaluation so far (``load_checkpoint`` it), else None."""
        return checkpoint.best_checkpoint(checkpoint_root(self.config.output_dir))

    def _best_so_far(self) -> bool:
        """Whether this step's evaluation is the best yet of ``keep_best`` (the same answer on every rank)."""
        figure = self.config.keep_best
        if figure is None or self.last_eval is None or self.last_eval[0] != self.global_step:
            return False
        if figure not in self.last_eval[1]:
            raise ConfigError(f"keep_best is {figure!r}, but evaluate() gives {', '.join(self.last_eval[1])}: set "
                              "keep_best to one of them")  # fmt: skip
        value = self.last_eval[1][figure]
        if not improves(value, self.best and self.best["value"], self.config.keep_best_mode):
            return False
        self.best = {"figure": figure, "value": value, "step": self.global_step}
        return True

    def _load_best_weights(self) -> None:
        """``load_best_at_end`` (the default with ``keep_best``): the best evaluation's weights back into the model
        before fit() exports it, said in one line. Every rank."""
        best, cfg = self.best_checkpoint, self.config
        if cfg.keep_best is None or cfg.load_best_at_end is False or best is None or self.best is None:
            return
        figure = f"{self.best['figure']} {self.best['value']:.6g}"
        if self.best["step"] == self.global_step:
            self._say(f"the best evaluation is this last step's ({figure}): final/ holds its weights")
            return
        best = checkpoint.verify(best, contents=self.accelerator.is_main_process)
        if self.sharded:
            sharded_state.load_model(self.model, best)
        else:  # the plain module's weights, as accelerate's save_state wrote them
            from safetensors.torch import load_model

            load_model(self.unwrapped_model, best / "model.safetensors")  # read on the CPU, copied into the weights
        self._say(f"load_best_at_end: final/ holds the weights of step {self.best['step']}, the best evaluation "
                  f"({figure}), not those of the last step, {self.global_step}")  # fmt: skip

    def load_checkpoint(self, path: str | Path) -> None:
        """Continue from checkpoint ``path``: weights, optimizer, schedule, RNG and the position in the data. On any
        number of processes and batch size; ``fit()`` then refuses a different global batch (``cannot_train_on``),
        while ``evaluate()`` and ``predict()`` use the weights as they are."""
        # Sizes on every rank, contents (CRC-32) on the main process: reading every byte once is enough.
        path = checkpoint.verify(Path(path), contents=self.accelerator.is_main_process)
        state = checkpoint.read_state(path)
        written_by = state.get("sharding", "DDP")
        if written_by != self._sharding_name:
            raise CheckpointError(f"checkpoint {path} holds a {written_by} model, and this run is "
                                  f"{self._sharding_name}: resume it with the accelerate config that wrote "
                                  "it")  # fmt: skip
        now = Split(self.accelerator.num_processes, self.config.batch_size, self.config.gradient_accumulation_steps)
        try:
            batches, resplit = resumed_position(state, now, path, streaming=self.stream is not None)
        except CheckpointError as refusal:  # the weights still serve evaluate() and predict(); fit() refuses
            self.cannot_train_on, batches, resplit = refusal, state["batches_into_epoch"], ""
        refused = changes.refusal(state.get("config", {}), self.config.to_dict(), path, batches > 0,
                                  self.built_from_config[0], state.get("optimizer_class"), self._optimizer_class)
        self.cannot_train_on = self.cannot_train_on or refused  # a changed setting the saved state cannot go on under
        own_settings = changes.group_settings(self.optimizer)  # this run's; the checkpoint's replace them
        try:
            self.accelerator.load_state(str(path))
            if self.sharded:
                sharded_state.load(self.model, self.optimizer, path)
        except (RuntimeError, KeyError, ValueError, OSError) as err:
            if refused is not None:  # the optimizer state does not load for the reason it names
                raise refused from err
            detail = " ".join(str(err).split())[:2000]  # torch's size-mismatch report spans many lines
            raise CheckpointError(f"checkpoint {path} does not fit this run: {detail}") from err
        self.global_step, self.epoch = state["global_step"], state["epoch"]
        self.batches_into_epoch = batches
        if self.stream is not None and self.cannot_train_on is None:  # else the positions are another split's
            positions = state.get("streams") or [None] * self.accelerator.num_processes
            self.stream.resume_at(positions[self.accelerator.process_index], self.batches_into_epoch)
        self.run_id = state.get("run_id", self.run_id)
        self.best = state.get("best")
        self._say(f"resumed from {path}: step {self.global_step}, epoch {self.epoch}, batch {self.batches_into_epoch}"
                  f"{resplit}{_random_states(path, state['world_size'], now.processes)}")  # fmt: skip
        if self.cannot_train_on is None:
            self._apply_changed_settings(state, own_settings)

    def _apply_changed_settings(self, state: dict[str, Any], own_settings: list[dict[str, Any]]) -> None:
        """This run's settings where they differ from the checkpoint's, from the next step on, said in one line
        (``trainer.changes``; those the saved state cannot go on under were refused before the load)."""
        saved, now = state.get("config", {}), self.config.to_dict()
        built_scheduler = self.built_from_config[1]
        schedule_moved = saved.get("lr_scheduler", "constant") != "constant" or saved.get("warmup_steps", 0) > 0
        scheduler = getattr(self.lr_scheduler, "scheduler", self.lr_scheduler)  # accelerate's wrapper holds it
        lrs = changes.apply_settings(self.optimizer, scheduler, own_settings, self.global_step, schedule_moved,
                                     built_scheduler)  # fmt: skip
        applied = changes.said(changes.changed_settings(saved, now), self.global_step, lrs)
        if applied:
            self._say(applied)

    @property
    def _optimizer_class(self) -> str:
        return type(getattr(self.optimizer, "optimizer", self.optimizer)).__name__

    def save_model(self, directory: str | Path | None = None) -> Path:
        """Export the weights once, from the global main process, to ``<output_dir>/final`` by default:
        ``save_pretrained`` (safetensors) for transformers models, ``model.safetensors`` otherwise."""
        directory = Path(directory or Path(self.config.output_dir) / "final")
        self.accelerator.wait_for_everyone()
        model = self.unwrapped_model
        if self.sharded:  # gathered one tensor at a time onto the main process's CPU
            state_dict = sharded_state.full_model_state(model)
            if self.accelerator.is_main_process:
                from trainer.export import write_model

                write_model(state_dict, directory, model)
        elif hasattr(model, "save_pretrained"):
            state_dict = self.accelerator.get_state_dict(model)  # the plain module's: no "_orig_mod." prefixes
            if self.accelerator.is_main_process:
                with no_library_progress_bars_off_a_terminal():
                    model.save_pretrained(directory, state_dict=state_dict)
        else:
            self.accelerator.save_model(model, directory, safe_serialization=True)
        self.accelerator.wait_for_everyone()
        return directory


@dataclass(frozen=True)
class Split:
    """How a run splits its global batch: processes x batch_size x gradient_accumulation_steps."""

    processes: int
    batch_size: int
    accumulation: int

    @property
    def global_batch(self) -> int:
        return self.processes * self.batch_size * self.accumulation

    def __str__(self) -> str:
        return (f"{self.processes} process(es) x batch {self.batch_size} x accumulation {self.accumulation} = "
                f"{self.global_batch} global")  # fmt: skip


def resumed_position(state: dict[str, Any], now: Split, path: Path, streaming: bool) -> tuple[int, str]:
    """The micro-batch of the checkpoint's epoch this run reads next, and what a change of split means for it.

    Any split of the same global batch reads the same examples at each optimizer step: a step's global batch is
    the next ``global batch`` examples of the epoch's order (DistributedSampler's sharding table, whatever the
    processes, batch size and accumulation), so the position carries over as optimizer steps, on any number of
    processes. A different global batch would make every later step a different one: refused, naming both. A
    stream's position is each process's own (``trainer.streams``): its split cannot change."""
    saved = Split(state["world_size"], state["batch_size"], state["gradient_accumulation_steps"])
    if saved == now:
        return state["batches_into_epoch"], ""
    if streaming:
        raise CheckpointError(f"checkpoint {path} was written with {saved}, this run has {now}: a stream's position "
                              "is kept per process, so resume it with the same processes, batch_size and "
                              "gradient_accumulation_steps")  # fmt: skip
    if saved.global_batch != now.global_batch:
        raise CheckpointError(f"checkpoint {path} was written with {saved}; this run has {now}. Every later step "
                              f"would differ from the run's: keep {saved.global_batch} global "
                              f"({_keeping(saved.global_batch, now)}), or start a new run in another "
                              "output_dir")  # fmt: skip
    steps_into_epoch = state["batches_into_epoch"] // saved.accumulation
    return steps_into_epoch * now.accumulation, f"; split {saved} -> {now}: the same global batch, the same examples"


def _keeping(global_batch: int, now: Split) -> str:
    """A split of ``global_batch`` over this run's processes, said as the settings to use."""
    if global_batch % now.processes:
        return f"{global_batch} does not split over {now.processes} processes: launch a divisor of it"
    per_process = global_batch // now.processes
    if per_process % now.accumulation == 0:
        return f"batch_size {per_process // now.accumulation} with gradient_accumulation_steps {now.accumulation}"
    return f"batch_size {per_process} with gradient_accumulation_steps 1"


def _random_states(path: Path, saved_processes: int, processes: int) -> str:
    """What a resume on more processes than wrote the checkpoint does for the new ranks' random state."""
    if processes <= saved_processes:
        return ""
    new = ", ".join(map(str, range(saved_processes, processes)))
    return (f"; rank(s) {new} had no saved random state (the checkpoint has {saved_processes} processes'): "
            "they start from seed + rank, as at a fresh start")
