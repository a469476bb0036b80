"""What the launch's accelerate config asks for, read as accelerate reads it, and the answers this trainer does
not run, each refused by name with what to use instead: at the launch and by ``python -m trainer.check``, in the
same words (docs/launching.md). Left alone, each would run as something else (DeepSpeed as plain DDP) or fail deep
inside accelerate.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Iterator, Optional

from accelerate.utils import parse_flag_from_env

from trainer.errors import ShardingError

NO_OFFLOAD = (
    "the accelerate config sets fsdp_offload_params: CPU offload is not supported by this trainer yet; set "
    "it to false (more processes hold less each)"
)
NO_FP16 = (
    "mixed precision fp16 with FSDP2 is not supported (its loss scaler would have to see sharded gradients): "
    "use bf16 (mixed_precision: bf16), or no mixed precision"
)

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
    "the accelerate config asks for mixed_precision: fp8, which this trainer runs through torchao, not installed "
    "here: pip install torchao, or use bf16 (accelerate_configs/bf16.yaml; any GPU since Ampere)"
)
XLA = "the accelerate config asks for XLA (TPU), which this trainer does not run: it runs on CUDA GPUs and CPUs"

# What the launcher writes into each process's environment for each answer (accelerate.utils.launch).
_LAUNCHED = {"ACCELERATE_USE_DEEPSPEED": DEEPSPEED, "ACCELERATE_USE_MEGATRON_LM": MEGATRON}


def refusal_of_the_launch() -> Optional[str]:
    """Why this process's launch cannot run, from what ``accelerate launch`` set, or None."""
    if (dropped := dropped_mesh_flags()) is not None:
        return dropped
    for variable, message in _LAUNCHED.items():
        if os.environ.get(variable, "false").lower() == "true":
            return message
    if launch_asks_for_fp8() and (refused := refusal_of_fp8(os.environ.get("ACCELERATE_FP8_BACKEND"))):
        return refused
    return refusal_of_dynamo(os.environ.get("ACCELERATE_DYNAMO_BACKEND"))


def launch_asks_for_fp8() -> bool:
    """``mixed_precision: fp8``: torchao's fp8 matmuls over bf16 (trainer.parallel.float8)."""
    return os.environ.get("ACCELERATE_MIXED_PRECISION", "no").lower() == "fp8"


def refusal_of_fp8(backend: Optional[str]) -> Optional[str]:
    """Why this host cannot train fp8, or None: a backend other than torchao's, or no torchao installed."""
    if backend is not None and str(backend).upper() not in ("AO", "NO", "NONE", ""):
        return (
            f"the accelerate config asks for fp8 through {backend}; this trainer runs fp8 through torchao: set "
            "fp8_config's backend: AO (pip install torchao), or use bf16"
        )
    try:
        import torchao.float8  # noqa: F401
    except ImportError:
        return FP8
    return None


def dropped_mesh_flags(launcher: Optional[list[str]] = None) -> Optional[str]:
    """``accelerate launch --parallelism_config_tp_size 2`` (or another mesh flag) on a config file without a
    ``parallelism_config`` section: accelerate passes such flags on to no process, so the run would train another
    mesh without a word. Read from the launcher's command line (this process's parent's: ``accelerate launch``
    runs the workers' agent in its own process); None when it passed them on, or cannot be read."""
    if os.environ.get("ACCELERATE_USE_PARALLELISM_CONFIG", "false").lower() == "true":
        return None
    if launcher is None:
        try:
            with open(f"/proc/{os.getppid()}/cmdline", "rb") as file:
                launcher = [arg.decode(errors="replace") for arg in file.read().split(b"\0")]
        except OSError:
            return None
    # The launcher's own options: those before the training script (the script's own arguments follow it).
    script = next((i for i, arg in enumerate(launcher) if i > 1 and arg.endswith(".py")), len(launcher))
    asked = [
        arg if "=" in arg or i + 1 >= script else f"{arg} {launcher[i + 1]}"
        for i, arg in enumerate(launcher[:script])
        if arg.startswith("--parallelism_config_") and "accelerate" in " ".join(launcher[:3])
    ]
    if not asked:
        return None
    return (
        f"the launch asks for {', '.join(asked)}, which accelerate passes on to the processes only with a "
        "parallelism_config section in the config file: the run would train another mesh without a word. Put the "
        "mesh in the config file's parallelism_config (accelerate_configs/hsdp.yaml has the section; "
        "docs/parallelism.md the command for each mesh)"
    )


def refusal_of_the_file(
    distributed_type: str, mixed_precision: str, dynamo_backend: Optional[str] = None, *, fp8_backend: Any = None
) -> Optional[str]:
    """The same, from an accelerate config file's ``distributed_type``, ``mixed_precision``,
    ``dynamo_config.dynamo_backend`` and ``fp8_config.backend``."""
    by_type = {"DEEPSPEED": DEEPSPEED, "MEGATRON_LM": MEGATRON, "XLA": XLA}
    if distributed_type in by_type:
        return by_type[distributed_type]
    if str(mixed_precision).lower() == "fp8" and (refused := refusal_of_fp8(fp8_backend)):
        return refused
    return refusal_of_dynamo(dynamo_backend)


def refusal_of_dynamo(backend: Optional[str]) -> Optional[str]:
    """``accelerate config``'s torch dynamo answer (the strategy compiles with it: trainer.parallel.compiling),
    refused for a backend this torch does not have (accelerate's menu still offers ones torch dropped, such as
    nvprims_nvfuser, which would fail at the first step)."""
    if backend is None or backend.upper() == "NO":
        return None
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


def sharding_requested() -> bool:
    """Whether the launch's accelerate config asks for FSDP (``distributed_type: FSDP``); version 1, CPU offload
    and fp16 are refused by name: each needs a path this trainer does not take yet."""
    if not parse_flag_from_env("ACCELERATE_USE_FSDP"):
        return False
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
    return True


@contextlib.contextmanager
def accelerate_without_sharding() -> Iterator[None]:
    """While the Accelerator is built it sees a plain multi-process launch: accelerate must not take the model for
    its own FSDP (it would on a GPU host and not on a CPU one) nor build its own mesh (it refuses one on CPU)."""
    switches = ("ACCELERATE_USE_FSDP", "ACCELERATE_USE_PARALLELISM_CONFIG")
    saved = {name: os.environ.pop(name) for name in switches if name in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)


def accelerate_env(config_file: str) -> dict[str, str]:
    """What ``accelerate launch --config_file FILE`` tells each process about the job (FSDP and its settings, mixed
    precision, torch dynamo, the mesh, fp8), for an engine that starts the processes itself, as Ray Train does:
    ``os.environ.update(accelerate_env(path))`` in each worker before the Trainer (docs/clusters.md#ray). Where each
    process is (RANK, WORLD_SIZE, MASTER_ADDR, its process group) stays the engine's."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env

    args = launch_command_parser().parse_args(["--config_file", str(config_file), "train.py"])
    args, _, _ = _validate_launch_command(args)
    env = prepare_multi_gpu_env(args)
    return {key: value for key, value in env.items() if key.startswith(("ACCELERATE_", "FSDP_", "PARALLELISM_CONFIG_"))}
