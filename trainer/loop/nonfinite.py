"""``nan_policy``: a NaN or inf loss noticed without making any step wait for the device (``raise``: from the
log's one gather; ``skip``: agreed every step, the update and the schedule dropped, the buffers put back)
(docs/internals.md#nan-and-inf-losses).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import torch

from trainer.errors import NonFiniteLoss
from trainer.telemetry.window import NONE

if TYPE_CHECKING:
    from trainer.launch.run import Run


class NonFiniteGuard:
    """``nan_policy`` for one process of ``run`` (its Accelerator's ``gather`` and ``reduce``, on the device)."""

    def __init__(self, run: Run, *, policy: str):
        self.accelerator = accelerator = run.accelerator
        self.policy = policy
        # "skip": since the update.
        self._bad_in_window = torch.zeros((), dtype=torch.bool, device=accelerator.device)
        self.skipped_steps = 0
        # "skip": the model's state_dict buffers, and a copy of them as they.
        self._buffers: list[torch.Tensor] = []
        # Were after the last update.
        self._kept: list[torch.Tensor] = []

    def keep_buffers(self, model: torch.nn.Module) -> None:
        """Under "skip": copy ``model``'s buffers (those its state_dict holds) now and after every update, to put
        them back when a step is skipped. Call it before training."""
        if self.policy != "skip":
            return
        persistent = {id(value) for value in model.state_dict(keep_vars=True).values()}
        self._buffers = [buffer for buffer in model.buffers() if id(buffer) in persistent]
        self._kept = [buffer.detach().clone() for buffer in self._buffers]

    def observe(self, loss: torch.Tensor) -> torch.Tensor:
        """Note one micro-batch's loss; return the loss to count in the logs (under "skip", a non-finite one counts
        0: a skipped step does not poison the mean)."""
        if self.policy == "raise":
            # The log window notes the first bad step.
            return loss
        finite = torch.isfinite(loss)
        self._bad_in_window |= ~finite
        return torch.where(finite, loss, torch.zeros_like(loss))

    def skip_this_step(self) -> bool:
        """Under "skip": whether any rank saw a non-finite loss since the last update (all ranks get the same
        answer). Always False under "raise"."""
        if self.policy != "skip":
            return False
        bad = self.accelerator.reduce(self._bad_in_window.float(), reduction="sum").item() > 0
        self._bad_in_window.zero_()
        self.skipped_steps += bad
        # Skipped: put them back; else: keep a copy. One foreach copy, not one call a buffer.
        if self._buffers:
            with torch.no_grad():
                torch._foreach_copy_(*((self._buffers, self._kept) if bad else (self._kept, self._buffers)))
        return bad

    def check(self, first_bad_step: torch.Tensor, last_good: Optional[Path | str] = None) -> None:
        """Under "raise": stop on every rank if any rank saw a non-finite loss; ``first_bad_step`` is this rank's
        (``LogWindow.first_bad_step``), gathered here: a collective, call it on every rank."""
        if self.policy == "raise":
            self.raise_if_bad(self.accelerator.gather(first_bad_step.view(1)).tolist(), last_good)

    def raise_if_bad(self, first_bad_steps: list[float], last_good: Optional[Path | str] = None) -> None:
        """Stop if any rank's first bad step (every rank's, in rank order: the same list on every rank) is a step."""
        bad = {rank: int(step) for rank, step in enumerate(first_bad_steps) if step < NONE}
        if self.policy != "raise" or not bad:
            return
        step = min(bad.values())
        ranks = ", ".join(str(rank) for rank, s in bad.items() if s == step)
        raise NonFiniteLoss(
            f"non-finite loss (NaN or inf) at step {step} on rank {ranks}; nan_policy='raise' stopped training "
            "(a too-high lr, an inf in the data, or a window whose labels are all -100: no counted token, a mean of "
            "0/0). "
            + (f"The last good checkpoint is {last_good}. " if last_good else "")
            + "Set nan_policy='skip' to drop such steps instead."
        )

    def check_evaluation(self, metrics: dict[str, float], step: int, last_good: Optional[Path | str] = None) -> None:
        """Stop if an evaluation's loss is NaN or inf (the same reduced figure on every rank: all stop together)."""
        bad = [
            (key, value)
            for key, value in metrics.items()
            if key.startswith("eval_") and key.endswith("_loss") and not math.isfinite(value)
        ]
        if not bad:
            return
        raise NonFiniteLoss(
            f"evaluation at step {step} gave {bad[0][0]} {bad[0][1]}: the model's weights or buffers hold NaN or inf, "
            "or eval_data has an example that makes them. "
            + (f"The last good checkpoint is {last_good}." if last_good else "No checkpoint was written.")
        )
