"""Launches against the host: more processes than GPUs, CPU launches on a host with GPUs, several CPU processes,
and `accelerate config` itself driven through a pty. Real launches on a pretend GPU host (conftest.pretend_gpus:
torch.cuda reports GPUs, and any real CUDA work fails); tests/test_gpu.py repeats the GPU cases on a real one."""

from __future__ import annotations

import json
import sys
import time

import pytest

from conftest import CONFIGS, ROOT, SCENARIOS, accelerate_config, accelerate_launch, pretend_gpus, run, torchrun

GPT2 = ROOT / "examples" / "gpt2.py"
REFUSAL = "trainer: cannot start: "


def job_report(output_dir) -> dict:
    return json.loads((output_dir / "result.json").read_text())


@pytest.mark.parametrize("launcher", ["accelerate", "torchrun"])
def test_more_processes_than_gpus_stop_at_once_with_one_message_naming_what_works(tmp_path, launcher):
    # The README's main command on a 1-GPU machine: 2 processes, 1 GPU.
    started = time.monotonic()
    if launcher == "accelerate":
        result = accelerate_launch(GPT2, "--output-dir", tmp_path, env=pretend_gpus(1), expect_ok=False)
    else:
        result = torchrun(GPT2, "--output-dir", tmp_path, env=pretend_gpus(1), expect_ok=False)
    output = result.stdout + result.stderr
    assert output.count(REFUSAL) == 1, output  # once, not once per rank
    assert "starts 2 processes on this machine, but it has 1 GPU(s)" in output
    assert "accelerate launch --num_processes 1" in output and "torchrun --nproc_per_node 1" in output
    assert "accelerate_configs/cpu.yaml --num_processes 2" in output
    assert "gpt2 |" not in output and not (tmp_path / "tokenizer").exists()  # before any model or data
    assert time.monotonic() - started < 60


def test_a_launcher_that_gives_each_process_a_gpu_of_its_own_is_told_why_it_cannot_run_so(tmp_path):
    """srun --gpus-per-task sets CUDA_VISIBLE_DEVICES per process: each of 2 processes a machine sees one GPU.
    accelerate would map each to its own, but its barriers then address GPU 1 in a process that has only GPU 0."""
    result = torchrun(
        GPT2, "--output-dir", tmp_path, env={**pretend_gpus(2), "CUDA_VISIBLE_DEVICES": "1"}, expect_ok=False
    )
    output = result.stdout + result.stderr
    assert output.count(REFUSAL) == 1, output
    assert "starts 2 processes on this machine, but it has 1 GPU(s)" in output
    assert "(CUDA_VISIBLE_DEVICES='1' leaves this process 1. If a launcher gives each process its own GPU" in output
    assert "srun --gpu-bind=none" in output


SHARED = """
import sys, types
sys.path.insert(0, {root!r})
import torch
import torch.distributed as dist
from trainer.launch import host, run

dist.init_process_group("gloo")
host.destroy_process_group_at_exit()  # the teardown distributed_state registers
rank = dist.get_rank()
uuid = "GPU-one" if sys.argv[1] == "shared" else f"GPU-{{rank}}"  # the GPU each process was given
torch.cuda.get_device_properties = lambda device: types.SimpleNamespace(uuid=uuid)  # (no CUDA on this host)
state = types.SimpleNamespace(num_processes=2, process_index=rank, device=torch.device("cuda", 0))
run._compare_gpus(state, 60)
print(f"rank {{rank}} has a GPU of its own")
"""


def test_two_processes_given_one_gpu_stop_once_joined_with_one_message(tmp_path):
    """Once joined, the processes compare their GPUs' UUIDs over the host group: two on one GPU (two launches on one
    machine, each local rank 0) stop, named (2 real processes, gloo; the UUID each reads is set, this host having
    no GPU)."""
    (tmp_path / "shared.py").write_text(SHARED.format(root=str(ROOT)))
    env = {**pretend_gpus(1), "CUDA_VISIBLE_DEVICES": "0"}
    apart = torchrun(tmp_path / "shared.py", "apart", env=env)
    assert apart.stdout.count("has a GPU of its own") == 2
    shared = torchrun(tmp_path / "shared.py", "shared", env=env, expect_ok=False)
    output = shared.stdout + shared.stderr
    assert output.count(REFUSAL) == 1, output
    assert (
        "trainer: cannot start: this launch starts 2 processes on this machine, but it has 1 GPU(s) for them "
        "(ranks 0 and 1 share one, CUDA_VISIBLE_DEVICES='0' in each): one process per GPU. Run `accelerate "
        "launch --num_processes 1 ...`"
    ) in output
    assert "has a GPU of its own" not in output


@pytest.mark.parametrize("processes", [1, 2])
def test_cpu_yaml_runs_on_the_cpu_of_a_host_with_a_gpu(tmp_path, processes):
    result = accelerate_launch(
        SCENARIOS, "job", "--output_dir", tmp_path, config="cpu.yaml", num_processes=processes, env=pretend_gpus(1)
    )
    report = job_report(tmp_path)
    assert (report["world_size"], report["device"]) == (processes, "cpu")
    assert f"trainer | {processes} process(es) on 1 machine(s), device cpu" in result.stdout
    assert report["result"]["eval_loss"] < report["before"]["eval_loss"]


