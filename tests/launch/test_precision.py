"""What a GPU's matmuls run in (trainer/launch/host.py), said on the GPUs where it costs: the CUDA queries answered
as a V100, an A100 and an H100 would answer them (this host has no GPU; tests/test_gpu.py runs on a real one)."""

from __future__ import annotations

import pytest
import torch

from trainer.launch.host import apply_tf32, precision_words

GPUS = {
    "Tesla V100-SXM2-32GB": (7, 0),
    "Tesla T4": (7, 5),
    "NVIDIA A100-SXM4-80GB": (8, 0),
    "NVIDIA H100 80GB HBM3": (9, 0),
}


@pytest.fixture
def gpu(monkeypatch):
    def pretend(name: str) -> torch.device:
        major, minor = GPUS[name]
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (major, minor))
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: major >= 8)
        return torch.device("cuda", 0)

    return pretend


def test_bf16_without_bf16_tensor_cores_is_said_with_what_to_use(gpu):
    for name in ("Tesla V100-SXM2-32GB", "Tesla T4"):
        words = precision_words(gpu(name), "bf16")
        assert words.startswith(f"mixed precision bf16 on {name}, which has no bf16 tensor cores"), words
        assert "fp16.yaml" in words
    assert precision_words(gpu("NVIDIA A100-SXM4-80GB"), "bf16") is None


def test_fp32_on_tensor_cores_names_tf32_and_tf32_true_allows_it(gpu):
    before, cudnn = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    try:
        words = precision_words(gpu("NVIDIA H100 80GB HBM3"), "no")
        assert words.startswith("fp32 matmuls on NVIDIA H100 80GB HBM3 leave its tensor cores idle: set tf32: true")
        assert precision_words(gpu("Tesla V100-SXM2-32GB"), "no") is None  # no TF32 before Ampere
        apply_tf32(True, torch.device("cuda", 0))
        assert torch.get_float32_matmul_precision() == "high"
        assert precision_words(gpu("NVIDIA H100 80GB HBM3"), "no") is None
    finally:
        torch.set_float32_matmul_precision(before)
        torch.backends.cudnn.allow_tf32 = cudnn
    apply_tf32(True, torch.device("cpu"))
    assert torch.get_float32_matmul_precision() == before, "a CPU's matmuls are left as they are"
    assert precision_words(torch.device("cpu"), "bf16") is None


DETERMINISTIC_JOB = """
import os, torch
from trainer import TrainConfig, Trainer
print("BEFORE", torch.are_deterministic_algorithms_enabled(), os.environ.get("CUBLAS_WORKSPACE_CONFIG"))
data = [{{"x": torch.randn(4), "labels": torch.tensor(0)}} for _ in range(8)]

class Classifier(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 2)

    def forward(self, x, labels):
        return {{"loss": torch.nn.functional.cross_entropy(self.linear(x), labels)}}

Trainer(Classifier(), TrainConfig(output_dir={out!r}, max_steps=2, deterministic=True), train_data=data).fit()
print("AFTER", torch.are_deterministic_algorithms_enabled(), os.environ.get("CUBLAS_WORKSPACE_CONFIG"))
"""


def test_deterministic_turns_on_torchs_deterministic_algorithms_and_cublas_fixed_workspace(tmp_path):
    """A real process: ``deterministic: true`` makes torch refuse nondeterministic kernels and fixes cuBLAS's workspace
    (set before the first matmul, so a GPU reads it), for bitwise-repeatable runs."""
    import subprocess
    import sys

    from conftest import clean_env

    env = clean_env()
    env.pop("CUBLAS_WORKSPACE_CONFIG", None)
    script = DETERMINISTIC_JOB.format(out=str(tmp_path))
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "BEFORE False None" in result.stdout and "AFTER True :4096:8" in result.stdout, result.stdout
