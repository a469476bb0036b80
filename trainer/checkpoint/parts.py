"""The parts of a checkpoint that write files (docs/checkpoints.md): the model and its optimizer (torch DCP's
``shards/``, under every strategy), what accelerate keeps (the schedule, fp16's loss scaler, every rank's random
state) and the callbacks' states. Every method is collective: call it on every rank.

One format: DCP writes each tensor once (a replicated one by one rank, a sharded one by its holders) and reads it
back into any strategy and process count, so a DDP checkpoint resumes under FSDP2 and back through one path, and
``save_async`` writes either in the background. A checkpoint written before (DDP's ``model.safetensors`` and
``optimizer.bin``) is read by ``trainer.checkpoint.legacy``, which alone knows that format.
"""

from __future__ import annotations

import pickle
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch

from trainer.checkpoint import legacy
from trainer.checkpoint.compiled import CompiledGraphs
from trainer.checkpoint.hf_files import save_model_config
from trainer.checkpoint.safe_dcp import SHARDS, read_shards, refused_pickle
from trainer.console import warn

if TYPE_CHECKING:
    from trainer.launch.run import Run


class ModelPart:
    """The ``model`` part: ``model`` (the plain or sharded module, not DDP's wrapper) and ``optimizer`` (the torch
    optimizer itself), in ``shards/``; a transformers model's config beside, for the export."""

    def __init__(self, run: Run, model: torch.nn.Module, optimizer: torch.optim.Optimizer):
        self.model, self.optimizer, self.main = model, optimizer, run.main
        # A compiled model's graphs, kept beside its weights (trainer.checkpoint.compiled).
        self.graphs = CompiledGraphs.for_run(run)
        # Where loaded tensors go (not "cpu:0").
        self.device = "cpu" if run.device.type == "cpu" else str(run.device)
        # On a GPU, save_async's pinned copies, made at the first save, kept for the next (kept_stager).
        self._stager: Any = None
        self._stager_chosen = False

    def save(self, folder: Path, *, in_background: bool = False) -> None:
        """The shards into ``folder/shards`` (unless ``in_background``: ``save_async`` writes them)."""
        if not in_background:
            import torch.distributed.checkpoint as dcp

            dcp.save(self._dcp_state(folder), checkpoint_id=str(folder / SHARDS))
        if self.main:
            save_model_config(self.model, folder)
        if self.graphs is not None:
            self.graphs.save(folder)

    def save_async(self, folder: Path, process_group: Any) -> Future:
        """``save``, returning once the state is copied to CPU memory: the shards are written in the background
        (``trainer.checkpoint.background``), the collectives on ``process_group``."""
        import torch.distributed.checkpoint as dcp

        return dcp.async_save(
            self._dcp_state(folder),
            checkpoint_id=str(folder / SHARDS),
            process_group=process_group,
            async_stager=self._staging(),
        )

    def _staging(self) -> Any:
        """On a GPU, one stager for every background save, as torchtitan keeps one: pinned CPU copies allocated at
        the first save and refilled by the next, copied without blocking (DCP's default allocates fresh pageable
        memory at every save, which the step waits for). On the CPU, DCP's default: pinning gains nothing there."""
        if not self._stager_chosen and self.device != "cpu" and torch.cuda.is_available():
            from torch.distributed.checkpoint.staging import StagingOptions

            options = StagingOptions(
                use_pinned_memory=True, use_shared_memory=False, use_async_staging=False, use_non_blocking_copy=True
            )
            self._stager, self._stager_chosen = kept_stager(options), True
        return self._stager

    def load(self, folder: Path, state: dict[str, Any]) -> None:
        """The weights and optimizer state of checkpoint ``folder``: DCP reads each process's part, whatever the
        strategy and processes that wrote it."""
        from torch.distributed.checkpoint.state_dict import set_state_dict

        if self.graphs is not None:
            self.graphs.load(folder)
        if not (folder / SHARDS).is_dir():
            return legacy.read_before_dcp(self.model, self.optimizer, folder)
        loaded = self._dcp_state()
        read_shards(loaded, folder)
        set_state_dict(
            self.model, self.optimizer, model_state_dict=loaded["model"], optim_state_dict=loaded["optimizer"]
        )

    def load_weights(self, folder: Path) -> None:
        """The weights alone of checkpoint ``folder`` (the best evaluation's, at the end of training)."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

        if not (folder / SHARDS).is_dir():
            return legacy.read_before_dcp(self.model, None, folder)
        loaded = {"model": get_model_state_dict(self.model)}
        read_shards(loaded, folder)
        set_model_state_dict(self.model, loaded["model"])

    def _dcp_state(self, folder: Path | None = None) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        if folder is not None:
            (folder / SHARDS).mkdir(parents=True, exist_ok=True)
        model_state, optimizer_state = get_state_dict(self.model, self.optimizer)
        return {"model": model_state, "optimizer": optimizer_state}


class AccelerateState:
    """The ``accelerate`` part: the schedule, fp16's loss scaler and every rank's random states, written and read by
    accelerate's own ``save_accelerator_state`` / ``load_accelerator_state`` (what ``Accelerator.save_state`` writes,
    less the model and optimizer, which are the ``model`` part's)."""

    def __init__(self, run: Run, scheduler: Any):
        self.accelerator, self.scheduler = run.accelerator, scheduler

    def save(self, folder: Path, *, in_background: bool = False) -> None:
        from accelerate.checkpointing import save_accelerator_state

        acc = self.accelerator
        save_accelerator_state(
            str(folder), [], [], [self.scheduler], [], acc.process_index, 0, scaler=acc.scaler, safe_serialization=True
        )

    def load(self, folder: Path, state: dict[str, Any]) -> None:
        from accelerate.checkpointing import load_accelerator_state
        from accelerate.utils import load

        acc = self.accelerator
        # accelerate skips random states it cannot load with no word; a missing file is a rank the checkpoint had not.
        randoms = folder / f"random_states_{acc.process_index}.pkl"
        try:
            if randoms.is_file():
                load(randoms, map_location="cpu")
        except Exception as err:
            warn(
                f"{randoms} cannot be loaded safely ({type(err).__name__}; nothing in it was run): this process goes "
                "on with fresh random states, so dropout and sampling differ from an uninterrupted run"
            )
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
    """The ``callbacks`` part: every callback with ``state_dict`` (``named(callbacks)``), each rank's in a file of its
    own (their state may hold tensors: ``torch.load(weights_only=True)`` reads it back). A rank the checkpoint had
    not gets the first rank's."""

    def __init__(self, run: Run, callbacks: list, *, named: Callable[[list], dict[str, Any]]):
        self.callbacks, self.rank, self.named = callbacks, run.rank, named
        # Where loaded tensors go (not "cpu:0").
        self.device = "cpu" if run.device.type == "cpu" else run.device

    def save(self, folder: Path, *, in_background: bool = False) -> None:
        states = {name: callback.state_dict() for name, callback in self.named(self.callbacks).items()}
        if states:
            torch.save(states, folder / f"callback_states_{self.rank}.pt")

    def load(self, folder: Path, state: dict[str, Any]) -> None:
        file = folder / f"callback_states_{self.rank}.pt"
        file = file if file.is_file() else folder / "callback_states_0.pt"
        if not file.is_file():
            return
        try:
            saved = torch.load(file, map_location=self.device, weights_only=True)
        # Named: each rank reads a file of its own.
        except pickle.UnpicklingError as err:
            raise pickle.UnpicklingError(f"{file.name}: {refused_pickle(err)}") from None
        for name, callback in self.named(self.callbacks).items():
            if name in saved:
                callback.load_state_dict(saved[name])


def kept_stager(options: Any) -> Any:
    """A DCP ``DefaultStager`` to keep for every background save, or None (DCP's default, a new one each save) where
    a stager does not survive its first save: torch 2.11's closes itself at the end of each (its copies and type
    table emptied: the next save fails with ``KeyError``). Tried on a tiny state first, as that fault shows at once.
    One save is in flight at a time (``BackgroundSaves``), so refilling the kept copies never races a write."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    probe, tiny = DefaultStager(StagingOptions(False, False, False, False)), {"t": torch.zeros(1), "kind": int}
    try:
        probe.stage(tiny)
        probe.stage(tiny)
    except Exception:
        return None
    finally:
        probe.close()
    return DefaultStager(options)
