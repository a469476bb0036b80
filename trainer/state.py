"""Where training stands, as one object: the optimizer steps taken, the epoch being read and the micro-batches read
of it, and the run's id. A checkpoint holds it (its ``state_dict``, as JSON) and a resume puts it back; the loop
moves it on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional


@dataclass
class TrainState:
    """The training position. ``batches_per_epoch`` (this process's micro-batches in an epoch; None for a stream,
    whose length is unknown) and ``accumulation`` describe the run; the rest is state."""

    batches_per_epoch: Optional[int]
    accumulation: int
    # Optimizer steps taken.
    step: int = 0
    # The epoch being read.
    epoch: int = 0
    # Micro-batches read of it.
    batches_into_epoch: int = 0
    # Names every rank's wandb run (<run_id>-rank<k>): a resume continues them.
    run_id: str = ""
    # The evaluation due at this step was put off by a preemption (its checkpoint first): the resumed run's to run.
    evaluation_owed: bool = False

    @property
    def steps_per_epoch(self) -> Optional[int]:
        if not self.batches_per_epoch:
            return None
        # The last window of an epoch may be short.
        return -(-self.batches_per_epoch // self.accumulation)

    @property
    def epoch_progress(self) -> float:
        """Epochs done, as a fraction (the epoch index when the data has no length)."""
        return self.step / self.steps_per_epoch if self.steps_per_epoch else float(self.epoch)

    def stepped(self, micro_batches: int) -> None:
        """One optimizer step taken over ``micro_batches`` micro-batches."""
        self.step += 1
        self.batches_into_epoch += micro_batches
        self.evaluation_owed = False

    def continue_at(self, batches: int) -> None:
        """A resume reads on from micro-batch ``batches`` of the epoch (this run's split of the checkpoint's)."""
        self.batches_into_epoch = batches

    def next_epoch(self) -> None:
        self.epoch, self.batches_into_epoch = self.epoch + 1, 0

    def state_dict(self) -> dict[str, Any]:
        """The position a resume continues from: the next step's (a finished epoch's end is the next one's start)."""
        epoch, batches = self.epoch, self.batches_into_epoch
        if self.batches_per_epoch and batches >= self.batches_per_epoch:
            epoch, batches = epoch + 1, 0
        position = {"global_step": self.step, "epoch": epoch, "batches_into_epoch": batches, "run_id": self.run_id}
        return {**position, "evaluation_owed": self.evaluation_owed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step, self.epoch = state["global_step"], state["epoch"]
        self.batches_into_epoch = state["batches_into_epoch"]
        self.run_id = state.get("run_id") or self.run_id
        self.evaluation_owed = state.get("evaluation_owed") is True
