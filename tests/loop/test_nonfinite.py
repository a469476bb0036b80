"""The log window keeps each step's loss tensor untouched until the trainer syncs, and notes the first non-finite one
for the NaN guard; past FOLD_EVERY of them they fold on the device, so memory stays flat under a long log_every.
Plain logic: in-process."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from trainer.loop.nonfinite import NonFiniteGuard, NonFiniteLoss
from trainer.telemetry.window import FOLD_EVERY, WINDOW_FIELDS, LogWindow

FIRST_BAD = WINDOW_FIELDS.index("first_bad")

# The run of a 1-process job: its Accelerator's gather returns this rank's row.
ONE_RANK = SimpleNamespace(accelerator=SimpleNamespace(device=torch.device("cpu"), gather=lambda tensor: tensor))


def test_the_guard_keeps_a_bounded_list_and_still_names_the_first_bad_step():
    guard, window = NonFiniteGuard(ONE_RANK, policy="raise"), LogWindow(torch.device("cpu"))
    for step in range(1, 3 * FOLD_EVERY):
        loss = torch.tensor(float("nan") if step in (2500, 2600) else 1.0)
        window.add(guard.observe(loss), step, batch=None, examples=1)
        assert len(window._losses) < FOLD_EVERY
    with pytest.raises(NonFiniteLoss, match="at step 2500 on rank 0"):
        guard.check(window.first_bad_step())


def test_the_guard_passes_finite_losses():
    guard, window = NonFiniteGuard(ONE_RANK, policy="raise"), LogWindow(torch.device("cpu"))
    for step in range(1, 2 * FOLD_EVERY):
        window.add(guard.observe(torch.tensor(0.5)), step, batch=None, examples=1)
    guard.check(window.first_bad_step())


def test_the_window_folds_and_its_loss_sum_is_exact():
    window = LogWindow(torch.device("cpu"))
    for i in range(3 * FOLD_EVERY + 5):
        window.add(torch.tensor(float(i % 7)), i, batch=None, examples=2)
        assert len(window._losses) < FOLD_EVERY
    row = window.row()[0].tolist()
    assert row[0] == sum(i % 7 for i in range(3 * FOLD_EVERY + 5))
    assert row[1:3] == [3 * FOLD_EVERY + 5, 2 * (3 * FOLD_EVERY + 5)]


def test_the_first_non_finite_step_rides_the_logs_row_and_names_every_rank_that_saw_it():
    """The one gather of a log carries each rank's first bad step: the guard reads it from there, no gather of its
    own. Rank 1 saw NaN at step 7, rank 0 at step 9: step 7, rank 1."""
    guard = NonFiniteGuard(ONE_RANK, policy="raise")
    rows = []
    for bad_step in (9, 7):
        window = LogWindow(torch.device("cpu"))
        for step in range(1, 12):
            window.add(torch.tensor(float("inf") if step == bad_step else 1.0), step, batch=None, examples=1)
        rows.append(window.row()[0].tolist())
    with pytest.raises(NonFiniteLoss, match="at step 7 on rank 1"):
        guard.raise_if_bad([row[FIRST_BAD] for row in rows])
    clean = LogWindow(torch.device("cpu")).row()[0].tolist()[FIRST_BAD]
    guard.raise_if_bad([clean, clean])  # no rank saw one: nothing to stop
