"""FSDP2: the model sharded over the processes when the accelerate config asks for it (accelerate_configs/fsdp.yaml),
on this CPU host over gloo as on GPUs. At 2 processes FSDP2 adds the same gradients in the same order as DDP, so DDP
is an exact oracle: the weights must be equal bit for bit. Through real processes (tests/jobs/ragged_lm.py, a tiny GPT-2
on ragged sequences; one launch runs the FSDP2 jobs and their DDP references, --ddp)."""

from __future__ import annotations

import json
import re
import sys

import numpy as np
import pytest
import torch
from torch.distributed.fsdp import FSDPModule

from trainer.checkpoint.safe_dcp import read_sharded_weights

from conftest import ROOT, accelerate_launch, clean_env, free_port, run

RAGGED = ROOT / "tests" / "jobs" / "ragged_lm.py"
ADAMW = ["--batch_size", "2", "--accumulation", "2", "--optimizer", "adamw", "--lr", "0.01"]
RESUMED = [*ADAMW, "--save_every", "2", "--epochs", "2", "--keep_last", "6"]
SHORT = ["--batch_size", "4", "--max_steps", "3", "--optimizer", "adamw", "--lr", "0.01"]
NANOGPT = [
    "--batch_size",
    "4",
    "--max_steps",
    "6",
    "--lr",
    "0.01",
    "--warmup",
    "2",
    "--weight_decay",
    "0.1",
    "--nanogpt",
]
EMA = ["--ema", "0.5", "--ema_start", "2"]
MUON = [*RESUMED, "--optimizer", "muon", "--weight_decay", "0.1"]  # the last --optimizer wins
CLIPPED = ["--batch_size", "4", "--clip", "0.5"]
OOM = ["--auto_microbatch", "--oom_above", "1"]
# auto_microbatch under FSDP2 needs FSDPModule.reset_iter_state (torch 2.13): earlier torch refuses it by name.
RESETS = hasattr(FSDPModule, "reset_iter_state")
SHARDED_OOM = [*OOM, *([] if RESETS else ["--expect_refusal"])]
BY_SIZE = ["--env", "FSDP_AUTO_WRAP_POLICY=SIZE_BASED_WRAP", "--env", "FSDP_MIN_NUM_PARAMS=1000"]
# The accelerate config's torch dynamo answer; aot_eager: dynamo's and autograd's tracing without inductor's code
# generation (its floats are the compile: true jobs'), so the updates are eager's bit for bit and it costs seconds.
AOT = ["--env", "ACCELERATE_DYNAMO_BACKEND=aot_eager"]
VARIANTS = {
    # 45 evaluation rows: 23 and 22 per process, 12 and 11 batches of 2; a sharded model's forwards run in lockstep.
    "fsdp": [*ADAMW, "--eval", "--eval_examples", "45", "--predict"],
    "ddp": [*ADAMW, "--eval", "--eval_examples", "45", "--predict", "--ddp"],
    "fsdp, activation checkpointing": [*ADAMW, "--recompute"],
    "ddp, activation checkpointing": [*ADAMW, "--recompute", "--ddp"],
    "fsdp, clipped": ["--batch_size", "4", "--clip", "0.5"],
    "ddp, clipped": ["--batch_size", "4", "--clip", "0.5", "--ddp"],
    "fsdp, a model built in bf16": ["--bf16_model", "--batch_size", "4", "--optimizer", "adamw", "--max_steps", "2"],
    "fsdp, straight": RESUMED,  # the uninterrupted runs the resumed ones must reach
    "ddp, straight": [*RESUMED, "--ddp"],
    # New processes' view of a checkpoint is all a crash leaves: continued from step 4 in this same launch.
    "fsdp, resumed at step 4": [*RESUMED, "--resume_from", "{straight}/checkpoints/step-00000004"],
    # A DDP checkpoint continued sharded, and a sharded one continued as DDP.
    "fsdp, resumed from ddp's step 4": [*RESUMED, "--resume_from", "{ddp}/checkpoints/step-00000004"],
    "ddp, resumed from fsdp's step 4": [*RESUMED, "--ddp", "--resume_from", "{straight}/checkpoints/step-00000004"],
    "fsdp, saved in the background": [*RESUMED, "--save_async"],
    "ddp, saved in the background": [*RESUMED, "--save_async", "--ddp"],
    "fsdp, resumed from a background save": [
        *RESUMED,
        "--save_async",
        "--resume_from",
        "{background}/checkpoints/step-00000004",
    ],
    "fsdp, the highest eval loss kept as best": [*RESUMED, "--eval", "--eval_examples", "8", "--best"],
    # Where the weights come from: built on meta (initialised shard by shard), each process's own (the first's
    # win, as under DDP), from_pretrained with the other processes' new head left on meta.
    "fsdp, built on meta": [*ADAMW, "--build", "meta", "--initial"],
    "ddp, built on meta": [*ADAMW, "--build", "meta", "--initial", "--ddp"],
    "ddp, 3 steps": [*SHORT, "--ddp"],
    # SGD: AdamW would magnify the float noise of gradients that are 0 in exact arithmetic (GPT-2's key biases).
    "fsdp, reduced every micro-batch": ["--batch_size", "2", "--accumulation", "2", "--reduce_every"],
    "ddp, accumulated": ["--batch_size", "2", "--accumulation", "2", "--ddp"],
    "fsdp, seeded differently on each process": [*SHORT, "--build", "seeded_per_rank"],
    "fsdp, wrapped by size": [*SHORT, *BY_SIZE],
    "fsdp, not wrapped": [*SHORT, "--env", "FSDP_AUTO_WRAP_POLICY=NO_WRAP"],
    "ddp, a model built in bf16": [
        "--bf16_model",
        "--batch_size",
        "4",
        "--optimizer",
        "adamw",
        "--max_steps",
        "2",
        "--ddp",
    ],
    "fsdp, a pretrained classifier loaded cpu-ram-efficiently": [
        *SHORT,
        "--model",
        "classifier",
        "--pretrained",
        "{ddp}/final",
        "--env",
        "FSDP_CPU_RAM_EFFICIENT_LOADING=true",
        "--env",
        "FSDP_SYNC_MODULE_STATES=true",
        "--initial",
    ],
    "ddp, a pretrained classifier": [
        *SHORT,
        "--model",
        "classifier",
        "--pretrained",
        "{ddp}/final",
        "--ddp",
        "--initial",
    ],
    # nanoGPT's recipe through factories the trainer calls after sharding: its AdamW (betas 0.9 / 0.95, decay 0.1
    # on the trainer's groups) and its get_lr; and the config's cosine down to a floor.
    "fsdp, nanoGPT's optimizer and schedule": NANOGPT,
    "ddp, nanoGPT's optimizer and schedule": [*NANOGPT, "--ddp"],
    # Two named eval sets, the best of one kept: straight, and resumed at step 4 (after two evaluations).
    "fsdp, two eval sets": [*RESUMED, "--eval_sets", "--best"],
    "fsdp, two eval sets, resumed at step 4": [
        *RESUMED,
        "--eval_sets",
        "--best",
        "--resume_from",
        "{two_sets}/checkpoints/step-00000004",
    ],
    # Rank 1 stuck inside its first block's forward: rank 0 waits in the next block's all-gather, in forward too.
    "fsdp, rank 1 stalled inside a block": [*SHORT, "--stall_in_block", "4"],
    # An average of the weights (ema_decay 0.5 after step 2), evaluated (every 3 steps, and at the end) and
    # exported; resumed from the sharded checkpoint of step 4 sharded, and as DDP.
    "fsdp, ema": [*RESUMED, *EMA, "--eval", "--eval_examples", "8", "--eval_every", "3"],
    "ddp, ema": [*RESUMED, *EMA, "--eval", "--eval_examples", "8", "--eval_every", "3", "--history", "--ddp"],
    "fsdp, ema resumed at step 4": [*RESUMED, *EMA, "--resume_from", "{ema}/checkpoints/step-00000004"],
    "ddp, ema resumed from fsdp's step 4": [
        *RESUMED,
        *EMA,
        "--ddp",
        "--resume_from",
        "{ema}/checkpoints/step-00000004",
    ],
    "fsdp, ema, the highest eval loss kept as best": [
        *RESUMED,
        "--ema",
        "0.5",
        "--eval",
        "--eval_examples",
        "8",
        "--best",
    ],
    # Out of memory above 1 example a micro-batch, with auto_microbatch: in rank 1's forwards, in every rank's
    # backwards (checkpointed every 2 steps, and resumed at step 2 with the split that fit).
    "ddp, clipped, out of memory in rank 1's forward": [*CLIPPED, "--ddp", *OOM, "--oom_rank", "1"],
    "ddp, clipped, out of memory in every backward": [
        *CLIPPED,
        "--ddp",
        *OOM,
        "--oom_in",
        "backward",
        "--save_every",
        "2",
        "--keep_last",
        "6",
    ],
    "ddp, clipped, out of memory, resumed at step 2": [
        *CLIPPED,
        "--ddp",
        *OOM,
        "--oom_in",
        "backward",
        "--resume_from",
        "{oom}/checkpoints/step-00000002",
    ],
    "ddp, out of memory even at one example": [
        "--batch_size",
        "2",
        "--max_steps",
        "1",
        "--ddp",
        "--auto_microbatch",
        "--oom_above",
        "0",
        "--expect_refusal",
    ],
    # Sharded: rank 1 out of memory in forward (after the root's all-gather), and in the backward of the third of 4
    # blocks (after the fourth's reduce-scatter: rank 0 stops at its next collective); a piece of one example.
    "fsdp, clipped, out of memory in rank 1's forward": [*CLIPPED, *SHARDED_OOM, "--oom_rank", "1"],
    "fsdp, clipped, 4 blocks": [*CLIPPED, "--layers", "4"],
    "fsdp, clipped, 4 blocks, out of memory in rank 1's third block's backward": [
        *CLIPPED,
        "--layers",
        "4",
        *SHARDED_OOM,
        "--oom_rank",
        "1",
        "--oom_in",
        "middle_block_backward",
    ],
    "fsdp, out of memory even at one example": [
        "--batch_size",
        "2",
        "--max_steps",
        "1",
        "--auto_microbatch",
        "--oom_above",
        "0",
        "--expect_refusal",
    ],
    # compile: each block on its own under FSDP2 (inductor), the whole model or each block under DDP.
    "fsdp, compiled": [*RESUMED, "--compile", "--count_graphs"],
    "fsdp, compiled, resumed at step 4": [
        *RESUMED,
        "--compile",
        "--resume_from",
        "{compiled}/checkpoints/step-00000004",
    ],
    "ddp, compiled whole": [*RESUMED, "--compile", "--ddp"],
    "ddp, compiled per block": [
        *RESUMED,
        "--compile",
        "--ddp",
        "--env",
        "ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION=1",
    ],
    "fsdp, compiled by the accelerate config": [*ADAMW, *AOT, "--count_graphs"],
    "fsdp, 4 blocks, compiled by the accelerate config": [*ADAMW, *AOT, "--count_graphs", "--layers", "4"],
    "fsdp, compiled, activation checkpointing": [*ADAMW, *AOT, "--recompute"],
    "fsdp, compiled, ema": [*RESUMED, *EMA, *AOT, "--eval", "--eval_examples", "8", "--eval_every", "3"],
    "fsdp, compiled, out of memory in rank 1's forward": [*CLIPPED, *SHARDED_OOM, *AOT, "--oom_rank", "1"],
    "fsdp, muon": MUON,
    "ddp, muon": [*MUON, "--ddp"],
    "fsdp, muon, resumed at step 4": [*MUON, "--resume_from", "{muon}/checkpoints/step-00000004"],
    "fsdp, cosine down to a floor": [
        "--batch_size",
        "4",
        "--max_steps",
        "6",
        "--optimizer",
        "adamw",
        "--lr",
        "0.01",
        "--warmup",
        "2",
        "--schedule",
        "cosine_with_min_lr",
        "--min_lr_ratio",
        "0.1",
    ],
}


