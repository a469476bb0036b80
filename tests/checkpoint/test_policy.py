"""What a resume may do (trainer/checkpoint/policy.py), in-process: plain rules over a checkpoint's recorded run and
this run's settings. The same rules run through 2 real processes in tests/checkpoint/test_resume_changes.py and
tests/parallel/test_fsdp.py; these tests say each rule on its own, in milliseconds."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from trainer import CheckpointError, TrainConfig
from trainer.checkpoint.policy import (
    Split,
    apply_settings,
    changed_settings,
    group_settings,
    random_states,
    refusal,
    resumed_position,
    said,
)
from trainer.checkpoint.store import resume_point
from trainer.optim.build import build_scheduler

PATH = Path("runs/x/checkpoints/step-00000009")


def run_of(processes: int, batch_size: int, accumulation: int) -> dict:
    return {"world_size": processes, "batch_size": batch_size, "gradient_accumulation_steps": accumulation}


def test_the_same_global_batch_on_another_split_continues_at_the_same_example():
    assert resumed_position(run_of(2, 4, 1), 6, Split(2, 4, 1), path=PATH, streaming=False) == (6, "")
    # 2 x 2 x accumulation 2, 8 micro-batches in (4 steps): 1 x 2 x 4 reads on from micro-batch 16 (4 steps of 4)
    batches, words = resumed_position(run_of(2, 2, 2), 8, Split(1, 2, 4), path=PATH, streaming=False)
    assert batches == 16
    assert words == (
        "; split 2 process(es) x batch 2 x accumulation 2 = 8 global -> 1 process(es) x batch 2 x "
        "accumulation 4 = 8 global: the same global batch, the same examples"
    )


@pytest.mark.parametrize(
    "now, keep",
    [
        (Split(2, 4, 1), "keep 4 global (batch_size 2 with gradient_accumulation_steps 1)"),
        (Split(3, 1, 1), "keep 4 global (4 does not split over 3 processes: launch a divisor of it)"),
        (Split(2, 1, 4), "keep 4 global (batch_size 2 with gradient_accumulation_steps 1)"),
        (Split(1, 3, 2), "keep 4 global (batch_size 2 with gradient_accumulation_steps 2)"),
    ],
)
def test_another_global_batch_is_refused_naming_both_and_a_split_that_keeps_it(now, keep):
    with pytest.raises(CheckpointError, match="was written with 1 process") as refused:
        resumed_position(run_of(1, 4, 1), 3, now, path=PATH, streaming=False)
    assert keep in str(refused.value)


def test_a_streams_split_cannot_change():
    with pytest.raises(CheckpointError, match="a stream's position is kept per process"):
        resumed_position(run_of(2, 2, 2), 8, Split(1, 2, 4), path=PATH, streaming=True)


BASE = TrainConfig(
    optimizer="adamw", lr=1e-2, weight_decay=0.01, lr_scheduler="cosine", warmup_steps=2, max_steps=10
).to_dict()


def refused(mid_epoch: bool = True, saved_class: str = "AdamW", now_class: str = "AdamW", **changes):
    found = refusal(
        BASE,
        {**BASE, **changes},
        PATH,
        mid_epoch=mid_epoch,
        built_optimizer=True,
        saved_class=saved_class,
        optimizer_class=now_class,
    )
    return str(found) if found is not None else None


def test_what_the_saved_state_cannot_go_on_under_is_refused_by_name():
    assert "written with optimizer adamw, and this run has sgd" in refused(optimizer="sgd")
    assert "its optimizer was AdamW, and this run's is RMSprop" in refused(now_class="RMSprop")
    assert "weight_decay 0.01 -> 0.0 changes the optimizer's parameter groups" in refused(weight_decay=0.0)
    assert refused(weight_decay=0.02) is None, "the same groups: applied, not refused"
    assert "seed 0 -> 1 changes the order of examples in the epoch it stopped in" in refused(seed=1)
    assert refused(seed=1, mid_epoch=False) is None, "at an epoch's end any order goes"
    assert refused(seed=1, shuffle=False) is not None, "shuffle changed too: the order changes"
    assert (
        refusal(
            {**BASE, "shuffle": False},
            {**BASE, "shuffle": False, "seed": 1},
            PATH,
            mid_epoch=True,
            built_optimizer=True,
            saved_class="AdamW",
            optimizer_class="AdamW",
        )
        is None
    ), "an epoch read in order does not depend on the seed"
    # A mixture of training sets draws its epoch from data_weights: changed mid-epoch, a half-read epoch reorders.
    mixed = {**BASE, "data_weights": {"a": [[0, 0.5], [6, 0.75]], "b": [[0, 0.5], [6, 0.25]]}}
    changed = refusal(
        mixed,
        {**mixed, "data_weights": {"a": 0.9, "b": 0.1}},
        PATH,
        mid_epoch=True,
        built_optimizer=True,
        saved_class="AdamW",
        optimizer_class="AdamW",
    )
    assert "changes the order of examples in the epoch it stopped in" in str(changed)
    # As a checkpoint's JSON holds them (tuples as lists): the same weights, not a change.
    as_json = {**mixed, "data_weights": {"a": [(0, 0.5), (6, 0.75)], "b": [(0, 0.5), (6, 0.25)]}}
    assert (
        refusal(
            mixed, as_json, PATH, mid_epoch=True, built_optimizer=True, saved_class="AdamW", optimizer_class="AdamW"
        )
        is None
    )


def test_what_changed_is_said_in_one_line_with_the_next_lr():
    changes = changed_settings(BASE, {**BASE, "lr": 1e-4, "output_dir": "elsewhere", "batch_size": 99})
    assert changes == {"lr": (0.01, 0.0001)}, "where the run writes and how it splits are not compared"
    assert said(changes, 9, (3.8e-4, 3.8e-6)) == (
        "changed since the checkpoint, applied from step 10: lr 0.01 -> "
        "0.0001, so the next step's lr is 3.8e-06, not 0.00038"
    )
    assert said({}, 9, (0.1, 0.1)) == ""


def test_a_changed_schedule_is_recomputed_at_the_step_reached_from_this_runs_settings():
    """A checkpoint of a constant lr 0.01 (a schedule never stepped) at step 9, resumed with lr 1e-4 and a cosine
    schedule: the next step's lr is the one a fresh run of this run's settings has there."""
    config = TrainConfig(lr=1e-4, lr_scheduler="cosine", warmup_steps=2, max_steps=20)

    def sgd():
        return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=config.lr)

    fresh = sgd()
    fresh_schedule = build_scheduler(fresh, config, 20)
    for _ in range(9):
        fresh.step()
        fresh_schedule.step()
    optimizer = sgd()
    scheduler = build_scheduler(optimizer, config, 20)
    own = group_settings(optimizer)  # this run's, before the checkpoint's replace them
    optimizer.param_groups[0].update(lr=0.01, initial_lr=0.01)  # what loading the checkpoint put there
    before, after = apply_settings(optimizer, scheduler, own, step=9, moved=(False, True), built_scheduler=True)
    assert before == 0.01 and after == pytest.approx(fresh.param_groups[0]["lr"], rel=1e-12)
    assert scheduler.last_epoch == 9 and scheduler.get_last_lr() == [after]
    user = sgd()  # a user's own scheduler keeps its saved state: only the optimizer's settings are this run's
    own = group_settings(user)
    user.param_groups[0].update(lr=0.01, momentum=0.5)
    assert apply_settings(user, None, own, step=9, moved=(True, True), built_scheduler=False) == (0.01, 0.01)
    assert user.param_groups[0]["momentum"] == 0
    # Constant before and after: never stepped, its state stays as an uninterrupted run's (the resume proof compares
    # it byte for byte), at the step reached it was last_epoch 9 and differed.
    constant = sgd()
    kept = build_scheduler(constant, TrainConfig(lr=1e-4), 20)
    apply_settings(constant, kept, group_settings(constant), step=9, moved=(False, False), built_scheduler=True)
    assert kept.last_epoch == 0 and constant.param_groups[0]["lr"] == 1e-4


def test_what_resume_asks_for(tmp_path):
    root = tmp_path / "checkpoints"
    assert resume_point(root, None) is None
    assert resume_point(root, "auto") is None
    (root / "step-00000003").mkdir(parents=True)
    with pytest.raises(CheckpointError, match="already holds checkpoints of an earlier run. Set resume='auto'"):
        resume_point(root, None)
    with pytest.raises(CheckpointError, match="is torn: it has no trainer_state.json"):
        resume_point(root, str(root / "step-00000003"))


def test_new_ranks_are_told_where_their_random_state_comes_from():
    assert random_states(2, 2) == random_states(2, 1) == ""
    assert "rank(s) 2, 3 had no saved random state (the checkpoint has 2 processes')" in random_states(2, 4)
