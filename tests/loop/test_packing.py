"""Packed sequences: documents flattened into one row per micro-batch with ``position_ids`` restarting at each one
(transformers' ``DataCollatorWithFlattening``) train exactly as the same documents padded, through 2 processes:
each document attends to itself alone, and every counted token weighs the same. A model whose attention crosses the
documents (OPT) is refused at the first step."""

from __future__ import annotations

import json

import numpy as np

from conftest import ROOT, accelerate_launch


def test_packed_documents_give_the_losses_and_updates_of_the_same_documents_padded(tmp_path):
    accelerate_launch(ROOT / "tests" / "jobs" / "packing.py", "--out", tmp_path, config="cpu.yaml", num_processes=2)
    runs = json.loads((tmp_path / "packing.json").read_text())
    for arch in ("gpt2", "llama"):
        packed, padded = runs[f"{arch} packed"], runs[f"{arch} padded"]
        assert len(packed["losses"]) == 4
        np.testing.assert_allclose(packed["losses"], padded["losses"], rtol=1e-6, err_msg=arch)
        for name, values in padded["weights"].items():
            np.testing.assert_allclose(packed["weights"][name], values, rtol=0, atol=1e-6, err_msg=f"{arch} {name}")
        # examples/s counts documents, not the one row each flattened micro-batch is: a step reads 8 documents
        # (4 a process, in order), and tokens/s their tokens (no padding), so examples per token is 8 / their length.
        lengths = packed["lengths"]
        steps = [8 / sum(lengths[8 * s : 8 * s + 8]) for s in range(4)]
        np.testing.assert_allclose(packed["examples_per_token"], steps, rtol=1e-9, err_msg=arch)
    assert runs["opt packed"].startswith("the batches are packed"), runs["opt packed"]
    assert "OPTForCausalLM's attention crosses those restarts" in runs["opt packed"]