def launch(out, *args, **kw):
    return accelerate_launch(RAGGED, "--out", out, *args, config="fsdp.yaml", **kw)


@pytest.fixture(scope="module")
def fsdp(tmp_path_factory):
    """Every job of VARIANTS, in one FSDP2 launch of 2 processes: {name: (summary, output folder)}, and its stdout."""
    out = tmp_path_factory.mktemp("fsdp")
    keys = {name: f"v{i}" for i, name in enumerate(VARIANTS)}
    folders = {
        "straight": out / keys["fsdp, straight"],
        "background": out / keys["fsdp, saved in the background"],
        "ddp": out / keys["ddp, straight"],
        "two_sets": out / keys["fsdp, two eval sets"],
        "ema": out / keys["fsdp, ema"],
        "oom": out / keys["ddp, clipped, out of memory in every backward"],
        "compiled": out / keys["fsdp, compiled"],
        "muon": out / keys["fsdp, muon"],
    }
    variants = {keys[name]: [flag.format(**folders) for flag in flags] for name, flags in VARIANTS.items()}
    result = launch(out, "--variants", json.dumps(variants))
    runs = {name: (json.loads((out / key / "ragged.json").read_text()), out / key) for name, key in keys.items()}
    return runs, result


def test_fsdp2_shards_the_model_and_reaches_ddps_weights_bit_for_bit(fsdp):
    runs, result = fsdp
    assert "trainer | 2 process(es) on 1 machine(s), device cpu (FSDP2)" in result.stdout
    assert (
        "| FSDP2 over 2 processes: 28,544 parameters, 14,272 held by this process (2 sharded blocks + root)"
        in result.stdout
    )
    sharded, ddp = runs["fsdp"][0], runs["ddp"][0]
    assert ddp["held"] == 28_544 and sharded["held"] == 28_544 // 2  # each process holds half of every tensor
    # The same updates: AdamW, accumulation 2, token-weighted loss, evaluation in lockstep.
    assert sharded["weights"] == ddp["weights"]
    assert sharded["losses"] == ddp["losses"]
    assert sharded["eval_loss"] == ddp["eval_loss"] == pytest.approx(sharded["eval_reference"], rel=1e-6)
    assert len(sharded["predicted"]) == 45 and sharded["predicted"] == ddp["predicted"]
    # Clipping: the norm is summed from the shards, a different float order than DDP's whole tensors.
    clipped, reference = runs["fsdp, clipped"][0], runs["ddp, clipped"][0]
    for name, values in reference["weights"].items():
        np.testing.assert_allclose(clipped["weights"][name], values, rtol=0, atol=1e-6, err_msg=name)
    # The logged gradient norm (before clipping) is the whole model's, summed from the shards, with or without
    # clipping: DDP's to float order.
    for fsdp_run, ddp_run in ((sharded, ddp), (clipped, reference)):
        assert all(norm > 0 for norm in ddp_run["grad_norms"])
        np.testing.assert_allclose(fsdp_run["grad_norms"], ddp_run["grad_norms"], rtol=1e-6)


def test_activation_checkpointing_recomputes_each_block_with_the_same_updates(fsdp):
    runs, result = fsdp
    assert "(2 sharded blocks + root, activation checkpointing)" in result.stdout
    for kind in ("fsdp", "ddp"):
        assert runs[f"{kind}, activation checkpointing"][0]["weights"] == runs[kind][0]["weights"], kind


def test_master_weights_and_optimizer_state_are_fp32_even_for_a_model_built_in_bf16(fsdp):
    summary = fsdp[0]["fsdp, a model built in bf16"][0]
    assert summary["dtypes"] == ["torch.float32"]
    assert summary["optimizer_dtypes"] == ["torch.float32"]
    assert "low-precision trainable tensors upcast to fp32 masters" in fsdp[1].stdout


def test_mixed_precision_bf16_computes_in_bf16_over_fp32_masters(fsdp, tmp_path):
    """bf16 compute over fp32 weights and optimizer state; and a checkpoint written without mixed precision goes
    on under bf16, said in a line."""
    written = fsdp[0]["fsdp, straight"][1] / "checkpoints" / "step-00000004"
    variants = {
        "bf16": ["--batch_size", "4", "--optimizer", "adamw", "--max_steps", "2"],
        "resumed": [*RESUMED, "--resume_from", str(written)],
    }
    result = launch(tmp_path, "--variants", json.dumps(variants), run_args=["--mixed_precision", "bf16"])
    assert "(FSDP2), 1 CPU threads per process, mixed precision bf16" in result.stdout
    summary = json.loads((tmp_path / "bf16" / "ragged.json").read_text())
    assert summary["computed"] == ["torch.bfloat16"]
    assert summary["dtypes"] == summary["optimizer_dtypes"] == ["torch.float32"]
    assert result.stdout.count("mixed precision no -> bf16 (the launch's accelerate config) from step 5") == 1


