"""Same updates on a language model's real data (tests/jobs/ragged_lm.py: a tiny GPT-2 on ragged sequences padded to 32,
labels -100 on the padding): every counted token of the global batch weighs the same whatever the split into
processes and accumulation micro-batches; transformers' own Trainer as the outside oracle; streaming data sets read
by every process, each its own part, resumed bit-identically. Through real processes."""

from __future__ import annotations

import json

import numpy as np
import pytest
import transformers
from packaging.version import Version

from conftest import ROOT, accelerate_launch, python

RAGGED = ROOT / "tests" / "jobs" / "ragged_lm.py"


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
    return max(
        float(np.max(np.abs(np.subtract(a["weights"][k], b["weights"][k]))) / np.max(np.abs(b["weights"][k])))
        for k in b["weights"]
    )


# One launch each for the 1-process and the 2-process jobs (tests/jobs/ragged_lm.py --variants): the start-up paid once.
ONE_PROCESS = {
    "batch 8": ["--batch_size", "8"],
    "1 process x 4 x accumulation 2": ["--batch_size", "4", "--accumulation", "2"],
}
TWO_PROCESSES = {
    "2 processes x 2 x accumulation 2": ["--batch_size", "2", "--accumulation", "2"],
    "2 processes x 4": ["--batch_size", "4"],
    "2 processes x 4, their loss_fn returns (sum, count)": ["--batch_size", "4", "--loss", "pair"],
    "2 processes x 2 x accumulation 2, a torch IterableDataset": [
        "--batch_size",
        "2",
        "--accumulation",
        "2",
        "--data",
        "torch_stream",
        "--max_steps",
        "6",
    ],
}
# GPT-2 as a sequence classifier takes **kwargs but computes its loss inline, a mean over its examples: weighed by
# its examples. 46 examples, batch 4: 1 process x accumulation 2 ends on a window of 4 + 2 examples (an average of
# the two micro-batch means would give the 2 examples the weight of 4); 2 processes end on 3 + 3.
CLASSIFIER = ["--model", "classifier", "--examples", "46"]
ONE_PROCESS.update(
    {
        "classifier, batch 8": [*CLASSIFIER, "--batch_size", "8"],
        "classifier, 1 process x 4 x accumulation 2": [*CLASSIFIER, "--batch_size", "4", "--accumulation", "2"],
    }
)
TWO_PROCESSES["classifier, 2 processes x 4"] = [*CLASSIFIER, "--batch_size", "4"]


# The uninterrupted jobs the stream resumes are compared with (by processes, steps), in the same launches.
IN_ORDER = {(1, 14), (2, 10)}


@pytest.fixture(scope="module")
def splits(tmp_path_factory) -> dict[str, dict]:
    """Every job of ONE_PROCESS and TWO_PROCESSES, and the uninterrupted jobs of IN_ORDER ("in order, P x S"): two
    launches, one per process count. Summaries by name."""
    tmp_path, runs = tmp_path_factory.mktemp("splits"), {}
    for processes, variants in ((1, ONE_PROCESS), (2, TWO_PROCESSES)):
        flags = {name: [*args, *([] if "classifier" in name else ["--eval"])] for name, args in variants.items()}
        flags.update(
            {
                f"in order, {p} x {steps}": [*RESUMED, "--max_steps", str(steps)]
                for p, steps in IN_ORDER
                if p == processes
            }
        )
        keys = {f"v{i}": name for i, name in enumerate(flags)}
        run(
            tmp_path,
            str(processes),
            "--variants",
            json.dumps({key: flags[name] for key, name in keys.items()}),
            processes=processes,
        )
        runs.update(
            {
                name: json.loads((tmp_path / str(processes) / key / "ragged.json").read_text())
                for key, name in keys.items()
            }
        )
    return runs


def test_every_counted_token_weighs_the_same_whatever_the_split(splits):
    runs = {name: summary for name, summary in splits.items() if not name.startswith("in order")}
    for split, summary in runs.items():
        reference = runs["classifier, batch 8" if split.startswith("classifier") else "batch 8"]
        assert summary["world_size"] == (2 if "2 processes" in split else 1)
        # Before token weighting: 0.60 (2 x 2 x 2), 0.24 (2 x 4), 0.17 (1 x 4 x 2) apart. Now float order alone.
        difference = largest_difference(summary, reference)
        print(f"{split}: largest weight difference {difference:.2e} (relative)")
        assert difference < 1e-5, split
        np.testing.assert_allclose(summary["losses"], reference["losses"], rtol=1e-5, err_msg=split)
        # The eval loss counts each token once too, on any number of processes.
        if not split.startswith("classifier"):
            assert summary["eval_loss"] == pytest.approx(summary["eval_reference"], rel=1e-5), split


