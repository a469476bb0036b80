"""On a host with a GPU (skipped without CUDA): the launch paths a GPU user takes, for real.

bf16 and fp16 on the GPU, a crash and resume ending bit-identical on one GPU, pinned memory and fused AdamW in
use, the fp32 output copy gone under mixed precision, ``compile``, the banner, cpu.yaml staying on the CPU, more
processes than GPUs refused with one message (two launches sharing one GPU too), a real out-of-memory met by
``auto_microbatch``; with 2 GPUs, DDP and FSDP2 over NCCL and each process bound to one GPU refused. Run:
``python -m pytest -q tests/test_gpu.py``.
"""

from __future__ import annotations

import json
import os
import re
import sys

import pytest
import torch
from test_checkpoint import assert_bit_identical, final_weights, result_line
from test_gpt2 import load_example

from conftest import (
    ROOT,
    SCENARIOS,
    accelerate_launch,
    accelerate_node,
    clean_env,
    free_port,
    run,
    run_together,
    torchrun,
)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
REFUSAL = "trainer: cannot start: "


def gpu_env(**extra: str) -> dict[str, str]:
    """clean_env() with the host's GPUs visible again."""
    env = clean_env(**extra)
    env.pop("CUDA_VISIBLE_DEVICES")
    if "CUDA_VISIBLE_DEVICES" in os.environ:
        env["CUDA_VISIBLE_DEVICES"] = os.environ["CUDA_VISIBLE_DEVICES"]
    return env


def job(tmp_path, *args, config="single_gpu.yaml", run_args=(), **kw) -> tuple[dict, str]:
    result = accelerate_launch(
        SCENARIOS, "job", "--output_dir", tmp_path, *args, config=config, run_args=run_args, env=gpu_env(), **kw
    )
    return json.loads((tmp_path / "result.json").read_text()), result.stdout + result.stderr


@pytest.mark.parametrize("precision", ["no", "bf16", "fp16"])
def test_one_gpu_trains_in_each_precision_with_pinned_memory_fused_adamw_and_no_fp32_copy(tmp_path, precision):
    report, output = job(tmp_path, run_args=["--mixed_precision", precision])
    assert (report["device"], report["mixed_precision"], report["world_size"]) == ("cuda", precision, 1)
    assert f"trainer | 1 process(es) on 1 machine(s), device cuda, mixed precision {precision}" in output
    assert report["fused_optimizer"] and report["pin_memory"]
    expected = {"no": "torch.float32", "bf16": "torch.bfloat16", "fp16": "torch.float16"}[precision]
    assert report["logits_dtype"] == expected, "the model's outputs stay in the autocast dtype"
    assert report["result"]["eval_loss"] < report["before"]["eval_loss"]


def test_crash_and_resume_on_one_gpu_ends_bit_identical(tmp_path):
    def launch(output_dir, *args, **kw):
        return accelerate_launch(
            SCENARIOS,
            "resume",
            "--output_dir",
            output_dir,
            *map(str, args),
            config="single_gpu.yaml",
            env=gpu_env(),
            **kw,
        )

    launch(tmp_path / "reference")
    crashed = launch(tmp_path / "crashed", "--crash_at", 9, "--crash_rank", 0, expect_ok=False)
    assert "CRASH rank 0 after step 9" in crashed.stdout
    resumed = launch(tmp_path / "crashed")
    assert "step 8, epoch 0, batch 8" in resumed.stdout and result_line(resumed.stdout)["global_step"] == 36
    assert_bit_identical(final_weights(tmp_path / "reference"), final_weights(tmp_path / "crashed"))


def test_compile_on_a_gpu_trains_and_exports_plain_weights(tmp_path):
    bf16 = ["--mixed_precision", "bf16"]
    result = accelerate_launch(
        SCENARIOS,
        "resume",
        "--output_dir",
        tmp_path,
        "--compile",
        "--max_steps",
        "8",
        config="single_gpu.yaml",
        run_args=bf16,
        env=gpu_env(),
    )
    assert result_line(result.stdout)["global_step"] == 8
    assert not any(key.startswith("_orig_mod") for key in final_weights(tmp_path))


@pytest.mark.parametrize("processes", [1, 2])
def test_cpu_yaml_stays_on_the_cpu_of_a_gpu_host(tmp_path, processes):
    report, output = job(tmp_path, config="cpu.yaml", num_processes=processes)
    assert (report["device"], report["world_size"]) == ("cpu", processes)
    assert f"{processes} process(es) on 1 machine(s), device cpu" in output


