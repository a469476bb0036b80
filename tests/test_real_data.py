"""Same updates on a language model's real data (tests/ragged_lm.py: a tiny GPT-2 on ragged sequences padded to 32,
labels -100 on the padding): every counted token of the global batch weighs the same whatever the split into
processes and accumulation micro-batches; transformers' own Trainer as the outside oracle; streaming data sets read
by every process, each its own part, resumed bit-identically. Through real processes."""

from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import ROOT, accelerate_launch, python, torchrun

RAGGED = ROOT / "tests" / "ragged_lm.py"


def run(tmp_path, name, *args, processes=1, launcher=None, **kw):
    out = tmp_path / name
    if processes == 1:
        result = python(RAGGED, "--out", out, *args, **kw)
    else:
        result = (launcher or accelerate_launch)(RAGGED, "--out", out, *args, **kw)
    summary = json.loads((out / "ragged.json").read_text()) if (out / "ragged.json").exists() else None
    return summary, result


def largest_difference(a: dict, b: dict) -> float:
    """The largest weight difference, relative to the largest weight of its tensor."""
    return max(float(np.max(np.abs(np.subtract(a["weights"][k], b["weights"][k]))) / np.max(np.abs(b["weights"][k])))
               for k in b["weights"])  # fmt: skip


@pytest.fixture(scope="module")
def one_process_batch_8(tmp_path_factory):
    """The reference: 1 process, batch 8, SGD, 6 steps (one epoch of the 48 sequences)."""
    return run(tmp_path_factory.mktemp("reference"), "one", "--batch_size", "8", "--eval")[0]


SPLITS = {"2 processes x 2 x accumulation 2": ["--batch_size", "2", "--accumulation", "2"],
          "2 processes x 4": ["--batch_size", "4"],
          "1 process x 4 x accumulation 2": ["--batch_size", "4", "--accumulation", "2"],
          "2 processes x 4, their loss_fn returns (sum, count)": ["--batch_size", "4", "--loss", "pair"]}


@pytest.mark.parametrize("split", list(SPLITS))
def test_every_counted_token_weighs_the_same_whatever_the_split(tmp_path, one_process_batch_8, split):
    args = SPLITS[split]
    processes = 1 if split.startswith("1 process") else 2
    summary, _ = run(tmp_path, "split", *args, "--eval", processes=processes)
    assert summary["world_size"] == processes
    # Before token weighting: 0.71 (2 x 2 x 2) and 0.26 (1 x 4 x 2) apart. Now float reduction order alone.
    difference = largest_difference(summary, one_process_batch_8)
    print(f"{split}: largest weight difference {difference:.2e} (relative)")
    assert difference < 1e-5
    np.testing.assert_allclose(summary["losses"], one_process_batch_8["losses"], rtol=1e-5)
    # The eval loss counts each token once too, on any number of processes.
    assert summary["eval_loss"] == pytest.approx(summary["eval_reference"], rel=1e-5)


@pytest.mark.parametrize("processes,accumulation", [(1, 2), (2, 1)])
def test_a_model_that_averages_its_own_loss_is_weighed_by_its_count(tmp_path, processes, accumulation):
    """GPT-2 as a sequence classifier takes **kwargs but computes its loss inline: its mean is weighed by its
    examples. 46 examples, batch 4: 1 process x accumulation 2 ends on a window of 4 + 2 examples (an average of
    the two micro-batch means would give the 2 examples the weight of 4); 2 processes end on 3 + 3."""
    args = ["--model", "classifier", "--examples", "46"]
    big, _ = run(tmp_path, "big", *args, "--batch_size", "8")
    split, _ = run(tmp_path, "split", *args, "--batch_size", "4", "--accumulation", str(accumulation),
                   processes=processes)  # fmt: skip
    assert largest_difference(split, big) < 1e-5
    np.testing.assert_allclose(split["losses"], big["losses"], rtol=1e-5)


ORACLE_CASES = {
    "adamw, accumulation 4, warm-up + cosine, clipping, weight decay 0.1, a short last window": [
        "--examples", "52", "--batch_size", "2", "--accumulation", "4", "--optimizer", "adamw", "--lr", "0.01",
        "--weight_decay", "0.1", "--schedule", "cosine", "--warmup", "2", "--clip", "0.5"],
    "sgd, batch 8": ["--batch_size", "8"],
}  # fmt: skip


