"""Launching on clusters, on one host: two "nodes" through accelerate launch and torchrun, Slurm's scripts, a
config written by `accelerate config`, the preflight check, and a rank that stalls."""

from __future__ import annotations

import json
import os
import re
import sys
import time

import pytest
from test_same_updates import COMMON, assert_same_run

from conftest import (
    CONFIGS,
    JOBS,
    ROOT,
    SAME_UPDATES,
    SCENARIOS,
    accelerate_launch,
    accelerate_node,
    clean_env,
    free_port,
    job_exits,
    launch_jobs,
    python,
    read_summary,
    run,
    run_together,
    split_jobs,
)

STALL = ["--stall_at", "5", "--stall_rank", "1"]
SGD_MEAN = ["--opt", "sgd", "--loss", "mean", "--lr", "0.5"]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The reference: one process with the whole batch of 10."""
    out = tmp_path_factory.mktemp("one")
    python(SAME_UPDATES, *COMMON, *SGD_MEAN, "--batch_size", "10", "--output_dir", out)
    return read_summary(out)


def files_under(directory):
    return sorted(str(p.relative_to(directory)) for p in directory.rglob("*") if p.is_file())


def test_two_nodes_through_accelerate_launch_match_one_process_each_file_written_once(tmp_path, one_process):
    # Each "node" runs in its own folder with a relative output_dir: two disks, as on two machines without a
    # shared filesystem, so every file shows which node wrote it.
    port, nodes = free_port(), [tmp_path / "node0", tmp_path / "node1"]
    for node in nodes:
        node.mkdir()
    args = [SAME_UPDATES, *COMMON, *SGD_MEAN, "--batch_size", "5", "--output_dir", "out"]
    run_together([(accelerate_node(rank, port, *args), node) for rank, node in enumerate(nodes)])
    two = read_summary(nodes[0] / "out")
    assert two["world_size"] == 2
    assert_same_run(one_process, two)
    # The global main process alone writes the results and the model (and holds the output_dir's lock); every rank
    # only its own metrics.
    assert files_under(nodes[0] / "out") == [
        ".lock",
        "final/model.safetensors",
        "metrics/rank0.jsonl",
        "same_updates.json",
    ]
    assert files_under(nodes[1] / "out") == ["metrics/rank1.jsonl"]


def test_two_nodes_through_torchrun_c10d_match_one_process(tmp_path, one_process):
    endpoint = f"127.0.0.1:{free_port()}"
    out = tmp_path / "out"
    node = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "2",
        "--nproc_per_node",
        "1",
        "--rdzv-id",
        "456",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        endpoint,
        SAME_UPDATES,
        *COMMON,
        *SGD_MEAN,
        "--batch_size",
        "5",
        "--output_dir",
        out,
    ]
    run_together([(node, ROOT), (node, ROOT)])
    two = read_summary(out)
    assert two["world_size"] == 2
    assert_same_run(one_process, two)


@pytest.mark.parametrize("script, nodes, gpus", [("single_node.sbatch", 1, 2), ("multi_node.sbatch", 2, 1)])
def test_slurm_scripts_under_the_environment_slurm_sets(tmp_path, one_process, script, nodes, gpus):
    """Environment-driven, not a real Slurm: the variables sbatch sets, and an srun that starts one task per node
    on this host (tests/support/fake_slurm). The scripts' own launch logic runs: the head node, the free port, the
    per-node --machine_rank, and a real 2-process job comes out of it. Kept beside tests/launch/test_slurm.py (a real
    Slurm) for what that one cannot give here: processes counted from the GPUs Slurm allots (SLURM_GPUS_ON_NODE),
    and the head taken from the node list (the real cluster's node names do not resolve on this host)."""
    env = clean_env(
        PATH=f"{ROOT / 'tests' / 'support' / 'fake_slurm'}{os.pathsep}{os.path.dirname(sys.executable)}{os.pathsep}"
        + os.environ["PATH"],
        SLURM_JOB_ID="4242",
        SLURM_NNODES=str(nodes),
        SLURM_JOB_NODELIST=",".join(["localhost"] * nodes),
        SLURM_GPUS_ON_NODE=str(gpus),
        SCRIPT=str(SAME_UPDATES),
    )
    out = tmp_path / "out"
    result = run(
        ["bash", ROOT / "examples" / "slurm" / script, *COMMON, *SGD_MEAN, "--batch_size", "5", "--output_dir", out],
        env=env,
    )
    assert f"slurm job 4242: {nodes} node" in result.stdout
    if nodes > 1:
        assert re.search(r"head localhost:\d+", result.stdout)
    two = read_summary(out)
    assert two["world_size"] == 2
    assert_same_run(one_process, two)


def test_a_config_written_by_accelerate_config_launches_a_job(tmp_path, one_process):
    config = tmp_path / "my.yaml"  # what `accelerate config default` writes on this machine: 1 process on CPU
    run([sys.executable, "-m", "accelerate.commands.accelerate_cli", "config", "default", "--config_file", config])
    result = accelerate_launch(
        SAME_UPDATES, *COMMON, *SGD_MEAN, "--batch_size", "10", "--output_dir", tmp_path / "out", config=config
    )
    assert "trainer | 1 process(es)" in result.stdout
    assert_same_run(one_process, read_summary(tmp_path / "out"))


def test_preflight_reads_a_config_and_names_each_problem():
    fine = run([sys.executable, "-m", "trainer.check", "--config_file", CONFIGS / "multi_gpu.yaml"])
    assert "1 machine(s) x 2 process(es) = 2 processes" in fine.stdout
    assert fine.stdout.rstrip().endswith("preflight: no problems found")
    shipped = run(
        [sys.executable, "-m", "trainer.check", "--config_file", CONFIGS / "multi_node.yaml"], expect_ok=False
    )
    assert "2 machine(s) x 8 process(es) = 16 processes" in shipped.stdout
    assert "rendezvous: static at 127.0.0.1:29500" in shipped.stdout
    assert "PROBLEM: main_process_ip 127.0.0.1 is a loopback address" in shipped.stdout
    # gloo's interface: the trainer's CPU groups hang where the hostname resolves to one the other nodes cannot reach.
    assert "network: GLOO_SOCKET_IFNAME is not set" in shipped.stdout
    named = run(
        [sys.executable, "-m", "trainer.check", "--config_file", CONFIGS / "multi_node.yaml"],
        expect_ok=False,
        env=clean_env(GLOO_SOCKET_IFNAME="eth7"),
    )
    assert "  network: gloo on eth7" in named.stdout


def test_preflight_says_what_it_cannot_check_and_names_a_folder_passed_as_the_file(tmp_path):
    """A block class that names no module (GPT2Blok) went with "no problems found": the check has no model, and
    says so; a folder was "config file not found"."""
    path = tmp_path / "blok.yaml"
    path.write_text(
        (CONFIGS / "fsdp.yaml")
        .read_text()
        .replace("fsdp_config:\n", "fsdp_config:\n  fsdp_transformer_layer_cls_to_wrap: GPT2Blok\n")
    )
    said = run([sys.executable, "-m", "trainer.check", "--config_file", path]).stdout
    assert "  blocks: GPT2Blok (fsdp_transformer_layer_cls_to_wrap), not checked: this check builds no model" in said
    folder = run([sys.executable, "-m", "trainer.check", "--config_file", tmp_path], expect_ok=False)
    assert folder.returncode == 1 and f"PROBLEM: config file {tmp_path} is a folder" in folder.stdout


@pytest.fixture(scope="module")
def preflights(tmp_path_factory) -> dict:
    """Where output_dir is -> what the preflight inside a two-node launch printed on node 0, and its exit: one
    folder on both, a folder of each node's own (a relative path from each node's folder), a path under a file; the
    three checks in one launch (tests/jobs/run_many.py)."""
    root = tmp_path_factory.mktemp("preflights")
    port, nodes = free_port(), [root / "node0", root / "node1"]
    for node in nodes:
        node.mkdir()
    (root / "a file").write_text("")
    output_dirs = {"shared": root / "shared", "not shared": "out", "unwritable": root / "a file" / "out"}
    check = str(ROOT / "trainer" / "check.py")
    jobs = json.dumps([[check, "--output_dir", str(folder)] for folder in output_dirs.values()])
    results = run_together(
        [(accelerate_node(rank, port, JOBS, jobs), node) for rank, node in enumerate(nodes)],
        expect_ok=False,
        env=clean_env(PYTHONPATH=str(ROOT)),
    )
    exits, heads = job_exits(results[0].stderr, len(output_dirs)), split_jobs(results[0].stdout)
    assert "Traceback" not in results[0].stdout + results[1].stdout
    ended = zip(output_dirs.items(), exits, heads, strict=True)
    return {name: (folder, exit, head) for (name, folder), exit, head in ended}


@pytest.mark.parametrize("where", ["shared", "not shared"])
def test_preflight_inside_a_two_node_launch_checks_the_shared_output_dir(preflights, where):
    _, exit, head = preflights[where]
    assert "job: 2 process(es) on 1 host(s), every rank answered" in head
    assert re.search(r"rank +0 \| local rank 0 \| .+ \| cpu", head) and re.search(r"rank +1 \| local rank 0", head)
    if where == "shared":
        assert exit == 0 and "one filesystem, shared by all 1 host(s)" in head
        assert head.rstrip().endswith("no problems found")
    else:
        assert exit == 1 and "PROBLEM: output_dir out is not one shared filesystem: rank 0" in head
        assert "PROBLEM: output_dir out is not one shared filesystem: rank 1" in head


def test_preflight_inside_a_two_node_launch_names_an_output_dir_no_rank_can_write(preflights):
    output_dir, exit, head = preflights["unwritable"]
    assert exit == 1 and "shared by all" not in head
    for rank in (0, 1):
        assert f"PROBLEM: output_dir {output_dir} is not writable from rank {rank} " in head


def test_preflight_names_a_config_it_cannot_read_or_the_launch_would_refuse(tmp_path):
    """Read alone: an empty file, invalid YAML, an unknown distributed_type, no processes, and what the trainer
    refuses at once (CPU offload, fp16 with FSDP2, DeepSpeed, Megatron-LM, fp8 through Transformer Engine) are
    PROBLEM lines, not tracebacks or 'no problems found'."""
    from trainer.tools.preflight import describe_config

    fsdp = (CONFIGS / "fsdp.yaml").read_text()
    files = {
        "empty": "",
        "invalid": "a: [\n",
        "typo": "distributed_type: FSPD\nnum_processes: 2\n",
        "none": fsdp.replace("num_processes: 2", "num_processes: 0"),
        "refused": fsdp.replace("fsdp_offload_params: false", "fsdp_offload_params: true").replace(
            "mixed_precision: 'no'", "mixed_precision: fp16"
        ),
        # Answers of `accelerate config` the trainer does not run: what the launch says, said first.
        "deepspeed": "distributed_type: DEEPSPEED\nnum_processes: 2\ndeepspeed_config:\n  zero_stage: 3\n",
        "megatron": "distributed_type: MEGATRON_LM\nnum_processes: 2\n",
        "fp8": "distributed_type: MULTI_GPU\nnum_processes: 2\nmixed_precision: fp8\nfp8_config:\n  backend: TE\n",
    }
    problems = {}
    for name, text in files.items():
        (tmp_path / f"{name}.yaml").write_text(text)
        problems[name] = describe_config(str(tmp_path / f"{name}.yaml"), launched=False)[1]
    assert problems["empty"][0].endswith(
        f"empty.yaml is empty: write one with `accelerate config --config_file {tmp_path / 'empty.yaml'}`"
    )
    assert "invalid.yaml cannot be read by accelerate: while parsing a flow node" in problems["invalid"][0]
    assert "typo.yaml cannot be read by accelerate: 'FSPD' is not a valid DistributedType" in problems["typo"][0]
    assert problems["none"] == ["num_processes 0 and num_machines 1 must each be at least 1"]
    # (On a host with fewer GPUs than the config's 2 processes, that is one more problem, of this host.)
    problems["refused"] = [p for p in problems["refused"] if "but this machine has" not in p]
    assert [p.split(":")[0] for p in problems["refused"]] == [
        "the accelerate config sets fsdp_offload_params",
        "mixed precision fp16 with FSDP2 is not supported (its loss scaler would have to see sharded gradients)",
    ]
    from trainer.launch.accelerate_config import DEEPSPEED, MEGATRON, refusal_of_fp8

    assert (problems["deepspeed"], problems["megatron"]) == ([DEEPSPEED], [MEGATRON])
    assert problems["fp8"] == [refusal_of_fp8("TE")]  # the trainer's fp8 is torchao's


def test_preflight_asks_wandb_only_of_a_job_that_uses_it(tmp_path):
    env = clean_env()
    for name in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_PROJECT"):
        env.pop(name, None)
    env["HOME"] = str(tmp_path)  # no ~/.netrc: no API key anywhere
    check = ROOT / "trainer" / "check.py"  # `accelerate launch -m trainer.check`, as the README runs it
    ended = launch_jobs({"quiet": [check], "asked": [check, "--wandb_project", "p"]}, env=env)
    quiet, asked = ended["quiet"], ended["asked"]
    assert quiet.returncode == 0 and "wandb" not in quiet.stdout
    assert quiet.stdout.rstrip().endswith("preflight: no problems found")
    assert asked.returncode == 1 and "wandb: unreachable" in asked.stdout


def test_a_stalled_rank_is_named_by_the_others_once(tmp_path):
    """Rank 0 reaches the all-reduce 1.5 s after rank 1 stalls (a loaded host): rank 1 has made no progress for the
    2 s of ``stall_warning_s`` while rank 0 has waited only 0.5 s. One report still, once both have waited."""
    result = accelerate_launch(
        SCENARIOS, "resume", "--output_dir", tmp_path, *STALL, "--stall_s", "7", "--stall_lag", "1.5",
        "--stall_warning_s", "2",
    )  # fmt: skip
    assert "STALL rank 1 at step 5" in result.stdout and "RESULT" in result.stdout
    reports = [line for line in result.stderr.splitlines() if line.startswith("trainer: stalled")]
    assert len(reports) == 1, result.stderr  # one report per stall, from one rank
    assert re.search(r"rank 0 \(.+\) backward at step 5", reports[0]), reports[0]
    assert reports[0].endswith("Waiting for rank(s) 1 (forward at step 5)."), reports[0]


def test_the_collective_timeout_ends_a_job_whose_rank_never_arrives(tmp_path):
    # The stall outlasts anything a loaded host adds (start-up, and the launcher's 30 s between its SIGTERM to the
    # sleeping rank and its SIGKILL): a job that ends well before the stall would is one the timeout ended.
    started = time.monotonic()
    result = accelerate_launch(
        SCENARIOS,
        "resume",
        "--output_dir",
        tmp_path,
        *STALL,
        "--stall_s",
        "900",
        "--stall_warning_s",
        "2",
        "--collective_timeout_s",
        "8",
        expect_ok=False,
        timeout=800,
    )
    assert time.monotonic() - started < 600, "ended by the 8 s timeout, not by the stalled rank waking up"
    assert "Waiting for rank(s) 1 (forward at step 5)." in result.stderr
    # The rank left waiting says it in one line (gloo's raw traceback before).
    assert "trainer: a collective ended at collective_timeout_s, another process not there (Timed out waiting" in (
        result.stderr
    ), result.stderr[-3000:]
    assert "[rank0]: Traceback" not in result.stderr, result.stderr[-3000:]


def test_skypilots_run_line_makes_one_job_of_its_nodes_from_the_variables_skypilot_sets(tmp_path, one_process):
    """examples/skypilot/train.yaml's ``run:``, as SkyPilot runs it on each node (the task's ``envs`` exported, then
    SKYPILOT_NODE_IPS, SKYPILOT_NODE_RANK, SKYPILOT_NUM_NODES, SKYPILOT_NUM_GPUS_PER_NODE): two "nodes" on loopback,
    one CPU process each, reach the weights of one process."""
    import yaml

    task = yaml.safe_load((ROOT / "examples" / "skypilot" / "train.yaml").read_text())
    assert task["num_nodes"] == 2 and "/outputs" in task["volumes"] and "--resume auto" in task["envs"]["ARGS"]
    out = tmp_path / "out"
    env = clean_env(**{key: str(value) for key, value in task["envs"].items()})
    env.update(
        SKYPILOT_NODE_IPS="127.0.0.1\n127.0.0.1",
        SKYPILOT_NUM_NODES="2",
        SKYPILOT_NUM_GPUS_PER_NODE="1",
        MASTER_PORT=str(free_port()),
        SCRIPT=str(SAME_UPDATES),
        ARGS=" ".join([*COMMON, *SGD_MEAN, "--batch_size", "5", "--output_dir", str(out)]),
        PATH=f"{os.path.dirname(sys.executable)}:{env['PATH']}",  # torchrun, as pip installs it
    )
    nodes = [(["env", f"SKYPILOT_NODE_RANK={rank}", "bash", "-c", task["run"]], ROOT) for rank in (0, 1)]
    run_together(nodes, env=env)
    two = read_summary(out)
    assert two["world_size"] == 2
    assert_same_run(one_process, two)