def test_the_exported_model_is_the_trained_one_whole(fsdp):
    from transformers import GPT2LMHeadModel

    summary, out = fsdp[0]["fsdp"]
    exported = GPT2LMHeadModel.from_pretrained(out / "final")
    for name, parameter in exported.named_parameters():
        assert parameter.flatten().tolist() == summary["weights"][name], name


@pytest.mark.parametrize("kind", ["fsdp", "ddp"])
def test_any_checkpoint_exports_to_a_loadable_model_on_one_process(fsdp, tmp_path, kind):
    """python -m trainer.export: no process group, no merge tool; a sharded checkpoint's shards read back whole."""
    from transformers import GPT2LMHeadModel

    summary, out = fsdp[0][f"{kind}, straight"]
    last = out / "checkpoints" / "step-00000012"
    result = run([sys.executable, "-m", "trainer.export", str(last), str(tmp_path)])
    assert f"exported {last} to {tmp_path}/model.safetensors (AutoModel*.from_pretrained)" in result.stdout
    exported = GPT2LMHeadModel.from_pretrained(tmp_path)
    for name, parameter in exported.named_parameters():
        assert parameter.flatten().tolist() == summary["weights"][name], name


def test_a_large_export_is_written_a_file_at_a_time_with_an_index_from_pretrained_reads(fsdp, tmp_path):
    """The export never holds more than one file's tensors: over the size limit (here 40 kB, 5 GB by default) the
    weights go into numbered files with transformers' index, read back whole by from_pretrained."""
    import shutil

    from transformers import GPT2LMHeadModel

    from trainer.checkpoint.hf_files import write_streamed
    from trainer.checkpoint.safe_dcp import sharded_weights

    summary, out = fsdp[0]["fsdp, straight"]
    checkpoint = out / "checkpoints" / "step-00000012"
    entries, fetch = sharded_weights(checkpoint)
    written = write_streamed(entries, fetch, tmp_path, max_file_bytes=40_000)
    shutil.copyfile(checkpoint / "config.json", tmp_path / "config.json")
    index = json.loads(written.read_text())
    assert written.name == "model.safetensors.index.json" and len(set(index["weight_map"].values())) > 2
    exported = GPT2LMHeadModel.from_pretrained(tmp_path)
    for name, parameter in exported.named_parameters():
        assert parameter.flatten().tolist() == summary["weights"][name], name


def test_a_sharded_model_ends_with_the_best_evaluations_weights(fsdp):
    """load_best_at_end under FSDP2: every process reads its part of the best checkpoint's shards back. The best is
    the highest eval loss here, one of the early evaluations: the DDP run of the same job saved those weights at that
    step (FSDP2 and DDP agree bit for bit at 2 processes)."""

    runs, result = fsdp
    summary, out = runs["fsdp, the highest eval loss kept as best"]
    best = (out / "checkpoints" / "best").read_text()
    step = int(best.removeprefix("step-"))
    assert (
        step < 12
        and f"load_best_at_end: final/ holds the weights of step {step}, the best evaluation (eval_loss "
        in result.stdout
    )
    then = read_sharded_weights(runs["ddp, straight"][1] / "checkpoints" / best)
    assert all(summary["weights"][name] == then[name].flatten().tolist() for name in summary["weights"])
    assert summary["weights"] != runs["fsdp, straight"][0]["weights"], "not the last step's"


def test_a_sharded_checkpoint_holds_each_processs_shards_and_resumes_bit_identical(fsdp):
    runs, result = fsdp
    straight, folder = runs["fsdp, straight"]
    checkpoint = folder / "checkpoints" / "step-00000004"
    manifest = json.loads((checkpoint / "trainer_state.json").read_text())
    # Each process wrote its own shards, listed (size and CRC-32) with the rest; DCP's index last. One format: a DDP
    # run's checkpoint is the same files (DCP writes each replicated tensor once, spread over the processes).
    ddp = json.loads((runs["ddp, straight"][1] / "checkpoints" / "step-00000004" / "trainer_state.json").read_text())
    for held in (manifest, ddp):
        assert {"shards/__0_0.distcp", "shards/__1_0.distcp", "shards/.metadata"} <= set(held["crc32"])
        assert not {"model.safetensors", "optimizer.bin"} & set(held["files"]) and "sharding" not in held
    assert f"resumed from {checkpoint}: step 4," in result.stdout
    resumed = runs["fsdp, resumed at step 4"][0]
    assert resumed["weights"] == straight["weights"]
    assert resumed["losses"] == straight["losses"][4:]


def test_a_ddp_checkpoint_resumes_sharded_and_a_sharded_one_as_ddp(fsdp):
    """One format read by either strategy: a DDP run's checkpoint into every process's shards, FSDP2's shards back
    whole into DDP's model. The same updates as the uninterrupted run of the resuming kind, to the float floor (at 2
    processes FSDP2 adds DDP's gradients in DDP's order)."""
    runs, result = fsdp
    for resumed, written_by, straight in (
        ("fsdp, resumed from ddp's step 4", "ddp", "fsdp, straight"),
        ("ddp, resumed from fsdp's step 4", "fsdp", "ddp, straight"),
    ):
        checkpoint = runs[f"{written_by}, straight"][1] / "checkpoints" / "step-00000004"
        assert f"resumed from {checkpoint}: step 4, epoch 0, batch 8" in result.stdout, resumed
        summary, reference = runs[resumed][0], runs[straight][0]
        np.testing.assert_allclose(summary["losses"], reference["losses"][4:], rtol=1e-6, err_msg=resumed)
        for name, values in reference["weights"].items():
            np.testing.assert_allclose(summary["weights"][name], values, rtol=0, atol=1e-6, err_msg=resumed + name)


def test_a_crafted_shard_index_is_refused_by_name_on_resume_and_in_export_and_runs_nothing(fsdp, tmp_path):
    """DCP's index (.metadata) is a pickle: one that names anything but DCP's metadata classes (here os.system, with
    the manifest's size and CRC-32 made to match) is refused in one line, on a resume by path and in the export, and
    the command it carries never runs."""
    import os
    import pickle
    import shutil
    import zlib

    source = fsdp[0]["fsdp, straight"][1] / "checkpoints" / "step-00000004"
    checkpoint = tmp_path / "run" / "checkpoints" / "step-00000004"
    shutil.copytree(source, checkpoint)
    ran = tmp_path / "it-ran"

    class Payload:
        def __reduce__(self):
            return os.system, (f"touch {ran}",)

    index = checkpoint / "shards" / ".metadata"
    metadata = pickle.loads(index.read_bytes())  # the real index, made by this test's own launch
    metadata.planner_data = Payload()
    index.write_bytes(pickle.dumps(metadata))
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    state["files"]["shards/.metadata"] = index.stat().st_size
    state["crc32"]["shards/.metadata"] = f"{zlib.crc32(index.read_bytes()):08x}"
    (checkpoint / "trainer_state.json").write_text(json.dumps(state))
    refused = (
        f"trainer: checkpoint {checkpoint}: shards/.metadata names {os.system.__module__}.system, which is "
        "not part of a checkpoint's index: the checkpoint is refused, and nothing in it was run"
    )
    exported = run([sys.executable, "-m", "trainer.export", str(checkpoint), str(tmp_path / "out")], expect_ok=False)
    assert exported.stderr.strip().splitlines() == [refused]
    resumed = run(
        [
            sys.executable,
            str(RAGGED),
            "--out",
            str(tmp_path / "resumed"),
            *RESUMED,
            "--ddp",
            "--resume_from",
            str(checkpoint),
        ],
        expect_ok=False,
    )
    assert refused in resumed.stderr and "Traceback" not in resumed.stderr, resumed.stderr[-2000:]
    assert not ran.exists(), "the crafted index ran its command"


