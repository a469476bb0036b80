"""Every accelerate config loads with accelerate's loader (each launches a job in tests/test_examples.py); the CPU
fallback and its guard; exact evaluation; user DataLoaders; data too small for the world size; a refusal said
once even when the first process meets it last. Multi-process cases
are real `accelerate launch` runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from accelerate.commands.config.config_args import load_config_from_file

from conftest import CONFIGS, ROOT, SAME_UPDATES, SCENARIOS, accelerate_launch, clean_env, launch_jobs, python

ALL_CONFIGS = sorted(p.name for p in CONFIGS.glob("*.yaml"))


@pytest.mark.parametrize("name", ALL_CONFIGS)
def test_config_loads_with_accelerates_own_loader_and_says_how_to_launch(name):
    config = load_config_from_file(str(CONFIGS / name))
    assert config.num_processes >= 1 and config.compute_environment.value == "LOCAL_MACHINE"
    header = (CONFIGS / name).read_text().split("\n", 3)
    assert header[0].startswith("#") and f"accelerate launch --config_file accelerate_configs/{name}" in "".join(header)


def test_the_expected_configs_exist():
    expected = {
        "single_gpu.yaml",
        "multi_gpu.yaml",
        "multi_node.yaml",
        "fp16.yaml",
        "bf16.yaml",
        "cpu.yaml",
        "fsdp.yaml",
    }
    assert expected <= set(ALL_CONFIGS)


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory) -> dict[str, subprocess.CompletedProcess]:
    """name -> how a 2-process job of multi_gpu.yaml ended; all in one launch (conftest.launch_jobs)."""
    out = tmp_path_factory.mktemp("two_processes")
    loader = [SCENARIOS, "user_loader", "--sampler"]
    runs = {
        "job": [SCENARIOS, "job", "--output_dir", out / "job"],
        "distributed": [*loader, "distributed", "--output_dir", out / "distributed"],
        "own_part": [*loader, "own_part", "--output_dir", out / "own_part"],
        "no sampler": [*loader, "none", "--output_dir", out / "none"],
        "too small": [SCENARIOS, "too_small", "--output_dir", out / "too_small"],
    }
    return launch_jobs(runs)


def test_multi_gpu_config_on_cpu_host_is_one_ddp_job_with_exact_evaluation(two_processes, tmp_path):
    ended = two_processes["job"]
    assert ended.returncode == 0, ended.stderr[-3000:]
    two, output = json.loads(Path(ended.args[-1], "result.json").read_text()), ended.stdout + ended.stderr
    assert two["world_size"] == 2 and two["device"] == "cpu"
    assert output.count("No GPU on this host") == 1
    assert "batch 8 per process x 2 processes x 1 accumulation = 16 global" in output
    assert "4 optimizer steps per epoch, 16 in all" in output

    # 9 eval examples on 2 processes: each counted once (a padded DistributedSampler would count 10), and the
    # untrained model's eval loss equals the one-process figure.
    accelerate_launch(SCENARIOS, "job", "--output_dir", tmp_path, config="single_gpu.yaml")
    one = json.loads((tmp_path / "result.json").read_text())
    assert two["before"]["eval_examples"] == one["before"]["eval_examples"] == 9
    assert two["before"]["eval_loss"] == pytest.approx(one["before"]["eval_loss"], rel=1e-6)
    assert "eval_perplexity" not in two["before"], "a classifier's exp(loss) is no perplexity"


def test_guard_stops_processes_that_each_believe_they_are_alone():
    result = accelerate_launch(SCENARIOS, "world_guard", expect_ok=False)
    assert "The launcher started WORLD_SIZE=2 processes, but this process" in result.stderr
    assert "joined a world of 1" in result.stderr


@pytest.mark.parametrize("sampler", ["distributed", "own_part"])
def test_users_dataloader_is_read_as_is_on_every_process(two_processes, sampler):
    """A DistributedSampler's loader is not sharded twice; a stream that splits itself is read on every process
    (accelerate alone would dispatch: only process 0's stream read, its batches split between the processes)."""
    ended = two_processes[sampler]
    assert ended.returncode == 0, ended.stderr[-3000:]
    assert "SEEN rank0 [[0, 2, 4], [6, 8, 10]]" in ended.stdout
    assert "SEEN rank1 [[1, 3, 5], [7, 9, 11]]" in ended.stdout


def test_users_dataloader_without_distributed_sampler_is_refused_with_what_to_pass(two_processes):
    ended = two_processes["no sampler"]
    assert ended.returncode == 1 and "train_data is a DataLoader with a SequentialSampler" in ended.stderr
    assert "Pass the Dataset itself as train_data" in ended.stderr


def test_users_dataloader_is_used_as_is_in_one_process(tmp_path):
    result = python(SCENARIOS, "user_loader", "--sampler", "none", "--output_dir", tmp_path)
    assert "SEEN rank0 [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11]]" in result.stdout


def test_data_set_smaller_than_the_world_is_refused(two_processes):
    ended = two_processes["too small"]
    assert ended.returncode == 1 and "train_data has 1 examples, fewer than the 2 processes" in ended.stderr


FSDP1 = (
    "the accelerate config asks for FSDP version 1; this trainer shards with FSDP2. Convert the file with "
    "`accelerate to-fsdp2 --config_file <yours> --output_file <new>` (or set fsdp_version: 2 under fsdp_config)"
)


def test_a_refusal_before_the_process_group_is_said_when_the_first_process_reaches_it_last(tmp_path):
    """Another rank meeting the launch's refusal first waits for the first process to say it: exiting, it had the
    elastic agent end the job, the first process with it, and the line was never said (seen under load)."""
    script = tmp_path / "late_first.py"
    script.write_text(
        "import os, time\nimport torch\nfrom trainer import TrainConfig, Trainer\n\n"
        "if os.environ['RANK'] == '0':\n    time.sleep(3)  # the first process reaches the refusal last\n"
        f"Trainer(torch.nn.Linear(1, 1), TrainConfig(output_dir={str(tmp_path / 'out')!r}), [[1.0]])\n"
    )
    result = accelerate_launch(script, config="fsdp.yaml", run_args=["--fsdp_version", "1"], expect_ok=False)
    said = [line for line in result.stderr.splitlines() if line.startswith("trainer: ")]
    assert said == [f"trainer: {FSDP1}"], result.stderr[-3000:]
    assert "[rank0]: Traceback" not in result.stderr and "[rank1]: Traceback" not in result.stderr


@pytest.mark.parametrize(
    "config, user_threads, processes",
    [("single_gpu.yaml", None, 1), ("multi_gpu.yaml", None, 2), ("single_gpu.yaml", "1", 1)],
)
def test_cpu_threads_are_shared_among_local_processes_unless_the_user_chose(tmp_path, config, user_threads, processes):
    # accelerate launch sets OMP_NUM_THREADS=1 itself when it is unset; a lone process must still get every core.
    env = clean_env()
    env.pop("OMP_NUM_THREADS")
    if user_threads:
        env["OMP_NUM_THREADS"] = user_threads
    result = accelerate_launch(SAME_UPDATES, "--epochs", "1", "--output_dir", tmp_path, config=config, env=env)
    expected = int(user_threads) if user_threads else max(1, len(os.sched_getaffinity(0)) // processes)
    # One process is not distributed: nothing in brackets (accelerate's word for it, "NO", means nothing to a reader).
    kind = " (MULTI_CPU)" if processes > 1 else ""
    assert f"{processes} process(es) on 1 machine(s), device cpu{kind}, {expected} CPU threads" in result.stdout


ABORTED = """
import os, sys
sys.path.insert(0, {root!r})
from trainer import distributed_state
distributed_state()
def waiting_for_a_peer():  # where NCCL's watchdog would find a rank that waited out collective_timeout_s
    os.abort()
waiting_for_a_peer()
"""


def test_a_process_ended_by_sigabrt_says_where_it_was():
    """NCCL's watchdog ends a waiting rank with SIGABRT: no exception, no traceback, unless the process says where
    it was (faulthandler, on stderr)."""
    result = subprocess.run(
        [sys.executable, "-c", ABORTED.format(root=str(ROOT))],
        capture_output=True,
        text=True,
        env=clean_env(),
        timeout=120,
    )
    assert result.returncode == -6  # SIGABRT
    assert "Fatal Python error: Aborted" in result.stderr and "waiting_for_a_peer" in result.stderr, result.stderr
