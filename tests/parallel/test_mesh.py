"""Meshes past one dimension, from accelerate's parallelism_config: HSDP (replicate x shard) and tensor parallelism
(alone, and under FSDP), through 4 real processes on this CPU host (gloo). Each equals DDP on the same data to the
float floor (another reduction order), and a checkpoint of each continues on other meshes: FSDP, DDP, 1 process.

One launch runs every 4-process job (tests/jobs/ragged_lm.py --variants); the parallelism_config reaches each job as
accelerate passes it to its workers (PARALLELISM_CONFIG_* variables, set per job with --env). The first job is
launched the way a user launches HSDP: accelerate_configs/hsdp.yaml with its one-machine flags."""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest

from trainer.errors import ShardingError
from trainer.launch.mesh import Layout, requested_layout
from trainer.parallel.tensor_parallel import tensor_parallel

from conftest import ROOT, SCENARIOS, accelerate_launch, clean_env, run

RAGGED = ROOT / "tests" / "jobs" / "ragged_lm.py"
ON = ["--env", "ACCELERATE_USE_PARALLELISM_CONFIG=true"]


def sizes(replicate: int, shard: int, tp: int = 1) -> list[str]:
    """The flags of a job whose parallelism_config has these sizes (over the launch's own)."""
    return [
        *ON,
        "--env",
        f"PARALLELISM_CONFIG_DP_REPLICATE_SIZE={replicate}",
        "--env",
        f"PARALLELISM_CONFIG_DP_SHARD_SIZE={shard}",
        "--env",
        f"PARALLELISM_CONFIG_TP_SIZE={tp}",
    ]


FSDP_4, DDP_4, TP_FSDP, TP_ALONE = sizes(1, 4), sizes(4, 1), sizes(1, 2, 2), sizes(1, 1, 4)
# 48 rows, in order; SGD (AdamW would magnify the float noise of gradients that are 0 in exact arithmetic); a global
# batch of 8 however it is split; clipped, so that the norm over DTensors of both dimensions is exercised.
COMMON = ["--epochs", "1", "--clip", "0.5"]
SAVED = ["--save_every", "2", "--keep_last", "3"]  # the runs the others resume from
FOUR = ["--batch_size", "1", "--accumulation", "2", *COMMON]  # 4 data-parallel processes
TWO = ["--batch_size", "2", "--accumulation", "2", *COMMON]  # 2 (a tensor-parallel group of 2 reads one batch)
EVALUATED = ["--eval", "--eval_examples", "21", "--predict"]  # 6, 5, 5, 5 rows a process: in lockstep
LLAMA = ["--arch", "llama"]  # GPT-2 has no tensor-parallel plan; Llama has one
AOT = ["--env", "ACCELERATE_DYNAMO_BACKEND=aot_eager"]
VARIANTS = {
    "hsdp": [*FOUR, *EVALUATED, *SAVED],  # the launch's own parallelism_config (hsdp.yaml's flags): HSDP 2 x 2
    "fsdp": [*FOUR, *EVALUATED, *FSDP_4],
    "ddp": [*FOUR, *EVALUATED, *DDP_4, "--ddp"],  # a DDP job that names its replicas (dp_replicate_size 4)
    "hsdp, resumed as fsdp": [*FOUR, *FSDP_4, "--resume_from", "{hsdp}/checkpoints/step-00000002"],
    "hsdp, resumed as ddp": [*FOUR, *DDP_4, "--ddp", "--resume_from", "{hsdp}/checkpoints/step-00000002"],
    "tp x fsdp": [*LLAMA, *TWO, *EVALUATED, *SAVED, *TP_FSDP, "--recompute"],  # activation checkpointing too
    "tp x fsdp, split by the user's function": [*LLAMA, *TWO, *TP_FSDP, "--parallelize_fn"],
    "tp": [*LLAMA, "--batch_size", "4", "--accumulation", "2", *COMMON, *TP_ALONE],
    "ddp, llama": [*LLAMA, *FOUR, *EVALUATED, *DDP_4, "--ddp"],
    "tp x fsdp, resumed as fsdp": [*LLAMA, *FOUR, *FSDP_4, "--resume_from", "{tp}/checkpoints/step-00000002"],
    "tp x fsdp, resumed as ddp": [*LLAMA, *FOUR, *DDP_4, "--ddp", "--resume_from", "{tp}/checkpoints/step-00000002"],
    # Compiled per block by the accelerate config's torch dynamo answer (aot_eager: dynamo and autograd's tracing
    # without inductor's code generation, whose floats tests/parallel/test_fsdp.py checks).
    "hsdp, compiled": [*FOUR, *SAVED, *AOT],
    "hsdp, compiled, resumed": [*FOUR, *AOT, "--resume_from", "{compiled}/checkpoints/step-00000002"],
    # The first block's input a view of the TP-split embedding's local tensor (trainer.parallel.compiling).
    "tp x fsdp, compiled": [*LLAMA, *TWO, *EVALUATED, *TP_FSDP, "--recompute", *AOT],
    # Muon on the hidden matrices split over the tensor-parallel mesh (and sharded), against whole ones.
    "tp x fsdp, muon": [*LLAMA, *TWO, *TP_FSDP, "--optimizer", "muon", "--lr", "0.01"],
    "ddp, llama, muon": [*LLAMA, *FOUR, *DDP_4, "--ddp", "--optimizer", "muon", "--lr", "0.01"],
    # auto_microbatch: tensor parallelism's collectives run inside the model's own forward, HSDP's after the
    # reduce-scatter: refused by name for now.
    "hsdp, auto_microbatch": [*FOUR, "--auto_microbatch", "--expect_refusal"],
    "tp x fsdp, auto_microbatch": [*LLAMA, *TWO, *TP_FSDP, "--auto_microbatch", "--expect_refusal"],
}


