"""An exponential moving average (EMA) of the trainable weights (``ema_decay``), as Lightning's ``WeightAveraging``,
timm's ``ModelEmaV3`` and diffusers' ``EMAModel`` keep one (docs/project.md).

Each trainable parameter gets an average of the same kind (a shard under FSDP2: each process updates its own part,
with no collective); after each optimizer step taken, one fused ``average += (1 - ema_decay) * (weights - average)``
over this process's pieces; until ``ema_start_step`` the average follows the weights. In a checkpoint it is the
``ema`` part, ``ema/shards`` (DCP), so it loads into any strategy and process count as the weights do.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Optional

import torch

from trainer.checkpoint.safe_dcp import SHARDS, read_shards
from trainer.console import say
from trainer.errors import CheckpointError
from trainer.parallel.gradients import local

if TYPE_CHECKING:
    from trainer.launch.run import Run
    from trainer.parallel.strategy import Strategy

# The folder of a checkpoint that holds the average.
EMA = "ema"


class WeightAverage:
    """The average of ``model``'s trainable parameters (the plain or sharded module, not DDP's wrapper);
    ``let_go(model)`` before its weights change under a forward's gathered copies (``Strategy.reshard``)."""

    def __init__(self, model: torch.nn.Module, *, decay: float, start_step: int = 0, let_go: Any = None):
        self.decay, self.start_step = decay, start_step
        self.model, self.let_go = model, let_go
        trainable = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
        # The model's own names, as its state dict has them.
        self.names = [name.replace("_checkpoint_wrapped_module.", "") for name, _ in trainable]
        self.weights = [p for _, p in trainable]
        with torch.no_grad():
            self.average = [p.detach().clone() for p in self.weights]

    @classmethod
    def for_run(cls, run: Run, strategy: Strategy, model: torch.nn.Module) -> Optional["WeightAverage"]:
        """The average ``ema_decay`` asks for, or None."""
        config = run.config
        if config.ema_decay is None:
            return None
        return cls(model, decay=config.ema_decay, start_step=config.ema_start_step, let_go=strategy.reshard)

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
                # One tensor's worth of extra memory at a time.
                held = piece.clone()
                piece.copy_(average)
                average.copy_(held)

    def _let_go_of_gathered_weights(self) -> None:
        if self.let_go is not None:
            self.let_go(self.model)

    # ---------------------------------------------------------------- the checkpoint's ``ema`` part (collective)

    def save(self, folder: Path, *, in_background: bool = False) -> None:
        import torch.distributed.checkpoint as dcp

        (folder / EMA / SHARDS).mkdir(parents=True, exist_ok=True)
        dcp.save({EMA: self._by_name()}, checkpoint_id=str(folder / EMA / SHARDS))

    def load(self, folder: Path, state: dict[str, Any]) -> None:
        if not (folder / EMA).exists():
            self.restart(folder)
            return
        if not (folder / EMA / SHARDS / ".metadata").is_file():
            # Part of an average is no average: said, rather than started again from the weights without a word.
            raise CheckpointError(
                f"checkpoint {folder}: {EMA}/ holds no whole average of the weights (no {EMA}/{SHARDS}/.metadata). "
                f"Resume from another checkpoint (resume=<path>), or delete its {EMA}/ folder to start the average "
                "from its weights"
            )
        # In place, this process's part.
        read_shards({EMA: self._by_name()}, folder / EMA)

    def _by_name(self) -> dict[str, torch.Tensor]:
        return dict(zip(self.names, self.average, strict=True))

    def restart(self, folder: Path) -> None:
        """A checkpoint written without an average: the average starts from the weights it held."""
        with torch.no_grad():
            torch._foreach_copy_(_pieces(self.average), _pieces(self.weights))
        say(f"ema_decay: checkpoint {folder.name} holds no average of the weights: the average starts from its weights")


def _pieces(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """This process's part of each tensor (a view of its storage)."""
    return [local(t) for t in tensors]
