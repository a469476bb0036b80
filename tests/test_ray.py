"""Ray Train, for real: examples/ray/train.py starts a local Ray cluster of CPU workers (``ray.init``) and runs
tests/ragged_lm.py's job through ``TorchTrainer``, the accelerate config's settings taken by each worker
(``trainer.accelerate_env``), the process group Ray made; a worker that dies is restarted by ``FailureConfig`` and the
job resumes from its last checkpoint.
Skipped where ray is not installed (``pip install -e ".[ray]"``; the test extra installs it)."""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest

from conftest import CONFIGS, ROOT, accelerate_launch, clean_env, run

pytestmark = pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="needs ray: pip install -e '.[ray]'")
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
        ROOT / "tests" / "ragged_lm.py",
    ]
    command += ["--max-failures", "1", "--storage-path", tmp_path / "records", "--"]
    command += ["--out", tmp_path / "ray", *FLAGS, "--crash_at", "5", "--crash_once"]
    ray = run([str(c) for c in command], env=clean_env(RAY_DEDUP_LOGS="0"))
    output = ray.stdout + ray.stderr
    assert "CRASH after step 5" in output, output[-3000:]
    assert "device cpu (FSDP2)" in output
    assert f"resumed from {tmp_path}/ray/checkpoints/step-00000004: step 4" in output, output[-3000:]
    accelerate_launch(ROOT / "tests" / "ragged_lm.py", "--out", tmp_path / "launched", *FLAGS, config="fsdp.yaml")
    under_ray, launched = (json.loads((tmp_path / n / "ragged.json").read_text()) for n in ("ray", "launched"))
    assert under_ray["world_size"] == 2 and under_ray["held"] == launched["held"]
    assert under_ray["weights"] == launched["weights"]