@pytest.fixture(scope="module")
def meshes(tmp_path_factory):
    """Every job of VARIANTS in one launch of 4 processes: {name: (summary, folder)}, and the launch's output."""
    out = tmp_path_factory.mktemp("mesh")
    keys = {name: f"v{i}" for i, name in enumerate(VARIANTS)}
    folders = {"hsdp": out / keys["hsdp"], "tp": out / keys["tp x fsdp"], "compiled": out / keys["hsdp, compiled"]}
    variants = {keys[name]: [flag.format(**folders) for flag in flags] for name, flags in VARIANTS.items()}
    hsdp = [
        "--num_machines",
        "1",
        "--num_processes",
        "4",
        "--mixed_precision",
        "no",
        "--parallelism_config_dp_replicate_size",
        "2",
        "--parallelism_config_dp_shard_size",
        "2",
    ]
    result = accelerate_launch(
        RAGGED, "--out", out, "--variants", json.dumps(variants), config="hsdp.yaml", run_args=hsdp
    )
    runs = {name: (json.loads((out / key / "ragged.json").read_text()), out / key) for name, key in keys.items()}
    return runs, result


def largest_difference(a: dict, b: dict) -> float:
    return max(float(np.max(np.abs(np.subtract(a["weights"][name], b["weights"][name])))) for name in a["weights"])


def test_hsdp_shards_within_a_replica_and_equals_fsdp_and_ddp_over_4(meshes):
    runs, result = meshes
    assert "device cpu (HSDP)" in result.stdout
    assert "HSDP 2 x 2 (replicate x shard): 28,544 parameters, 14,272 held by this process" in result.stdout
    assert "FSDP2 over 4 processes: 28,544 parameters, 7,136 held by this process" in result.stdout
    hsdp, fsdp, ddp = (runs[name][0] for name in ("hsdp", "fsdp", "ddp"))
    assert hsdp["held"] == 28_544 // 2 and fsdp["held"] == 28_544 // 4
    assert hsdp["seen"] == ddp["seen"]  # each process reads what it reads under DDP
    for other in (fsdp, ddp):
        assert largest_difference(hsdp, other) < 1e-6
        np.testing.assert_allclose(hsdp["losses"], other["losses"], rtol=1e-6)
        np.testing.assert_allclose(hsdp["grad_norms"], other["grad_norms"], rtol=1e-5)
        assert hsdp["eval_loss"] == pytest.approx(other["eval_loss"], rel=1e-6)
        assert hsdp["predicted"] == other["predicted"]
    assert hsdp["eval_loss"] == pytest.approx(hsdp["eval_reference"], rel=1e-6)


