"""Faults a user's own model, loss or data bring (issue 12's fault list), through 2 real processes: each gets one
line naming the culprit and the fix, no traceback from the workers, and a non-zero exit."""

from __future__ import annotations

import pytest

from conftest import SCENARIOS, accelerate_launch


def fault(tmp_path, name: str, *extra: str, expect_ok: bool = False):
    return accelerate_launch(SCENARIOS, "faults", "--fault", name, "--output_dir", tmp_path, *extra,
                             expect_ok=expect_ok)  # fmt: skip


def worker_tracebacks(stderr: str) -> int:
    return stderr.count("[rank0]: Traceback") + stderr.count("[rank1]: Traceback")


def test_a_parameter_outside_the_loss_names_find_unused_parameters_which_fixes_it(tmp_path):
    failed = fault(tmp_path / "default", "unused")
    assert failed.stderr.count("trainer: some parameters of the model took no part in the previous step's loss") == 1
    assert "Set find_unused_parameters: true" in failed.stderr and worker_tracebacks(failed.stderr) == 0
    fault(tmp_path / "fixed", "unused", "--find_unused_parameters", expect_ok=True)


@pytest.mark.parametrize("name, got", [
    ("loss_float", "must return a scalar tensor, got 1.0 (a float has no gradient)"),
    ("loss_none", "must return a scalar tensor, got None"),
    ("loss_vector", "must return a scalar tensor, got a tensor of shape (4,) (reduce it: .mean())"),
])  # fmt: skip
def test_a_loss_fn_that_returns_no_scalar_tensor_is_named(tmp_path, name, got):
    failed = fault(tmp_path, name)
    assert failed.stderr.count(f"trainer: loss_fn faults.<locals>.<lambda> {got}") == 1, failed.stderr[-2000:]
    assert worker_tracebacks(failed.stderr) == 0


def test_an_empty_eval_set_is_refused_before_training(tmp_path):
    failed = fault(tmp_path, "empty_eval")
    assert failed.stderr.count("trainer: eval_data has no examples") == 1
    assert "step " not in failed.stdout, "refused before the first step, not after all of training"


@pytest.mark.parametrize("name, said, lines", [
    ("metrics_shape", "metrics_fn's 'accuracy' has 3 values for a batch of 4 examples: return one number per example", 1),
    ("frozen", "the model (TinyClassifier) has no trainable parameter (requires_grad is False on every one)", 1),
    ("tensorboard_file", "tensorboard: true, but rank 0 cannot write its events to", 2),  # each rank its own folder
])  # fmt: skip
def test_a_wrong_metrics_fn_a_frozen_model_and_a_tensorboard_path_that_is_a_file_are_named(tmp_path, name, said,
                                                                                          lines):  # fmt: skip
    failed = fault(tmp_path, name)
    assert failed.stderr.count(said) == 1 and failed.stderr.count("trainer: ") == lines, failed.stderr[-3000:]
    assert worker_tracebacks(failed.stderr) == 0, failed.stderr[-3000:]
