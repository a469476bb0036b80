"""Every rank's log window, gathered once, as each rank's figures and the job's (trainer/telemetry/window.py's
summarize), in-process; tests/telemetry/test_tracking.py reads the same figures back from a real 2-process job's wandb
runs."""

from __future__ import annotations

import pytest

from trainer.telemetry.window import WINDOW_FIELDS, summarize


def row(**values: float) -> list[float]:
    window = {"steps": 4, "seconds": 2.0, "micro_batches": 4, "loss_weight": 4, "first_bad": 2.0**62, **values}
    return [float(window.get(field, 0.0)) for field in WINDOW_FIELDS]


def test_the_global_loss_weighs_every_ranks_counted_items_and_the_slowest_rank_is_named():
    rows = [
        row(loss_sum=8.0, loss_weight=4, examples=32, tokens=320, data_wait=0.1, forward=0.4),
        row(loss_sum=36.0, loss_weight=12, examples=32, tokens=960, data_wait=0.9, forward=0.5, seconds=2.5),
    ]
    own, job = summarize(rows, rank=1)
    assert job["global/train_loss"] == 44.0 / 16, "every counted token alike, not the mean of the ranks' means"
    assert own["rank/loss"] == 3.0 and own["rank/data_wait_s"] == pytest.approx(0.9 / 4)
    assert job["global/examples_per_s"] == 64 / 2.5 and job["global/tokens_per_s"] == 1280 / 2.5
    assert job["global/slowest_rank"] == 1, "its data wait and forward pass are what the other rank waited for"
    assert job["global/step_time_max_s"] == 2.5 / 4 and job["global/data_wait_min_s"] == pytest.approx(0.1 / 4)


def test_a_window_without_tokens_has_no_token_figures():
    own, job = summarize([row(loss_sum=1.0, examples=8)], rank=0)
    assert "global/tokens_per_s" not in job and "rank/tokens_per_s" not in own
