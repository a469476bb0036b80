"""Training sets mixed by weight (trainer.data.mixing) through real processes (tests/jobs/mixing_job.py): the same
examples and updates at 1 process x batch 8 as at 2 x 4, each log's shares, a resume after a killed rank
bit-identical to the run never interrupted, and datasets streams interleaved."""

from __future__ import annotations

import importlib.util
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from conftest import JOBS, ROOT, accelerate_launch, job_exits, python, split_jobs

MIXING = ROOT / "tests" / "jobs" / "mixing_job.py"
HAS_DATASETS = importlib.util.find_spec("datasets") is not None


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    """{name: output_dir} of: 1 process x batch 8; 2 x 4; 2 x 4 with rank 1 killed after step 7, then resumed; a
    copy of the killed run resumed with set a resized (30 -> 38 examples); weights infinite, and finite but summing
    to infinity; two streams, 2 x 4. And the resumed runs' exit statuses, outputs and errors, by name."""
    out = tmp_path_factory.mktemp("mixing")
    runs = {name: out / name for name in ("one", "two", "killed", "resized", "infinite", "overflowing", "streams")}
    python(MIXING, "--output_dir", runs["one"], "--batch_size", "8")
    killed = accelerate_launch(MIXING, "--output_dir", runs["killed"], "--crash_at", "7", expect_ok=False)
    assert killed.returncode != 0 and not (runs["killed"] / "final").exists()
    shutil.copytree(runs["killed"], runs["resized"])
    args = {
        "resized": ["--size_a", "38"],
        "infinite": ["--weights", '{"a": Infinity, "b": 1}'],
        "overflowing": ["--weights", '{"a": 1e308, "b": 1e308}'],
        "streams": ["--streams"],
    }
    # A host without datasets (a bare GPU host) runs the rest.
    names = [name for name in runs if name != "one" and (HAS_DATASETS or name != "streams")]
    jobs = [[str(MIXING), "--output_dir", str(runs[name]), *args.get(name, [])] for name in names]
    launched = accelerate_launch(JOBS, json.dumps(jobs), expect_ok=False)
    exits, outs, errs = job_exits(launched.stderr, len(names)), split_jobs(launched.stdout), split_jobs(launched.stderr)
    return runs, {name: ended for name, *ended in zip(names, exits, outs, errs, strict=True)}


def figures(output_dir) -> list[dict]:
    return json.loads((output_dir / "mixing.json").read_text())["rows"]


def weights(output_dir) -> dict[str, torch.Tensor]:
    return load_file(str(output_dir / "final" / "model.safetensors"))


def test_the_same_examples_and_updates_at_any_process_count_in_the_weighted_shares(mixed):
    runs, ended = mixed
    assert ended["two"][0] == 0, ended["two"][2][-3000:]
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
    runs, ended = mixed
    status, resumed, _ = ended["killed"]
    assert (
        status == 0 and f"resumed from {runs['killed']}/checkpoints/step-00000006: step 6, epoch 1, batch 1" in resumed
    )
    uninterrupted, again = weights(runs["two"]), weights(runs["killed"])
    assert all(torch.equal(uninterrupted[name], again[name]) for name in uninterrupted)
    assert [row["train_loss"] for row in figures(runs["killed"])] == [
        row["train_loss"] for row in figures(runs["two"])
    ][6:]


@pytest.mark.skipif(not HAS_DATASETS, reason="datasets is not installed")
def test_datasets_streams_are_interleaved_by_weight(mixed):
    runs, ended = mixed
    assert ended["streams"][0] == 0, ended["streams"][2][-3000:]
    assert [row["step"] for row in figures(runs["streams"])] == list(range(1, 7))
    assert (runs["streams"] / "final" / "model.safetensors").is_file()


def trainer_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "trainer: " in line]


def test_a_training_set_resized_mid_epoch_is_refused_at_the_resume_and_the_checkpoint_kept(mixed):
    """Set a had 30 examples when step 6's checkpoint was written, one step into an epoch; resumed with 38, the
    epoch's order (drawn from the sizes) is another: some examples would be read twice and others never. It was
    accepted without a word, and the run ended 5.5e-3 away from where either data would lead."""
    runs, ended = mixed
    status, _, errors = ended["resized"]
    checkpoint = runs["resized"] / "checkpoints" / "step-00000006"
    assert status == 1 and trainer_lines(errors) == [
        f"[rank0]: trainer: checkpoint {checkpoint}: the training data has changed size since it was written (a 30, "
        "b 10 examples then, a 38, b 10 now), in the epoch it stopped in: its order is drawn from the sizes, so some "
        "examples would be read twice and others never. Resume with the data it was written with until the epoch "
        "ends (a checkpoint at an epoch's end takes any), or start a new run in another output_dir"
    ], errors[-3000:]
    assert (runs["resized"] / "checkpoints" / "latest").read_text() == "step-00000006"
    assert not (runs["resized"] / "final").exists()


@pytest.mark.parametrize(
    "name, said",
    [
        ("infinite", "data_weights['a'] is inf: a weight (a finite number, 0 or more)"),
        ("overflowing", "data_weights from step 0 sum to inf ({'a': 1e+308, 'b': 1e+308}): give weights whose sum"),
    ],
)
def test_weights_that_are_not_finite_or_sum_to_infinity_are_refused_by_name(mixed, name, said):
    """A raw ``torch.cat(): expected a non-empty list of Tensors`` from every rank before."""
    _, ended = mixed
    status, _, errors = ended[name]
    assert status == 1 and len(trainer_lines(errors)) == 1 and said in trainer_lines(errors)[0], errors[-3000:]
    assert "Traceback" not in errors, errors[-3000:]
