"""Expert parallelism (``ep_size``) and a mixture of experts' load-balancing loss over the global batch: a tiny
Qwen3-MoE (4 experts, top 2, load-balancing loss at 0.1, gradients clipped) trains under EP 2 on 2 processes, EP 2 x
FSDP 2 on 4, EP 2 under HSDP 2 x 2 and DDP on 2 to the losses, weights, evaluation and predictions of one process
(float order), its experts' weights on the (efsdp, ep) mesh; an EP 2 x FSDP 2 checkpoint resumes on one process and
under EP 2 on 2; a Mixtral and a model of one's own (an ``ep_plan``) likewise once; what cannot be split is refused by
name (tests/jobs/experts.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from conftest import JOBS, ROOT, accelerate_launch, clean_env, run

JOB = ROOT / "tests" / "jobs" / "experts.py"
sys.path.insert(0, str(ROOT / "tests" / "jobs"))


def launched(runs: dict[str, list], root: Path, *, processes: int = 1, config: str = "fsdp.yaml", replicas: int = 1):
    """Each run's results ({name: flags}, written under root/name), the runs made one after another in one process
    (plain python) or one launch on ``processes`` (``replicas``: HSDP's), tests/jobs/run_many.py: a launch's
    start-up is most of a run's time."""
    jobs = json.dumps([[str(JOB), "--out", str(root / name), *map(str, flags)] for name, flags in runs.items()])
    if processes == 1:
        run([sys.executable, str(JOBS), jobs])
    else:
        sizes = {"PARALLELISM_CONFIG_DP_REPLICATE_SIZE": str(replicas), "PARALLELISM_CONFIG_DP_SHARD_SIZE": "2"}
        env = {**clean_env(), "ACCELERATE_USE_PARALLELISM_CONFIG": "true", **sizes} if replicas > 1 else None
        accelerate_launch(JOBS, jobs, config=config, num_processes=processes, timeout=600, env=env)
    found = {name: json.loads((root / name / "experts.json").read_text()) for name in runs}
    for name, results in found.items():
        results["weights"] = load_file(root / name / "final" / "model.safetensors")
        results["folder"] = root / name
    return found


def same(found: dict, reference: dict, *, atol: float = 1e-6) -> None:
    np.testing.assert_allclose(found["losses"], reference["losses"], rtol=1e-6)
    # A model of one's own logs no load (its router is its own).
    assert (found["load"] == reference["load"]) or np.allclose(found["load"], reference["load"], rtol=1e-6)
    assert found["eval_loss"] == pytest.approx(reference["eval_loss"], rel=1e-6)
    np.testing.assert_allclose(found["logits"], reference["logits"], rtol=0, atol=1e-5)
    for name, tensor in reference["weights"].items():
        torch.testing.assert_close(found["weights"][name], tensor, rtol=0, atol=atol, msg=name)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, dict]:
    """Every run of this module but DDP's and HSDP's: EP 2 x FSDP 2 on 4 processes (a checkpoint each step), then
    one process's runs (that checkpoint resumed too), then every EP 2 run on 2 processes in one launch."""
    root = tmp_path_factory.mktemp("experts")
    found = launched({"ep 2 x fsdp 2": ["--ep", 2, "--batch-size", 1, "--save-every", 1]}, root, processes=4)
    step = root / "ep 2 x fsdp 2" / "checkpoints" / "step-00000002"
    alone = {"alone": [], "resumed alone": ["--resume", step, "--batch-size", 4]}
    found |= launched(alone | {f"{family} alone": ["--family", family] for family in FAMILIES}, root)
    ep2 = {
        "ep 2": ["--ep", 2, "--batch-size", 2],
        "resumed under ep 2": ["--resume", step, "--ep", 2, "--batch-size", 2],
    }
    ep2 |= {f"{family} under ep 2": ["--family", family, "--ep", 2, "--batch-size", 2] for family in FAMILIES}
    return found | launched(ep2, root, processes=2)


FAMILIES = ("mixtral", "own")


