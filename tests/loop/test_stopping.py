"""Stopping early through real processes (tests/jobs/scenarios.py `stop`, 2 CPU processes): one rank's should_stop stops
every rank after the same step, with a checkpoint; EarlyStopping on an eval loss that cannot improve, and across a
preemption and a resume (its patience and a user's stateful callback checkpointed); keep_best keeps the best
evaluation's checkpoint apart from keep_last, also across a resume."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from trainer import PREEMPTED_EXIT

from conftest import SCENARIOS, accelerate_launch, launch_jobs

# The runs that need no signal, in one launch of 2 processes (tests/jobs/run_many.py), in this order: name -> arguments.
RUNS = {
    "one_rank_stops": ["stop", "--stop_at", "5"],
    "early_stopping": ["stop"],
    "best": ["best"],
    "best_again": ["best", "--max_steps", "14"],
    "best_cut": ["best", "--signal_at", "3"],  # preempted at step 4, before its evaluation
    "best_cut_again": ["best"],
    "patience_cut": ["patience", "--signal_at", "5"],  # preempted at step 6, before its evaluation
    "patience_cut_again": ["patience"],
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, tuple[str, Path]]:
    """name -> (that run's output, its output_dir); best_again continues best's output_dir."""
    out = tmp_path_factory.mktemp("stopping")
    folders = {name: out / name.removesuffix("_again") for name in RUNS}
    ended = launch_jobs({name: [SCENARIOS, *args, "--output_dir", folders[name]] for name, args in RUNS.items()})
    cut = ("best_cut", "patience_cut")
    assert [run.returncode for run in ended.values()] == [PREEMPTED_EXIT if name in cut else 0 for name in RUNS]
    return {name: (run.stdout, folders[name]) for name, run in ended.items()}


def stopped(output: str) -> tuple[dict, str]:
    reports = {
        line.split(" ", 2)[1]: json.loads(line.split(" ", 2)[2])
        for line in output.splitlines()
        if line.startswith("STOPPED ")
    }
    assert set(reports) == {"rank0", "rank1"}
    for report in reports.values():
        report.pop("train_runtime_s")
    assert reports["rank0"] == reports["rank1"], "every rank stops at the same step, with the same figures"
    return reports["rank0"], output


def test_one_ranks_should_stop_stops_every_rank_at_the_next_log_with_a_checkpoint(runs):
    # rank 1 alone asks after step 5; the ranks log every 3 steps: both stop after step 6 (of 40).
    output, tmp_path = runs["one_rank_stops"]
    result, output = stopped(output)
    assert result["global_step"] == 6 and result["stopped"] == "should_stop set on rank(s) 1"
    assert "stopping at step 6 of 40: should_stop set on rank(s) 1" in output
    assert (tmp_path / "checkpoints" / "latest").read_text() == "step-00000006"
    assert (tmp_path / "final" / "model.safetensors").is_file()


def test_early_stopping_ends_a_run_whose_eval_loss_does_not_improve(runs):
    # lr 0: the eval loss (every 2 steps) never improves; patience 2 asks at step 6, the log at step 9 agrees.
    output, tmp_path = runs["early_stopping"]
    result, output = stopped(output)
    assert result["global_step"] == 9
    assert "EarlyStopping: eval_loss has not improved on 1.15853 (step 2)" in result["stopped"]
    assert (tmp_path / "checkpoints" / "latest").read_text() == "step-00000009"


def test_early_stopping_and_a_users_callback_keep_their_state_across_a_preemption(runs):
    """EarlyStopping(patience=3) had waited 1 evaluation (step 4's after step 2's best) when the job was preempted
    at step 6, before step 6's evaluation (the ranks agree on a signal before an evaluation): resumed, it runs step
    6's evaluation first and stops after 1 more (step 8's, agreed at the log of step 10), as the uninterrupted run
    does, not 3 more (which a patience started again from zero would take). A user's callback with state_dict gets
    its count and its tensor back."""
    preempted, resumed = runs["patience_cut"][0], runs["patience_cut_again"][0]  # exits checked by the fixture
    assert "trainer: preempted (SIGUSR1) at step 6 of 40" in preempted, preempted[-2000:]
    begin = {
        line.split(" ", 2)[1]: json.loads(line.split(" ", 2)[2])
        for line in resumed.splitlines()
        if line.startswith("BEGIN ")
    }
    assert begin["rank0"] == begin["rank1"]
    assert {key: begin["rank0"][key] for key in ("step", "waited", "best_step", "seen")} == {
        "step": 6,
        "waited": 1,
        "best_step": 2,
        "seen": 2,
    }
    assert "step 6's evaluation, put off by the preemption for its checkpoint, runs first" in resumed
    assert begin["rank0"]["total"] > 0, "the callback's tensor came back too"
    stopped = [json.loads(line.split(" ", 2)[2]) for line in resumed.splitlines() if line.startswith("STOPPED ")]
    assert len(stopped) == 2 and all(result["global_step"] == 10 for result in stopped), stopped
    assert "EarlyStopping: eval_loss has not improved on" in stopped[0]["stopped"]
    assert "(step 2) for 3 evaluations" in stopped[0]["stopped"]


def test_keep_best_keeps_the_best_evaluations_checkpoint_apart_from_keep_last(runs):
    # The figure peaks at step 4; checkpoints every 2 steps with keep_last=1.
    output, tmp_path = runs["best"]
    best = tmp_path / "checkpoints" / "step-00000004"
    assert f"BEST rank0 {best} " in output and f"BEST rank1 {best} " in output
    assert '"figure": "eval_peak", "value": 0.0, "step": 4' in output
    # Said at the start, on the banner.
    assert "| keep_best eval_peak (max); final/ holds that checkpoint's weights" in output, output
    # load_best_at_end (keep_best's default): the model fit() ends with is the best evaluation's, and it says so.
    assert (
        "load_best_at_end: final/ holds the weights of step 4, the best evaluation (eval_peak 0), not those of "
        "the last step, 10" in output
    )
    # Resumed and trained on, the best is still the step-4 one (its value came back with the checkpoint); the
    # first run kept best, latest, step 4 and step 10 (keep_last=1): step 10 gives way to step 14.
    again, _ = runs["best_again"]
    assert f"BEST rank0 {best} " in again and f"resumed from {tmp_path}/checkpoints/step-00000010" in again
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        "best",
        "latest",
        "step-00000004",
        "step-00000014",
    ]
    assert_same_weights(tmp_path / "final" / "model.safetensors", best)


def eval_steps(output_dir: Path) -> list[int | str]:
    """The steps evaluated, as the main process's metrics file has them, and where a run was preempted."""
    rows = [json.loads(line) for line in (output_dir / "metrics" / "rank0.jsonl").read_text().splitlines()]
    return [
        "preempted" if "preempted" in row else row["step"] for row in rows if "eval/peak" in row or "preempted" in row
    ]


