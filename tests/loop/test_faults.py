"""Faults a user's own model, loss or data bring, through 2 real processes: each gets one line naming the culprit
and the fix, no traceback from the workers, and a non-zero exit. Every fault is one run of a single launch
(tests/jobs/run_many.py: each run ends as its process would, alone)."""

from __future__ import annotations

import re

import pytest

from conftest import SCENARIOS, launch_jobs

# name -> the run's extra arguments
RUNS = {
    "unused": ["--fault", "unused"],
    "unused, fixed": ["--fault", "unused", "--find_unused_parameters"],
    "loss_float": ["--fault", "loss_float"],
    "loss_none": ["--fault", "loss_none"],
    "loss_vector": ["--fault", "loss_vector"],
    "empty_eval": ["--fault", "empty_eval"],
    "metrics_shape": ["--fault", "metrics_shape"],
    "frozen": ["--fault", "frozen"],
    "tensorboard_file": ["--fault", "tensorboard_file"],
}


@pytest.fixture(scope="module")
def faults(tmp_path_factory) -> dict[str, tuple[int, str, str]]:
    """name -> (the run's exit status, its stdout, its stderr)."""
    out = tmp_path_factory.mktemp("faults")
    runs = {
        name: [SCENARIOS, "faults", *args, "--output_dir", out / f"run{i}"]
        for i, (name, args) in enumerate(RUNS.items())
    }
    return {name: (run.returncode, run.stdout, run.stderr) for name, run in launch_jobs(runs).items()}


def failed(faults, name: str) -> tuple[str, str]:
    status, stdout, stderr = faults[name]
    assert status != 0, f"{name} ended well:\n{stdout}\n{stderr}"
    return stdout, stderr


def worker_tracebacks(stderr: str) -> int:
    return stderr.count("[rank0]: Traceback") + stderr.count("[rank1]: Traceback")


def test_a_parameter_outside_the_loss_names_find_unused_parameters_which_fixes_it(faults):
    _, stderr = failed(faults, "unused")
    assert stderr.count("trainer: some parameters of the model took no part in the previous step's loss") == 1
    assert "Set find_unused_parameters: true" in stderr and worker_tracebacks(stderr) == 0
    assert faults["unused, fixed"][0] == 0, faults["unused, fixed"][2][-3000:]


@pytest.mark.parametrize(
    "name, got",
    [
        ("loss_float", "must return a scalar tensor, got 1.0 (a float has no gradient)"),
        ("loss_none", "must return a scalar tensor, got None"),
        ("loss_vector", "must return a scalar tensor, got a tensor of shape (4,) (reduce it: .mean())"),
    ],
)
def test_a_loss_fn_that_returns_no_scalar_tensor_is_named(faults, name, got):
    _, stderr = failed(faults, name)
    assert stderr.count(f"trainer: loss_fn faults.<locals>.<lambda> {got}") == 1, stderr[-2000:]
    assert worker_tracebacks(stderr) == 0


def test_an_empty_eval_set_is_refused_before_training(faults):
    stdout, stderr = failed(faults, "empty_eval")
    assert stderr.count("trainer: eval_data has no examples") == 1
    assert "step " not in stdout, "refused before the first step, not after all of training"


@pytest.mark.parametrize(
    "name, said, lines",
    [
        ("metrics_shape", "metrics_fn's 'accuracy' has 3 values for a batch of 4 examples: return one number per", 1),
        ("frozen", "the model (TinyClassifier) has no trainable parameter (requires_grad is False on every one)", 1),
        ("tensorboard_file", "tensorboard: true, but rank 0 cannot write its events to", 2),  # each rank its own folder
    ],
)
def test_a_wrong_metrics_fn_a_frozen_model_and_a_tensorboard_path_that_is_a_file_are_named(faults, name, said, lines):
    stdout, stderr = failed(faults, name)
    assert stderr.count(said) == 1 and stderr.count("trainer: ") == lines, stderr[-3000:]
    assert worker_tracebacks(stderr) == 0, stderr[-3000:]
    if name == "metrics_shape":
        # Found from one eval batch before the first step, not at the first evaluation.
        assert not re.search(r"^step \d+/", stdout, re.M), stdout[-3000:]