def test_ep_2_x_fsdp_2_on_4_processes_trains_as_one_process(runs):
    found = runs["ep 2 x fsdp 2"]
    same(found, runs["alone"])
    assert found["expert_mesh"] == ["efsdp", "ep"]
    assert "EP 2 x FSDP2 over 4 processes (each expert over 2)" in found["banner"]
    # The load is logged, and not that of a balanced router: it measures something.
    assert all(load > 1.0 for load in found["load"])
    # final/ is a whole model transformers reads.
    from transformers import Qwen3MoeForCausalLM

    model = Qwen3MoeForCausalLM.from_pretrained(found["folder"] / "final")
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, found["weights"].get(name, tensor)), name
    assert model.model.layers[0].mlp.experts.gate_up_proj.shape[0] == 4


@pytest.mark.parametrize("kind", ["EP 2 on 2", "DDP on 2", "EP 2 x HSDP 2 x 2 on 4"])
def test_ep_2_ddp_and_ep_2_under_hsdp_train_as_one_process(tmp_path, runs, kind):
    """DDP too: each process adding its own rows' load-balancing loss counted it twice, of other statistics."""
    if kind == "DDP on 2":
        found = launched({kind: ["--batch-size", 2]}, tmp_path, processes=2, config="multi_gpu.yaml")[kind]
    elif kind == "EP 2 on 2":
        found = runs["ep 2"]
        assert found["expert_mesh"] == ["efsdp", "ep"]
    else:
        found = launched({kind: ["--ep", 2, "--batch-size", 1]}, tmp_path, processes=4, replicas=2)[kind]
        assert found["expert_mesh"] == ["dp_replicate", "efsdp", "ep"]
        assert "EP 2 x HSDP 2 x 2 (each expert over 1)" in found["banner"]
    same(found, runs["alone"])


def test_an_ep_checkpoint_resumes_on_one_process_and_under_ep_2(runs):
    whole = runs["ep 2 x fsdp 2"]
    for name in ("resumed alone", "resumed under ep 2"):
        again = runs[name]
        assert again["losses"] == pytest.approx(whole["losses"][2:], rel=1e-6)
        for key, tensor in whole["weights"].items():
            torch.testing.assert_close(again["weights"][key], tensor, rtol=0, atol=1e-6, msg=f"{name}: {key}")


@pytest.mark.parametrize("family", FAMILIES)
def test_a_mixtral_and_a_model_of_ones_own_train_under_ep_2_as_on_one_process(runs, family):
    """``own``: a plain torch module whose ``ep_plan`` names its experts (docs/parallelism.md#expert-parallelism)."""
    found = runs[f"{family} under ep 2"]
    same(found, runs[f"{family} alone"])
    assert found["expert_mesh"] == ["efsdp", "ep"]


def test_the_load_balancing_loss_is_the_models_own_on_one_process():
    """The trainer's (its counts over every process) equals transformers' on one process, padding masked."""
    from experts import build, rows

    from trainer import TrainConfig
    from trainer.launch.run import Run
    from trainer.loop.routing import RouterLoss

    model, batch = build(), {k: torch.stack([row[k] for row in rows()[:4]]) for k in rows()[0]}
    routing = RouterLoss.install(Run.join(TrainConfig()), model)
    own = model(**batch).loss
    mine = model(**batch, **routing.recording()).loss + routing.loss(batch)
    assert mine.item() == pytest.approx(own.item(), rel=1e-6)
    assert routing.imbalance() > 1.0


def test_what_cannot_be_split_is_refused_by_name():
    from experts import build

    from trainer.errors import ShardingError
    from trainer.launch.mesh import Layout, with_experts
    from trainer.parallel.experts import experts_of

    with pytest.raises(ShardingError, match="ep_size 3 does not divide the 4 experts of model.layers.0.mlp.experts"):
        experts_of(build(), 3)
    from chunked import build as llama

    with pytest.raises(ShardingError, match="LlamaForCausalLM has no MoE layer the trainer can find"):
        experts_of(llama(), 2)
    with pytest.raises(ShardingError, match="ep_size 2 splits the experts .* needs an FSDP config"):
        with_experts(Layout(replicate=2), 2)
    with pytest.raises(ShardingError, match="ep_size 4 does not divide the 6 processes FSDP2 shards over"):
        with_experts(Layout(shard=6, sharded=True), 4)
    with pytest.raises(ShardingError, match="ep_size 2 with tp_size 2 is not supported yet"):
        with_experts(Layout(shard=2, tp=2, sharded=True), 2)
    assert with_experts(Layout(shard=4, sharded=True), 2).describe() == (
        "EP 2 x FSDP2 over 4 processes (each expert over 2)"
    )