def test_hsdp_and_tp_x_fsdp_compiled_per_block_equal_eager_and_resume_exactly(meshes):
    """The accelerate config's torch dynamo answer under HSDP: each block compiled (aot_eager: eager's floats), the
    same updates as eager, resumed bit for bit. Under TP 2 x FSDP 2 (a Llama, its embedding split too, activation
    checkpointing on) the same: eager's losses, weights and evaluation, bit for bit."""
    runs, result = meshes
    assert "device cpu (HSDP, compiled per block: 2 x GPT2Block and the loss (aot_eager))" in result.stdout
    compiled = runs["hsdp, compiled"][0]
    assert compiled["weights"] == runs["hsdp"][0]["weights"] and compiled["losses"] == runs["hsdp"][0]["losses"]
    assert runs["hsdp, compiled, resumed"][0]["weights"] == compiled["weights"]
    tp_compiled, tp_eager = runs["tp x fsdp, compiled"][0], runs["tp x fsdp"][0]
    banner = "device cpu (TP x FSDP2, compiled per block: 2 x LlamaDecoderLayer and the loss (aot_eager))"
    assert banner in result.stdout
    for figure in ("weights", "losses", "eval_loss", "predicted"):
        assert tp_compiled[figure] == tp_eager[figure], figure


def test_muon_runs_on_tensor_parallel_shards_as_on_whole_matrices(meshes):
    """Muon's Newton-Schulz iteration on a matrix split over TP 2 x FSDP 2 (DTensor gathers what it needs): DDP's
    losses, and its weights to the floor of the bf16 iteration (0.013 here after 6 steps at lr 0.01)."""
    runs, _ = meshes
    split, whole = runs["tp x fsdp, muon"][0], runs["ddp, llama, muon"][0]
    np.testing.assert_allclose(split["losses"], whole["losses"], rtol=1e-4)
    assert largest_difference(split, whole) < 0.03


def test_tensor_parallelism_alone_and_under_fsdp_equals_ddp_and_a_group_reads_one_batch(meshes):
    runs, result = meshes
    assert "device cpu (TP x FSDP2)" in result.stdout and "device cpu (TP)" in result.stdout
    assert (
        "batch 2 per tensor-parallel group of 2 x 2 tensor-parallel groups x 2 accumulation = 8 global" in result.stdout
    )
    tp_fsdp, tp, ddp = (runs[name][0] for name in ("tp x fsdp", "tp", "ddp, llama"))
    parameters = sum(len(w) for w in ddp["weights"].values())
    assert f"TP 2 x FSDP 2: {parameters:,} parameters" in result.stdout and f"TP 4: {parameters:,}" in result.stdout
    assert tp_fsdp["held"] < parameters / 3 and tp["held"] < parameters / 2  # embeddings and norms are not split
    # The processes of a tensor-parallel group read the same batches; the groups split the data as 2 processes do.
    first, second = tp_fsdp["seen"][0], tp_fsdp["seen"][2]
    assert tp_fsdp["seen"] == [first, first, second, second]
    assert [i for batch in first for i in batch][:4] == [0, 2, 4, 6] and second[0] == [1, 3]
    assert all(reads == tp["seen"][0] for reads in tp["seen"]) and tp["seen"][0][0] == [0, 1, 2, 3]
    own = runs["tp x fsdp, split by the user's function"][0]
    assert own["held"] > tp_fsdp["held"]  # the attention is left whole
    for run_ in (tp_fsdp, tp, own):
        assert largest_difference(run_, ddp) < 1e-6
        np.testing.assert_allclose(run_["losses"], ddp["losses"], rtol=1e-6)
        np.testing.assert_allclose(run_["grad_norms"], ddp["grad_norms"], rtol=1e-5)
    assert tp_fsdp["eval_loss"] == pytest.approx(ddp["eval_loss"], rel=1e-6)
    assert tp_fsdp["predicted"] == ddp["predicted"]
    # Gathering a TP x FSDP weight (the export) takes two all-gathers, which DTensor calls "suboptimal": not the
    # user's to change, so not on their console.
    assert "suboptimal" not in result.stderr, result.stderr[-3000:]


def test_auto_microbatch_is_refused_by_name_on_a_mesh_it_cannot_watch(meshes):
    runs = meshes[0]
    assert runs["hsdp, auto_microbatch"][0]["refused"].startswith(
        "auto_microbatch is not supported with HSDP 2 x 2 (replicate x shard) yet"
    )
    assert runs["tp x fsdp, auto_microbatch"][0]["refused"].startswith(
        "auto_microbatch is not supported with TP 2 x FSDP 2 yet"
    )


