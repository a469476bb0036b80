"""Training sets mixed by weight (trainer.data.mixing) through real processes (tests/mixing_job.py): the same
examples and updates at 1 process x batch 8 as at 2 x 4, each log's shares, a resume after a killed rank
bit-identical to the run never interrupted, and datasets streams interleaved."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch
from safetensors.torch import load_file

from conftest import JOBS, ROOT, accelerate_launch, python, split_jobs

MIXING = ROOT / "tests" / "mixing_job.py"
HAS_DATASETS = importlib.util.find_spec("datasets") is not None


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    """{name: output_dir} of: 1 process x batch 8; 2 x 4; 2 x 4 with rank 1 killed after step 7, then resumed;
    two streams, 2 x 4. And the resumed run's output."""
    out = tmp_path_factory.mktemp("mixing")
    runs = {name: out / name for name in ("one", "two", "killed", "streams")}
    python(MIXING, "--output_dir", runs["one"], "--batch_size", "8")
    killed = accelerate_launch(MIXING, "--output_dir", runs["killed"], "--crash_at", "7", expect_ok=False)
    assert killed.returncode != 0 and not (runs["killed"] / "final").exists()
    jobs = [[str(MIXING), "--output_dir", str(runs[name])] for name in ("two", "killed")]
    if HAS_DATASETS:  # a host without datasets (a bare GPU host) runs the rest
        jobs.append([str(MIXING), "--output_dir", str(runs["streams"]), "--streams"])
    outputs = split_jobs(accelerate_launch(JOBS, json.dumps(jobs)).stdout)
    return runs, outputs[1]


def figures(output_dir) -> list[dict]:
    return json.loads((output_dir / "mixing.json").read_text())["rows"]


def weights(output_dir) -> dict[str, torch.Tensor]:
    return load_file(str(output_dir / "final" / "model.safetensors"))


def test_the_same_examples_and_updates_at_any_process_count_in_the_weighted_shares(mixed):
    runs, _ = mixed
    one, two = figures(runs["one"]), figures(runs["two"])
    assert [row["step"] for row in one] == [row["step"] for row in two] == list(range(1, 11))
    for a, b in zip(one, two, strict=True):
        assert a["train_loss"] == pytest.approx(b["train_loss"], abs=1e-6)
        # Each log (a step of 8 examples) draws as data_weights asks: 4 of a's and 4 of b's for 6 steps, then 6 and 2.
        shares = (0.5, 0.5) if a["step"] <= 6 else (0.75, 0.25)
        assert (a["data/a"], a["data/b"]) == (b["data/a"], b["data/b"]) == shares, (a, b)
    for name, tensor in weights(runs["one"]).items():
        assert torch.allclose(tensor, weights(runs["two"])[name], atol=1e-6), name
    logged = [json.loads(line) for line in (runs["two"] / "metrics" / "rank1.jsonl").read_text().splitlines()]
    assert [row["data/a"] for row in logged if "rank/loss" in row] == [0.5] * 6 + [0.75] * 4, "on every rank's sinks"


def test_a_run_killed_mid_epoch_resumes_bit_identical(mixed):
    runs, resumed = mixed
    assert f"resumed from {runs['killed']}/checkpoints/step-00000006: step 6, epoch 1, batch 1" in resumed
    uninterrupted, again = weights(runs["two"]), weights(runs["killed"])
    assert all(torch.equal(uninterrupted[name], again[name]) for name in uninterrupted)
    assert [row["train_loss"] for row in figures(runs["killed"])] == [
        row["train_loss"] for row in figures(runs["two"])
    ][6:]


@pytest.mark.skipif(not HAS_DATASETS, reason="datasets is not installed")
def test_datasets_streams_are_interleaved_by_weight(mixed):
    runs, _ = mixed
    assert [row["step"] for row in figures(runs["streams"])] == list(range(1, 7))
    assert (runs["streams"] / "final" / "model.safetensors").is_file()
