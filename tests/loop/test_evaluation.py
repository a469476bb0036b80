"""evaluate() with metrics_fn and predict(): every example counted once, in dataset order, whatever the process
count. Real processes: 9 examples on 1 process (plain python) and on 2 (accelerate launch), a fixed model."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import SCENARIOS, accelerate_launch, python


def reports(output: str) -> dict[str, dict]:
    lines = [line.split(" ", 2) for line in output.splitlines() if line.startswith("PREDICT ")]
    return {rank: json.loads(payload) for _, rank, payload in lines}


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    (report,) = reports(python(SCENARIOS, "predict", "--output_dir", tmp_path_factory.mktemp("one")).stdout).values()
    return report


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
    two = reports(accelerate_launch(SCENARIOS, "predict", "--output_dir", tmp_path_factory.mktemp("two")).stdout)
    assert set(two) == {"rank0", "rank1"}
    return two


def test_metrics_count_every_example_once_and_match_one_process(one_process, two_processes):
    expected = one_process["expected_labels"]
    for report in [one_process, *two_processes.values()]:
        metrics = report["metrics"]
        assert metrics["eval_examples"] == 9
        # The mean label is exact only if each of the 9 examples is counted once (padding would repeat example 0).
        assert metrics["eval_label"] == pytest.approx(sum(expected) / 9, rel=1e-12)
        assert metrics["eval_accuracy"] == pytest.approx(one_process["metrics"]["eval_accuracy"], rel=1e-12)
        assert metrics["eval_loss"] == pytest.approx(one_process["metrics"]["eval_loss"], rel=1e-6)


def test_predictions_come_back_in_dataset_order_on_every_process(one_process, two_processes):
    assert one_process["labels"] == one_process["expected_labels"]
    for report in two_processes.values():
        assert report["labels"] == one_process["expected_labels"]  # example i's own label in row i
        assert len(report["logits"]) == 9
        for row, reference in zip(report["logits"], one_process["logits"], strict=True):
            assert row == pytest.approx(reference, rel=1e-5)


def test_predictions_made_in_bf16_come_back_as_fp32_on_the_cpu():
    """Under mixed precision a model's outputs are bf16 (or fp16), which numpy cannot read: predict() returns fp32,
    row by row off the device."""
    from types import SimpleNamespace

    import torch

    from trainer.loop.evaluation import predict

    model = torch.nn.Linear(3, 2)
    loader = [torch.ones(2, 3), torch.ones(1, 3)]
    autocast = lambda: torch.autocast("cpu", dtype=torch.bfloat16)  # noqa: E731
    # One process's run: its device, its data-parallel place, no host group, its own decisions.
    single = SimpleNamespace(size=1, rank=0, group=None)
    run = SimpleNamespace(device=torch.device("cpu"), dp=single, host=None, main_decides=lambda decide: decide())
    rows = predict(model, loader, run=run, predict_fn=lambda m, batch: m(batch), autocast=autocast, num_examples=3)
    assert rows.dtype == torch.float32 and rows.device.type == "cpu" and rows.numpy().shape == (3, 2)


def test_a_users_metrics_on_the_cpu_join_the_trainers_sums_on_any_device():
    """metrics_fn returning numpy or CPU tensors (sklearn, .cpu()) while the trainer's sums live on the device: on
    a CPU host the meta device stands in for a GPU. Everything is combined on the device; the only failure left is
    the final read, which a meta tensor cannot give (a GPU's can)."""
    import contextlib
    from types import SimpleNamespace

    import numpy as np
    import torch

    from trainer.loop.evaluation import evaluate

    meta = torch.device("meta")
    batches = [torch.ones(2, 3), torch.ones(1, 3)]
    loss_fn = lambda model, batch: torch.zeros((), device=meta)  # noqa: E731
    metrics_fn = lambda model, batch: {"numpy": np.ones(len(batch)), "cpu": torch.ones(len(batch))}  # noqa: E731
    single = SimpleNamespace(size=1, rank=0, group=None)
    run = SimpleNamespace(device=meta, dp=single, host=None, main_decides=lambda decide: decide())
    with pytest.raises(NotImplementedError, match="meta"):  # "Cannot copy out of meta tensor": the final read
        evaluate(
            torch.nn.Identity(),
            batches,
            run=run,
            loss_fn=loss_fn,
            metrics_fn=metrics_fn,
            autocast=contextlib.nullcontext,
            tokens=lambda batch: None,
        )


def test_eval_data_as_a_dict_must_name_data_sets():
    """A dict of named data sets is several eval sets; a dict of columns (a batch) is refused naming its entries."""
    from trainer.errors import DataError
    from trainer.loop.evaluation import named_sets

    assert list(named_sets({"val": [{"x": 1}], "test": [{"x": 2}]})) == ["val", "test"]
    assert named_sets([{"x": 1}]) == {"": [{"x": 1}]} and named_sets(None) == {}
    with pytest.raises(DataError, match="got 'input_ids': Tensor, 'labels': Tensor"):
        named_sets({"input_ids": torch.zeros(2, 3), "labels": torch.zeros(2)})
    with pytest.raises(DataError, match="got 'my set': list"):
        named_sets({"my set": [1]})
