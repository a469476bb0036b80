"""The minGPU exercise through real processes: 1 process at batch 10 and 2 processes at batch 5 reach the same
weights, the sharding tables, the per-epoch reshuffle, and gradient accumulation. Runs examples/same_updates.py."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import SAME_UPDATES, accelerate_launch, python, read_summary, torchrun

COMMON = ["--no_shuffle", "--epochs", "3", "--num_examples", "40", "--dim", "10"]


def run_one_process(tmp_path, name, *args):
    out = tmp_path / name
    python(SAME_UPDATES, *COMMON, *args, "--output_dir", out)
    return read_summary(out)


def run_two_processes(tmp_path, name, *args, launcher="accelerate"):
    out = tmp_path / name
    launch = accelerate_launch if launcher == "accelerate" else torchrun
    result = launch(SAME_UPDATES, *COMMON, *args, "--output_dir", out)
    summary = read_summary(out)
    assert summary["world_size"] == 2, "two launched processes must form one DDP job"
    return summary, result


def assert_same_run(a, b):
    np.testing.assert_allclose(a["losses"], b["losses"], rtol=1e-5, atol=1e-9)
    np.testing.assert_allclose(a["weights"], b["weights"], rtol=1e-5, atol=1e-7)


def assert_different_run(a, b):
    assert not np.allclose(a["weights"], b["weights"], rtol=1e-3, atol=1e-6)


@pytest.mark.parametrize("launcher", ["accelerate"])  # torchrun: test_sharding_table_drop_last, tests/test_examples.py
def test_sgd_summed_loss_needs_lr_times_k(tmp_path, launcher):
    one = run_one_process(tmp_path, "one", "--opt", "sgd", "--loss", "sum", "--batch_size", "10", "--lr", "1")
    two, result = run_two_processes(
        tmp_path, "two", "--opt", "sgd", "--loss", "sum", "--batch_size", "5", "--lr", "2", launcher=launcher
    )
    assert_same_run(one, two)
    # DDP averages gradients: the same lr on a summed loss takes half the step, so the weights differ.
    same_lr, _ = run_two_processes(
        tmp_path, "same_lr", "--opt", "sgd", "--loss", "sum", "--batch_size", "5", "--lr", "1", launcher=launcher
    )
    assert_different_run(one, same_lr)
    if launcher == "accelerate":  # the CPU fallback speaks once, on the main process
        assert (result.stdout + result.stderr).count("No GPU on this host") == 1


def test_sgd_mean_loss_needs_no_lr_scaling(tmp_path):
    one = run_one_process(tmp_path, "one", "--opt", "sgd", "--loss", "mean", "--batch_size", "10", "--lr", "0.5")
    two, _ = run_two_processes(tmp_path, "two", "--opt", "sgd", "--loss", "mean", "--batch_size", "5", "--lr", "0.5")
    assert_same_run(one, two)


def test_adam_eps0_needs_no_lr_scaling(tmp_path):
    args = ["--opt", "adam", "--eps", "0", "--loss", "sum", "--lr", "0.1"]
    one = run_one_process(tmp_path, "one", *args, "--batch_size", "10")
    two, _ = run_two_processes(tmp_path, "two", *args, "--batch_size", "5")
    assert_same_run(one, two)


SHARDING = ["--num_examples", "9", "--dim", "1", "--batch_size", "3", "--epochs", "1", "--no_shuffle"]


def test_sharding_table_padded_tail(tmp_path):
    accelerate_launch(SAME_UPDATES, *SHARDING, "--output_dir", tmp_path)
    seen = read_summary(tmp_path)["seen"]  # 0-based: the exercise's x1 is 0
    assert seen == [[[0, 2, 4], [6, 8]], [[1, 3, 5], [7, 0]]]


def test_sharding_table_drop_last(tmp_path):
    torchrun(SAME_UPDATES, *SHARDING, "--drop_last", "--output_dir", tmp_path)
    seen = read_summary(tmp_path)["seen"]
    assert seen == [[[0, 2, 4], [6]], [[1, 3, 5], [7]]]


def test_reshuffle_each_epoch_agreed_by_ranks_and_reproducible(tmp_path):
    args = ["--num_examples", "12", "--dim", "2", "--epochs", "2", "--opt", "sgd", "--lr", "0.1"]
    accelerate_launch(SAME_UPDATES, *args, "--batch_size", "3", "--output_dir", tmp_path / "two")
    rank0, rank1 = read_summary(tmp_path / "two")["seen"]
    epochs = [sum(rank0[e * 2 : e * 2 + 2], []) + sum(rank1[e * 2 : e * 2 + 2], []) for e in range(2)]
    for order in epochs:
        assert sorted(order) == list(range(12)), "every example exactly once per epoch, none shared by ranks"
    assert epochs[0] != epochs[1], "set_epoch must give a new shuffle each epoch"
    assert epochs[0] != sorted(epochs[0]), "shuffle=True must shuffle"

    # One process at batch 6 draws the same permutation: its batch t is the union of the ranks' batches t.
    python(SAME_UPDATES, *args, "--batch_size", "6", "--output_dir", tmp_path / "one")
    (one,) = read_summary(tmp_path / "one")["seen"]
    assert [sorted(b) for b in one] == [sorted(a + b) for a, b in zip(rank0, rank1, strict=True)]

    python(SAME_UPDATES, *args, "--batch_size", "6", "--seed", "1", "--output_dir", tmp_path / "seed1")
    assert read_summary(tmp_path / "seed1")["seen"][0] != one, "the seed decides the order"


def test_gradient_accumulation_matches_the_large_batch(tmp_path):
    args = ["--opt", "adam", "--loss", "mean", "--lr", "0.05", "--num_examples", "32", "--no_shuffle"]
    big = tmp_path / "big"
    python(SAME_UPDATES, *args, "--batch_size", "8", "--output_dir", big)
    small = tmp_path / "small"
    python(SAME_UPDATES, *args, "--batch_size", "2", "--gradient_accumulation_steps", "4", "--output_dir", small)
    big, small = read_summary(big), read_summary(small)
    assert len(big["losses"]) == len(small["losses"]) == 12, "4 optimizer steps per epoch, 3 epochs"
    assert_same_run(big, small)
    none = tmp_path / "none"
    python(SAME_UPDATES, *args, "--batch_size", "2", "--output_dir", none)
    assert_different_run(big, read_summary(none))


def test_a_short_last_window_weighs_what_it_holds(tmp_path):
    """250 examples, 1 epoch, in order: batch 8 ends on a batch of 2, batch 2 x 4 accumulation on a window of one
    micro-batch. That window is averaged over what it holds (accelerate would divide it by 4)."""
    args = ["--opt", "sgd", "--loss", "mean", "--lr", "0.5", "--num_examples", "250", "--epochs", "1"]
    big = run_one_process(tmp_path, "big", *args, "--batch_size", "8")
    small = run_one_process(tmp_path, "small", *args, "--batch_size", "2", "--gradient_accumulation_steps", "4")
    assert len(big["losses"]) == len(small["losses"]) == 32
    assert_same_run(big, small)
    two, _ = run_two_processes(tmp_path, "two", *args, "--batch_size", "2", "--gradient_accumulation_steps", "2")
    assert two["seen"][0][-1] == [248] and two["seen"][1][-1] == [249], "DistributedSampler's tail, unpadded"
    assert_same_run(big, two)


def test_accumulation_longer_than_an_epoch_averages_the_epoch(tmp_path):
    """12 examples, batch 2, accumulation 8: each epoch is one window of 6 micro-batches, the update of batch 12."""
    args = ["--opt", "sgd", "--loss", "mean", "--lr", "0.5", "--num_examples", "12"]
    whole = run_one_process(tmp_path, "whole", *args, "--batch_size", "12")
    accumulated = run_one_process(tmp_path, "acc", *args, "--batch_size", "2", "--gradient_accumulation_steps", "8")
    assert_same_run(whole, accumulated)