def test_a_rank_stuck_inside_a_sharded_block_is_named_by_the_others(fsdp):
    """Rank 1 asleep inside block 0's forward at step 2: rank 0 waits in block 1's all-gather, in forward as well;
    the report names rank 1 by the sharded blocks each has entered, as DDP's names the rank behind in its step."""
    output = fsdp[1].stdout + fsdp[1].stderr
    assert "STALL rank 1 inside block 0 at step 2" in output
    reports = [line for line in fsdp[1].stderr.splitlines() if line.startswith("trainer: stalled")]
    assert len(reports) == 1, reports  # one report per stall, from one rank
    assert re.search(r"rank 0 \(.+\) forward at step 2 \(sharded block 3\)", reports[0]), reports[0]
    assert reports[0].endswith("Waiting for rank(s) 1 (forward at step 2 (sharded block 2))."), reports[0]


@pytest.mark.parametrize("kind", ["fsdp", "ddp"])
def test_save_async_writes_the_same_checkpoints_while_training_goes_on(fsdp, kind):
    """FSDP2 and DDP alike: both checkpoints are DCP's (checkpoint/test_checkpoint.py kills a DDP job mid-write)."""
    runs = fsdp[0]
    straight = runs[f"{kind}, straight"][0]
    background, folder = runs[f"{kind}, saved in the background"]
    assert background["weights"] == straight["weights"], "training does not wait for the write, nor change"
    checkpoints = folder / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["latest", *(f"step-{s:08d}" for s in range(2, 13, 2))]
    assert (checkpoints / "latest").read_text() == "step-00000012", "the last one committed before fit() returned"
    manifest = json.loads((checkpoints / "step-00000004" / "trainer_state.json").read_text())
    assert {"shards/__0_0.distcp", "shards/__1_0.distcp", "shards/.metadata"} <= set(manifest["crc32"])
    if kind == "ddp":
        return
    straight = runs["fsdp, straight"][0]
    resumed = runs["fsdp, resumed from a background save"][0]
    assert resumed["weights"] == straight["weights"]
    assert resumed["losses"] == straight["losses"][4:]


def close_to(resumed: dict, straight: dict, split: str, accumulation: int) -> None:
    """Float reduction order apart: another process count adds the same numbers in another order, which AdamW
    magnifies in weights whose gradients are near 0 (8 steps: 1.3e-3 of the tensor's largest weight at most)."""
    first_step = sorted(i for reads in resumed["seen"] for batch in reads[:accumulation] for i in batch)
    assert first_step == list(range(32, 40)), f"{split}: step 5 reads examples 32-39, as the uninterrupted run"
    np.testing.assert_allclose(resumed["losses"], straight["losses"][4:], rtol=1e-6, err_msg=split)
    for name, values in straight["weights"].items():
        scale = np.max(np.abs(values))
        np.testing.assert_allclose(resumed["weights"][name], values, rtol=0, atol=5e-3 * scale, err_msg=name)


def test_a_checkpoint_of_2_processes_continues_on_1_or_4_with_the_same_global_batch(fsdp, tmp_path):
    """2 processes x 2 x accumulation 2 (8 global), checkpoint at step 4, continued as 1 x 2 x 4 (FSDP2 and DDP
    checkpoints, and the DDP one sharded) and as 4 x 1 x 2 (FSDP2): the same examples at every step, the weights of
    the uninterrupted run."""
    runs = fsdp[0]
    start = {kind: runs[f"{kind}, straight"][1] / "checkpoints" / "step-00000004" for kind in ("fsdp", "ddp")}
    common = ["--optimizer", "adamw", "--lr", "0.01", "--epochs", "2"]
    one = {
        "fsdp": [*common, "--batch_size", "2", "--accumulation", "4", "--resume_from", str(start["fsdp"])],
        "ddp": [*common, "--batch_size", "2", "--accumulation", "4", "--resume_from", str(start["ddp"]), "--ddp"],
        # The DDP checkpoint continued sharded, on 1 process: another format and another split at once.
        "fsdp from ddp": [*common, "--batch_size", "2", "--accumulation", "4", "--resume_from", str(start["ddp"])],
        # A Trainer without train_data (and another global batch, 1 x 3): the weights serve an evaluation.
        "evaluate": [
            "--optimizer",
            "adamw",
            "--batch_size",
            "3",
            "--resume_from",
            str(start["fsdp"]),
            "--eval",
            "--evaluate_only",
        ],
        # A model built on meta starts from the same weights on 1 process as on 2.
        "meta": ["--build", "meta", "--initial", "--batch_size", "2", "--max_steps", "1"],
    }
    result = launch(tmp_path / "one", "--variants", json.dumps(one), num_processes=1)
    assert (
        "split 2 process(es) x batch 2 x accumulation 2 = 8 global -> 1 process(es) x batch 2 x accumulation "
        "4 = 8 global: the same global batch, the same examples" in result.stdout
    )
    for kind in ("fsdp", "ddp"):
        resumed = json.loads((tmp_path / "one" / kind / "ragged.json").read_text())
        close_to(resumed, runs[f"{kind}, straight"][0], f"{kind} 2 -> 1", accumulation=4)
    resumed = json.loads((tmp_path / "one" / "fsdp from ddp" / "ragged.json").read_text())
    close_to(resumed, runs["ddp, straight"][0], "ddp on 2 -> fsdp on 1", accumulation=4)
    evaluated = json.loads((tmp_path / "one" / "evaluate" / "ragged.json").read_text())
    assert evaluated["weights"] == {
        name: tensor.flatten().tolist()
        for name, tensor in read_sharded_weights(start["fsdp"]).items()
        if name in evaluated["weights"]
    }
    assert evaluated["eval_loss"] == pytest.approx(evaluated["eval_reference"], rel=1e-6)
    assert evaluated["fit_refused"].startswith("fit(): this Trainer was built with train_data=None")
    on_one = json.loads((tmp_path / "one" / "meta" / "ragged.json").read_text())
    assert on_one["initial"] == runs["fsdp, built on meta"][0]["initial"]
    result = launch(
        tmp_path / "four",
        *common,
        "--batch_size",
        "1",
        "--accumulation",
        "2",
        "--resume_from",
        start["fsdp"],
        num_processes=4,
    )
    assert (
        "rank(s) 2, 3 had no saved random state (the checkpoint has 2 processes'): they start from seed + rank"
        in result.stdout
    )
    four = json.loads((tmp_path / "four" / "ragged.json").read_text())
    assert four["held"] == 28_544 // 4
    close_to(four, runs["fsdp, straight"][0], "fsdp 2 -> 4", accumulation=2)


def refusal(tmp_path, config: str, **env: str) -> list[str]:
    """The lines a one-process Trainer of ``TrainConfig(config)`` prints to stderr, refused."""
    config = f"output_dir='{tmp_path}', {config}"
    script = f"import torch, trainer as t; t.Trainer(torch.nn.Linear(1, 1), t.TrainConfig({config}), [[1.0]])"
    result = run([sys.executable, "-c", script], expect_ok=False, env=clean_env(**env))
    return result.stderr.strip().splitlines()


def test_an_fsdp_version_1_config_is_refused_in_one_line(tmp_path):
    assert refusal(tmp_path, "", ACCELERATE_USE_FSDP="true", FSDP_VERSION="1") == [
        "trainer: the accelerate config asks for FSDP version 1; this trainer shards with FSDP2. Convert the file "
        "with `accelerate to-fsdp2 --config_file <yours> --output_file <new>` (or set fsdp_version: 2 under "
        "fsdp_config)"
    ]


def test_launches_the_trainer_does_not_run_are_refused_in_one_line_and_a_blank_block_class_is_unset(tmp_path):
    """What accelerate launch sets in each process for DeepSpeed, Megatron-LM and fp8 through Transformer Engine
    (the trainer's fp8 is torchao's): one line each, in one
    process; FSDP2 with fsdp_transformer_layer_cls_to_wrap: '' (`accelerate config` answered with Enter) shards as if
    no class were named."""
    script = f"""
import os, torch, trainer as t
cases = {{"deepspeed": {{"ACCELERATE_USE_DEEPSPEED": "true"}}, "megatron": {{"ACCELERATE_USE_MEGATRON_LM": "true"}},
         "fp8": {{"ACCELERATE_MIXED_PRECISION": "fp8", "ACCELERATE_FP8_BACKEND": "TE"}},
         "blank": {{"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2",
                   "FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP", "FSDP_TRANSFORMER_CLS_TO_WRAP": ""}}}}
for name, env in cases.items():
    os.environ.update(env)
    try:
        config = t.TrainConfig(output_dir=r"{tmp_path}/" + name)
        t.Trainer(torch.nn.Linear(1, 1), config, [[1.0]])
        print(name, "BUILT")
    except t.errors.Refusal as err:
        print(name, "REFUSED", err)
    for key in env:
        os.environ.pop(key, None)
"""
    one = {
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
    }
    out = run([sys.executable, "-c", script], env=clean_env(**one)).stdout
    from trainer.launch.accelerate_config import DEEPSPEED, MEGATRON, refusal_of_fp8

    for name, message in (("deepspeed", DEEPSPEED), ("megatron", MEGATRON), ("fp8", refusal_of_fp8("TE"))):
        assert f"{name} REFUSED {message}" in out, out
    assert "blank BUILT" in out and "names no block class" in out, out


