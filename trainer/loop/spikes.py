"""``spike_policy: rollback``: a step whose loss is over ``spike_threshold`` times its recent level (the mean of the
last 10 steps') is not taken. Every rank reads the same loss (one all-reduce of two numbers a step), goes back to the
last checkpoint in the same process, and reads on after the spike: the batches of the steps since that checkpoint
are skipped, the spike's with them, as PaLM skipped the batches around its spikes. ``spike_lr_factor`` lowers the lr
from then on. Each rollback is recorded in the checkpoints after it, and the data position with it, so that a
resume goes on as the uninterrupted run does (docs/recipes.md#loss-spikes-rolled-back).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch

from trainer.console import say
from trainer.errors import LossSpike

if TYPE_CHECKING:
    from trainer.checkpoint.manager import Checkpointer
    from trainer.launch.run import Run
    from trainer.state import TrainState

# The steps whose mean loss is the recent level.
RECENT = 10
# Rollbacks to one checkpoint before the run stops: the spikes come from the weights, not from some batches.
MOST_ROLLBACKS = 3


class SpikeGuard:
    """Watches each step's loss on every rank of ``run``; a part of every checkpoint (its recent losses, its
    rollbacks, the lr's scale)."""

    def __init__(self, run: Run, *, optimizer: torch.optim.Optimizer, scheduler: Any):
        self.accelerator, config = run.accelerator, run.config
        self.threshold, self.lr_factor = config.spike_threshold, config.spike_lr_factor
        self.optimizer, self.scheduler = optimizer, getattr(scheduler, "scheduler", scheduler)
        # This step's sum of the logged losses and of their weights (as the log window weighs them), on the device.
        self._sums = torch.zeros(2, dtype=torch.float64, device=run.device)
        self.recent: list[float] = []
        # Each rollback: the spike's step and loss, the recent level, the checkpoint's step, the steps skipped.
        self.rollbacks: list[dict[str, Any]] = []
        self.spike: Optional[dict[str, Any]] = None

    @classmethod
    def for_run(cls, run: Run, **parts: Any) -> Optional["SpikeGuard"]:
        return cls(run, **parts) if run.config.spike_policy == "rollback" else None

    def observe(self, loss: torch.Tensor, weight: Any) -> None:
        """One micro-batch's logged loss and its weight (``Weighing.loss``)."""
        self._sums[0] += loss.detach().double().reshape(())
        self._sums[1] += weight.detach().double().reshape(()) if torch.is_tensor(weight) else float(weight)

    def spiked(self, step: int) -> bool:
        """Whether step ``step``'s loss (every rank's micro-batches, weighed as the log does) is a spike: the same
        answer on every rank. A NaN or inf is nan_policy's, not a spike."""
        total, weight = self.accelerator.reduce(self._sums.clone(), reduction="sum").tolist()
        self._sums.zero_()
        loss = total / weight if weight else math.nan
        level = sum(self.recent) / len(self.recent) if self.recent else math.nan
        self.spike = None
        if math.isfinite(loss) and level > 0 and loss > self.threshold * level:
            self.spike = {"step": step, "loss": loss, "recent": level}
            return True
        if math.isfinite(loss):
            self.recent = [*self.recent, loss][-RECENT:]
        return False

    def roll_back(self, checkpoints: Checkpointer, state: TrainState, *, forget: Callable[[], None], bar: Any) -> None:
        """After the spike: every part back from the last checkpoint but the data's position, which goes on past the
        spike's batches; the log's unlogged steps ``forget``-ten, the progress ``bar`` moved back; said in a line.
        Raises ``LossSpike`` when there is no checkpoint to go back to, or spikes keep coming after one."""
        spike, rollbacks = self.spike, self.rollbacks
        checkpoints.wait()
        path, step = checkpoints.last, spike["step"]
        said = (
            f"loss {spike['loss']:.4g} at step {step}, over {self.threshold:g} x its recent level {spike['recent']:.4g}"
        )
        if path is None:
            raise LossSpike(f"{said}, before any checkpoint to roll back to (spike_policy: rollback): lower save_every")
        position = state.epoch, state.batches_into_epoch
        checkpoints.roll_back(path)
        back_to = state.step
        if sum(record["back_to"] == back_to for record in rollbacks) >= MOST_ROLLBACKS:
            raise LossSpike(
                f"{said}: the {MOST_ROLLBACKS + 1}th spike since step {back_to}'s checkpoint, {path}. The weights "
                "spike whatever the batches: lower the lr or raise spike_threshold, and resume from it"
            )
        state.epoch, state.batches_into_epoch = position
        forget()
        bar.n = back_to
        # The checkpoint's lr holds the rollbacks it records; this one and any since it lower it further.
        since = len(rollbacks) + 1 - len(self.rollbacks)
        self.rollbacks = [*rollbacks, {**spike, "back_to": back_to, "skipped": [back_to + 1, step]}]
        lowered = ""
        if self.lr_factor:
            self.lower_lr(self.lr_factor**since)
            lowered = f"; the lr is {self.lr_scale:g} x the schedule's from now on"
        skipped = f"the batches of steps {back_to + 1}-{step} skipped"
        say(f"{said}: rolled back to step {back_to} ({path}), {skipped}{lowered}")

    @property
    def lr_scale(self) -> float:
        """The lr's scale after the rollbacks so far (``spike_lr_factor`` once for each)."""
        return self.lr_factor ** len(self.rollbacks) if self.lr_factor else 1.0

    def lower_lr(self, scale: float) -> None:
        """The optimizer's lr and the schedule's base lrs times ``scale``."""
        for group in self.optimizer.param_groups:
            group["lr"] = group["lr"] * scale
            if "initial_lr" in group:
                group["initial_lr"] = group["initial_lr"] * scale
        if hasattr(self.scheduler, "base_lrs"):
            self.scheduler.base_lrs = [lr * scale for lr in self.scheduler.base_lrs]

    def state_dict(self) -> dict[str, Any]:
        return {"recent": self.recent, "rollbacks": self.rollbacks}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.recent, self.rollbacks = list(state["recent"]), list(state["rollbacks"])