def test_the_export_of_any_mesh_is_the_whole_trained_model(meshes):
    from transformers import AutoModelForCausalLM

    for name in ("hsdp", "tp x fsdp", "tp"):
        summary, folder = meshes[0][name]
        exported = AutoModelForCausalLM.from_pretrained(folder / "final")
        for weight, parameter in exported.named_parameters():
            assert parameter.flatten().tolist() == summary["weights"][weight], f"{name}: {weight}"


def test_checkpoints_continue_on_other_meshes_from_the_same_example(meshes, tmp_path):
    """HSDP 2 x 2 and TP 2 x FSDP 2 checkpoints at step 2, continued as FSDP over 4 and DDP over 4 (in the 4-process
    launch) and on 1 process (here): the examples of the uninterrupted run, its weights to the float floor."""
    runs = meshes[0]
    for straight, resumed in (
        ("hsdp", "hsdp, resumed as fsdp"),
        ("hsdp", "hsdp, resumed as ddp"),
        ("tp x fsdp", "tp x fsdp, resumed as fsdp"),
        ("tp x fsdp", "tp x fsdp, resumed as ddp"),
    ):
        assert_continues(runs[resumed][0], runs[straight][0], f"{straight} -> {resumed}")
    one = {
        name: [
            *flags,
            "--batch_size",
            "2",
            "--accumulation",
            "4",
            *COMMON,
            "--resume_from",
            str(runs[name][1] / "checkpoints" / "step-00000002"),
        ]
        for name, flags in (("hsdp", []), ("tp x fsdp", LLAMA))
    }
    accelerate_launch(RAGGED, "--out", tmp_path, "--variants", json.dumps(one), config="fsdp.yaml", num_processes=1)
    for name in one:
        assert_continues(json.loads((tmp_path / name / "ragged.json").read_text()), runs[name][0], f"{name} -> 1")


def assert_continues(resumed: dict, straight: dict, what: str) -> None:
    first_step = sorted(i for reads in resumed["seen"] for batch in reads for i in batch)[:8]
    assert first_step == list(range(16, 24)), f"{what}: step 3 reads examples 16-23, as the uninterrupted run"
    np.testing.assert_allclose(resumed["losses"], straight["losses"][2:], rtol=1e-5, err_msg=what)
    assert largest_difference(resumed, straight) < 1e-5, what


def test_a_mesh_the_trainer_cannot_build_is_refused_by_name(monkeypatch):
    def launched_with(**sizes: str) -> None:
        for name in [n for n in os.environ if n.startswith("PARALLELISM_CONFIG_")]:
            monkeypatch.delenv(name)
        for name, value in sizes.items():
            monkeypatch.setenv(f"PARALLELISM_CONFIG_{name.upper()}", value)

    def refused(world: int, sharded: bool, **sizes: str) -> str:
        launched_with(**sizes)
        with pytest.raises(ShardingError) as caught:
            requested_layout(world, sharded)
        return str(caught.value)

    assert "sp_size 2 asks for DeepSpeed's sequence parallelism" in refused(4, True, sp_size="2", dp_shard_size="2")
    assert "dp_replicate_size 2 x dp_shard_size 2 x tp_size 1 = 4 processes, but the launch has 8" in refused(
        8, True, dp_replicate_size="2", dp_shard_size="2"
    )
    assert "dp_shard_size 4 shards the model, which needs an FSDP config" in refused(4, False, dp_shard_size="4")
    assert "dp_shard_size 1 leaves FSDP nothing to shard over" in refused(4, True, dp_replicate_size="4")
    assert "parallelism_config: Tensor/Context parallelism" in refused(4, True, tp_size="2", dp_replicate_size="2")
    launched_with(dp_replicate_size="4")
    assert requested_layout(4, False) == Layout(replicate=4)  # a DDP launch that names its replicas is DDP
    launched_with(dp_replicate_size="1", dp_shard_size="1")
    assert requested_layout(4, True) == Layout(shard=4, sharded=True)  # sizes of 1: the launch's own mesh
    assert Layout(2, 2, 2, True).describe() == "TP 2 x HSDP 2 x 2 (replicate x shard)"


class TwoProcessMesh:
    """Stands for a tensor-parallel mesh of 2 where only its size is read (the plan is checked before any split)."""

    def size(self) -> int:
        return 2