def test_a_model_output_fsdp2_cannot_look_into_is_refused_and_a_dict_or_a_dataclass_trains(tmp_path):
    """FSDP2 finds a module's output tensors in dicts, tuples and (from torch 2.12) dataclasses only: from a
    SimpleNamespace, or a dataclass under torch 2.11, no gradient reached the shards and the weights never moved,
    without an error. Now one line at the first step."""
    from trainer.parallel.sharding import _walks_dataclasses

    result = accelerate_launch(
        ROOT / "tests" / "jobs" / "scenarios.py", "outputs", "--output_dir", tmp_path, config="fsdp.yaml"
    )
    moved = json.loads(result.stdout.split("RESULT ")[-1].splitlines()[0])
    containers = "a dict, a tuple, a dataclass" if _walks_dataclasses() else "a dict, a tuple"
    refusal = (
        "forward returns a {}, in which FSDP2 finds no tensor: no gradient would reach the sharded weights, "
        f"and they would never change (without an error). Return {containers} or a transformers ModelOutput "
        "instead"
    )
    assert moved["namespace"] == "TinyClassifier." + refusal.format("SimpleNamespace")
    assert moved["dict"] > 1e-3  # every tensor moved
    if _walks_dataclasses():
        assert moved["dataclass"] == moved["dict"]
    else:  # torch 2.11: the dataclass is refused, not trained without moving
        assert moved["dataclass"] == "DataclassClassifier." + refusal.format("OutputRecord")


def test_the_preflight_reads_an_fsdp_config_as_a_sharded_launch_of_its_processes(tmp_path):
    """python -m trainer.check: accelerate starts an FSDP file's processes through torchrun (not its one-process CPU
    launcher); version 1 is named with the way to convert it."""
    fsdp = ROOT / "accelerate_configs" / "fsdp.yaml"
    fine = run([sys.executable, "-m", "trainer.check", "--config_file", str(fsdp)])
    assert (
        "  model: sharded over the processes (FSDP2): each holds 1/2 of the weights, gradients and optimizer "
        "state" in fine.stdout
    )
    assert fine.stdout.rstrip().endswith("preflight: no problems found")
    version_1 = tmp_path / "fsdp1.yaml"
    version_1.write_text(fsdp.read_text().replace("fsdp_version: 2", "fsdp_version: 1"))
    refused = run([sys.executable, "-m", "trainer.check", "--config_file", str(version_1)], expect_ok=False)
    assert (
        "PROBLEM: fsdp_version 1: the trainer shards with FSDP2; convert the file with `accelerate to-fsdp2 "
        "--config_file <yours> --output_file <new>`" in refused.stdout
    )


def test_a_model_built_on_meta_is_initialised_shard_by_shard_as_ddp_initialises_it_whole(fsdp):
    """``with torch.device("meta")``: no process ever builds the whole model. Each module is made and initialised
    under a seed of its own, so FSDP2's shards and DDP's whole model start from the same weights and train to the
    same ones, bit for bit (the process count changing nothing: the one-process launch below checks that)."""
    runs, result = fsdp
    assert "(2 sharded blocks + root); built on meta, each process initialised its shards" in result.stdout
    sharded, ddp = runs["fsdp, built on meta"][0], runs["ddp, built on meta"][0]
    assert sharded["initial"] == ddp["initial"]
    assert sharded["weights"] == ddp["weights"] and sharded["losses"] == ddp["losses"]
    initial = {name: np.array(values) for name, values in sharded["initial"].items()}
    assert np.all(initial["transformer.h.0.ln_1.weight"] == 1.0)  # the model's own initialisation, not torch.empty
    assert 0.015 < initial["transformer.h.0.mlp.c_fc.weight"].std() < 0.025  # GPT-2's N(0, 0.02)
    assert 0.005 < initial["transformer.h.0.mlp.c_proj.weight"].std() < 0.015  # its residual scaling, 0.02/sqrt(4)
    assert sharded["tied"] and ddp["tied"]


def test_every_process_starts_from_the_first_processs_weights_as_under_ddp(fsdp):
    """A model seeded differently on each process (nanoGPT's way) trains from the first process's weights, as DDP
    makes it by broadcasting when it wraps; a from_pretrained classifier loaded with fsdp_cpu_ram_efficient_loading
    (transformers leaves the new head on meta on the other processes) gets the first process's head."""
    runs, result = fsdp
    reference = runs["ddp, 3 steps"][0]
    assert runs["fsdp, seeded differently on each process"][0]["weights"] == reference["weights"]
    loaded = runs["fsdp, a pretrained classifier loaded cpu-ram-efficiently"][0]
    ddp = runs["ddp, a pretrained classifier"][0]
    assert loaded["initial"] == ddp["initial"] and loaded["weights"] == ddp["weights"]
    pretrained = runs["ddp, straight"][0]["weights"]
    assert loaded["initial"]["transformer.h.1.mlp.c_fc.weight"] == pretrained["transformer.h.1.mlp.c_fc.weight"]


def test_wrap_policies_are_applied_as_accelerate_applies_them(fsdp):
    """SIZE_BASED_WRAP: every module over min_num_params its own group, nested; GPT-2's tied embeddings stay
    together in the root (FSDP2 refuses a tied weight in two groups). NO_WRAP: one group. The same updates as DDP."""
    runs, result = fsdp
    reference = runs["ddp, 3 steps"][0]
    for name in ("fsdp, wrapped by size", "fsdp, not wrapped"):
        assert runs[name][0]["weights"] == reference["weights"], name
    assert "held by this process (15 sharded blocks + root)" in result.stdout  # blocks, attention, MLPs, Conv1Ds
    assert "held by this process (0 sharded blocks + root)" in result.stdout


def test_accumulation_may_reduce_scatter_every_micro_batch_with_the_same_updates(fsdp):
    """reduce_every_micro_batch: each micro-batch's gradients reduce-scattered at once, the window's accumulated
    sharded (never the whole model's gradients on a process): DDP's updates, in another float order."""
    every, ddp = fsdp[0]["fsdp, reduced every micro-batch"][0], fsdp[0]["ddp, accumulated"][0]
    np.testing.assert_allclose(every["losses"], ddp["losses"], rtol=1e-6)
    for name, values in ddp["weights"].items():
        np.testing.assert_allclose(every["weights"][name], values, rtol=0, atol=1e-6, err_msg=name)
    assert every["weights"] != ddp["weights"], "reduced at another point: not DDP's float order"


def test_ddp_trains_a_low_precision_model_over_fp32_masters_as_fsdp2_does(fsdp):
    summary = fsdp[0]["ddp, a model built in bf16"][0]
    assert summary["dtypes"] == summary["optimizer_dtypes"] == ["torch.float32"]
    assert "| 28 low-precision trainable tensors upcast to fp32 masters" in fsdp[1].stdout


TIED = """
import torch, trainer as t
class Tied(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.head = torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight
    def forward(self, x):
        return self.head(self.embed(x))
loss = lambda model, batch: torch.nn.functional.cross_entropy(model(batch).flatten(0, 1), batch.flatten())
config = t.TrainConfig(output_dir={out!r}, batch_size=4, max_steps=2, save_every=2)
t.Trainer(Tied(), config, [torch.tensor([i % 10]) for i in range(8)], loss_fn=loss).fit()
"""


