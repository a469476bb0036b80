"""Watching the loss for NaN / inf without making every step wait for the device.

``nan_policy="raise"``: each rank records, on the device, the first step whose loss was not finite. The record is
read (one gather, every rank together, so no rank is left waiting in a collective) when the trainer logs, before
every checkpoint, and at the end: training stops naming the step and the rank(s), and no state after a non-finite
loss is ever checkpointed, so the last checkpoint is good.

``nan_policy="skip"``: at each optimizer step the ranks agree (one all-reduce and a host sync per optimizer step:
the price of choosing skip) whether any of them saw a non-finite loss in the accumulation window; if so every rank
drops that update and the schedule does not advance.
"""

from __future__ import annotations

import torch
from accelerate import Accelerator


class NonFiniteLoss(FloatingPointError):
    """A loss was NaN or infinite under nan_policy='raise'."""


class NonFiniteGuard:
    def __init__(self, accelerator: Accelerator, policy: str):
        self.accelerator = accelerator
        self.policy = policy
        device = accelerator.device
        self._first_bad_step = torch.full((), -1, dtype=torch.long, device=device)  # "raise": per rank
        self._bad_in_window = torch.zeros((), dtype=torch.bool, device=device)  # "skip": since the last update
        self.skipped_steps = 0

    def observe(self, loss: torch.Tensor, step: int) -> torch.Tensor:
        """Note whether ``loss`` (of optimizer step ``step``) is finite; return the loss to count in the logs."""
        finite = torch.isfinite(loss)
        if self.policy == "raise":
            seen = finite | (self._first_bad_step >= 0)
            self._first_bad_step = torch.where(seen, self._first_bad_step, step)
            return loss
        self._bad_in_window |= ~finite
        return torch.where(finite, loss, torch.zeros_like(loss))  # a skipped step does not poison the mean

    def skip_this_step(self) -> bool:
        """Under "skip": whether any rank saw a non-finite loss since the last update (all ranks get the same
        answer). Always False under "raise"."""
        if self.policy != "skip":
            return False
        bad = self.accelerator.reduce(self._bad_in_window.float(), reduction="sum").item() > 0
        self._bad_in_window.zero_()
        self.skipped_steps += bad
        return bad

    def check(self, last_good: str = "") -> None:
        """Under "raise": stop on every rank if any rank saw a non-finite loss (a collective: call on all ranks)."""
        if self.policy != "raise":
            return
        first_bad = self.accelerator.gather(self._first_bad_step.view(1)).tolist()
        bad = {rank: step for rank, step in enumerate(first_bad) if step >= 0}
        if bad:
            step = min(bad.values())
            ranks = ", ".join(str(rank) for rank, s in bad.items() if s == step)
            raise NonFiniteLoss(
                f"non-finite loss (NaN or inf) at step {step} on rank {ranks}; nan_policy='raise' stopped training. "
                + (f"The last good checkpoint is {last_good}. " if last_good else "")
                + "Set nan_policy='skip' to drop such steps instead."
            )
