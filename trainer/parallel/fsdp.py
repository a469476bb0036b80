"""Sharding the model over the processes (FSDP2) when the accelerate config asks for it: each process then holds
1/K of the weights, gradients and optimizer state, where DDP keeps a whole copy of each on every process.

The switch is the launch's accelerate config (``distributed_type: FSDP`` with ``fsdp_version: 2``: what
``accelerate config`` writes when a user answers FSDP, version 2; ``accelerate_configs/fsdp.yaml``), read the way
accelerate reads it (its ``FullyShardedDataParallelPlugin`` parses the FSDP_* settings of the launch).

Why the trainer calls torch's ``fully_shard`` itself rather than letting accelerate's FSDP plugin prepare the model:
accelerate switches its plugin on only for GPU-like distributed types; on a host without a GPU (``cpu=True``, gloo)
it drops the plugin without a word and the model trains as DDP. The path here is the same on every host, NCCL or
gloo, so what the CPU tests exercise is what a GPU user runs. Accelerate still launches the processes, joins the
process group, shards the data and holds the mixed precision; it just never sees the model.

What is sharded: each transformer block (the classes the config names, else the model's ``_no_split_modules``, else
the children of its largest ModuleList; a size-based policy makes every module over ``min_num_params`` a group,
nested) is one FSDP group, and the root module holds the rest, input and output embeddings together (weights tied
between them must live in one group). The groups are placed one at a time, each made whole on the device and then
sharded (``trainer.parallel.placement``: from the first process's weights, or initialised for a model built on meta), so
no process ever holds the whole model on its device. Master weights are fp32 always: trainable parameters of a
lower precision are upcast, and the banner says how many, since AdamW state in bf16 stalls training without an
error. Mixed precision bf16 computes in bf16 and reduces gradients in fp32.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import torch
from accelerate.utils import FullyShardedDataParallelPlugin, parse_flag_from_env

from trainer.errors import ShardingError
from trainer.parallel.blocks import checkpoint_activations, outermost
from trainer.parallel.fsdp_outputs import refuse_outputs_fsdp2_cannot_see
from trainer.parallel.placement import (
    META,
    built_on_meta,
    fill,
    first_process_says,
    from_first_process,
    initialise,
    region,
    to_upcast,
    upcast_words,
)
from trainer.parallel.tensor_parallel import TensorParallel
from trainer.telemetry.console import say

FULLY_SHARDED = "FSDP2"
NO_OFFLOAD = (
    "the accelerate config sets fsdp_offload_params: CPU offload is not supported by this trainer yet; set "
    "it to false (more processes hold less each)"
)
NO_FP16 = (
    "mixed precision fp16 with FSDP2 is not supported (its loss scaler would have to see sharded gradients): "
    "use bf16 (mixed_precision: bf16), or no mixed precision"
)
FROM_META, FROM_FIRST = "meta", "first process"  # where a sharded model's weights come from


@dataclass
class ShardedModel:
    """What sharding did to a model, for the banner and the checkpoints."""

    processes: int
    mesh: str  # the banner's name of the mesh: "FSDP2 over 4 processes", "HSDP 2 x 2 (replicate x shard)"
    parameters: int  # elements of the whole model
    held: int  # elements this process holds
    groups: Optional[int]  # FSDP groups besides the root (None: not sharded by FSDP, tensor parallelism alone)
    upcast: list[str]  # trainable parameters upcast to fp32 master weights
    activation_checkpointing: bool
    built_on_meta: bool = False  # initialised as it was sharded, rather than sent by the first process

    def describe(self) -> str:
        upcast = f"; {upcast_words(self.upcast)}" if self.upcast else ""
        upcast += "; built on meta, each process initialised its shards" if self.built_on_meta else ""
        checkpointed = ", activation checkpointing" if self.activation_checkpointing else ""
        groups = "tensor-parallel modules split" if self.groups is None else f"{self.groups} sharded blocks + root"
        return (
            f"{self.mesh}: {self.parameters:,} parameters, {self.held:,} "
            f"held by this process ({groups}{checkpointed}){upcast}"
        )


def requested_plugin(config: Any) -> Optional[FullyShardedDataParallelPlugin]:
    """The launch's FSDP settings when its accelerate config asks for FSDP, else None. Version 1, CPU offload, fp16
    and ``compile`` are refused by name: each needs a path this trainer does not take yet (fp16 a loss scaler over
    sharded gradients, where bf16 needs none)."""
    if not parse_flag_from_env("ACCELERATE_USE_FSDP"):
        return None
    version = os.environ.get("FSDP_VERSION", "1")
    if version != "2":
        raise ShardingError(
            f"the accelerate config asks for FSDP version {version}; this trainer shards with FSDP2. "
            "Convert the file with `accelerate to-fsdp2 --config_file <yours> --output_file <new>` "
            "(or set fsdp_version: 2 under fsdp_config)"
        )
    if parse_flag_from_env("FSDP_OFFLOAD_PARAMS"):
        raise ShardingError(NO_OFFLOAD)
    if os.environ.get("ACCELERATE_MIXED_PRECISION", "no") == "fp16":
        raise ShardingError(NO_FP16)
    if config.compile:
        raise ShardingError("compile: true with FSDP2 is not supported yet: set compile: false, or train with DDP")
    return FullyShardedDataParallelPlugin(fsdp_version=2)


@contextlib.contextmanager
def accelerate_without_sharding() -> Iterator[None]:
    """While the Accelerator is built: accelerate must not take the model for its own FSDP (it would on a GPU host
    and not on a CPU one) nor build its own mesh from the parallelism_config (it refuses one on CPU), so it sees a
    plain multi-process launch; the trainer shards the model over its own mesh (``trainer.launch.mesh``)."""
    switches = ("ACCELERATE_USE_FSDP", "ACCELERATE_USE_PARALLELISM_CONFIG")
    saved = {name: os.environ.pop(name) for name in switches if name in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)


def shard(
    model: torch.nn.Module,
    plugin: FullyShardedDataParallelPlugin,
    mesh: Any,
    device: torch.device,
    mixed_precision: str,
    recompute: bool = False,
    seed: int = 0,
    name: str = "",
    tp: Optional[TensorParallel] = None,
) -> ShardedModel:
    """Shard ``model`` in place over ``mesh`` (1-D: FSDP; replicate x shard: HSDP; None: tensor parallelism alone),
    one FSDP group at a time (its blocks, then the root with the rest): each group's tensors are made whole on
    ``device`` (from the first process's weights, or initialised for a model built on meta:
    ``trainer.parallel.placement``), split over the tensor-parallel mesh (``tp``), then sharded, so no process ever
    holds more than its shards and one group whole (a user's ``parallelize_fn`` gets the model whole). With
    ``recompute`` (or the config's fsdp_activation_checkpointing) blocks checkpoint their activations."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    joined = torch.distributed.is_initialized()  # (the mesh joined every process: broadcasts go to all)
    rank, world = (torch.distributed.get_rank(), torch.distributed.get_world_size()) if joined else (0, 1)
    start = first_process_says(how_to_start(model), world)  # every process takes the first one's path
    if start not in (FROM_META, FROM_FIRST):
        raise ShardingError(start)
    upcast = to_upcast(model)
    source = None if start == FROM_META else from_first_process(rank, world)
    if tp is not None and mesh is not None:  # a tensor-parallel output is a view of what torch gathered: FSDP warns
        warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")  # of in-place ops
    placed = tp is not None and tp.function is not None  # the user's split wants the model whole: placed first
    if placed:
        _place(model, region(model, set()), device, source, set(upcast), start, seed)
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
    for group in [*groups, model]:  # children before parents; the root last, holding the rest (tied embeddings)
        modules = region(group, done)
        if not placed:
            _place(model, modules, device, source, set(upcast), start, seed)
            if tp is not None:
                tp.split(modules)
        if mesh is not None:
            after = {} if group is model else {"reshard_after_forward": bool(plugin.reshard_after_forward)}
            fully_shard(group, mesh=mesh, **after, **precision)
        done.add(id(group))
    if mesh is not None:
        refuse_outputs_fsdp2_cannot_see(model)
    return ShardedModel(
        processes=world,
        mesh=name or f"{FULLY_SHARDED} over {world} processes",
        parameters=sum(_global_numel(p) for p in model.parameters()),
        held=sum(_local_numel(p) for p in model.parameters()),
        groups=len(groups) if mesh is not None else None,
        upcast=list(upcast.values()),
        activation_checkpointing=recompute,
        built_on_meta=start == FROM_META,
    )


def _place(
    model: torch.nn.Module,
    modules: list[torch.nn.Module],
    device: torch.device,
    source: Any,
    upcast: set[int],
    start: str,
    seed: int,
) -> None:
    """``modules``' tensors whole on ``device``: the first process's, or initialised (a model built on meta)."""
    fill(modules, device, source, upcast)
    if start == FROM_META:
        initialise(model, modules, seed, device)


def wrap_groups(model: torch.nn.Module, plugin: FullyShardedDataParallelPlugin) -> list[torch.nn.Module]:
    """The modules that become FSDP groups of their own, children before parents, as accelerate applies the
    config's policy: TRANSFORMER_BASED_WRAP the block classes (named, else the model's ``_no_split_modules``, else
    the children of its largest ModuleList, said in a line), SIZE_BASED_WRAP every module over ``min_num_params``,
    nested (a ModuleList, a container without forward, is no group), NO_WRAP none. A module holding a weight tied
    to one outside it is left to the group around it: FSDP2 keeps a tied weight in one group."""
    from accelerate.utils.fsdp_utils import fsdp2_prepare_auto_wrap_policy
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

    try:
        policy = fsdp2_prepare_auto_wrap_policy(plugin, model)
    except ValueError as err:  # a block class the model does not have
        raise ShardingError(f"fsdp_transformer_layer_cls_to_wrap: {err}") from None
    if policy is None:  # NO_WRAP
        return []
    candidates = [
        module
        for module in region(model, set())
        if module is not model and policy(module) and type(module).forward is not torch.nn.Module.forward
    ]
    by_class = getattr(plugin.auto_wrap_policy, "func", plugin.auto_wrap_policy) is transformer_auto_wrap_policy
    if not candidates and by_class and not plugin.transformer_cls_names_to_wrap:
        candidates = repeated_blocks(model)
    holders: dict[int, set[int]] = {}
    for module in model.modules():
        for parameter in module._parameters.values():
            if parameter is not None:
                holders.setdefault(id(parameter), set()).add(id(module))
    return [module for module in candidates if not _tied_outside(module, holders)]


def repeated_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """For a model that names no block class: the children of its largest ModuleList (nanoGPT's ``transformer.h``,
    torchtitan's ``layers``), said in a line; none (one group) when it has no ModuleList, also said."""
    lists = [(name, m) for name, m in model.named_modules() if isinstance(m, torch.nn.ModuleList) and len(m)]
    how = "name its block class in fsdp_transformer_layer_cls_to_wrap to choose the groups"
    if not lists:
        say(
            f"FSDP2: {type(model).__name__} names no block class (_no_split_modules) and has no ModuleList: the "
            f"whole model is one group, gathered whole for every forward; {how}",
            once=True,
        )
        return []
    name, blocks = max(lists, key=lambda item: sum(p.numel() for p in item[1].parameters()))
    say(
        f"FSDP2: {type(model).__name__} names no block class (_no_split_modules): each of the {len(blocks)} "
        f"modules of {name} ({type(blocks[0]).__name__}) is one group; {how}",
        once=True,
    )
    return list(blocks)


def _tied_outside(module: torch.nn.Module, holders: dict[int, set[int]]) -> bool:
    inside = {id(sub) for sub in module.modules()}
    return any(not holders[id(p)] <= inside for p in module.parameters())


def how_to_start(model: torch.nn.Module) -> str:
    """This process's model as a starting point: built on meta (initialised as it is sharded), or weights the first
    process sends; a first process with some weights on meta gets the refusal's text."""
    if built_on_meta(model):
        return FROM_META
    missing = [name for name, p in model.named_parameters() if p.device == META]
    if missing:
        return (
            f"{len(missing)} parameter(s) of the model are on the meta device on the first process "
            f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}), which sends every process its "
            "weights: build the model wholly on meta, or wholly on a device"
        )
    return FROM_FIRST


def _global_numel(parameter: torch.Tensor) -> int:
    return parameter.numel()  # a DTensor's numel is the whole tensor's


def _local_numel(parameter: torch.Tensor) -> int:
    local = getattr(parameter, "to_local", None)
    return local().numel() if local is not None else parameter.numel()