def test_accelerates_cpu_flag_on_a_host_with_a_gpu_runs_on_the_cpu(tmp_path):
    # accelerate's own CPU path (ACCELERATE_USE_CPU): the process state, set_seed and the Accelerator must agree.
    accelerate_launch(
        SCENARIOS, "job", "--output_dir", tmp_path, config="single_gpu.yaml", run_args=["--cpu"], env=pretend_gpus(1)
    )
    assert job_report(tmp_path)["device"] == "cpu"


def test_several_processes_asked_of_accelerates_cpu_launcher_stop_naming_what_works(tmp_path):
    result = accelerate_launch(
        SCENARIOS,
        "job",
        "--output_dir",
        tmp_path,
        config="single_gpu.yaml",
        run_args=["--cpu"],
        num_processes=2,
        expect_ok=False,
    )
    output = result.stdout + result.stderr
    assert output.count(REFUSAL) == 1 and "but started ONE" in output
    assert "accelerate_configs/cpu.yaml --num_processes K" in output
    assert not (tmp_path / "result.json").exists()


# ------------------------------------------------------------- `accelerate config`, interactive, through a pty

# The README's walk-through for CPU processes ("Your own cluster's config"), and the multi-CPU answers that
# accelerate's CPU launcher cannot honour without mpirun.
README_CPU_ANSWERS = {"Which type of machine": "multi-GPU", "How many GPU(s)": "2", "What GPU(s) (by id)": "-1,-1"}
MULTI_CPU_ANSWERS = {"Which type of machine": "multi-CPU", "How many processes": "2"}


def test_the_readmes_accelerate_config_answers_give_k_cpu_processes_even_on_a_gpu_host(tmp_path):
    path = tmp_path / "my.yaml"
    asked = accelerate_config(path, README_CPU_ANSWERS)
    assert (
        "What GPU(s) (by id) should be used for training on this machine as a comma-separated list? [all]:",
        "-1,-1",
    ) in asked
    walk_through = (ROOT / "docs" / "clusters.md").read_text()
    assert all(f"`{answer}`" in walk_through for answer in README_CPU_ANSWERS.values()), "the docs walk through these"
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        path,
        SCENARIOS,
        "job",
        "--output_dir",
        tmp_path / "job",
    ]
    run([str(c) for c in cmd], env=pretend_gpus(1))
    report = job_report(tmp_path / "job")
    assert (report["world_size"], report["device"]) == (2, "cpu")


def test_a_multi_cpu_config_from_accelerate_config_stops_instead_of_running_one_process(tmp_path):
    path = tmp_path / "multi_cpu.yaml"
    accelerate_config(path, MULTI_CPU_ANSWERS)
    assert "distributed_type: MULTI_CPU" in path.read_text() and "num_processes: 2" in path.read_text()
    check = run([sys.executable, "-m", "trainer.check", "--config_file", str(path)], expect_ok=False)
    assert "PROBLEM: accelerate launch starts 1 process for this file, not 2" in check.stdout
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        path,
        SCENARIOS,
        "job",
        "--output_dir",
        tmp_path / "job",
    ]
    result = run([str(c) for c in cmd], expect_ok=False)
    assert (result.stdout + result.stderr).count(REFUSAL) == 1
    assert not (tmp_path / "job" / "result.json").exists()


def test_preflight_names_more_processes_than_gpus_and_passes_cpu_yaml():
    check = run(
        [sys.executable, "-m", "trainer.check", "--config_file", str(CONFIGS / "multi_gpu.yaml")],
        env=pretend_gpus(1),
        expect_ok=False,
    )
    assert "PROBLEM: 2 processes per machine, but this machine has 1 GPU(s)" in check.stdout
    for processes in ("1", "2"):
        cpu = run(
            [
                sys.executable,
                "-m",
                "trainer.check",
                "--config_file",
                str(CONFIGS / "cpu.yaml"),
                "--num_processes",
                processes,
            ],
            env=pretend_gpus(1),
        )
        assert "gloo on CPU" in cpu.stdout and "preflight: no problems found" in cpu.stdout


def test_a_busy_machine_is_told_what_thread_count_to_use():
    """Nothing said what thread count suits a shared host, where 2 threads a process ran 10x slower than 1 at
    load 30: past twice its cores' load, the job's first line of advice says so (its figures in-process here: a
    test cannot load the machine to order)."""
    from trainer.launch.host import busy_host

    said = busy_host(30.0, cores=2, threads=2)
    assert said.startswith("this machine is busy (load 30 on 2 cores): 2 CPU threads per process can run far")
    assert "OMP_NUM_THREADS=1" in said
    assert busy_host(3.0, cores=2, threads=2) is None and busy_host(30.0, cores=2, threads=1) is None
