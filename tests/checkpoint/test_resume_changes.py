"""A resume that trusts nothing, through 2 real processes (tests/jobs/resume_cases.py): settings changed since the
checkpoint are refused by name or applied and said, a damaged ``latest`` pointer never leads elsewhere, a skipped
NaN step leaves BatchNorm's statistics as they were, a NaN evaluation stops the run, a metrics file that cannot be
written is one line, and a preemption during slow periodic saves checkpoints at the next save."""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import pytest

from conftest import ROOT, accelerate_launch, clean_env, launch_command

CASES = ROOT / "tests" / "jobs" / "resume_cases.py"


@pytest.fixture(scope="module")
def cases_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("resume_cases")


@pytest.fixture(scope="module")
def cases(cases_dir) -> dict[str, str]:
    """Every case's line (``CASE <name> | what it said | REFUSED ... | figures``), by name."""
    result = accelerate_launch(CASES, "--output_dir", cases_dir)
    found = {}
    for line in result.stdout.splitlines():
        if line.startswith("CASE "):
            name, _, rest = line.removeprefix("CASE ").partition(" | ")
            found[name] = rest
    return found


def figure(line: str, name: str):
    return json.loads(line.rsplit(" | ", 1)[1])[name]


def test_a_changed_optimizer_is_refused_naming_both_whoever_built_it(cases):
    for new in ("sgd", "adam"):
        assert (
            f"step-00000009: it was written with optimizer adamw, and this run has {new}: the saved optimizer "
            f"state cannot go on as {new}'s. Resume with optimizer adamw"
        ) in cases[f"optimizer_{new}"]
        # Loaded for evaluate() and predict(), not "resumed from": fit() refuses to continue from it.
        assert "step-00000009 for evaluate() and predict() only: step 9, epoch 1" in cases[f"optimizer_{new}"]
        assert "resumed from" not in cases[f"optimizer_{new}"]
    assert "its optimizer was AdamW, and this run's is RMSprop" in cases["user_optimizer"]
    assert "weight_decay 0.01 -> 0.0 changes the optimizer's parameter groups" in cases["weight_decay_off"]
    assert "Error(s) in loading state_dict" not in cases["weight_decay_off"], "named, not torch's words"
    mismatch = "Size mismatch between saved torch.Size([32, 8]) and current: torch.Size([64, 8]) for model.net.0.weight"
    assert mismatch in cases["model_shape"] and "does not fit this run" in cases["model_shape"]


def test_a_changed_lr_or_schedule_is_applied_whole_from_the_next_step_and_said(cases):
    for name in ("lr", "constant", "max_steps", "unchanged", "weight_decay", "seed_at_epoch_end"):
        line = cases[name]
        assert "REFUSED" not in line, line
        assert math.isclose(figure(line, "next_lr"), figure(line, "fresh_lr"), rel_tol=1e-12), line
    assert (
        "changed since the checkpoint, applied from step 10: lr 0.01 -> 0.0001, so the next step's lr is "
        "3.806e-06, not 0.0003806"
    ) in cases["lr"]
    assert (
        "lr_scheduler cosine -> constant, warmup_steps 2 -> 0, so the next step's lr is 0.01, not 0.0003806"
        in cases["constant"]
    )
    assert "applied from step 11: max_steps 10 -> 20, so the next step's lr is 0.005868, not 0" in cases["max_steps"]
    assert figure(cases["weight_decay"], "settings") == [[0.8, 0.99], 0.02], "the optimizer's own settings too"
    assert "changed since" not in cases["unchanged"]


def test_a_seed_change_is_refused_mid_epoch_and_taken_at_an_epoch_boundary(cases):
    assert (
        "seed 0 -> 1 changes the order of examples in the epoch it stopped in: some examples would be read "
        "twice and others never. Resume with seed 0 until the epoch ends"
    ) in cases["seed_mid_epoch"]
    assert "applied from step 7: seed 0 -> 1" in cases["seed_at_epoch_end"]


@pytest.mark.parametrize(
    "name, shown",
    [
        ("elsewhere", "holds b'../../other/checkpoints/step-00000003'"),
        ("not_utf8", r"holds b'\xff\xfe'"),
        ("empty", "is empty"),
        ("nul", r"holds b'\x00\x00"),
    ],
)
def test_a_damaged_latest_pointer_is_named_and_the_newest_whole_checkpoint_used(cases, name, shown):
    line = cases[f"pointer_{name}"]
    assert figure(line, "resumed") == "step-00000010", line
    assert "trainer: the latest pointer " in line and f"is corrupt: it {shown}" in line, line
    assert "continuing from the newest whole checkpoint" in line and "torn" not in line


def test_a_skipped_nan_step_leaves_batchnorm_statistics_as_they_were(cases):
    skipped, eval_loss, buffers_finite = figure(cases["nan_buffers"], "skipped_eval_finite")
    assert skipped == 1 and math.isfinite(eval_loss) and buffers_finite


def test_a_nan_evaluation_stops_the_run_naming_the_last_good_checkpoint(cases):
    assert "REFUSED evaluation at step 5 gave eval_loss nan" in cases["nan_eval"]
    assert "The last good checkpoint is " in cases["nan_eval"] and "step-00000003" in cases["nan_eval"]


