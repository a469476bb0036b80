"""``spike_policy: rollback`` through real processes (tests/jobs/spikes.py): a 50x loss at step 10 is rolled back to
step 8's checkpoint with the batches of steps 9-10 skipped, to the weights of a run that never had those batches, on
1 process and under DDP and FSDP2 on 2; with the lr lowered, a run killed after the rollback resumes to the
uninterrupted weights; a spike before any checkpoint stops the run by name; what a rollback cannot work with is
refused; in this process, a NaN step under nan_policy skip leaves the guard watching."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from trainer import TrainConfig
from trainer.errors import ConfigError
from trainer.launch.run import Run
from trainer.loop.step import StepRunner
from trainer.optim import build as optim
from trainer.parallel import for_run
from trainer.telemetry.telemetry import Telemetry

from conftest import ROOT, accelerate_launch, clean_env, launch_jobs, run

JOB = ROOT / "tests" / "jobs" / "spikes.py"


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> dict[str, subprocess.CompletedProcess]:
    """The 1-process runs, by name: a run with the lr lowered, killed after step 12's checkpoint, alone; then in one
    process (conftest.launch_jobs) its resume and every other run."""
    root = tmp_path_factory.mktemp("spikes")
    crash = clean_env(TRAINER_CRASH_AFTER_CHECKPOINT="12")
    run([sys.executable, str(JOB), "--out", str(root / "cut"), "--lr_factor", "0.5"], expect_ok=False, env=crash)
    runs = {
        "one": [],
        "without": ["--drop", "32-39"],  # the run that never had the spike's batches
        "whole": ["--lr_factor", "0.5"],
        "cut": ["--lr_factor", "0.5", "--resume", "auto"],
        "early": ["--save_every", "12"],  # a spike before any checkpoint
        "again": ["--poison", "36-51"],  # steps 10 to 13 all spike
    }
    return launch_jobs({name: [JOB, "--out", root / name, *args] for name, args in runs.items()}, one_process=True)


def weights(ended: subprocess.CompletedProcess):
    return load_file(Path(ended.args[2], "final", "model.safetensors"))


def test_a_spike_is_rolled_back_to_the_weights_of_a_run_without_its_batches(one_process):
    said = one_process["one"].stdout
    assert "| a loss over 3 x the last 10 steps' mean rolled back" in said
    assert "loss 41.36 at step 10, over 3 x its recent level 1.084: rolled back to step 8 (" in said
    assert "step-00000008), the batches of steps 9-10 skipped" in said
    # Every part back from step 8 (weights, AdamW's moments, the schedule), the data read on after step 10: the run
    # that never had those 8 examples, bit for bit.
    mine, theirs = weights(one_process["one"]), weights(one_process["without"])
    assert all(torch.equal(mine[name], theirs[name]) for name in theirs)
    # Recorded in the checkpoints after it.
    step = Path(one_process["one"].args[2], "checkpoints", "step-00000016")
    (record,) = json.loads((step / "trainer_state.json").read_text())["spikes"]["rollbacks"]
    assert (record["step"], record["back_to"], record["skipped"]) == (10, 8, [9, 10])


@pytest.mark.parametrize("config", ["multi_gpu.yaml", "fsdp.yaml"])
def test_two_processes_roll_back_alike_under_ddp_and_fsdp2(one_process, tmp_path, config):
    said = accelerate_launch(JOB, "--out", str(tmp_path / "two"), config=config, num_processes=2).stdout
    assert said.count("rolled back to step 8") == 1
    mine = weights(one_process["one"])
    theirs = load_file(tmp_path / "two" / "final" / "model.safetensors")
    assert all(torch.allclose(mine[name], theirs[name], rtol=0, atol=1e-6) for name in mine)


def test_a_run_killed_after_a_rollback_that_lowered_the_lr_resumes_to_the_uninterrupted_weights(one_process):
    assert "skipped; the lr is 0.5 x the schedule's from now on" in one_process["whole"].stdout
    resumed = one_process["cut"].stdout
    # No line of a changed lr: the resume keeps the lowered one.
    assert "resumed from" in resumed and "changed since the checkpoint" not in resumed
    mine, theirs = weights(one_process["whole"]), weights(one_process["cut"])
    assert all(torch.equal(mine[name], theirs[name]) for name in theirs)


def test_a_spike_before_any_checkpoint_stops_the_run_by_name(one_process):
    done = one_process["early"]
    assert done.returncode == 1 and done.stderr.strip() == (
        "trainer: loss 41.36 at step 10, over 3 x its recent level 1.084, before any checkpoint to roll back to "
        "(spike_policy: rollback): lower save_every"
    )


def test_spikes_that_keep_coming_after_one_checkpoint_stop_the_run_at_the_fourth(one_process):
    """Steps 10 to 13's batches all spike: back to step 8 three times, each skipping on; the fourth stops the run."""
    done = one_process["again"]
    assert done.returncode == 1 and done.stdout.count("rolled back to step 8") == 3
    assert "the 4th spike since step 8's checkpoint" in done.stderr and "lower the lr" in done.stderr


@pytest.mark.parametrize(
    "settings, words",
    [
        ({"spike_policy": "rollback"}, "spike_policy: rollback goes back to the last checkpoint: set save_every"),
        ({"spike_policy": "restart", "save_every": 4}, "spike_policy must be null or 'rollback'"),
        ({"spike_policy": "rollback", "save_every": 4, "spike_threshold": 0.5}, "spike_threshold is a factor"),
        ({"spike_policy": "rollback", "save_every": 4, "spike_lr_factor": 2.0}, "spike_lr_factor must be in"),
        (
            {"spike_policy": "rollback", "save_every": 4, "checkpoint_storage": "s3://b/r"},
            "not with checkpoint_storage yet",
        ),
    ],
)
def test_settings_a_rollback_cannot_work_with_are_refused(settings, words):
    with pytest.raises(ConfigError, match=words):
        TrainConfig(**settings)


def test_a_nan_step_under_nan_policy_skip_leaves_the_spike_guard_watching(tmp_path):
    """A NaN is nan_policy's: skipped, never a spike, kept out of the recent level; the guard's sums start afresh at
    the next step, so a spike after it is still seen (one process, in this pytest process)."""
    rollback = dict(nan_policy="skip", spike_policy="rollback", save_every=1)
    run = Run.join(TrainConfig(output_dir=str(tmp_path), optimizer="sgd", lr=0.01, batch_size=2, **rollback))
    strategy = for_run(run)
    torch.manual_seed(0)
    model = strategy.apply(torch.nn.Linear(3, 1), prebuilt_optimizer=False)
    built = optim.build(model, run.config, optimizer=None, lr_scheduler=None, total_steps=8)
    model = strategy.prepare(model, built.optimizer)
    steps = StepRunner(run, strategy, model, optimization=built, loss_fn=mse, window=Telemetry(run).window)
    steps.begin()
    generator = torch.Generator().manual_seed(0)
    good = [(torch.randn(3, generator=generator), torch.randn(1, generator=generator)) for _ in range(2)]
    nan, spike = [(x, torch.tensor([float("nan")])) for x, _ in good], [(x, y * 30) for x, y in good]
    seen = []
    for step, data in enumerate([good, good, nan, good, spike], start=1):
        (window,) = list(steps.windows(torch.utils.data.DataLoader(data, batch_size=2)))
        steps.run(window, step, measure_norm=False)
        seen.append(steps.spiked)
    assert seen == [False, False, False, False, True]
    assert len(steps.spikes.recent) == 3 and steps.nonfinite.skipped_steps == 1


def mse(model, batch):
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)
