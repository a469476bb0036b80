"""datasets.Dataset straight from .map(tokenize): the README's text-classification recipe, and trainer.columns."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from datasets import Dataset

from trainer.data.columns import ready_columns
from trainer.data.loaders import DataError

from conftest import JOBS, ROOT, accelerate_launch, split_jobs

RECIPE = ROOT / "examples" / "text_classification.py"


PADDINGS = {"dynamic": [], "max_length": ["--pad_to_max_length", "--max_length", "16"]}


@pytest.fixture(scope="module")
def recipe_runs(tmp_path_factory) -> dict[str, tuple[str, Path]]:
    """padding -> (the recipe's output, its output_dir): both runs in one launch of 2 processes
    (tests/jobs/run_many.py)."""
    out = tmp_path_factory.mktemp("recipe")
    runs = [[str(RECIPE), "--output_dir", str(out / padding), *flags] for padding, flags in PADDINGS.items()]
    outputs = split_jobs(accelerate_launch(JOBS, json.dumps(runs)).stdout)
    return {padding: (output, out / padding) for padding, output in zip(PADDINGS, outputs, strict=True)}


@pytest.mark.parametrize("padding", PADDINGS)
def test_text_classification_recipe_through_two_processes(recipe_runs, padding):
    out, output_dir = recipe_runs[padding]
    if padding == "dynamic":  # DataCollatorWithPadding pads each batch; the strings never reach it
        assert out.count("trainer | train_data: left out text (not inputs of model.forward)") == 1
        # The test split, read by predict() after training, is named as what it is ("data" before).
        assert out.count("trainer | predict(data): left out text (not inputs of model.forward)") == 1
    else:  # no collate_fn: the raw tokenised Dataset is formatted for the model, and said once
        assert (
            out.count(
                "trainer | train_data (a datasets.Dataset): labels, input_ids, attention_mask as torch "
                "tensors; left out text (not inputs of model.forward); label renamed labels"
            )
            == 1
        )
    accuracy = re.search(r"^text_classification \| eval accuracy ([\d.]+) at step (\d+) \((.*?)\)", out, re.M)
    assert float(accuracy[1]) >= 0.9
    assert accuracy[3] == "stopped early" and int(accuracy[2]) < 220  # EarlyStopping on eval_accuracy
    test = re.search(r"^text_classification \| test accuracy ([\d.]+) over (\d+) predictions", out, re.M)
    assert float(test[1]) >= 0.9 and test[2] == "100"  # predict(): every test example once, in order
    assert (output_dir / "checkpoints" / "best").is_file()


class TakesIds(torch.nn.Module):
    def forward(self, input_ids, attention_mask=None, labels=None):
        return input_ids


def tokenised(lengths: list[int]) -> Dataset:
    count = len(lengths)
    return Dataset.from_dict(
        {
            "text": [f"text {i}" for i in range(count)],
            "idx": list(range(count)),
            "input_ids": [list(range(n)) for n in lengths],
            "label": [0, 1, 0][:count],
        }
    )


def test_lists_of_different_lengths_without_a_collate_fn_are_refused_naming_the_columns_and_the_fix():
    with pytest.raises(DataError) as refused:
        ready_columns(tokenised([3, 5, 4]), TakesIds(), collate=False, name="train_data")
    assert "train_data: column(s) input_ids hold lists of different lengths" in str(refused.value)
    assert "collate_fn=DataCollatorWithPadding(tokenizer)" in str(refused.value)


def test_fixed_length_rows_become_the_models_tensors():
    data, said = ready_columns(tokenised([4, 4, 4]), TakesIds(), collate=False, name="eval_data")
    assert said == (
        "eval_data (a datasets.Dataset): input_ids, labels as torch tensors; left out text, idx (not "
        "inputs of model.forward); label renamed labels"
    )
    batch = next(iter(torch.utils.data.DataLoader(data, batch_size=3)))
    assert set(batch) == {"input_ids", "labels"} and batch["input_ids"].shape == (3, 4)


def test_with_a_collate_fn_the_rows_stay_python_without_the_unused_columns():
    data, said = ready_columns(tokenised([3, 5, 4]), TakesIds(), collate=True, name="train_data")
    assert said == "train_data: left out text, idx (not inputs of model.forward)"
    assert data[1] == {"input_ids": [0, 1, 2, 3, 4], "label": 1}


def test_a_dataset_the_user_formatted_is_used_as_is():
    mine = tokenised([4, 4, 4]).with_format("torch", columns=["input_ids", "idx"])
    data, said = ready_columns(mine, TakesIds(), collate=False, name="train_data")
    assert data is mine and said is None