ORACLE_CASES = {
    "adamw, accumulation 4, warm-up + cosine, clipping, weight decay 0.1, a short last window": [
        "--examples",
        "52",
        "--batch_size",
        "2",
        "--accumulation",
        "4",
        "--optimizer",
        "adamw",
        "--lr",
        "0.01",
        "--weight_decay",
        "0.1",
        "--schedule",
        "cosine",
        "--warmup",
        "2",
        "--clip",
        "0.5",
    ],
    "sgd, batch 8": ["--batch_size", "8"],
}


@pytest.mark.skipif(
    Version(transformers.__version__) < Version("5.17"),
    reason="transformers' Trainer counts a causal LM's tokens after the shift from 5.x (checked: 5.17)",
)
def test_transformers_trainer_reaches_the_same_weights_bit_for_bit(tmp_path):
    cases = {f"c{i}": flags for i, flags in enumerate(ORACLE_CASES.values())}
    for trainer in ("ours", "hf"):
        run(tmp_path, trainer, "--trainer", trainer, "--variants", json.dumps(cases))
    for key, case in zip(cases, ORACLE_CASES, strict=True):
        ours, theirs = (json.loads((tmp_path / t / key / "ragged.json").read_text()) for t in ("ours", "hf"))
        assert len(ours["losses"]) == len(theirs["losses"]) > 5, case
        for name, values in theirs["weights"].items():
            assert ours["weights"][name] == values, f"{case}: {name} differs from transformers' Trainer"
        np.testing.assert_allclose(ours["losses"], theirs["losses"], rtol=1e-6, err_msg=case)  # theirs: float32 sums
        assert ours["lrs"] == theirs["lrs"], f"{case}: the logged lr is the one the step used, as transformers logs it"
        if "warm-up" in case:
            assert ours["lrs"][:3] == [0.0, 0.005, 0.01]


RESUMED = ["--batch_size", "2", "--accumulation", "2", "--save_every", "2", "--optimizer", "adamw", "--lr", "0.01"]


@pytest.fixture(scope="module")
def in_order(splits):
    """The uninterrupted job read from the list of sequences, by process count and steps: a stream split per
    process reads the same examples in the same order (every K-th), so it must reach these very weights."""
    return lambda processes, steps: splits[f"in order, {processes} x {steps}"]


# A pass over the stream is 12 steps on 1 process, 6 on 2. (data, processes, max_steps, crash after, checkpoint
# resumed, the first batch each process reads when it reruns): at the very end of a pass on 1 process, a datasets
# stream and a torch IterableDataset with state_dict(); 2 steps into the second pass on 2 (datasets'
# split_dataset_by_node: every 2nd example).
STREAM_RESUMES = [
    ("stream", 1, 14, 13, 12, [[0, 1]]),
    ("torch_stream", 1, 14, 13, 12, [[0, 1]]),
    ("stream", 2, 10, 9, 8, [[16, 18], [17, 19]]),
]


@pytest.mark.parametrize("data,processes,steps,crash,resumed_at,first_reads", STREAM_RESUMES)
def test_a_stream_is_read_in_parts_and_resumes_where_it_stopped_bit_identical(
    tmp_path, in_order, data, processes, steps, crash, resumed_at, first_reads
):
    if data == "stream":
        pytest.importorskip("datasets")
    args = [*RESUMED, "--data", data, "--max_steps", str(steps)]
    run(tmp_path, "crashed", *args, "--crash_at", str(crash), processes=processes, expect_ok=False)
    resumed, result = run(tmp_path, "crashed", *args, processes=processes)
    assert f"resumed from {tmp_path}/crashed/checkpoints/step-{resumed_at:08d}: step {resumed_at}," in result.stdout
    # Each process's position was in the checkpoint: the rerun reads on from there, its own part, nothing before.
    assert [reads[0] for reads in resumed["seen"]] == first_reads
    # The same weights, bit for bit, as the uninterrupted job read from the list of sequences.
    for name, values in in_order(processes, steps)["weights"].items():
        assert resumed["weights"][name] == values, f"{name} differs"


def test_a_stream_that_cannot_say_where_it_is_is_refused_at_resume(tmp_path):
    args = [*RESUMED, "--data", "torch_stream", "--stateless", "--max_steps", "10"]
    run(tmp_path, "run", *args, "--crash_at", "5", expect_ok=False)
    _, result = run(tmp_path, "run", *args, expect_ok=False)
    assert (
        "trainer: the checkpoint is 8 batches into an epoch of train_data (TorchStream), but it could not say "
        "where it stood: it has no state_dict() / load_state_dict()" in result.stderr
    )
    assert "Traceback" not in result.stderr
