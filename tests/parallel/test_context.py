"""Context parallelism (``cp_size`` in the parallelism_config): a tiny Llama (4 heads, 2 KV heads) trains on padded
rows and on packed documents under CP 2 on 2 processes (with chunked_loss too) and FSDP 2 x CP 2 on 4 to the losses,
weights, evaluation and predictions of one process (float order); a CP checkpoint resumes under CP bit for bit and on
one process, and one process's under CP; what cannot be split is refused by name (tests/jobs/context.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from conftest import JOBS, ROOT, accelerate_launch, clean_env, run

JOB = ROOT / "tests" / "jobs" / "context.py"


def launched(runs: dict[str, list], root: Path, *, cp: int = 1, shard: int = 1, processes: int = 1) -> dict:
    """Each run's results ({name: flags}, written under root/name), the runs made one after another in one process
    (plain python) or one launch with that parallelism_config (tests/jobs/run_many.py): a launch's start-up is most
    of a run's time."""
    jobs = json.dumps([[str(JOB), "--out", str(root / name), *map(str, flags)] for name, flags in runs.items()])
    if processes == 1:
        run([sys.executable, str(JOBS), jobs])
    else:
        sizes = {"PARALLELISM_CONFIG_CP_SIZE": str(cp), "PARALLELISM_CONFIG_DP_SHARD_SIZE": str(shard)}
        env = {**clean_env(), "ACCELERATE_USE_PARALLELISM_CONFIG": "true", **sizes}
        accelerate_launch(JOBS, jobs, config="fsdp.yaml", num_processes=processes, env=env)
    found = {name: json.loads((root / name / "context.json").read_text()) for name in runs}
    for name, results in found.items():
        results["weights"] = load_file(root / name / "final" / "model.safetensors")
    return found


def same(found: dict, reference: dict, *, atol: float = 1e-6) -> None:
    np.testing.assert_allclose(found["losses"], reference["losses"], rtol=1e-6)
    assert found["eval_loss"] == pytest.approx(reference["eval_loss"], rel=1e-6)
    np.testing.assert_allclose(found["logits"], reference["logits"], rtol=0, atol=1e-5)
    for name, tensor in reference["weights"].items():
        torch.testing.assert_close(found["weights"][name], tensor, rtol=0, atol=atol, msg=name)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, dict]:
    """Every run of this module but the 4-process one: one process's, then every CP 2 run in one launch of 2 (a CP
    checkpoint resumed under CP, one process's resumed under CP), then the CP checkpoint resumed on one process."""
    root = tmp_path_factory.mktemp("context")
    found = launched({"padded": [], "packed": ["--packed"], "solo": ["--save-every", 1]}, root)
    cp = {
        "cp padded": [],
        "cp packed": ["--packed"],
        "cp padded, chunked_loss": ["--chunked"],
        "whole": ["--save-every", 1],
        "again": ["--resume", root / "whole" / "checkpoints" / "step-00000002"],
        "onto": ["--resume", root / "solo" / "checkpoints" / "step-00000002"],
    }
    found |= launched(cp, root, cp=2, processes=2)
    return found | launched({"resumed alone": ["--resume", root / "whole" / "checkpoints" / "step-00000002"]}, root)


@pytest.mark.parametrize("kind", ["padded", "packed", "padded, chunked_loss"])
def test_cp_2_on_2_processes_trains_as_one_process(runs, kind):
    found = runs[f"cp {kind}"]
    same(found, runs[kind.split(",")[0]])
    assert "CP 2 x FSDP2 over 2 processes" in found["banner"]
    assert "batch 4 per process x 1 processes" in found["banner"]


def test_fsdp_2_x_cp_2_on_4_processes_trains_as_one_process(tmp_path, runs):
    found = launched({"cp 2 x fsdp 2": ["--batch-size", 2]}, tmp_path, cp=2, shard=2, processes=4)["cp 2 x fsdp 2"]
    same(found, runs["padded"])
    assert "CP 2 x FSDP2 over 4 processes" in found["banner"]