def test_accelerates_cpu_flag_stays_on_the_cpu_of_a_gpu_host(tmp_path):
    report, _ = job(tmp_path, run_args=["--cpu"])
    assert report["device"] == "cpu"


@pytest.mark.parametrize("launcher", ["accelerate", "torchrun"])
def test_more_processes_than_gpus_stop_with_one_message(tmp_path, launcher):
    too_many = GPUS + 1
    gpt2 = ROOT / "examples" / "gpt2.py"
    if launcher == "accelerate":
        result = accelerate_launch(
            gpt2, "--output-dir", tmp_path, num_processes=too_many, env=gpu_env(), expect_ok=False
        )
    else:
        result = torchrun(gpt2, "--output-dir", tmp_path, nproc=too_many, env=gpu_env(), expect_ok=False)
    output = result.stdout + result.stderr
    assert output.count(REFUSAL) == 1, output
    assert f"starts {too_many} processes on this machine, but it has {GPUS} GPU(s)" in output
    assert "invalid device ordinal" not in output and "gpt2 |" not in output


def test_the_gpt2_example_on_one_gpu_uses_tf32_a_gpu_batch_and_reports_mfu(tmp_path):
    example = load_example()
    from trainer.telemetry.mfu import peak_flops_of

    known = peak_flops_of(torch.cuda.get_device_name(0)) is not None  # else --peak-flops says
    tiny = [
        "--n-layer",
        "1",
        "--n-embd",
        "64",
        "--n-head",
        "2",
        "--seq-len",
        "64",
        "--vocab-size",
        "512",
        "--max-steps",
        "10",
        "--log-every",
        "5",
        "--eval-every",
        "1000",
        "--save-every",
        "1000",
        *([] if known else ["--peak-flops", "1e14"]),
    ]
    result = accelerate_launch(
        ROOT / "examples" / "gpt2.py", *tiny, "--output-dir", tmp_path, config="single_gpu.yaml", env=gpu_env()
    )
    assert "TF32 matmuls on" in result.stdout
    assert f"batch {example.GPU_BATCH_SIZE} per process x 1 processes" in result.stdout
    assert re.search(r"^step 10/10 \| .* tokens/s \| MFU [\d.]+%$", result.stdout, re.M)


def test_fsdp2_shards_over_nccl_and_computes_in_bf16_over_fp32_masters(tmp_path):
    """fsdp.yaml on one GPU (a mesh of one, NCCL): sharded, bf16 compute, fp32 master weights and AdamW state, a
    sharded checkpoint, evaluation in lockstep."""
    ragged = ROOT / "tests" / "jobs" / "ragged_lm.py"
    result = accelerate_launch(
        ragged,
        "--out",
        tmp_path,
        "--batch_size",
        "4",
        "--optimizer",
        "adamw",
        "--max_steps",
        "3",
        "--save_every",
        "2",
        "--eval",
        config="fsdp.yaml",
        num_processes=1,
        run_args=["--mixed_precision", "bf16"],
        env=gpu_env(),
    )
    assert "device cuda (FSDP2)" in result.stdout and "mixed precision bf16" in result.stdout
    summary = json.loads((tmp_path / "ragged.json").read_text())
    assert summary["computed"] == ["torch.bfloat16"]
    assert summary["dtypes"] == summary["optimizer_dtypes"] == ["torch.float32"]
    assert (tmp_path / "checkpoints" / "step-00000002" / "shards" / ".metadata").is_file()


