"""The minGPU exercise through real processes: 1 process at batch 10 and 2 processes at batch 5 reach the same
weights, the sharding tables, the per-epoch reshuffle, and gradient accumulation. Runs examples/same_updates.py,
its one-process runs in one process and its two-process runs in one launch (tests/jobs/run_many.py)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from conftest import JOBS, SAME_UPDATES, accelerate_launch, python, read_summary, torchrun

COMMON = ["--no_shuffle", "--epochs", "3", "--num_examples", "40", "--dim", "10"]
SHARDING = ["--num_examples", "9", "--dim", "1", "--batch_size", "3", "--epochs", "1", "--no_shuffle"]
RESHUFFLE = ["--num_examples", "12", "--dim", "2", "--epochs", "2", "--opt", "sgd", "--lr", "0.1"]
ACCUMULATION = ["--opt", "adam", "--loss", "mean", "--lr", "0.05", "--num_examples", "32", "--no_shuffle"]
SHORT_WINDOW = [*COMMON, "--opt", "sgd", "--loss", "mean", "--lr", "0.5", "--num_examples", "250", "--epochs", "1"]
LONG_WINDOW = [*COMMON, "--opt", "sgd", "--loss", "mean", "--lr", "0.5", "--num_examples", "12"]

# Every run of the module, by name: the one-process runs in one process, the two-process runs in one launch
# (tests/jobs/run_many.py: the start-up paid once, not per run).
ONE_PROCESS = {
    "sgd_sum": [*COMMON, "--opt", "sgd", "--loss", "sum", "--batch_size", "10", "--lr", "1"],
    "sgd_mean": [*COMMON, "--opt", "sgd", "--loss", "mean", "--batch_size", "10", "--lr", "0.5"],
    "adam_eps0": [*COMMON, "--opt", "adam", "--eps", "0", "--loss", "sum", "--lr", "0.1", "--batch_size", "10"],
    "reshuffle": [*RESHUFFLE, "--batch_size", "6"],
    "reshuffle_seed1": [*RESHUFFLE, "--batch_size", "6", "--seed", "1"],
    "accumulation_big": [*ACCUMULATION, "--batch_size", "8"],
    "accumulation_small": [*ACCUMULATION, "--batch_size", "2", "--gradient_accumulation_steps", "4"],
    "accumulation_none": [*ACCUMULATION, "--batch_size", "2"],
    "short_window_big": [*SHORT_WINDOW, "--batch_size", "8"],
    "short_window_small": [*SHORT_WINDOW, "--batch_size", "2", "--gradient_accumulation_steps", "4"],
    "long_window_whole": [*LONG_WINDOW, "--batch_size", "12"],
    "long_window_accumulated": [*LONG_WINDOW, "--batch_size", "2", "--gradient_accumulation_steps", "8"],
}
TWO_PROCESSES = {
    "sgd_sum": [*COMMON, "--opt", "sgd", "--loss", "sum", "--batch_size", "5", "--lr", "2"],
    "sgd_sum_same_lr": [*COMMON, "--opt", "sgd", "--loss", "sum", "--batch_size", "5", "--lr", "1"],
    "sgd_mean": [*COMMON, "--opt", "sgd", "--loss", "mean", "--batch_size", "5", "--lr", "0.5"],
    "adam_eps0": [*COMMON, "--opt", "adam", "--eps", "0", "--loss", "sum", "--lr", "0.1", "--batch_size", "5"],
    "sharding_padded_tail": SHARDING,
    "reshuffle": [*RESHUFFLE, "--batch_size", "3"],
    "short_window": [*SHORT_WINDOW, "--batch_size", "2", "--gradient_accumulation_steps", "2"],
}


def jobs(runs: dict, out: Path) -> str:
    return json.dumps([[str(SAME_UPDATES), *args, "--output_dir", str(out / name)] for name, args in runs.items()])


@pytest.fixture(scope="module")
def one(tmp_path_factory):
    """name -> the summary of that one-process run."""
    out = tmp_path_factory.mktemp("one")
    python(JOBS, jobs(ONE_PROCESS, out))
    return {name: read_summary(out / name) for name in ONE_PROCESS}


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    """name -> the summary of that run of 2 processes under ``accelerate launch`` (and "output": the launch's)."""
    out = tmp_path_factory.mktemp("two")
    result = accelerate_launch(JOBS, jobs(TWO_PROCESSES, out))
    summaries = {name: read_summary(out / name) for name in TWO_PROCESSES}
    for name, summary in summaries.items():
        assert summary["world_size"] == 2, f"{name}: two launched processes must form one DDP job"
    return {**summaries, "output": result.stdout + result.stderr}


def assert_same_run(a, b):
    np.testing.assert_allclose(a["losses"], b["losses"], rtol=1e-5, atol=1e-9)
    np.testing.assert_allclose(a["weights"], b["weights"], rtol=1e-5, atol=1e-7)


def assert_different_run(a, b):
    assert not np.allclose(a["weights"], b["weights"], rtol=1e-3, atol=1e-6)


def test_sgd_summed_loss_needs_lr_times_k(one, two):
    assert_same_run(one["sgd_sum"], two["sgd_sum"])
    # DDP averages gradients: the same lr on a summed loss takes half the step, so the weights differ.
    assert_different_run(one["sgd_sum"], two["sgd_sum_same_lr"])
    assert two["output"].count("No GPU on this host") == 1, "the CPU fallback speaks once, on the main process"


def test_sgd_mean_loss_needs_no_lr_scaling(one, two):
    assert_same_run(one["sgd_mean"], two["sgd_mean"])


def test_adam_eps0_needs_no_lr_scaling(one, two):
    assert_same_run(one["adam_eps0"], two["adam_eps0"])


def test_sharding_table_padded_tail(two):
    seen = two["sharding_padded_tail"]["seen"]  # 0-based: the exercise's x1 is 0
    assert seen == [[[0, 2, 4], [6, 8]], [[1, 3, 5], [7, 0]]]


def test_sharding_table_drop_last(tmp_path):
    torchrun(SAME_UPDATES, *SHARDING, "--drop_last", "--output_dir", tmp_path)
    seen = read_summary(tmp_path)["seen"]
    assert seen == [[[0, 2, 4], [6]], [[1, 3, 5], [7]]]


def test_reshuffle_each_epoch_agreed_by_ranks_and_reproducible(one, two):
    rank0, rank1 = two["reshuffle"]["seen"]
    epochs = [sum(rank0[e * 2 : e * 2 + 2], []) + sum(rank1[e * 2 : e * 2 + 2], []) for e in range(2)]
    for order in epochs:
        assert sorted(order) == list(range(12)), "every example exactly once per epoch, none shared by ranks"
    assert epochs[0] != epochs[1], "set_epoch must give a new shuffle each epoch"
    assert epochs[0] != sorted(epochs[0]), "shuffle=True must shuffle"

    # One process at batch 6 draws the same permutation: its batch t is the union of the ranks' batches t.
    (alone,) = one["reshuffle"]["seen"]
    assert [sorted(b) for b in alone] == [sorted(a + b) for a, b in zip(rank0, rank1, strict=True)]
    assert one["reshuffle_seed1"]["seen"][0] != alone, "the seed decides the order"


def test_gradient_accumulation_matches_the_large_batch(one):
    big, small = one["accumulation_big"], one["accumulation_small"]
    assert len(big["losses"]) == len(small["losses"]) == 12, "4 optimizer steps per epoch, 3 epochs"
    assert_same_run(big, small)
    assert_different_run(big, one["accumulation_none"])


def test_a_short_last_window_weighs_what_it_holds(one, two):
    """250 examples, 1 epoch, in order: batch 8 ends on a batch of 2, batch 2 x 4 accumulation on a window of one
    micro-batch. That window is averaged over what it holds (accelerate would divide it by 4)."""
    big, small = one["short_window_big"], one["short_window_small"]
    assert len(big["losses"]) == len(small["losses"]) == 32
    assert_same_run(big, small)
    spread = two["short_window"]  # 2 processes x batch 2 x accumulation 2
    assert spread["seen"][0][-1] == [248] and spread["seen"][1][-1] == [249], "DistributedSampler's tail, unpadded"
    assert_same_run(big, spread)


def test_accumulation_longer_than_an_epoch_averages_the_epoch(one):
    """12 examples, batch 2, accumulation 8: each epoch is one window of 6 micro-batches, the update of batch 12."""
    assert_same_run(one["long_window_whole"], one["long_window_accumulated"])
