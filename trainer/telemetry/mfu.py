"""Model FLOPs utilisation on the step line (``| MFU 41.5%``) and in every tracker (``mfu``, a fraction): the FLOPs
the model's tokens/s amount to, against the peak of the processes' devices.

FLOPs per token: ``flops_per_token`` when set; for a transformers model whose config says its layers and width,
6N for the forward and backward of N parameters plus causal attention's 6 x layers x width x sequence length (the
scores and the weighted sum, half of PaLM's 12LHT, which counts every key for every query), the sequence length
being the logged window's tokens per example. Anything else has no MFU. Peak: ``peak_flops`` (per device) when set,
else the dense bf16 tensor-core peak of the GPU ``torch.cuda.get_device_name`` names, from the table below; a CPU,
or a GPU not in the table, is said once rather than guessed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch

from trainer.console import say

if TYPE_CHECKING:
    from trainer.launch.run import Run

# Dense bf16 peaks in FLOP/s, by a part of torch.cuda.get_device_name; a longer name wins over a part of it
# ("H100 PCIe" over "H100", "L40S" over "L40" over "L4").
PEAK_FLOPS = {
    "B200": 2250e12,
    "H200": 989e12,
    "H100 PCIe": 756e12,
    "H100 NVL": 835e12,
    "H100": 989e12,
    "A100": 312e12,
    "L40S": 362e12,
    "L40": 181e12,
    "L4": 121e12,
    "A10": 125e12,
    "RTX 4090": 165e12,
    "RTX 3090": 71e12,
    "V100": 125e12,
    "T4": 65e12,
}


def peak_flops_of(name: str) -> Optional[float]:
    """The peak of the GPU called ``name``: the table's longest key that is part of it; None for one not there."""
    keys = [key for key in PEAK_FLOPS if key in name]
    return PEAK_FLOPS[max(keys, key=len)] if keys else None


class Utilisation:
    """MFU from a log step's global tokens/s and examples/s; said once when it cannot be known."""

    def __init__(self, run: Run, model: torch.nn.Module):
        config, device = run.config, run.device
        self.given = config.flops_per_token
        shape = getattr(model, "config", None)
        layers, width = (getattr(shape, "num_hidden_layers", None), getattr(shape, "hidden_size", None))
        self.layers_width = layers * width if isinstance(layers, int) and isinstance(width, int) else None
        # A sharded model's parameters count whole.
        self.parameters = sum(p.numel() for p in model.parameters())
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"this {device.type}"
        self.peak = config.peak_flops or (peak_flops_of(name) if device.type == "cuda" else None)
        self.processes, self.device_name, self.said = run.world, name, False

    def of(self, tokens_per_s: Optional[float], examples_per_s: float) -> Optional[float]:
        """The fraction of the peak used, or None (said once, when the FLOPs are known and the peak is not)."""
        if tokens_per_s is None or (self.given is None and self.layers_width is None):
            return None
        if self.peak is None:
            if not self.said:
                say(
                    f"MFU: the peak FLOP/s of {self.device_name} is not known here: set peak_flops (per device) "
                    "to see it on the step line",
                    once=True,
                )
                self.said = True
            return None
        sequence = tokens_per_s / examples_per_s if examples_per_s else 0.0
        flops = self.given or 6 * self.parameters + 6 * self.layers_width * sequence
        return flops * tokens_per_s / (self.peak * self.processes)