def test_fsdp2_on_one_gpu_saves_in_the_background_and_builds_a_meta_model_on_the_gpu(tmp_path):
    """save_async on one process: DCP's background save needs a CPU (gloo) group beside NCCL even at world size 1,
    under FSDP2 and DDP alike (both checkpoints are DCP's, from the GPU's tensors). A model built on meta: each
    module made on the GPU and initialised there, never whole on the CPU. And per-block compile under FSDP2."""
    ragged = ROOT / "tests" / "jobs" / "ragged_lm.py"
    variants = {
        "async": ["--save_async", "--save_every", "2", "--max_steps", "4"],
        "ddp async": ["--save_async", "--save_every", "2", "--max_steps", "4", "--ddp"],
        "meta": ["--build", "meta", "--initial", "--max_steps", "2"],
        # lr 0.01: AdamW at the default 0.5 turns the float noise of near-zero gradients into 0.02 of a weight.
        "eager": ["--save_every", "2", "--max_steps", "4", "--lr", "0.01"],
        "compiled": ["--compile", "--save_every", "2", "--max_steps", "4", "--lr", "0.01"],
        "compiled, resumed": [
            "--compile",
            "--max_steps",
            "4",
            "--lr",
            "0.01",
            "--resume_from",
            f"{tmp_path}/compiled/checkpoints/step-00000002",
        ],
    }
    result = accelerate_launch(
        ragged,
        "--out",
        tmp_path,
        "--batch_size",
        "4",
        "--optimizer",
        "adamw",
        "--variants",
        json.dumps(variants),
        config="fsdp.yaml",
        num_processes=1,
        env=gpu_env(),
    )
    for name in ("async", "ddp async"):
        assert (tmp_path / name / "checkpoints" / "step-00000004" / "shards" / ".metadata").is_file(), name
    assert "built on meta, each process initialised its shards" in result.stdout
    meta = json.loads((tmp_path / "meta" / "ragged.json").read_text())
    assert meta["tied"] and all(loss == loss for loss in meta["losses"])
    # compile: true under FSDP2 on the GPU: each block compiled (inductor's GPU kernels), eager's updates to the
    # float floor, resumed bit for bit.
    assert "(FSDP2, compiled per block: 2 x GPT2Block and the loss (inductor))" in result.stdout
    eager, compiled, resumed = (
        json.loads((tmp_path / n / "ragged.json").read_text()) for n in ("eager", "compiled", "compiled, resumed")
    )
    for name, values in eager["weights"].items():
        assert torch.allclose(torch.tensor(compiled["weights"][name]), torch.tensor(values), atol=5e-3), name
    assert resumed["weights"] == compiled["weights"]


def test_two_launches_of_a_multi_node_job_on_one_gpu_host_stop_once_joined_with_one_message(tmp_path):
    """multi_node.yaml's two machines started on one host: each launch's one process is local rank 0 and takes
    GPU 0. Joined over NCCL, they find they share it (their GPUs' UUIDs), before NCCL's first collective would."""
    port = free_port()
    results = run_together(
        [
            (accelerate_node(rank, port, SCENARIOS, "job", "--output_dir", tmp_path / f"node{rank}"), ROOT)
            for rank in range(2)
        ],
        env=gpu_env(),
        expect_ok=False,
    )
    output = "".join(result.stdout + result.stderr for result in results)
    assert output.count(REFUSAL) == 1, output
    assert (
        "this launch starts 2 processes on this machine, but it has 1 GPU(s) for them (ranks 0 and 1 share "
        "one" in output
    )  # then ", CUDA_VISIBLE_DEVICES=... in each" where the host sets it


@pytest.mark.skipif(GPUS < 2, reason="needs 2 GPUs")
def test_each_process_bound_to_its_own_gpu_by_cuda_visible_devices_is_told_why_it_cannot_run_so(tmp_path):
    """srun --gpus-per-task's way (here a shell that sets CUDA_VISIBLE_DEVICES=$LOCAL_RANK): each process sees one
    GPU; accelerate's barriers would address GPU 1 in the process that has only GPU 0."""
    worker = f"CUDA_VISIBLE_DEVICES=$LOCAL_RANK exec {sys.executable} {SCENARIOS} job --output_dir {tmp_path}"
    result = torchrun("bash", "-c", worker, run_args=["--no-python"], env=gpu_env(), expect_ok=False)
    output = result.stdout + result.stderr
    assert output.count(REFUSAL) == 1, output
    assert "If a launcher gives each process its own GPU this way" in output and "invalid device" not in output


@pytest.mark.skipif(GPUS < 2, reason="needs 2 GPUs")
def test_ddp_and_fsdp2_over_nccl_on_two_gpus_agree_save_in_the_background_and_exit_cleanly(tmp_path):
    """The multi-process GPU paths: DDP and FSDP2 over NCCL (2 processes), the token count's all-reduce, lockstep
    evaluation, a sharded checkpoint written in the background beside NCCL (its gloo group), and the teardown."""
    from test_mesh import largest_difference

    common = [
        "--batch_size",
        "2",
        "--accumulation",
        "2",
        "--optimizer",
        "adamw",
        "--lr",
        "0.01",
        "--max_steps",
        "4",
        "--save_every",
        "2",
        "--eval",
        "--eval_examples",
        "45",
    ]
    variants = {"fsdp": [*common, "--save_async"], "ddp": [*common, "--ddp"]}
    result = accelerate_launch(
        ROOT / "tests" / "jobs" / "ragged_lm.py",
        "--out",
        tmp_path,
        "--variants",
        json.dumps(variants),
        config="fsdp.yaml",
        num_processes=2,
        env=gpu_env(),
    )
    assert "trainer | 2 process(es) on 1 machine(s), device cuda (FSDP2)" in result.stdout
    runs = {name: json.loads((tmp_path / name / "ragged.json").read_text()) for name in variants}
    assert largest_difference(runs["fsdp"], runs["ddp"]) < 1e-5  # TF32 off (torch's default): to the float floor
    assert runs["fsdp"]["eval_loss"] == pytest.approx(runs["ddp"]["eval_loss"], rel=1e-5)
    assert (tmp_path / "fsdp" / "checkpoints" / "step-00000004" / "shards" / ".metadata").is_file()
    output = result.stdout + result.stderr
    assert "No device id is provided" not in output, "a barrier that does not name its GPU"
    assert "has NOT been destroyed" not in output, "a process group left to the interpreter's exit"


