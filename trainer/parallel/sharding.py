"""Sharding a model over the processes with FSDP2's ``fully_shard``, one group at a time (docs/sharded.md).

The trainer calls ``fully_shard`` itself rather than letting accelerate's FSDP plugin prepare the model: accelerate
drops the plugin without a word on a host without a GPU, and the model would train as DDP; this path is the same on
NCCL and gloo (but for gloo's reduce-scatter: ``trainer.parallel.fsdp.reduce_scatter``), so what the CPU tests
exercise is what a GPU runs. Each block is one FSDP group, untied input embeddings
and output head one each, each MoE layer's experts one (expert parallelism), and the root holds the rest (tied
embeddings together); master weights are fp32; bf16 computes in bf16 and reduces gradients in fp32.
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import torch

from trainer.errors import ShardingError
from trainer.parallel.blocks import checkpoint_activations, outermost, vocabulary_ends, wrap_groups
from trainer.parallel.experts import Experts
from trainer.parallel.placement import Placement, region, upcast_words
from trainer.parallel.tensor_parallel import TensorParallel


@dataclass
class ShardedModel:
    """What sharding did to a model, for the banner."""

    # The banner's name of the mesh: "FSDP2 over 4 processes", "HSDP 2 x 2 (replicate x shard)".
    mesh: str
    # Elements of the whole model, and those this process holds.
    parameters: int
    held: int
    # FSDP groups besides the root (None: not sharded by FSDP, tensor parallelism alone).
    groups: Optional[int]
    upcast: list[str]
    activation_checkpointing: bool
    built_on_meta: bool = False
    # Groups besides the blocks: the untied embeddings and head, each MoE layer's experts.
    apart: str = ""

    def describe(self) -> str:
        upcast = f"; {upcast_words(self.upcast)}" if self.upcast else ""
        upcast += "; built on meta, each process initialised its shards" if self.built_on_meta else ""
        checkpointed = ", activation checkpointing" if self.activation_checkpointing else ""
        groups = f"{self.groups} sharded blocks{self.apart} + root"
        groups = "tensor-parallel modules split" if self.groups is None else groups
        return (
            f"{self.mesh}: {self.parameters:,} parameters, {self.held:,} "
            f"held by this process ({groups}{checkpointed}){upcast}"
        )


def shard(
    model: torch.nn.Module,
    plugin: Any,
    mesh: Any,
    *,
    device: torch.device,
    mixed_precision: str,
    recompute: bool = False,
    seed: int = 0,
    name: str = "",
    tp: Optional[TensorParallel] = None,
    experts: Optional[Experts] = None,
) -> ShardedModel:
    """Shard ``model`` in place over ``mesh`` (1-D: FSDP; replicate x shard: HSDP; None: tensor parallelism alone),
    one FSDP group at a time (its blocks, then the root): each group made whole on ``device`` (``Placement``), split
    over the tensor-parallel mesh (``tp``), then sharded, so no process holds more than its shards and one group
    whole (a user's ``parallelize_fn`` gets the model whole). ``recompute``: blocks checkpoint their activations.
    ``experts``: each MoE layer's experts split (expert parallelism) and sharded as a group of their own first."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    placement = Placement(model, device=device, seed=seed)
    if tp is not None and mesh is not None:
        # A tensor-parallel output is a view of what torch gathered: FSDP warns of in-place ops on it.
        warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    # The user's split wants the model whole: placed first.
    placed = tp is not None and tp.function is not None
    if placed:
        placement.place(region(model, set()))
        tp.function(model, tp.mesh)
    groups = wrap_groups(model, plugin)
    recompute = recompute or bool(plugin.activation_checkpointing)
    if recompute:
        wrappers = {id(w._checkpoint_wrapped_module): w for w in checkpoint_activations(model, outermost(groups))}
        groups = [wrappers.get(id(group), group) for group in groups]
    precision = {}
    if mixed_precision == "bf16":
        precision["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    done: set[int] = set()
    experts_modules = [module for module, _ in experts.modules.values()] if experts is not None else []
    # Untied input embeddings and output head: groups of their own (None: in the root).
    ends = vocabulary_ends(model, groups) if mesh is not None else []
    # Children before parents (experts before their blocks); the root last, holding the rest (tied embeddings).
    for group in [*experts_modules, *groups, *ends, model]:
        modules = region(group, done)
        if not placed:
            placement.place(modules)
            if tp is not None:
                tp.split(modules)
        after = {} if group is model else {"reshard_after_forward": bool(plugin.reshard_after_forward)}
        if ends and group is ends[-1]:
            # Its backward comes right after its forward: gathered once for both.
            after = {"reshard_after_forward": False}
        if experts is not None and group in experts:
            experts.split(group)
            experts.shard(group, **after, **precision)
        elif mesh is not None:
            fully_shard(group, mesh=mesh, **after, **precision)
        done.add(id(group))
    if mesh is not None:
        refuse_outputs_fsdp2_cannot_see(model)
    return ShardedModel(
        mesh=name,
        parameters=sum(p.numel() for p in model.parameters()),
        held=sum(getattr(p, "to_local", lambda p=p: p)().numel() for p in model.parameters()),
        groups=len(groups) if mesh is not None else None,
        upcast=list(placement.upcast.values()),
        activation_checkpointing=recompute,
        built_on_meta=placement.built_on_meta,
        apart=(" + embeddings + head" if ends else "")
        + (f" + {len(experts_modules)} experts" if experts_modules else ""),
    )


# A sharded module whose output FSDP2 cannot look into trains without an error while no gradient reaches its
# weights: FSDP2 starts a module's backward from hooks on the tensors its forward returns, and finds them in tensors,
# dicts, lists, tuples, named tuples and (torch 2.12) dataclasses only. Refused at the first training forward.


def refuse_outputs_fsdp2_cannot_see(model: torch.nn.Module) -> None:
    """On each sharded module of ``model``: at its first forward in training, a refusal naming it when its output
    holds tensors that need gradients and FSDP2 finds none of them."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            # The hook's own handle, for it to remove itself.
            handle: list = []
            handle.append(module.register_forward_hook(_check_once(handle)))


def _check_once(handle: list) -> Callable:
    def check(module: torch.nn.Module, inputs: Any, output: Any) -> None:
        if not (torch.is_grad_enabled() and module.training):
            # An evaluation: no backward to miss.
            return
        handle[0].remove()
        if _fsdp_finds(output) or not any(True for _ in _tensors_needing_grad(output, depth=0, seen=set())):
            return
        from torch.distributed.fsdp import FSDPModule

        # fully_shard's subclass.
        name = next(c for c in type(module).__mro__[1:] if c is not FSDPModule).__name__
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
