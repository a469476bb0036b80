"""An exponential moving average (EMA) of the trainable weights (``ema_decay``), as Lightning's
``WeightAveraging``, timm's ``ModelEmaV3`` and diffusers' ``EMAModel`` keep one.

Each trainable parameter gets an average of the same kind: under FSDP2 (and tensor parallelism) a DTensor sharded
like the parameter, so each process keeps and updates only its own part of the average, with no collective. After
each optimizer step taken (not one that ``nan_policy: skip`` or fp16's loss scaler skipped), one fused update over
this process's pieces, ``average += (1 - ema_decay) * (weights - average)``; up to step ``ema_start_step`` the
average follows the weights instead, so that it does not average in the random start. The average is kept in the
weights' dtype (FSDP2's weights are fp32 masters); buffers (a BatchNorm's statistics) are the model's own.

In a checkpoint the average is the ``ema`` part, ``ema/shards`` (torch.distributed.checkpoint), whatever the run's
format, so it loads into a run of either format and process count as the weights do. ``ema_eval``: evaluations
swap it into the model and back (exact copies). ``ema_final``: at the end of ``fit()`` it is copied into the model,
so that ``final/`` holds it (with ``keep_best``, the best checkpoint's average).
"""

from __future__ import annotations

import contextlib
import warnings
from pathlib import Path
from typing import Any, Iterator, Optional

import torch

from trainer.checkpoint.model_part import SHARDS, read_shards
from trainer.telemetry.console import say

EMA = "ema"  # the folder of a checkpoint that holds the average


class WeightAverage:
    """The average of ``model``'s trainable parameters (the plain or sharded module, not DDP's wrapper)."""

    def __init__(self, model: torch.nn.Module, decay: float, start_step: int = 0):
        self.decay, self.start_step = decay, start_step
        trainable = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
        self.names = [name.replace("_checkpoint_wrapped_module.", "") for name, _ in trainable]  # the model's own
        self.weights = [p for _, p in trainable]
        with torch.no_grad():
            self.average = [p.detach().clone() for p in self.weights]
        # FSDP2 keeps the root group's gathered weights after a forward (backward would gather them again at once):
        # they must be let go when the shards under them change, or the next forward computes with the old ones.
        self._sharded: list = []
        if any(hasattr(p, "to_local") for p in self.weights):  # DTensors: a sharded model (no import otherwise)
            from torch.distributed.fsdp import FSDPModule

            self._sharded = [m for m in model.modules() if isinstance(m, FSDPModule)]

    @classmethod
    def for_config(cls, config: Any, model: torch.nn.Module) -> Optional["WeightAverage"]:
        return None if config.ema_decay is None else cls(model, config.ema_decay, config.ema_start_step)

    def update(self, step: int) -> None:
        """After optimizer step ``step`` was taken."""
        with torch.no_grad():
            if step <= self.start_step:
                torch._foreach_copy_(_pieces(self.average), _pieces(self.weights))
            else:
                torch._foreach_lerp_(_pieces(self.average), _pieces(self.weights), 1.0 - self.decay)

    @contextlib.contextmanager
    def swapped_in(self) -> Iterator[None]:
        """The model holds the average inside the context, its own weights again after it (bit for bit)."""
        self._swap()
        try:
            yield
        finally:
            self._swap()

    def copy_to_model(self) -> None:
        self._let_go_of_gathered_weights()
        with torch.no_grad():
            torch._foreach_copy_(_pieces(self.weights), _pieces(self.average))

    def _swap(self) -> None:
        self._let_go_of_gathered_weights()
        with torch.no_grad():
            for piece, average in zip(_pieces(self.weights), _pieces(self.average), strict=True):
                held = piece.clone()  # one tensor's worth of extra memory at a time
                piece.copy_(average)
                average.copy_(held)

    def _let_go_of_gathered_weights(self) -> None:
        for module in self._sharded:  # FSDPModule.reshard(): back to this process's shards, which are swapped
            module.reshard()

    # ---------------------------------------------------------------- the checkpoint's ``ema`` part (collective)

    def save(self, folder: Path, in_background: bool = False) -> None:
        import torch.distributed.checkpoint as dcp

        (folder / EMA / SHARDS).mkdir(parents=True, exist_ok=True)
        with _single_process_quietly():
            dcp.save({EMA: self._by_name()}, checkpoint_id=str(folder / EMA / SHARDS))

    def load(self, folder: Path, state: dict[str, Any]) -> None:
        if not (folder / EMA / SHARDS / ".metadata").is_file():
            self.restart(folder)
            return
        with _single_process_quietly():
            read_shards({EMA: self._by_name()}, folder / EMA)  # in place, this process's part

    def _by_name(self) -> dict[str, torch.Tensor]:
        return dict(zip(self.names, self.average, strict=True))

    def restart(self, folder: Path) -> None:
        """A checkpoint written without an average: the average starts from the weights it held."""
        with torch.no_grad():
            torch._foreach_copy_(_pieces(self.average), _pieces(self.weights))
        say(f"ema_decay: checkpoint {folder.name} holds no average of the weights: the average starts from its weights")


def _pieces(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """This process's part of each tensor: a DTensor's local shard (a view of its storage), a plain tensor itself."""
    return [t.to_local() if hasattr(t, "to_local") else t for t in tensors]


@contextlib.contextmanager
def _single_process_quietly() -> Iterator[None]:
    with warnings.catch_warnings():  # one process, no process group: DCP says it assumes so, and it is so
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        warnings.filterwarnings("ignore", message=".*assuming the intent is to.*")
        yield
