"""Watching the loss for NaN / inf without making every step wait for the device.

``nan_policy="raise"``: each rank keeps its losses since the last check, untouched: no device work per step. They
are examined (one isfinite over all of them, then one gather, every rank together, so no rank is left waiting in a
collective) when the trainer logs, before every checkpoint, and at the end: training stops naming the first bad
step and the rank(s), and no state after a non-finite loss is ever checkpointed, so the last checkpoint is good.

``nan_policy="skip"``: at each optimizer step the ranks agree (one all-reduce and a host sync per optimizer step:
the price of choosing skip) whether any of them saw a non-finite loss in the accumulation window; if so every rank
drops that update and the schedule does not advance, and puts back the buffers a forward pass changes (BatchNorm's
running statistics, which a NaN batch has already poisoned; under DDP rank 0's are broadcast to all at the next
forward): the model is as it was before the skipped step. The buffers are copied after every update to allow it.

Either way an evaluation whose loss comes out NaN or inf stops training (the model itself is broken, or the eval
data holds a bad example): never a run that ends "successfully" with ``eval_loss nan``.
"""

from __future__ import annotations

import math

import torch
from accelerate import Accelerator

from trainer.refusal import Refusal


class NonFiniteLoss(Refusal, FloatingPointError):
    """A training loss was NaN or infinite under nan_policy='raise', or an evaluation's loss was."""


NONE = 2**62  # "no bad step yet": larger than any step, so the first bad step is a minimum
FOLD_EVERY = 1024  # losses kept before they are folded into the record on the device (memory stays flat)


class NonFiniteGuard:
    def __init__(self, accelerator: Accelerator, policy: str):
        self.accelerator = accelerator
        self.policy = policy
        device = accelerator.device
        self._unchecked: list[tuple[int, torch.Tensor]] = []  # "raise": (step, loss) since the last check
        self._first_bad_step = torch.full((), NONE, dtype=torch.long, device=device)  # "raise": this rank's
        self._bad_in_window = torch.zeros((), dtype=torch.bool, device=device)  # "skip": since the last update
        self.skipped_steps = 0
        self._buffers: list[torch.Tensor] = []  # "skip": the model's state_dict buffers, and a copy of them as they
        self._kept: list[torch.Tensor] = []  # were after the last update

    def keep_buffers(self, model: torch.nn.Module) -> None:
        """Under "skip": copy ``model``'s buffers (those its state_dict holds) now and after every update, to put
        them back when a step is skipped. Call it before training."""
        if self.policy != "skip":
            return
        self._buffers = [buffer for module in model.modules() for name, buffer in module._buffers.items()
                         if buffer is not None and name not in module._non_persistent_buffers_set]  # fmt: skip
        self._kept = [buffer.detach().clone() for buffer in self._buffers]

    def observe(self, loss: torch.Tensor, step: int) -> torch.Tensor:
        """Note ``loss`` of optimizer step ``step``; return the loss to count in the logs."""
        if self.policy == "raise":
            self._unchecked.append((step, loss))  # examined at the next check()
            if len(self._unchecked) >= FOLD_EVERY:
                self._fold()
            return loss
        finite = torch.isfinite(loss)
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
        with torch.no_grad():
            for buffer, kept in zip(self._buffers, self._kept, strict=True):
                (buffer if bad else kept).copy_(kept if bad else buffer)  # skipped: put back; else: keep a copy
        return bad

    def check_evaluation(self, metrics: dict[str, float], step: int, last_good: str = "") -> None:
        """Stop if an evaluation's loss is NaN or inf (the same reduced figure on every rank: all stop together)."""
        loss = metrics.get("eval_loss", 0.0)
        if math.isfinite(loss):
            return
        raise NonFiniteLoss(
            f"evaluation at step {step} gave eval_loss {loss}: the model's weights or buffers hold NaN or inf, or "
            "eval_data has an example that makes them. "
            + (f"The last good checkpoint is {last_good}." if last_good else "No checkpoint was written.")
        )

    def check(self, last_good: str = "") -> None:
        """Under "raise": stop on every rank if any rank saw a non-finite loss (a collective: call on all ranks)."""
        if self.policy != "raise":
            return
        self._fold()
        first_bad = self.accelerator.gather(self._first_bad_step.view(1)).tolist()
        bad = {rank: step for rank, step in enumerate(first_bad) if step != NONE}
        if bad:
            step = min(bad.values())
            ranks = ", ".join(str(rank) for rank, s in bad.items() if s == step)
            raise NonFiniteLoss(
                f"non-finite loss (NaN or inf) at step {step} on rank {ranks}; nan_policy='raise' stopped training. "
                + (f"The last good checkpoint is {last_good}. " if last_good else "")
                + "Set nan_policy='skip' to drop such steps instead."
            )

    def _fold(self) -> None:
        """Fold the kept losses into this rank's first-bad-step record, on the device (no host sync)."""
        if not self._unchecked:
            return
        steps = torch.tensor([step for step, _ in self._unchecked], device=self._first_bad_step.device)
        finite = torch.isfinite(torch.stack([loss.reshape(()) for _, loss in self._unchecked]))
        self._unchecked.clear()
        first_here = torch.where(finite, NONE, steps).min()
        self._first_bad_step = torch.minimum(self._first_bad_step, first_here)
