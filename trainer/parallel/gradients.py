"""The gradients' global norm and their scaling, for gradients spread over the processes (DTensors: FSDP2's shards,
HSDP's, tensor parallelism's, on meshes of their own).

Why not ``torch.nn.utils.clip_grad_norm_``: on DTensors it dispatches every parameter's norm through DTensor and
stacks them (quadratic in the parameters: pytorch/pytorch#169445), and under FSDP x TP the gradients live on two
meshes (a block's weights on the (data, tensor) mesh, a norm layer's on the data mesh alone), whose norms would
have to be combined across meshes.
Here each process sums the squares of the pieces it holds, a piece held by several processes (replicated over a
mesh dimension, or over the processes a mesh leaves out) counted once, and one all-reduce adds them up: one
collective per step, whatever the parameters.
"""

from __future__ import annotations

import logging
import math
from typing import Iterable

import torch
import torch.distributed as dist

REDISTRIBUTE = logging.getLogger("torch.distributed.tensor._redistribute")


def local(tensor: torch.Tensor) -> torch.Tensor:
    """What this process holds of ``tensor``: a DTensor's local piece (an alias: scaling it scales the DTensor)."""
    return tensor._local_tensor if hasattr(tensor, "_local_tensor") else tensor


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` whole: a DTensor gathered from its pieces (collective: every process calls it), else as it is."""
    if not hasattr(tensor, "full_tensor"):
        return tensor
    # A TP x FSDP weight takes two all-gathers, which DTensor calls "suboptimal" at each: a gather, no reduction
    # whose order could differ, and nothing a user can change.
    level = REDISTRIBUTE.level
    REDISTRIBUTE.setLevel(logging.ERROR)
    try:
        return tensor.full_tensor()
    finally:
        REDISTRIBUTE.setLevel(level)


def copies(tensor: torch.Tensor, world: int) -> int:
    """How many processes hold the same piece of ``tensor`` as this one: those its mesh replicates it over, times
    those outside its mesh (every process, for a plain tensor: the same on all, as under tensor parallelism)."""
    mesh = getattr(tensor, "device_mesh", None)
    if mesh is None:
        return world
    replicated = math.prod(
        mesh.size(dim) for dim, placement in enumerate(tensor.placements) if placement.is_replicate()
    )
    return replicated * (world // mesh.size())


def total_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The L2 norm of all of ``grads`` together, as if each were whole: a 0-dim fp32 tensor, the same on every
    process, on the gradients' device (read it only when needed: reading it waits for the GPU)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    by_copies: dict[int, list[torch.Tensor]] = {}
    for grad in grads:
        by_copies.setdefault(copies(grad, world), []).append(local(grad))
    squares = torch.zeros((), dtype=torch.float32, device=local(grads[0]).device)
    for count, pieces in by_copies.items():
        norms = torch._foreach_norm([p for p in pieces if p.numel()]) if any(p.numel() for p in pieces) else []
        if norms:
            squares = squares + torch.stack([n.float() for n in norms]).square().sum() / count
    if world > 1:
        dist.all_reduce(squares)
    return squares.sqrt()


def scale_(grads: list[torch.Tensor], factor: torch.Tensor | float) -> None:
    """Multiply every gradient by ``factor`` in place, on the pieces each process holds (no DTensor dispatch)."""
    pieces = [local(grad) for grad in grads]
    if pieces:
        torch._foreach_mul_(pieces, factor)


def clip_(parameters: Iterable[torch.Tensor], max_norm: float) -> torch.Tensor:
    """Scale the gradients so that their global norm is at most ``max_norm`` (as ``clip_grad_norm_`` does, without a
    host read); return their norm before clipping."""
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return torch.zeros(())
    norm = total_norm(grads)
    scale_(grads, torch.clamp(max_norm / (norm + 1e-6), max=1.0))
    return norm
