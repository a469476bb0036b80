"""The resume proof (``python -m trainer.check --resume-proof``) on a user's script, unchanged
(tests/jobs/proof_script.py): a sound script is proven exact under a 2-process launch and its control differs; a script
whose loss depends on a counter it keeps itself fails, naming the step after the resume and the tensor; an unseeded
one fails before a resume is tried; what the proof sets reaches a TrainConfig built in code (``TRAINER_OVERRIDES``)."""

from __future__ import annotations

import sys

import pytest

from trainer import TrainConfig
from trainer.errors import ConfigError

from conftest import CONFIGS, ROOT, clean_env, run

SCRIPT = ROOT / "tests" / "jobs" / "proof_script.py"


def proof(tmp_path, *args, launch=(), expect_ok=True):
    command = [sys.executable, "-m", "trainer.check", "--resume-proof", "--work_dir", str(tmp_path), *launch]
    return run([*command, str(SCRIPT), *args], expect_ok=expect_ok, timeout=600, env=clean_env()).stdout


def test_a_sound_script_is_proven_exact_under_a_launch_and_its_control_differs(tmp_path):
    said = proof(tmp_path, launch=("--config_file", str(CONFIGS / "multi_gpu.yaml")))
    assert "killed after step 2's checkpoint" in said
    assert "exact: every checkpoint after the resume at step 2 is the uninterrupted run's, byte for byte" in said
    # The control read the epoch from its start: the position and the weights differ at the next checkpoint.
    assert "control differed, as it must: step 4: the training position: step 4, epoch 0, batch 4 against" in said
    assert "model weight inner.weight" in said
    # Both processes' files were compared, and the resumed run's last checkpoint is the uninterrupted one's.
    assert (tmp_path / "resumed" / "checkpoints" / "step-00000006" / "shards" / "__1_0.distcp").is_file()


def test_a_script_with_a_counter_of_its_own_fails_naming_the_step_and_the_tensor(tmp_path):
    said = proof(tmp_path, "--counter", expect_ok=False)
    assert "NOT EXACT: step 4's checkpoint differs from the uninterrupted run's: model weight inner.weight" in said
    assert "The resume was at step 2. What usually causes it: state the script keeps outside the trainer" in said
    assert f"the runs' logs and checkpoints are in {tmp_path}" in said


def test_an_unseeded_script_fails_before_any_resume(tmp_path):
    said = proof(tmp_path, "--unseeded", expect_ok=False)
    assert "NOT EXACT: step 2's checkpoint differs" in said
    assert "Two runs of the script disagree before any resume" in said
    # It stops there: a resume cannot be judged.
    assert "  resumed:" not in said


def test_trainer_overrides_reach_a_config_built_in_code(monkeypatch):
    monkeypatch.setenv("TRAINER_OVERRIDES", '{"output_dir": "runs/elsewhere", "max_steps": 6, "resume": null}')
    config = TrainConfig(output_dir="runs/mine", max_steps=100, save_every=10, resume="auto")
    assert (config.output_dir, config.max_steps, config.save_every, config.resume) == ("runs/elsewhere", 6, 10, None)
    assert config.replace(lr=1e-3).max_steps == 6
    monkeypatch.setenv("TRAINER_OVERRIDES", "{max_step: 6}")
    with pytest.raises(ConfigError, match="TRAINER_OVERRIDES: unknown key 'max_step'. Did you mean: max_steps"):
        TrainConfig()
    monkeypatch.setenv("TRAINER_OVERRIDES", "[6]")
    with pytest.raises(ConfigError, match="TRAINER_OVERRIDES must be a mapping of TrainConfig keys"):
        TrainConfig()