@pytest.mark.parametrize("case", list(ORACLE_CASES))
def test_transformers_trainer_reaches_the_same_weights_bit_for_bit(tmp_path, case):
    ours, _ = run(tmp_path, "ours", *ORACLE_CASES[case])
    theirs, _ = run(tmp_path, "hf", "--trainer", "hf", *ORACLE_CASES[case])
    assert len(ours["losses"]) == len(theirs["losses"]) > 5
    for name, values in theirs["weights"].items():
        assert ours["weights"][name] == values, f"{name} differs from transformers' Trainer"
    np.testing.assert_allclose(ours["losses"], theirs["losses"], rtol=1e-6)  # float32 sums vs ours in float64
    assert ours["lrs"] == theirs["lrs"], "the logged lr is the one the step used, as transformers logs it"
    if "warm-up" in case:
        assert ours["lrs"][:3] == [0.0, 0.005, 0.01]


def test_a_stream_is_read_by_every_process_its_own_part(tmp_path, one_process_batch_8):
    stream, _ = run(tmp_path, "stream", "--data", "stream", "--batch_size", "2", "--accumulation", "2",
                    "--max_steps", "6", processes=2)  # fmt: skip
    rank0, rank1 = stream["seen"]
    read = sorted(i for batch in rank0[:12] + rank1[:12] for i in batch)
    assert read == list(range(48)), "each example once, by one process"
    assert rank0[0] == [0, 2] and rank1[0] == [1, 3], "datasets' split_dataset_by_node: every 2nd example"
    assert largest_difference(stream, one_process_batch_8) < 1e-5
    plain, _ = run(tmp_path, "torch", "--data", "torch_stream", "--batch_size", "4", "--max_steps", "6",
                   processes=2, launcher=torchrun)  # fmt: skip
    assert plain["seen"][1][0] == [1, 3, 5, 7], "a torch IterableDataset: process k keeps examples k, k+K, ..."
    assert largest_difference(plain, one_process_batch_8) < 1e-5


RESUMED = ["--batch_size", "2", "--accumulation", "2", "--save_every", "2", "--optimizer", "adamw", "--lr", "0.01"]

# A pass over the stream is 12 steps on 1 process, 6 on 2. (data, processes, max_steps, crash after, checkpoint
# resumed, the first batch the rerun reads): at the very end of a pass, and 2 steps into the second pass.
STREAM_RESUMES = [("stream", 1, 14, 13, 12, [0, 1]), ("stream", 2, 10, 9, 8, [16, 18]),
                  ("torch_stream", 2, 10, 9, 8, [16, 18])]  # fmt: skip


@pytest.mark.parametrize("data,processes,steps,crash,resumed_at,first_read", STREAM_RESUMES)
def test_a_stream_resumes_where_it_stopped_bit_identical(tmp_path, data, processes, steps, crash, resumed_at,
                                                         first_read):  # fmt: skip
    args = [*RESUMED, "--data", data, "--max_steps", str(steps)]
    full, _ = run(tmp_path, "full", *args, processes=processes)
    run(tmp_path, "crashed", *args, "--crash_at", str(crash), processes=processes, expect_ok=False)
    resumed, result = run(tmp_path, "crashed", *args, processes=processes)
    assert f"resumed from {tmp_path}/crashed/checkpoints/step-{resumed_at:08d}: step {resumed_at}," in result.stdout
    for name, values in full["weights"].items():
        assert resumed["weights"][name] == values, f"{name} differs after the resume"
    # The checkpoint holds each process's position in the stream: the rerun reads on from there, nothing before.
    assert resumed["seen"][0][0] == first_read


def test_a_stream_that_cannot_say_where_it_is_is_refused_at_resume(tmp_path):
    args = [*RESUMED, "--data", "torch_stream", "--stateless", "--max_steps", "10"]
    run(tmp_path, "run", *args, "--crash_at", "5", expect_ok=False)
    _, result = run(tmp_path, "run", *args, expect_ok=False)
    assert "trainer: the checkpoint is 8 batches into an epoch of train_data (TorchStream), but it could not say " \
           "where it stood: it has no state_dict() / load_state_dict()" in result.stderr
    assert "Traceback" not in result.stderr
