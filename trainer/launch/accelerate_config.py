"""Answers of ``accelerate config`` that this trainer does not run, each refused by name with what to use instead:
at the launch (what ``accelerate launch`` put in each process's environment) and by ``python -m trainer.check``
(what the file says), in the same words. Left alone, each would run as something else without a word (DeepSpeed
as plain DDP) or fail deep inside accelerate.
"""

from __future__ import annotations

import os
from typing import Optional

DEEPSPEED = (
    "the accelerate config asks for DeepSpeed (distributed_type: DEEPSPEED), which this trainer does not "
    "run: shard the model with FSDP2 instead (accelerate_configs/fsdp.yaml: DeepSpeed ZeRO-3's full "
    "sharding), or train with DDP (accelerate_configs/multi_gpu.yaml)"
)
MEGATRON = (
    "the accelerate config asks for Megatron-LM (distributed_type: MEGATRON_LM), which this trainer does not "
    "run: for tensor parallelism set tp_size in a parallelism_config under FSDP2 (accelerate_configs/"
    "hsdp.yaml shows the section)"
)
FP8 = (
    "the accelerate config asks for mixed_precision: fp8, which this trainer does not run yet: use bf16 "
    "(accelerate_configs/bf16.yaml; no loss scaler, any GPU since Ampere)"
)
XLA = "the accelerate config asks for XLA (TPU), which this trainer does not run: it runs on CUDA GPUs and CPUs"

# What the launcher writes into each process's environment for each answer (accelerate.utils.launch).
_LAUNCHED = {"ACCELERATE_USE_DEEPSPEED": DEEPSPEED, "ACCELERATE_USE_MEGATRON_LM": MEGATRON}


def refusal_of_the_launch() -> Optional[str]:
    """Why this process's launch cannot run, from what ``accelerate launch`` set, or None."""
    for variable, message in _LAUNCHED.items():
        if os.environ.get(variable, "false").lower() == "true":
            return message
    if os.environ.get("ACCELERATE_MIXED_PRECISION", "no").lower() == "fp8":
        return FP8
    sharded = os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"
    return refusal_of_dynamo(os.environ.get("ACCELERATE_DYNAMO_BACKEND"), sharded)


def refusal_of_the_file(
    distributed_type: str, mixed_precision: str, dynamo_backend: Optional[str] = None
) -> Optional[str]:
    """The same, from an accelerate config file's ``distributed_type``, ``mixed_precision`` and
    ``dynamo_config.dynamo_backend``."""
    by_type = {"DEEPSPEED": DEEPSPEED, "MEGATRON_LM": MEGATRON, "XLA": XLA}
    if distributed_type in by_type:
        return by_type[distributed_type]
    if str(mixed_precision).lower() == "fp8":
        return FP8
    return refusal_of_dynamo(dynamo_backend, distributed_type == "FSDP")


def refusal_of_dynamo(backend: Optional[str], sharded: bool) -> Optional[str]:
    """``accelerate config``'s torch dynamo answer: accelerate compiles the model as it prepares it. Refused under
    FSDP2 (as ``compile: true`` is: the trainer shards the model itself, and a whole-model compile of it is
    untested), and for a backend this torch does not have (accelerate's menu still offers ones torch dropped, such
    as nvprims_nvfuser, which would fail at the first step)."""
    if backend is None or backend.upper() == "NO":
        return None
    if sharded:
        return (
            f"the accelerate config asks for torch dynamo (dynamo_backend: {backend}), which this trainer does "
            "not run with FSDP2 yet: answer no to torch dynamo (dynamo_backend: 'NO'), or train with DDP"
        )
    import torch
    import torch._dynamo

    if backend.lower() in torch._dynamo.list_backends(exclude_tags=()):
        return None
    return (
        f"the accelerate config asks for dynamo_backend: {backend}, which torch {torch.__version__} does not "
        "have: choose inductor (it compiles; eager and aot_eager only trace), or answer no to torch dynamo"
    )


def blank_block_class_unset() -> None:
    """``accelerate config`` answered with Enter writes ``fsdp_transformer_layer_cls_to_wrap: ''``: no class named,
    as if unset (the model's own ``_no_split_modules`` then), not a class called ''."""
    if os.environ.get("FSDP_TRANSFORMER_CLS_TO_WRAP", "unset").strip(" ,") == "":
        del os.environ["FSDP_TRANSFORMER_CLS_TO_WRAP"]
