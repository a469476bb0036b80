"""Ray Train, for real: examples/ray/train.py starts a local Ray cluster of CPU workers (``ray.init``) and runs
tests/jobs/ragged_lm.py's job through ``TorchTrainer``, the accelerate config's settings taken by each worker
(``trainer.accelerate_env``), the process group Ray made; a worker that dies is restarted by ``FailureConfig`` and the
job resumes from its last checkpoint; on a cluster of two nodes, Ray's notice that one is to be preempted is a
checkpoint at once. Skipped where ray is not installed (``pip install -e ".[ray]"``; the test extra installs it)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from conftest import CONFIGS, ROOT, accelerate_launch, clean_env, free_port, run

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="needs ray: pip install -e '.[ray]'"),
]
FLAGS = ["--batch_size", "2", "--accumulation", "2", "--optimizer", "adamw", "--lr", "0.01"]
FLAGS += ["--save_every", "2", "--epochs", "2", "--keep_last", "6"]


def test_ray_train_restarts_a_dead_worker_and_the_job_ends_bit_identical_to_an_accelerate_launch(tmp_path):
    """FSDP2 under Ray (fsdp.yaml's settings): the last worker dies after step 5, Ray restarts both, they resume from
    step 4 and reach the weights of the same job launched with accelerate launch and never interrupted."""
    example = ROOT / "examples" / "ray" / "train.py"
    command = [
        sys.executable,
        example,
        "--config-file",
        CONFIGS / "fsdp.yaml",
        "--script",
        ROOT / "tests" / "jobs" / "ragged_lm.py",
    ]
    command += ["--max-failures", "1", "--storage-path", tmp_path / "records", "--"]
    command += ["--out", tmp_path / "ray", *FLAGS, "--crash_at", "5", "--crash_once"]
    # RAY_ADDRESS=local: a cluster of its own, never one an earlier job left running on this host.
    ray = run([str(c) for c in command], env=clean_env(RAY_DEDUP_LOGS="0", RAY_ADDRESS="local"))
    output = ray.stdout + ray.stderr
    assert "CRASH after step 5" in output, output[-3000:]
    assert "device cpu (FSDP2)" in output
    assert f"resumed from {tmp_path}/ray/checkpoints/step-00000004: step 4" in output, output[-3000:]
    accelerate_launch(
        ROOT / "tests" / "jobs" / "ragged_lm.py", "--out", tmp_path / "launched", *FLAGS, config="fsdp.yaml"
    )
    under_ray, launched = (json.loads((tmp_path / n / "ragged.json").read_text()) for n in ("ray", "launched"))
    assert under_ray["world_size"] == 2 and under_ray["held"] == launched["held"]
    assert under_ray["weights"] == launched["weights"]


def test_ray_trains_notice_of_a_preemption_is_a_checkpoint_at_once_and_training_goes_on(tmp_path):
    """A Ray cluster of two nodes on this host (``ray start``: a head and a second node, one CPU and one worker each);
    the second node drained as a preemption while the job trains (``ray drain-node --reason
    DRAIN_NODE_REASON_PREEMPTION``, the call Ray's autoscaler makes for a spot reclaim): at the next check every rank
    commits a checkpoint of the same step, off save_every's, and training goes on to the end (Ray restarts the job
    once the node is gone: the restart and resume are the test above's)."""
    from ray._raylet import GcsClient
    from ray.core.generated import autoscaler_pb2

    port = free_port()
    address = f"127.0.0.1:{port}"
    # RAY_AUTH_MODE: one mode for every process of the cluster (`ray start --head` turns token auth on where a token
    # was left in ~/.ray by an earlier local cluster, and a second node's `ray start` does not).
    env = clean_env(RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S="0.5", RAY_ADDRESS=address, RAY_DEDUP_LOGS="0")
    env["RAY_AUTH_MODE"] = "disabled"
    ray = [sys.executable, "-m", "ray.scripts.scripts"]
    head = ["start", "--head", f"--port={port}", "--num-cpus=1", "--include-dashboard=false", "--disable-usage-stats"]
    run([*ray, *head], env=env)
    try:
        run([*ray, "start", f"--address={address}", "--num-cpus=1", "--disable-usage-stats"], env=env)
        gcs = GcsClient(address=address)
        nodes = gcs.get_all_node_info()
        second = next(node_id.hex() for node_id, info in nodes.items() if not info.is_head_node)
        command = [sys.executable, ROOT / "examples" / "ray" / "train.py", "--config-file", CONFIGS / "multi_gpu.yaml"]
        command += ["--script", ROOT / "tests" / "jobs" / "ragged_lm.py", "--storage-path", tmp_path / "records", "--"]
        command += ["--out", tmp_path / "ray", *FLAGS[:6], "--save_every", "40", "--max_steps", "40"]
        job = subprocess.Popen(
            [str(c) for c in [*command, "--step_sleep", "0.1"]], env=env, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True, start_new_session=True,
        )  # fmt: skip
        watchdog = threading.Timer(240, lambda: os.killpg(job.pid, signal.SIGKILL))  # a hang ends, and fails
        watchdog.start()
        output, drained = [], False
        for line in job.stdout:
            output.append(line)
            if "step 3/40" in line and not drained:  # as `ray drain-node` does, without its start-up
                drained = True
                reason = autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION")
                deadline_ms = int(time.time() * 1000) + 300_000
                assert gcs.drain_node(second, reason, "spot reclaim", deadline_ms)[0]
        job.wait(timeout=300)
        watchdog.cancel()
        said = "".join(output)
        assert job.returncode == 0, said[-4000:]
        noticed = re.search(r"Ray Train: node\(s\) of this job will be preempted \(ranks \[\d\]\): checkpoint (\S+) of "
                            r"step (\d+) committed, \d+ s before the deadline; training goes on", said)  # fmt: skip
        assert noticed, said[-4000:]
        step = int(noticed.group(2))
        assert 3 < step < 40 and noticed.group(1).endswith(f"step-{step:08d}")
        # Once (Ray's driver may echo a worker's line twice).
        assert "step 40/40" in said and len({line for line in output if "Ray Train: node(s)" in line}) == 1
    finally:
        run([*ray, "stop", "--force"], env=env)
