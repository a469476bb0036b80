"""examples/mlp.py (the DDP tutorial series' job) through every launcher, and picking up where it stopped."""

from __future__ import annotations

import re

import pytest

from conftest import ROOT, accelerate_launch, python, torchrun

MLP = ROOT / "examples" / "mlp.py"


def epoch_lines(output: str) -> list[str]:
    return sorted(re.findall(r"^\[(?:GPU|CPU)\d\] Epoch \d+ \| Batchsize: \d+ \| Steps: \d+$", output, re.M))


# fp16 on a host without a GPU: accelerate applies it on GPUs only; the banner says what the launch asked for.
@pytest.mark.parametrize(
    "config, processes, precision",
    [
        ("single_gpu.yaml", 1, "no"),
        ("cpu.yaml", 1, "no"),
        ("multi_gpu.yaml", 2, "no"),
        ("bf16.yaml", 2, "bf16"),
        ("fp16.yaml", 2, "fp16"),
    ],
)
def test_mlp_runs_with_each_config(tmp_path, config, processes, precision):
    result = accelerate_launch(MLP, "1", "1", "--output_dir", tmp_path, config=config)
    assert f"trainer | {processes} process(es)" in result.stdout
    assert f"mixed precision {precision}" in result.stdout  # the start banner
    steps = 2048 // processes // 32
    assert epoch_lines(result.stdout) == [
        f"[CPU{rank}] Epoch 0 | Batchsize: 32 | Steps: {steps}" for rank in range(processes)
    ]
    assert (tmp_path / "final" / "model.safetensors").is_file()


def test_mlp_under_torchrun_picks_up_where_it_stopped(tmp_path):
    first = torchrun(MLP, "2", "1", "--output_dir", tmp_path, "--batch_size", "16")
    assert len(epoch_lines(first.stdout)) == 4  # 2 processes x 2 epochs
    assert "[CPU1] Epoch 1 | Batchsize: 16 | Steps: 64" in first.stdout
    again = torchrun(MLP, "3", "1", "--output_dir", tmp_path, "--batch_size", "16")
    assert "step 128, epoch 2, batch 0" in again.stdout
    assert epoch_lines(again.stdout) == [
        "[CPU0] Epoch 2 | Batchsize: 16 | Steps: 64",
        "[CPU1] Epoch 2 | Batchsize: 16 | Steps: 64",
    ]


def test_mlp_plain_python(tmp_path):
    result = python(MLP, "1", "1", "--output_dir", tmp_path)
    assert epoch_lines(result.stdout) == ["[CPU0] Epoch 0 | Batchsize: 32 | Steps: 64"]