def test_a_plain_module_with_tied_weights_exports_loadable_with_load_state_dict(tmp_path):
    """accelerate's model file keeps one name of a tied weight; final/ and python -m trainer.export write every
    name, so that the plain module loads its export with load_state_dict (a transformers model ties its own)."""
    from safetensors.torch import load_file

    from trainer.checkpoint.export import export

    run([sys.executable, "-c", TIED.format(out=str(tmp_path / "run"))])
    export(tmp_path / "run" / "checkpoints" / "step-00000002", tmp_path / "exported")
    for folder in (tmp_path / "run" / "final", tmp_path / "exported"):
        weights = load_file(folder / "model.safetensors")
        assert sorted(weights) == ["embed.weight", "head.weight"], folder
        assert torch.equal(weights["embed.weight"], weights["head.weight"])


def test_background_saves_get_a_gloo_group_of_their_own_even_for_one_process(tmp_path):
    """DCP's background save refuses a group without a CPU backend: on one GPU the default group is NCCL, so one
    process needs its gloo group too (tests/test_gpu.py runs the save there)."""
    script = (
        "import torch.distributed as dist; from trainer.checkpoint.background import writers_group; "
        f"dist.init_process_group('gloo', init_method='file://{tmp_path}/store', rank=0, world_size=1); "
        "group = writers_group(1); print(group is not None and dist.get_backend(group))"
    )
    assert run([sys.executable, "-c", script]).stdout.strip() == "gloo"


def test_four_processes_each_hold_a_fraction_of_what_ddp_needs_while_training_resuming_and_exporting(tmp_path):
    """A GPT-2 of 11M parameters built on meta, on 4 processes: the memory each process needs while it trains,
    checkpoints, resumes and exports (its peak RSS above what it held when the job began: on this host a process's
    memory is its device's) stays well under what each DDP process needs for the same model, measured in the same
    launch; the weights are DDP's to the float floor, and the resumed run's the uninterrupted run's, bit for bit.
    glibc's malloc keeps a fixed mmap threshold here, so that a freed tensor leaves the RSS as it leaves a GPU
    allocator's count (its default raises the threshold as large blocks are freed, then keeps freed memory)."""
    from transformers import GPT2LMHeadModel

    big = [
        "--width",
        "384",
        "--layers",
        "6",
        "--batch_size",
        "1",
        "--optimizer",
        "adamw",
        "--lr",
        "0.001",
        "--max_steps",
        "3",
        "--build",
        "meta",
        "--peak",
    ]
    folder = tmp_path / "fsdp"
    variants = {
        "ddp": [*big, "--ddp"],  # first: what it leaves behind could only raise the others' peaks
        "fsdp": [*big, "--save_every", "2", "--keep_last", "3"],
        "resumed": [*big, "--save_every", "2", "--resume_from", f"{folder}/checkpoints/step-00000002"],
    }
    result = launch(
        tmp_path, "--variants", json.dumps(variants), num_processes=4, env=clean_env(MALLOC_MMAP_THRESHOLD_="65536")
    )
    runs = {name: json.loads((tmp_path / name / "ragged.json").read_text()) for name in variants}
    assert "FSDP2 over 4 processes: 10,684,416 parameters, 2,671,104 held by this process" in result.stdout
    needed = {
        name: [peak - floor for peak, floor in zip(run["peaks"], run["floors"], strict=True)]
        for name, run in runs.items()
    }
    sharded = max(needed["fsdp"] + needed["resumed"])
    assert sharded < 0.5 * min(needed["ddp"]), {name: [n // 2**20 for n in mib] for name, mib in needed.items()}
    assert runs["resumed"]["weights"] == runs["fsdp"]["weights"]
    # AdamW moves a weight by about lr whatever its gradient's size, so the float noise of gradients that are 0 in
    # exact arithmetic (GPT-2's key biases: softmax ignores them) differs by up to lr between float orders.
    for name, values in runs["ddp"]["weights"].items():
        tolerance = 3 * 1e-3 if name.endswith("c_attn.bias") else 1e-5
        np.testing.assert_allclose(runs["fsdp"]["weights"][name], values, rtol=0, atol=tolerance, err_msg=name)
    exported = GPT2LMHeadModel.from_pretrained(tmp_path / "resumed" / "final")
    for name, parameter in exported.named_parameters():
        if name in runs["fsdp"]["weights"]:
            assert parameter.flatten().tolist() == runs["fsdp"]["weights"][name], name


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x)


class PlainGPT(torch.nn.Module):
    """nanoGPT's shape: no _no_split_modules, its blocks in a ModuleList, the head tied to the embeddings."""

    def __init__(self):
        super().__init__()
        self.wte, self.h = torch.nn.Embedding(10, 4), torch.nn.ModuleList(Block() for _ in range(3))
        self.head = torch.nn.Linear(4, 10, bias=False)
        self.head.weight = self.wte.weight


def test_a_model_naming_no_block_class_is_sharded_by_the_children_of_its_largest_module_list(capsys):
    from accelerate.utils import FullyShardedDataParallelPlugin

    from trainer.parallel.blocks import wrap_groups

    model = PlainGPT()
    by_class = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap")
    assert wrap_groups(model, by_class) == list(model.h)
    assert (
        "FSDP2: PlainGPT names no block class (_no_split_modules): each of the 3 modules of h (Block) is one "
        "group; name its block class in fsdp_transformer_layer_cls_to_wrap" in capsys.readouterr().out
    )
    # By size, nested, every module over 15 parameters but the tied embeddings and head (they stay in the root).
    by_size = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="size_based_wrap", min_num_params=15)
    assert wrap_groups(model, by_size) == [module for block in model.h for module in (block.fc, block)]


def test_an_optimizer_and_schedule_of_ones_own_are_built_after_sharding_and_a_schedule_decays_to_a_floor(fsdp):
    """Factories under FSDP2 as under DDP: nanoGPT's AdamW over the trainer's weight-decay groups, and its get_lr to
    the step; the same weights bit for bit. The config's cosine_with_min_lr is nanoGPT's curve after the warm-up
    (transformers' warm-up starts at 0, nanoGPT's at lr / (warmup + 1))."""
    from ragged_lm import nanogpt_lr

    runs, result = fsdp
    own, ddp = runs["fsdp, nanoGPT's optimizer and schedule"][0], runs["ddp, nanoGPT's optimizer and schedule"][0]
    expected = [nanogpt_lr(step, 0.01, 2, 6) for step in range(6)]
    np.testing.assert_allclose(own["lrs"], expected, rtol=1e-12)
    assert own["weights"] == ddp["weights"] and own["lrs"] == ddp["lrs"]
    assert "your AdamW (lr 0.01), your LambdaLR" in result.stdout  # the peak lr, not the first warm-up step's
    floor = runs["fsdp, cosine down to a floor"][0]
    np.testing.assert_allclose(floor["lrs"][2:], expected[2:], rtol=1e-12)
    assert floor["lrs"][:2] == [0.0, 0.005]
    assert "adamw lr 0.01, cosine_with_min_lr schedule after 2 warm-up steps down to 0.1 x lr" in result.stdout


def test_several_named_eval_sets_each_get_their_figures_and_the_best_of_one_survives_a_resume(fsdp):
    runs, result = fsdp
    straight, folder = runs["fsdp, two eval sets"]
    resumed = runs["fsdp, two eval sets, resumed at step 4"][0]
    assert "eval at step 2: eval_head_loss" in result.stdout and "eval at step 2: eval_tail_loss" in result.stdout
    figures = straight["evaluations"]
    assert figures["eval_head_examples"] == 10 and figures["eval_tail_examples"] == 35
    assert figures["eval_head_loss"] != figures["eval_tail_loss"]
    assert resumed["evaluations"] == figures
    # keep_best on eval_tail_loss, mode max: the first evaluation's (step 2), final/'s weights; the resumed run
    # (in a folder of its own) carries that record on from step 4 to its last checkpoint.
    best = {
        name: tensor.flatten().tolist()
        for name, tensor in read_sharded_weights(folder / "checkpoints" / "step-00000002").items()
    }
    assert straight["weights"] == {name: best[name] for name in straight["weights"]}
    last = "checkpoints/step-00000012/trainer_state.json"
    record = json.loads((folder / last).read_text())["best"]
    assert record["figure"] == "eval_tail_loss" and record["step"] == 2
    assert json.loads((runs["fsdp, two eval sets, resumed at step 4"][1] / last).read_text())["best"] == record