def test_an_unwritable_metrics_file_is_one_line_on_each_rank(cases):
    for rank, line in ((0, cases["unwritable_metrics"]), (1, cases["unwritable_metrics_rank1"])):
        assert f"cannot write the metrics of rank {rank} to " in line and "IsADirectoryError" in line, line


def test_a_misspelt_figure_to_keep_or_watch_is_one_line_before_the_first_step(cases):
    """Found from one batch of the eval set before training (it cost eval_every steps before: GPU time lost to a
    typo, said at the first evaluation)."""
    assert '"steps": 0' in cases["misspelt_keep_best"] and '"steps": 0' in cases["misspelt_early_stopping"], cases
    assert (
        "REFUSED keep_best is 'eval_los', but evaluate() gives eval_loss, eval_examples: set keep_best to one "
        "of them" in cases["misspelt_keep_best"]
    )
    assert (
        "REFUSED EarlyStopping watches 'eval_accuracy', but evaluate() gives eval_loss, eval_examples: set its "
        "monitor to one of them" in cases["misspelt_early_stopping"]
    )


def test_a_resumed_run_shows_each_step_once_in_tensorboard(cases, cases_dir):
    """Resumed from step 2 of a run that logged steps 1-4: the replayed steps 3 and 4 replace the first run's."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    for rank in (0, 1):
        events = EventAccumulator(str(cases_dir / "tensorboard" / "tensorboard" / f"rank{rank}")).Reload()
        assert [e.step for e in events.Scalars("rank/loss")] == [1, 2, 3, 4]


def test_the_figures_a_user_logs_reach_every_tracker_from_every_rank(cases, cases_dir):
    """trainer.log on every rank (its own figures, each name's mean since the last log), a figure an on_log callback
    adds, and the gradient norm: in each rank's metrics file, wandb run (turned on by WANDB_PROJECT alone) and
    TensorBoard events, in log_history and in the plot's panels."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from wandb_records import offline_runs

    from trainer.telemetry.sinks import read_metrics
    from trainer.tools.plot import panels

    out = cases_dir / "figures"
    history = figure(cases["figures"], "log_history")
    assert [row["rank_figure"] for row in history] == [1.5, 3.5], "the main process's mean of steps 1-2, 3-4"
    assert all(row["callback_figure"] == 7.0 and row["grad_norm"] > 0 for row in history)
    rows = read_metrics(out)
    for rank in (0, 1):
        logged = [row for row in rows[rank] if "rank_figure" in row]
        assert [row["rank_figure"] for row in logged] == [100 * rank + 1.5, 100 * rank + 3.5]
        assert all(row["callback_figure"] == 7.0 for row in logged)
        events = EventAccumulator(str(out / "tensorboard" / f"rank{rank}")).Reload()
        assert [e.value for e in events.Scalars("rank_figure")] == [100 * rank + 1.5, 100 * rank + 3.5]
        assert "rank/loss" in events.Tags()["scalars"]
    assert all(
        row["global/grad_norm"] == h["grad_norm"]
        for row, h in zip([r for r in rows[0] if "global/grad_norm" in r], history, strict=True)
    )
    runs = {run.name: run for run in offline_runs(out)}
    assert sorted(runs) == ["experiment-rank0", "experiment-rank1"]
    assert [h["rank_figure"] for h in runs["experiment-rank1"].history if "rank_figure" in h] == [101.5, 103.5]
    assert {"gradient norm", "rank_figure", "callback_figure"} <= {title for title, *_ in panels(rows)}


def test_the_banner_counts_the_examples_a_small_epoch_really_has(cases):
    assert "= 20 global" in cases["small_data"] and "= 32 global" not in cases["small_data"]
    assert "an epoch has 10 examples per process in 1 batch(es)" in cases["small_data"]


def test_a_fresh_start_of_resume_auto_names_the_absolute_folder(cases):
    assert "resume='auto': no checkpoint in /" in cases["relative_output_dir"]
    assert "/relative/checkpoints: starting fresh" in cases["relative_output_dir"]


def test_sighup_during_slow_saves_checkpoints_at_the_next_save_not_saves_later(tmp_path):
    """Saves of 2 s against steps of 0.05 s: the ranks' agreement, paced on the steps, would come some 20 steps
    (five saves) after the signal; a periodic save first asks every rank, so the preemption's checkpoint is that
    save's step. SIGHUP (an ssh session closed) is a preemption signal by default, as SIGQUIT is."""
    command = launch_command(CASES, "--output_dir", tmp_path, "--slow_saves", "2", "--signal", "SIGHUP")
    job = subprocess.run(
        command, env=clean_env(), capture_output=True, text=True, timeout=240, start_new_session=True
    )  # the job's own process group: the script signals it
    output = job.stdout + job.stderr
    assert "SIGNAL SIGHUP to the job after step 5" in output, output[-3000:]
    assert "trainer: preempted (SIGHUP) at step 8 of 200: checkpoint" in output, output[-3000:]
    assert "SAVED step 12" not in output, "no periodic save after the signal"
    assert (tmp_path / "checkpoints" / "latest").read_text() == "step-00000008"
    assert output.count("exitcode  : 75") == 2, output[output.find("Failures:") - 300 :][:1800]


def test_sighup_and_sigquit_are_preemption_signals_by_default():
    from trainer import TrainConfig

    assert {"SIGTERM", "SIGINT", "SIGUSR1", "SIGHUP", "SIGQUIT"} <= set(TrainConfig().signal_names)
