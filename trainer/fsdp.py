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

What is sharded: each transformer block (the classes the config names, else the model's ``_no_split_modules``; a
size-based policy wraps every module over ``min_num_params``) is one FSDP group, and the root module holds the rest,
input and output embeddings together (weights tied between them must live in one group). Master weights are fp32
always: trainable parameters of a lower precision are upcast, and the banner says how many, since AdamW state in
bf16 stalls training without an error. Mixed precision bf16 computes in bf16 and reduces gradients in fp32.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import torch
from accelerate.utils import FullyShardedDataParallelPlugin, parse_flag_from_env

from trainer.activation_checkpointing import checkpoint_activations, outermost
from trainer.errors import ShardingError

FULLY_SHARDED = "FSDP2"

@dataclass
class ShardedModel:
    """What sharding did to a model, for the banner and the checkpoints."""

    processes: int
    parameters: int  # elements of the whole model
    held: int  # elements this process holds
    groups: int  # FSDP groups besides the root
    upcast: list[str]  # trainable parameters upcast to fp32 master weights
    activation_checkpointing: bool

    def describe(self) -> str:
        upcast = f"; {len(self.upcast)} low-precision trainable tensors upcast to fp32 masters" if self.upcast else ""
        checkpointed = ", activation checkpointing" if self.activation_checkpointing else ""
        return (f"{FULLY_SHARDED} over {self.processes} processes: {self.parameters:,} parameters, {self.held:,} "
                f"held by this process ({self.groups} sharded blocks + root{checkpointed}){upcast}")  # fmt: skip


def requested_plugin(config: Any) -> Optional[FullyShardedDataParallelPlugin]:
    """The launch's FSDP settings when its accelerate config asks for FSDP, else None. Version 1, CPU offload, fp16
    and ``compile`` are refused by name: each needs a path this trainer does not take yet (fp16 a loss scaler over
    sharded gradients, where bf16 needs none)."""
    if not parse_flag_from_env("ACCELERATE_USE_FSDP"):
        return None
    version = os.environ.get("FSDP_VERSION", "1")
    if version != "2":
        raise ShardingError(f"the accelerate config asks for FSDP version {version}; this trainer shards with FSDP2. "
                            "Convert the file with `accelerate to-fsdp2 --config_file <yours> --output_file <new>` "
                            "(or set fsdp_version: 2 under fsdp_config)")  # fmt: skip
    if parse_flag_from_env("FSDP_OFFLOAD_PARAMS"):
        raise ShardingError("the accelerate config sets fsdp_offload_params: CPU offload is not supported by this "
                            "trainer yet; set it to false (more processes hold less each)")  # fmt: skip
    if os.environ.get("ACCELERATE_MIXED_PRECISION", "no") == "fp16":
        raise ShardingError("mixed precision fp16 with FSDP2 is not supported (its loss scaler would have to see "
                            "sharded gradients): use bf16 (mixed_precision: bf16), or no mixed precision")  # fmt: skip
    if config.compile:
        raise ShardingError("compile: true with FSDP2 is not supported yet: set compile: false, or train with DDP")
    return FullyShardedDataParallelPlugin(fsdp_version=2)


@contextlib.contextmanager
def accelerate_without_fsdp() -> Iterator[None]:
    """While the Accelerator is built: accelerate must not take the model for its own FSDP (it would on a GPU host
    and not on a CPU one), so it sees a plain multi-process launch; the trainer shards the model itself."""
    saved = os.environ.pop("ACCELERATE_USE_FSDP", None)
    try:
        yield
    finally:
        if saved is not None:
            os.environ["ACCELERATE_USE_FSDP"] = saved


def shard(model: torch.nn.Module, plugin: FullyShardedDataParallelPlugin, mesh: Any, mixed_precision: str,
          recompute: bool = False) -> ShardedModel:  # fmt: skip
    """Shard ``model`` in place over ``mesh`` (its blocks, then the root), on the mesh's device; with ``recompute``
    (or the config's fsdp_activation_checkpointing) its blocks checkpoint their activations."""
    from accelerate.utils.fsdp_utils import fsdp2_prepare_auto_wrap_policy
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    upcast = [name for name, p in model.named_parameters() if p.requires_grad and p.dtype != torch.float32]
    for name, parameter in model.named_parameters():
        if name in upcast:
            parameter.data = parameter.data.float()  # fp32 masters: the optimizer state follows the parameter's dtype
    model.to(mesh.device_type)
    try:
        wraps = fsdp2_prepare_auto_wrap_policy(plugin, model) or (lambda module: False)
    except ValueError as err:  # a block class the model does not have
        raise ShardingError(f"fsdp_transformer_layer_cls_to_wrap: {err}") from None
    blocks = outermost([module for module in model.modules() if module is not model and wraps(module)])
    recompute = recompute or bool(plugin.activation_checkpointing)
    if recompute:
        blocks = checkpoint_activations(model, blocks)
    precision = {}
    if mixed_precision == "bf16":
        precision["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=bool(plugin.reshard_after_forward), **precision)
    fully_shard(model, mesh=mesh, **precision)  # the rest, tied embeddings included, in one group
    return ShardedModel(
        processes=mesh.size(),
        parameters=sum(_global_numel(p) for p in model.parameters()),
        held=sum(_local_numel(p) for p in model.parameters()),
        groups=len(blocks),
        upcast=upcast,
        activation_checkpointing=recompute,
    )


def _global_numel(parameter: torch.Tensor) -> int:
    return parameter.numel()  # a DTensor's numel is the whole tensor's


def _local_numel(parameter: torch.Tensor) -> int:
    local = getattr(parameter, "to_local", None)
    return local().numel() if local is not None else parameter.numel()