def test_an_average_of_the_weights_is_sharded_evaluated_exported_and_resumed_bit_for_bit(fsdp):
    runs, result = fsdp
    sharded, ddp = runs["fsdp, ema"][0], runs["ddp, ema"][0]
    # The average after each step, computed here from the weights the DDP run took at every step: it follows
    # the weights to step 2, then average += 0.5 * (weights - average).
    history = [{name: torch.tensor(values) for name, values in step.items()} for step in ddp["history"]]
    average = dict(history[1])
    for step in history[2:]:
        average = {name: torch.lerp(average[name], step[name], 0.5) for name in average}
    assert ddp["weights"] != ddp["history"][-1], "the model fit() ends with holds the average, not the last step"
    for name, values in ddp["weights"].items():
        np.testing.assert_allclose(values, average[name].tolist(), rtol=1e-6, atol=0, err_msg=name)
    # Sharded like the weights, each process updating its own part: the same average bit for bit.
    assert sharded["weights"] == ddp["weights"]
    # Evaluated with the average: the final evaluation equals the loss computed here on the model holding it.
    assert sharded["eval_loss"] == ddp["eval_loss"] == pytest.approx(sharded["eval_reference"], rel=1e-6)
    # final/ holds the average; the checkpoint's weights are the last step's (the average is a part of its own).
    from safetensors.torch import load_file

    exported = load_file(runs["fsdp, ema"][1] / "final" / "model.safetensors")
    checkpointed = read_sharded_weights(runs["fsdp, ema"][1] / "checkpoints" / "step-00000012")
    for name, values in ddp["weights"].items():
        assert exported[name].flatten().tolist() == values, name
        assert checkpointed[name].flatten().tolist() == ddp["history"][-1][name], name
    # The checkpoint holds the average (its ema part), so a resume from step 4 (sharded, or as DDP) reaches it.
    assert runs["fsdp, ema resumed at step 4"][0]["weights"] == sharded["weights"]
    assert runs["ddp, ema resumed from fsdp's step 4"][0]["weights"] == sharded["weights"]
    # keep_best judges the average's evaluations; the model fit() ends with (and final/) holds the best
    # checkpoint's average, not that checkpoint's weights, nor the last step's average.
    best, folder = runs["fsdp, ema, the highest eval loss kept as best"]
    step = json.loads((folder / "checkpoints" / "step-00000012" / "trainer_state.json").read_text())["best"]["step"]
    assert step < 12
    checkpoint = folder / "checkpoints" / f"step-{step:08d}"
    average, weights = read_sharded_weights(checkpoint / "ema", part="ema"), read_sharded_weights(checkpoint)
    assert best["weights"] == {name: average[name].flatten().tolist() for name in best["weights"]}
    assert best["weights"] != {name: weights[name].flatten().tolist() for name in best["weights"]}
    # The banner says so before the first step: final/ will not be the last step's weights.
    assert "| EMA of the weights (decay 0.5 from step 2) in evaluations and final/" in result.stdout


def test_a_micro_batch_out_of_memory_on_any_rank_is_cut_in_pieces_with_the_same_updates(fsdp):
    runs, result = fsdp
    reference = runs["ddp, clipped"][0]
    forward = runs["ddp, clipped, out of memory in rank 1's forward"][0]
    backward = runs["ddp, clipped, out of memory in every backward"][0]
    resumed = runs["ddp, clipped, out of memory, resumed at step 2"][0]
    # 4 examples a micro-batch, then 2, then 1: two reruns of step 1, on rank 1 alone or on both.
    assert forward["pieces"] == backward["pieces"] == 4
    assert forward["ooms"] == 0 and backward["ooms"] == 2  # rank 0's count: in forward, rank 1 alone ran out
    assert (
        "out of memory at step 1 (rank 1 in forward) with micro-batches of 4 example(s): every rank now cuts "
        "each micro-batch into 2 pieces (2 example(s) each) and reruns the step" in result.stdout
    )
    assert "(rank 0 in backward, rank 1 in backward) with micro-batches of 2 example(s)" in result.stdout
    tail = len(resumed["losses"])  # the steps the resumed run logged
    for summary in (forward, backward, resumed):  # the same updates, to the float floor of the other split
        for name, values in reference["weights"].items():
            np.testing.assert_allclose(summary["weights"][name], values, rtol=0, atol=2e-6, err_msg=name)
        np.testing.assert_allclose(summary["losses"][-tail:], reference["losses"][-tail:], rtol=1e-5)
    # The checkpoint keeps the split that fit: the resumed run starts with it and never runs out.
    assert resumed["ooms"] == 0 and resumed["pieces"] == 4
    # A piece of one example that does not fit either: one line, on every rank alike.
    assert runs["ddp, out of memory even at one example"][0]["refused"].startswith(
        "out of memory at step 1 (rank 0 in forward, rank 1 in forward) with micro-batches of one example: the model "
        "(28,544 parameters) and one example do not fit in this cpu device's memory; shard the model"
    )


def test_a_sharded_model_out_of_memory_on_one_rank_stops_every_rank_before_its_next_collective(fsdp):
    """FSDP2 gathers weights and reduce-scatters gradients inside forward and backward: rank 1 runs out there, rank 0
    learns of it before its next collective, both rerun in smaller pieces and reach the weights of the run that
    never ran out (the failed try's gradients left nowhere, the root's gathered ones included)."""
    runs, result = fsdp
    pairs = (
        ("fsdp, clipped, out of memory in rank 1's forward", "fsdp, clipped"),
        ("fsdp, clipped, 4 blocks, out of memory in rank 1's third block's backward", "fsdp, clipped, 4 blocks"),
    )
    if not RESETS:  # torch 2.11 and 2.12: refused by name, on every rank, before a step
        for name in [*(pair[0] for pair in pairs), "fsdp, out of memory even at one example"]:
            assert runs[name][0]["refused"] == (
                "auto_microbatch with a sharded model needs FSDPModule.reset_iter_state, which torch "
                f"{torch.__version__} lacks: use torch 2.13 or later, or set auto_microbatch: false and choose "
                "batch_size"
            ), name
        pytest.skip(f"torch {torch.__version__} has no FSDPModule.reset_iter_state: the refusal was checked")
    for name, reference in pairs:
        summary, expected = runs[name][0], runs[reference][0]
        assert summary["pieces"] == 4 and summary["ooms"] == 0, name  # rank 0's count: rank 1 alone ran out
        for weight, values in expected["weights"].items():
            np.testing.assert_allclose(summary["weights"][weight], values, rtol=0, atol=2e-6, err_msg=name)
        np.testing.assert_allclose(summary["losses"], expected["losses"], rtol=1e-5, err_msg=name)
    assert (
        "out of memory at step 1 (rank 1 in backward) with micro-batches of 2 example(s): every rank now cuts "
        "each micro-batch into 4 pieces" in result.stdout
    )
    assert runs["fsdp, out of memory even at one example"][0]["refused"].startswith(
        "out of memory at step 1 (rank 0 in forward, rank 1 in forward) with micro-batches of one example: the model "
        "(28,544 parameters, sharded) and one example do not fit in this cpu device's memory; shard it over more "
        "processes"
    )


def test_an_export_goes_into_a_folder_of_its_own_and_replaces_one_whole_only_when_told(fsdp, tmp_path):
    """Into a folder that holds another export: refused, or with --replace replaced whole (a stale index and its
    shards would load another model); into the checkpoint itself or an unwritable place: one line, nothing written."""
    from trainer.checkpoint.export import export
    from trainer.checkpoint.hf_files import INDEX
    from trainer.errors import ExportError

    checkpoint = fsdp[0]["fsdp, straight"][1] / "checkpoints" / "step-00000012"
    held = sorted(p.name for p in checkpoint.iterdir())
    stale = tmp_path / "stale"
    stale.mkdir()
    for name in (INDEX, "model-00001-of-00009.safetensors", "config.json"):
        (stale / name).write_text("{}")
    refused = run([sys.executable, "-m", "trainer.export", str(checkpoint), str(stale)], expect_ok=False)
    assert refused.returncode != 0 and refused.stderr.strip().splitlines() == [
        f"trainer: the export's folder {stale} already holds config.json, model-00001-of-00009.safetensors, "
        f"{INDEX}: export into a new or empty folder, or pass --replace to replace it whole"
    ]
    export(checkpoint, stale, replace=True)
    assert sorted(p.name for p in stale.iterdir()) == ["config.json", "model.safetensors"]
    with pytest.raises(ExportError, match="inside the checkpoint"):
        export(checkpoint, checkpoint / "exported")
    with pytest.raises(ExportError, match="cannot write the export into .*: Not a directory"):
        export(checkpoint, stale / "config.json" / "under a file")
    assert sorted(p.name for p in checkpoint.iterdir()) == held