@pytest.mark.skipif(GPUS < 4, reason="needs 4 GPUs")
def test_hsdp_and_tensor_parallelism_over_nccl_equal_ddp_on_four_gpus(tmp_path):
    """tests/parallel/test_mesh.py's equalities on 4 GPUs over NCCL: HSDP 2 x 2 = FSDP 4 = DDP 4 (GPT-2), TP 2 x FSDP 2
    = DDP 4 (Llama), to the float floor (TF32 off: torch's default, which the trainer leaves alone)."""
    from test_mesh import DDP_4, EVALUATED, FOUR, FSDP_4, LLAMA, TP_FSDP, TWO, largest_difference, sizes

    variants = {
        "hsdp": [*FOUR, *EVALUATED, *sizes(2, 2)],
        "fsdp": [*FOUR, *EVALUATED, *FSDP_4],
        "ddp": [*FOUR, *EVALUATED, *DDP_4, "--ddp"],
        "tp x fsdp": [*LLAMA, *TWO, *EVALUATED, *TP_FSDP],
        "ddp, llama": [*LLAMA, *FOUR, *EVALUATED, *DDP_4, "--ddp"],
    }
    result = accelerate_launch(
        ROOT / "tests" / "jobs" / "ragged_lm.py",
        "--out",
        tmp_path,
        "--variants",
        json.dumps(variants),
        config="fsdp.yaml",
        num_processes=4,
        env=gpu_env(),
    )
    assert "device cuda (HSDP)" in result.stdout and "device cuda (TP x FSDP2)" in result.stdout
    runs = {name: json.loads((tmp_path / name / "ragged.json").read_text()) for name in variants}
    for one, other in (("hsdp", "fsdp"), ("hsdp", "ddp"), ("tp x fsdp", "ddp, llama")):
        assert largest_difference(runs[one], runs[other]) < 1e-5, (one, other)
        assert runs[one]["eval_loss"] == pytest.approx(runs[other]["eval_loss"], rel=1e-5)


HUNGRY = """
import json, sys, torch, trainer as t
total = torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else 0
torch.manual_seed(0)
x = torch.randn(32, 4)
rows = [{"x": x[i], "y": x[i, :1] * 2} for i in range(32)]
weights = {}
for name, hungry in (("plain", False), ("hungry", True)):
    def loss_fn(model, batch, hungry=hungry):
        if hungry and model.training:  # 0.3 of the GPU's memory an example: 4 do not fit, 2 do
            if total:
                held = torch.empty(int(batch["x"].shape[0] * total * 0.3), dtype=torch.uint8, device=batch["x"].device)
                del held
            elif batch["x"].shape[0] > 2:  # (no GPU: as the allocator would)
                raise torch.OutOfMemoryError("CUDA out of memory")
        return ((model(batch["x"]) - batch["y"]) ** 2).mean()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    config = t.TrainConfig(output_dir=sys.argv[1] + "/" + name, batch_size=4, max_steps=4, lr=0.1, shuffle=False,
                           auto_microbatch=True, log_every=1)
    trainer = t.Trainer(model, config, train_data=rows, loss_fn=loss_fn)
    trainer.fit()
    weights[name] = [p.detach().cpu().flatten().tolist() for p in trainer.unwrapped_model.parameters()]
    pieces = trainer.steps.split.pieces
print(json.dumps({"weights": weights, "pieces": pieces}))
"""


def test_a_real_out_of_memory_on_the_gpu_cuts_the_micro_batch_with_the_same_updates(tmp_path):
    """auto_microbatch against the GPU's own allocator: 4 examples ask 1.2 x the GPU's memory, 2 fit."""
    result = run([sys.executable, "-c", HUNGRY, str(tmp_path)], env=gpu_env())
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert "out of memory at step 1 (rank 0 in forward) with micro-batches of 4 example(s)" in result.stdout
    assert summary["pieces"] == 2
    for plain, hungry in zip(summary["weights"]["plain"], summary["weights"]["hungry"], strict=True):
        assert hungry == pytest.approx(plain, abs=1e-6)
