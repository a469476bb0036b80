"""A LoRA adapter (PEFT) trained through real processes (tests/lora.py): only the adapter changes, 2 processes
give the updates of 1 (the loss is the transformers model's inside PEFT's wrapper, weighed by its tokens), FSDP2
gives DDP's, a resume is bit-exact, and ``final/`` is the adapter as PEFT writes it, which PEFT's own loader puts
back on a fresh base model."""

from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import ROOT, accelerate_launch, python

pytest.importorskip("peft")  # in the test extra; a host without it (the GPU host) skips
pytestmark = pytest.mark.xdist_group("lora")  # one worker runs the module: its launch runs once
LORA = ROOT / "tests" / "lora.py"


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, dict]:
    out = tmp_path_factory.mktemp("lora")
    jobs = {"fsdp": [], "ddp": ["--ddp"], "resumed": ["--ddp", "--resume_from", f"{out}/ddp/checkpoints/step-00000002"]}
    accelerate_launch(LORA, "--out", out, "--jobs", json.dumps(jobs), config="fsdp.yaml")
    python(LORA, "--out", out, "--jobs", json.dumps({"one process": ["--accumulation", "2"]}))
    return {name: json.loads((out / name / "lora.json").read_text()) for name in [*jobs, "one process"]}


def test_only_the_adapter_trains_with_the_same_updates_on_any_split_and_resumes_bit_exact(runs):
    ddp = runs["ddp"]
    for name, run in runs.items():
        assert run["frozen_kept"], f"{name}: a frozen base weight changed"
        assert all("lora_" in tensor for tensor in run["trained"]), name
    assert runs["resumed"]["trained"] == ddp["trained"]  # continued from step 2: bit-exact
    for name in ("one process", "fsdp"):  # 1 process x accumulation 2, and sharded: the same global batch
        for tensor, values in ddp["trained"].items():
            np.testing.assert_allclose(runs[name]["trained"][tensor], values, rtol=0, atol=1e-7, err_msg=name)
        np.testing.assert_allclose(runs[name]["losses"], ddp["losses"], rtol=1e-6, err_msg=name)
    assert 4.0 < ddp["losses"][0] < 4.3  # ln(64): the whole loss at 2 processes, not half of it


def test_final_is_the_adapter_that_peft_loads_back(runs):
    for name, run in runs.items():
        assert {"adapter_config.json", "adapter_model.safetensors"} <= set(run["final"]), name
        assert "model.safetensors" not in run["final"], name
        assert run["loaded_back"], f"{name}: PeftModel.from_pretrained(base, final) holds other weights"
