"""``activation_offloading: true``: the activations a forward saves for backward wait in pinned CPU memory instead of
on the device, copied back as backward reaches them (docs/sharded.md). The same updates: the values are copied, not
changed.

Why not torch's ``save_on_cpu``: it copies every tensor a layer saves, the weights too, so each step would carry the
whole model across the bus twice. Here a parameter stays where it is, as does a tensor already on the CPU or too
small to be worth a copy, and a tensor split over a mesh (tensor parallelism's activations: their pieces are the
mesh's).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.autograd.graph import saved_tensors_hooks

from trainer.parallel.gradients import local

# A tensor smaller than this stays on the device: its copy costs more than it frees.
MIN_BYTES = 1 << 20


class OffloadActivations(saved_tensors_hooks):
    """While it is open (a forward), each saved tensor on a device of ``device_types`` past ``min_bytes`` goes to
    CPU memory (pinned where CUDA is), and comes back for backward. ``offloaded``: how many went."""

    def __init__(self, *, min_bytes: int = MIN_BYTES, device_types: tuple[str, ...] = ("cuda",)):
        pinned = torch.cuda.is_available()
        self.offloaded = 0

        def pack(tensor: torch.Tensor) -> Any:
            if (
                tensor.device.type not in device_types
                or weight(tensor)
                or tensor.is_sparse
                or local(tensor) is not tensor
                or tensor.numel() * tensor.element_size() < min_bytes
            ):
                return tensor
            held = torch.empty(tensor.size(), dtype=tensor.dtype, layout=tensor.layout, pin_memory=pinned)
            # Asynchronous into pinned memory, on the compute stream: backward's copy back is ordered after it.
            held.copy_(tensor, non_blocking=pinned)
            self.offloaded += 1
            return tensor.device, held

        def unpack(packed: Any) -> torch.Tensor:
            if isinstance(packed, torch.Tensor):
                return packed
            device, held = packed
            return held.to(device, non_blocking=pinned)

        super().__init__(pack, unpack)


def weight(tensor: torch.Tensor) -> bool:
    """A parameter, or a view of one: a linear layer saves its weight transposed (``weight.t()``)."""
    return isinstance(tensor, torch.nn.Parameter) or isinstance(tensor._base, torch.nn.Parameter)