def test_a_cp_checkpoint_resumes_under_cp_bit_for_bit_and_on_one_process_and_the_other_way(runs):
    whole, again, alone = runs["whole"], runs["again"], runs["resumed alone"]
    for name, tensor in whole["weights"].items():
        assert torch.equal(again["weights"][name], tensor), name
    assert again["losses"] == whole["losses"][2:]
    for name, tensor in whole["weights"].items():
        torch.testing.assert_close(alone["weights"][name], tensor, rtol=0, atol=1e-6, msg=name)
    # And the other way: a checkpoint of one process resumed under CP 2.
    for name, tensor in runs["solo"]["weights"].items():
        torch.testing.assert_close(runs["onto"]["weights"][name], tensor, rtol=0, atol=1e-6, msg=name)


def test_what_context_parallelism_cannot_split_is_refused_by_name():
    from transformers import LlamaConfig, LlamaForCausalLM

    from trainer.errors import ShardingError
    from trainer.launch.mesh import Layout, mesh_lines, requested_layout
    from trainer.parallel.context import ContextParallel

    assert requested_layout(4, True, {"cp_size": 2, "dp_shard_size": 2}) == Layout(shard=2, sharded=True, cp=2)
    assert mesh_lines(Layout(shard=2, sharded=True, cp=2), 4, 4) == [
        "  model: CP 2 x FSDP2 over 4 processes: each process holds 1/4 of the weights, gradients and optimizer state",
        "  machine 0: ranks 0-3: replica(s) 0, context-parallel groups of 2",
    ]
    refusals = {
        "cp_size 2 shards the model, which needs an FSDP config": (2, False, {"cp_size": 2}),
        "cp_size 2 with tp_size 2 is not supported yet": (4, True, {"cp_size": 2, "tp_size": 2}),
        "set cp_size instead": (2, True, {"sp_size": 2}),
        "dp_shard_size 1 x cp_size 2 x tp_size 1 = 2 processes, but the launch has 4": (4, True, {"cp_size": 2}),
    }
    for words, (world, sharded, sizes) in refusals.items():
        with pytest.raises(ShardingError, match=words):
            requested_layout(world, sharded, sizes)
    config = dict(vocab_size=16, hidden_size=24, intermediate_size=32, num_hidden_layers=1, max_position_embeddings=8)
    for heads, kv, words in ((3, 3, "num_attention_heads 3, not divisible by 2"), (4, 1, "num_key_value_heads 1")):
        model = LlamaForCausalLM(LlamaConfig(**config, num_attention_heads=heads, num_key_value_heads=kv))
        with pytest.raises(ShardingError, match=words):
            ContextParallel(None, 2, 0).apply(model)
    model = LlamaForCausalLM(LlamaConfig(**config, num_attention_heads=4, num_key_value_heads=2))
    with pytest.raises(ShardingError, match="LlamaModel does not compute its loss through transformers' loss_f"):
        ContextParallel(None, 2, 0).apply(model.model)
    model.config._attn_implementation = "flex_attention"
    with pytest.raises(ShardingError, match="attention implementation 'flex_attention'"):
        ContextParallel(None, 2, 0).apply(model)


def test_a_model_split_again_by_a_second_trainer_is_split_once():
    """A second Trainer of the same model in one process (a resume in the same job) replaces the first's hooks: its
    rows are sliced once, through the kernel the model had."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from trainer.errors import ShardingError
    from trainer.parallel.context import ContextParallel

    config = dict(vocab_size=16, hidden_size=16, intermediate_size=32, num_hidden_layers=1, max_position_embeddings=8)
    model = LlamaForCausalLM(LlamaConfig(**config, num_attention_heads=4, num_key_value_heads=2))
    first, second = ContextParallel(None, 2, 0), ContextParallel(None, 2, 0)
    first.apply(model)
    second.apply(model)
    assert len(model._forward_pre_hooks) == 1 and len(model._forward_hooks) == 1
    assert second.kind == "sdpa" and model.config._attn_implementation.endswith(str(id(second)))
    # A loss in a tuple could not be summed over the group: refused by name.
    with pytest.raises(ShardingError, match="returned a tuple, not a ModelOutput"):
        second.join(model, (), (torch.ones(()),))