def test_a_signal_before_a_due_evaluation_checkpoints_first_and_the_resumed_run_evaluates_first(runs):
    """Rank 1 signalled after step 3; step 4 owes an evaluation and a checkpoint. The ranks agree on the signal
    before the evaluation, not after it (a long evaluation can outlast the launcher's grace): the preemption's
    checkpoint of step 4 is committed unevaluated. Resumed, step 4's evaluation runs before step 5, and step 4's
    checkpoint is saved again holding it, so keep_best picks and keeps what the uninterrupted run did."""
    cut, output_dir = runs["best_cut"]
    assert "trainer: preempted (SIGUSR1) at step 4 of 10" in cut, cut[-3000:]
    again, _ = runs["best_cut_again"]
    assert "step 4's evaluation, put off by the preemption for its checkpoint, runs first" in again, again[-3000:]
    assert eval_steps(output_dir) == [2, "preempted", 4, 6, 8, 10]
    assert eval_steps(runs["best"][1])[:5] == [2, 4, 6, 8, 10]
    best = output_dir / "checkpoints" / "step-00000004"
    assert f"BEST rank0 {best} " in again and f"BEST rank1 {best} " in again
    assert (output_dir / "checkpoints" / "best").read_text() == "step-00000004"
    state = json.loads((best / "trainer_state.json").read_text())
    assert state["best"] == {"figure": "eval_peak", "value": 0.0, "step": 4} and not state["train"]["evaluation_owed"]
    assert "load_best_at_end: final/ holds the weights of step 4, the best evaluation (eval_peak 0)" in again


def test_a_damaged_best_checkpoint_leaves_final_the_last_steps_weights_and_says_so(runs, tmp_path):
    """The best evaluation's checkpoint (step 4, not the latest) damaged before a resume: the run trains to its end,
    says why load_best_at_end cannot load it, and final/ holds the last step's weights (a rerun finds it done)."""
    _, trained = runs["best_again"]
    shutil.copytree(trained, tmp_path / "run")
    weights = tmp_path / "run" / "checkpoints" / "step-00000004" / "shards" / "__0_0.distcp"
    data = bytearray(weights.read_bytes())
    data[-8:] = bytes(8)  # the same size: only the CRC-32 tells
    weights.write_bytes(bytes(data))
    result = accelerate_launch(SCENARIOS, "best", "--output_dir", tmp_path / "run", "--max_steps", "16")
    assert result.stderr.count("trainer: load_best_at_end: checkpoint ") == 1, result.stderr[-3000:]
    assert "step-00000004 is damaged: shards/__0_0.distcp does not hold what was written" in result.stderr
    assert "final/ holds the last step's weights, 16, not the best evaluation's (step 4, eval_peak 0)" in result.stderr
    last = tmp_path / "run" / "checkpoints" / "step-00000016"
    assert_same_weights(tmp_path / "run" / "final" / "model.safetensors", last)
    assert weights.read_bytes() == bytes(data), "left as it is"


def assert_same_weights(file: Path, checkpoint: Path) -> None:
    """An exported model file holds the weights checkpoint ``checkpoint`` holds."""
    from safetensors.torch import load_file

    from trainer.checkpoint.safe_dcp import read_sharded_weights

    mine, theirs = load_file(file), read_sharded_weights(checkpoint)
    assert mine.keys() <= theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