def test_tensor_parallelism_without_a_plan_or_with_heads_it_cannot_split_is_refused_by_name():
    sys.path.insert(0, str(ROOT / "tests"))
    from ragged_lm import tiny_gpt2

    with pytest.raises(ShardingError, match="GPT2LMHeadModel has no tensor-parallel plan .* pass parallelize_fn="):
        tensor_parallel(tiny_gpt2(build="meta"), TwoProcessMesh(), None)
    llama = tiny_gpt2(build="meta", arch="llama")
    llama.config.num_key_value_heads = 3
    with pytest.raises(ShardingError, match="tp_size 2 does not divide LlamaForCausalLM's num_key_value_heads"):
        tensor_parallel(llama, TwoProcessMesh(), None)
    llama.config.num_key_value_heads = 4
    split = tensor_parallel(llama, TwoProcessMesh(), None)
    names = {id(m): n for n, m in llama.named_modules()}
    assert {names[i] for i in split.styles} >= {
        "model.layers.0.self_attn.q_proj",
        "model.layers.1.mlp.down_proj",
        "lm_head",
    }


def test_a_launch_with_deepspeeds_sequence_parallelism_stops_with_one_line(tmp_path):
    script = f"import torch, trainer as t; t.Trainer(torch.nn.Linear(1, 1), t.TrainConfig('{tmp_path}'), [[1.0]])"
    result = run(
        [sys.executable, "-c", script],
        expect_ok=False,
        env=clean_env(ACCELERATE_USE_PARALLELISM_CONFIG="true", PARALLELISM_CONFIG_SP_SIZE="2"),
    )
    assert result.stderr.strip().splitlines() == [
        "trainer: parallelism_config: sp_size 2 asks for DeepSpeed's sequence parallelism, which this trainer does "
        "not do: set cp_size instead (context parallelism over FSDP2), and sp_size to 1"
    ]


def test_the_preflight_prints_the_mesh_per_machine_and_refuses_one_that_does_not_fit(tmp_path):
    from trainer.tools.preflight import describe_config

    hsdp = ROOT / "accelerate_configs" / "hsdp.yaml"
    fine = run([sys.executable, "-m", "trainer.check", "--config_file", str(hsdp)])  # as a user runs it
    assert (
        "  model: HSDP 2 x 8 (replicate x shard): each process holds 1/8 of the weights, gradients and optimizer "
        "state\n  machine 0: ranks 0-7: replica(s) 0\n  machine 1: ranks 8-15: replica(s) 1\n" in fine.stdout
    )
    across = tmp_path / "across.yaml"  # FSDP x TP over 16 processes: each replica spans both machines
    across.write_text(
        hsdp.read_text()
        .replace("dp_replicate_size: 2", "dp_replicate_size: 1")
        .replace("dp_shard_size: 8", "dp_shard_size: 8\n  parallelism_config_tp_size: 2")
    )
    lines = describe_config(str(across), launched=True)[0]
    assert "  model: TP 2 x FSDP 8: each process holds 1/16 of the weights, gradients and optimizer state" in lines
    assert any(line.startswith("  note: one replica's 16 processes span 2 machines") for line in lines)
    wrong = tmp_path / "wrong.yaml"
    wrong.write_text(hsdp.read_text().replace("dp_shard_size: 8", "dp_shard_size: 4"))
    assert (
        "parallelism_config: dp_replicate_size 2 x dp_shard_size 4 x tp_size 1 = 8 processes, but the launch "
        "has 16: make the product the number of processes" in describe_config(str(wrong), launched=True)[1]
    )


def test_a_mesh_flag_accelerate_would_drop_stops_the_launch_in_one_line(tmp_path):
    """``accelerate launch --config_file fsdp.yaml --parallelism_config_tp_size 2``: accelerate passes the flag on
    only with a parallelism_config section in the file, so the job trained plain FSDP2 and exited 0 before."""
    result = accelerate_launch(
        SCENARIOS,
        "job",
        "--output_dir",
        tmp_path,
        config="fsdp.yaml",
        num_processes=2,
        run_args=["--parallelism_config_tp_size", "2"],
        expect_ok=False,
    )
    said = [line for line in result.stderr.splitlines() if "trainer: " in line]
    assert len(said) == 1 and "the launch asks for --parallelism_config_tp_size 2, which accelerate passes" in said[0]
    assert "FSDP2 over 2 processes" not in result.stdout, "nothing trained"
