"""A sharded module whose output FSDP2 cannot look into is refused at its first training forward.

FSDP2 starts a module's backward work (gathering its weights again, and for the root, the callback that
reduce-scatters the gradients of every group whose inputs need none) from hooks on the tensors its forward returns.
It finds them in tensors, dicts, lists, tuples, named tuples and (from torch 2.12) dataclasses (transformers'
``ModelOutput`` is a dict), and nowhere else: a model returning a ``SimpleNamespace``, an object of its own or
(torch 2.11) a dataclass trains without an error, its loss going down batch by batch while no gradient ever reaches
the sharded weights, so they never change
(measured: a two-layer classifier, 16 steps of AdamW under FSDP2, its weights bit-identical to the initial ones).
The check costs one walk of each sharded module's first training output; the hooks then remove themselves.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterator

import torch

from trainer.errors import ShardingError


def refuse_outputs_fsdp2_cannot_see(model: torch.nn.Module) -> None:
    """On each sharded module of ``model``: at its first forward in training, a refusal naming it when its output
    holds tensors that need gradients and FSDP2 finds none of them."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            handle: list = []  # the hook's own handle, for it to remove itself
            handle.append(module.register_forward_hook(_check_once(handle)))


def _check_once(handle: list) -> Callable:
    def check(module: torch.nn.Module, inputs: Any, output: Any) -> None:
        if not (torch.is_grad_enabled() and module.training):
            return  # an evaluation: no backward to miss
        handle[0].remove()
        if _fsdp_finds(output) or not any(True for _ in _tensors_needing_grad(output, depth=0, seen=set())):
            return
        from torch.distributed.fsdp import FSDPModule

        name = next(c for c in type(module).__mro__[1:] if c is not FSDPModule).__name__  # fully_shard's subclass
        containers = "a dict, a tuple, a dataclass" if _walks_dataclasses() else "a dict, a tuple"
        raise ShardingError(
            f"{name}.forward returns a {type(output).__name__}, in which FSDP2 finds no tensor: no gradient would "
            "reach the sharded weights, and they would never change (without an error). Return "
            f"{containers} or a transformers ModelOutput instead"
        )

    return check


def _walks_dataclasses() -> bool:
    """torch >= 2.12: FSDP2 walks outputs with ``collect_grad_tensors``, which looks into dataclasses."""
    try:
        from torch.distributed.fsdp._common_utils import collect_grad_tensors  # noqa: F401
    except ImportError:
        return False
    return True


def _fsdp_finds(output: Any) -> bool:
    """Whether FSDP2's own walk of a module's output finds a tensor that needs gradients."""
    if _walks_dataclasses():
        from torch.distributed.fsdp._common_utils import collect_grad_tensors

        return bool(collect_grad_tensors(output))
    # Earlier torch hooks what pytree's tree_flatten finds (FSDPState._register_pre_backward_hook): not a plain
    # dataclass, which trained without an error and without moving a weight under torch 2.11.
    from torch.utils._pytree import tree_flatten

    return any(torch.is_tensor(t) and t.requires_grad for t in tree_flatten(output)[0])


def _tensors_needing_grad(value: Any, depth: int, seen: set[int]) -> Iterator[torch.Tensor]:
    """Every tensor needing gradients in ``value``, looking into containers and objects' attributes too."""
    if depth > 6 or id(value) in seen:
        return
    seen.add(id(value))
    if torch.is_tensor(value):
        if value.requires_grad:
            yield value
        return
    if isinstance(value, dict):
        items = list(value.values())
    elif isinstance(value, (list, tuple, set, frozenset)):
        items = list(value)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        items = [getattr(value, field.name) for field in dataclasses.fields(value)]
    elif hasattr(value, "__dict__") and not isinstance(value, (type, torch.nn.Module)):
        items = list(vars(value).values())
    else:
        return
    for item in items:
        yield from _tensors_needing_grad(item, depth + 1, seen)
