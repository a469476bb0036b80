"""What a GPU's matmuls run in, said where it costs without a word: bf16 on a GPU without bf16 tensor cores (V100,
T4) is emulated, slower than fp32; fp32 matmuls on a GPU with tensor cores (A100, H100) leave them idle unless TF32
is allowed. ``tf32: true`` allows it (``torch.set_float32_matmul_precision("high")``, cuDNN too): matmuls with a
10-bit mantissa, as transformers' ``tf32`` and Lightning's hint have it; off by default, as in torch, since it
changes the numbers. Nothing is said on a CPU.
"""

from __future__ import annotations

from typing import Optional

import torch


def apply_tf32(allowed: bool, device: torch.device) -> None:
    """``tf32: true``: fp32 matmuls and convolutions on a CUDA device's tensor cores (TF32)."""
    if allowed and device.type == "cuda":
        torch.set_float32_matmul_precision("high")
        torch.backends.cudnn.allow_tf32 = True


def precision_words(device: torch.device, mixed_precision: str) -> Optional[str]:
    """A line for a GPU whose matmuls would run slower than they could, or None."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    if mixed_precision == "bf16" and not torch.cuda.is_bf16_supported(including_emulation=False):
        return (
            f"mixed precision bf16 on {name}, which has no bf16 tensor cores: torch emulates it, slower than "
            "fp32; use accelerate_configs/fp16.yaml (fp16 with a loss scaler) on this GPU"
        )
    major, _ = torch.cuda.get_device_capability(device)
    if mixed_precision == "no" and major >= 8 and torch.get_float32_matmul_precision() == "highest":
        return (
            f"fp32 matmuls on {name} leave its tensor cores idle: set tf32: true (TF32 matmuls, a 10-bit "
            "mantissa) or train in bf16 (accelerate_configs/bf16.yaml)"
        )
    return None
