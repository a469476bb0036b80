"""fp8 through torchao (``mixed_precision: fp8``, accelerate config's AO backend) under FSDP2 and DDP, on 2 CPU
processes over gloo: a launch of its own (mixed precision is the launch's), apart from tests/parallel/test_fsdp.py's
shared one so that the two pytest workers share the time. Skipped where torchao is not installed
(``pip install -e ".[fp8]"``; the test extra installs it)."""

from __future__ import annotations

import importlib.util
import json

import numpy as np
import pytest
from test_fsdp import RESUMED, SHORT, launch


@pytest.mark.skipif(importlib.util.find_spec("torchao") is None, reason="fp8 needs torchao: pip install -e '.[fp8]'")
def test_fp8_through_torchao_trains_sharded_and_as_ddp_resumes_bit_for_bit_and_exports_plain_weights(tmp_path):
    """mixed_precision: fp8 with torchao's backend (`accelerate launch --mixed_precision fp8 --fp8_backend ao`, as
    `accelerate config` writes it): a Llama's Linear layers compute in fp8 (all-gathered in fp8 under FSDP2), the
    output head in bf16, said on the banner; the same rows' loss falls in the second epoch under FSDP2 and DDP; a
    resume is the straight run bit for bit; the export is a plain model from_pretrained reads. A GPT-2, whose layers
    are Conv1D (the head aside), has nothing torchao converts: refused by name."""
    # One block, 24 rows: 3 steps an epoch (fp8's casts take half a second a step on this CPU).
    llama = ["--arch", "llama", "--width", "64", "--layers", "1", *RESUMED, "--examples", "24"]
    variants = {
        "fsdp": llama,
        "ddp": [*llama, "--ddp"],
        "resumed": [*llama, "--resume_from", f"{tmp_path}/fsdp/checkpoints/step-00000002"],
        "gpt2": [*SHORT, "--expect_refusal"],
    }
    fp8 = ["--mixed_precision", "fp8", "--fp8_backend", "ao"]
    result = launch(tmp_path, "--variants", json.dumps(variants), run_args=fp8)
    words = "mixed precision bf16, fp8 (torchao) in 7 Linear layers; in bf16: lm_head (the output head)"
    assert result.stdout.count(words) == 3, result.stdout
    runs = {name: json.loads((tmp_path / name / "ragged.json").read_text()) for name in variants}
    for name in ("fsdp", "ddp"):
        losses = runs[name]["losses"]
        assert np.mean(losses[3:]) < np.mean(losses[:3]) - 0.05, (name, losses)
    assert runs["resumed"]["weights"] == runs["fsdp"]["weights"]
    from transformers import LlamaForCausalLM

    exported = LlamaForCausalLM.from_pretrained(tmp_path / "fsdp" / "final")
    for name, parameter in exported.named_parameters():
        assert parameter.flatten().tolist() == runs["fsdp"]["weights"][name], name
    assert runs["gpt2"]["refused"].startswith("mixed_precision: fp8: GPT2LMHeadModel has no nn.Linear layer"), runs