@pytest.mark.parametrize("save_async", [False, True])
def test_a_full_disk_during_a_sharded_save_is_named_and_the_last_checkpoint_stays(tmp_path, save_async):
    """Each process writes its shards (torch.distributed.checkpoint, whose failure is a BaseException wrapping every
    rank's traceback): one line naming the full disk, the unfinished folder removed, step 2 still the latest; the
    metrics file that cannot be written either does not replace that line."""
    import subprocess

    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1200k", "tmpfs", str(disk)]).returncode != 0:
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    try:  # ~780 KB a checkpoint: step 2's fits, step 4's fills the disk
        failed = launch(
            disk / "run",
            *ADAMW,
            "--save_every",
            "2",
            "--max_steps",
            "6",
            *(["--save_async"] if save_async else []),
            expect_ok=False,
        )
        checkpoints = disk / "run" / "checkpoints"
        lines = [line.split("trainer: ", 1)[1] for line in failed.stderr.splitlines() if "trainer: " in line]
        said = failed.stdout + failed.stderr
        if save_async:  # the full disk may meet this step's metrics first: the checkpoint in flight is cleaned up
            assert "the disk is full" in said or "No space left on device" in said, said[-3000:]
            assert (
                "could not write checkpoint step-00000004" in said
                or "the checkpoint step-00000004 being "
                "written in the background was not committed: its folder was removed"
                in said
            ), said[-3000:]
        else:
            assert lines and lines[0].startswith("could not write checkpoint step-00000004: the disk is full"), (
                failed.stderr[-3000:]
            )
            assert f"{checkpoints / 'step-00000002'} is still the latest" in lines[0]
        assert "CheckpointException" not in failed.stderr
        if not save_async:  # (under save_async the metrics of rank 0 may fail alone first: the other rank, inside an
            assert "]: Traceback" not in failed.stderr  # all-gather then, gets gloo's error, as any one-rank failure)
        assert not list(checkpoints.glob(".tmp-*")), "the unfinished folder is removed, its space given back"
    finally:
        subprocess.run(["umount", "-l", str(disk)])


def test_compile_goes_block_by_block_under_fsdp2_and_ddp_and_equals_eager(fsdp):
    """compile: true under FSDP2 compiles each block's forward on its own (torchtitan's recipe; the whole sharded
    model compiled ran 2.4x slower than eager), under DDP the whole model or, as the accelerate config asks, each
    block. Each equals eager to the float floor (inductor's fused kernels, AdamW magnifying the noise of gradients
    that are 0 in exact arithmetic), resumes bit for bit, and one graph serves every block of a type: 4 blocks make
    no more than 2. The accelerate config's own dynamo answer (aot_eager here) gives eager's updates exactly,
    with activation checkpointing, an average of the weights, evaluation and auto_microbatch."""
    runs, result = fsdp
    for words in (
        "device cpu (FSDP2, compiled per block: 2 x GPT2Block and the loss (inductor))",
        "device cpu (MULTI_CPU, compiled whole (inductor))",
        "device cpu (MULTI_CPU, compiled per block: 2 x GPT2Block and the loss (inductor))",
        "device cpu (FSDP2, compiled per block: 4 x GPT2Block and the loss (aot_eager))",
    ):
        assert words in result.stdout, words
    for name, reference in (
        ("fsdp, compiled", "fsdp, straight"),
        ("ddp, compiled whole", "ddp, straight"),
        ("ddp, compiled per block", "ddp, straight"),
    ):
        compiled, eager = runs[name][0], runs[reference][0]
        np.testing.assert_allclose(compiled["losses"], eager["losses"], rtol=1e-6, err_msg=name)
        for weight, values in eager["weights"].items():  # 1.3e-4 and 1.6e-4 apart here
            np.testing.assert_allclose(compiled["weights"][weight], values, rtol=0, atol=1e-3, err_msg=name)
    # Sharded, a compiled block computes what it computes unsharded: FSDP2 equals DDP compiled per block exactly.
    assert runs["fsdp, compiled"][0]["weights"] == runs["ddp, compiled per block"][0]["weights"]
    assert runs["fsdp, compiled, resumed at step 4"][0]["weights"] == runs["fsdp, compiled"][0]["weights"]
    graphs = [runs[f"fsdp, {n}compiled by the accelerate config"][0]["graphs"] for n in ("", "4 blocks, ")]
    assert 0 < graphs[0] == graphs[1], graphs
    for name, reference in (
        ("fsdp, compiled by the accelerate config", "fsdp"),
        ("fsdp, compiled, activation checkpointing", "fsdp, activation checkpointing"),
        ("fsdp, compiled, ema", "fsdp, ema"),
        ("fsdp, compiled, out of memory in rank 1's forward", "fsdp, clipped, out of memory in rank 1's forward"),
    ):
        compiled, eager = runs[name][0], runs[reference][0]
        assert compiled["weights"] == eager["weights"] and compiled["losses"] == eager["losses"], name
    assert runs["fsdp, compiled, ema"][0]["eval_loss"] == runs["fsdp, ema"][0]["eval_loss"]
    # The export holds plain weights (no compiled wrapper's names), which from_pretrained reads.
    from transformers import GPT2LMHeadModel

    summary, out = runs["fsdp, compiled"]
    exported = GPT2LMHeadModel.from_pretrained(out / "final")
    for name, parameter in exported.named_parameters():
        assert parameter.flatten().tolist() == summary["weights"][name], name


def test_muon_trains_the_hidden_matrices_under_fsdp2_as_under_ddp_and_resumes_bit_for_bit(fsdp):
    """optimizer: muon: torch's Muon on the blocks' 8 weight matrices (Newton-Schulz on the whole matrix, gathered
    from its shards under FSDP2), AdamW on the embeddings, norms and biases; DDP's weights to the floor of Muon's
    bf16 iteration (2.1e-3 here, of weights that moved 0.14 from AdamW's), and a resume equals the straight run."""
    runs, result = fsdp
    assert "muon lr 0.01 (Muon on 8 hidden weight matrices, AdamW on the rest), weight decay 0.1" in result.stdout
    sharded, ddp = runs["fsdp, muon"][0], runs["ddp, muon"][0]
    assert sharded["losses"][-1] < sharded["losses"][0]
    np.testing.assert_allclose(sharded["losses"], ddp["losses"], rtol=1e-4)
    for name, values in ddp["weights"].items():
        np.testing.assert_allclose(sharded["weights"][name], values, rtol=0, atol=5e-3, err_msg=name)
    assert runs["fsdp, muon, resumed at step 4"][0]["weights"] == sharded["weights"]


def test_a_meta_models_initialisation_that_raises_is_one_line_naming_the_module(tmp_path):
    """Built on meta and sharded: a module's own reset_parameters() that raises, and a GPT-2 whose
    initializer_range is NaN (torch's normal_ refuses the std), came out as raw tracebacks from every rank; one
    line from the job now, naming the module (one launch, tests/jobs/run_many.py)."""
    from conftest import JOBS, SCENARIOS, job_exits, split_jobs

    faults = ("broken_reset", "nan_range")
    jobs = [[str(SCENARIOS), "nanogpt_meta", "--output_dir", str(tmp_path / f), "--fault", f] for f in faults]
    launched = accelerate_launch(JOBS, json.dumps(jobs), config="fsdp.yaml", num_processes=2, expect_ok=False)
    assert job_exits(launched.stderr, 2) == [1, 1], launched.stderr[-3000:]
    said = [[line for line in err.splitlines() if "trainer: " in line] for err in split_jobs(launched.stderr)]
    opening = "[rank0]: trainer: the model was built on the meta device, and the initialisation of its module"
    assert said == [
        [f"{opening} net.1 (BrokenNorm) raised ValueError: BrokenNorm cannot initialise itself"],
        [
            f"{opening} transformer.h.0.attn.c_attn (Conv1D) raised RuntimeError: normal expects std >= 0.0, but "
            "found std nan"
        ],
    ], launched.stderr[-3000:]
    assert "[rank0]: Traceback" not in launched.stderr and "[rank1]: Traceback" not in launched.stderr
