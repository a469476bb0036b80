"""The NaN guard and the loss window keep each step's loss tensor untouched until the trainer syncs; past
FOLD_EVERY of them they fold on the device, so memory stays flat under a long log_every. Plain logic: in-process."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from trainer.nonfinite import FOLD_EVERY, NonFiniteGuard, NonFiniteLoss
from trainer.tracking import StepWindow

ONE_RANK = SimpleNamespace(device=torch.device("cpu"), gather=lambda tensor: tensor)  # gather of a 1-process job


def test_the_guard_keeps_a_bounded_list_and_still_names_the_first_bad_step():
    guard = NonFiniteGuard(ONE_RANK, "raise")
    for step in range(1, 3 * FOLD_EVERY):
        loss = torch.tensor(float("nan") if step in (2500, 2600) else 1.0)
        guard.observe(loss, step)
        assert len(guard._unchecked) < FOLD_EVERY
    with pytest.raises(NonFiniteLoss, match="at step 2500 on rank 0"):
        guard.check()


def test_the_guard_passes_finite_losses():
    guard = NonFiniteGuard(ONE_RANK, "raise")
    for step in range(1, 2 * FOLD_EVERY):
        guard.observe(torch.tensor(0.5), step)
    guard.check()


def test_the_window_folds_and_its_loss_sum_is_exact():
    window = StepWindow(torch.device("cpu"))
    for i in range(3 * FOLD_EVERY + 5):
        window.add(torch.tensor(float(i % 7)), batch=None, examples=2)
        assert len(window._losses) < FOLD_EVERY
    row = window.row()[0].tolist()
    assert row[0] == sum(i % 7 for i in range(3 * FOLD_EVERY + 5))
    assert row[1:3] == [3 * FOLD_EVERY + 5, 2 * (3 * FOLD_EVERY + 5)]
