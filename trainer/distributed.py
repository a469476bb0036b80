"""Building the Accelerator, and the one place that knows about launchers and hosts without a GPU.

Why this module exists: on a host without CUDA, ``accelerate launch`` (or torchrun) with K processes starts K
processes that each build an Accelerator that believes it is alone: K silent, independent trainings. Building it
with ``cpu=True`` instead gives real DDP over gloo. We do that, say so once, and check that the world the launcher
announced (WORLD_SIZE) is the world the Accelerator joined.
"""

from __future__ import annotations

import atexit
import functools
import os

import torch
from accelerate import Accelerator
from accelerate.logging import get_logger

from trainer.config import TrainConfig

logger = get_logger(__name__)


ELASTIC_RECIPE = (
    "Restarted workers reconnect reliably only when the job is launched with --rdzv_backend c10d and "
    "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in the launcher's environment; otherwise they can read the failed "
    "attempt's addresses from the reused rendezvous store (pytorch/pytorch#135712)."
)


class WorldSizeMismatch(RuntimeError):
    """The launcher started K processes but the Accelerator sees a different number."""


def launched_world_size() -> int:
    """How many processes the launcher (accelerate launch, torchrun, Slurm + torchrun) says the job has."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def has_accelerator_device() -> bool:
    """A device DDP can use for K processes (CUDA, XPU, ...). Apple's MPS cannot host several processes."""
    if not torch.accelerator.is_available():
        return False
    return torch.accelerator.current_accelerator().type != "mps"


def build_accelerator(config: TrainConfig) -> Accelerator:
    """The Accelerator for this process: hardware and mixed precision from the accelerate config at launch.

    Steps the scheduler ourselves (``step_scheduler_with_optimizer=False``): accelerate would otherwise step it
    once per *process* per optimizer step, so a schedule would run K times faster on K processes.
    """
    world = launched_world_size()
    cpu_fallback = world > 1 and not has_accelerator_device()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    try:
        accelerator = Accelerator(
            cpu=cpu_fallback,  # False still honours the accelerate config's use_cpu (ACCELERATE_USE_CPU)
            gradient_accumulation_steps=config.gradient_accumulation_steps,
            step_scheduler_with_optimizer=False,
        )
    except RuntimeError as err:
        if attempt == 0:
            raise
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        message = f"restart {attempt}: the processes could not reconnect ({first_line}). {ELASTIC_RECIPE}"
        raise RuntimeError(message) from err
    check_world_size(accelerator)
    _destroy_process_group_at_exit()
    if accelerator.is_main_process:
        if cpu_fallback:
            logger.warning(
                f"No GPU on this host: running the {world} launched processes as real DDP on CPU over gloo "
                f"(accelerate would otherwise start {world} independent trainings).",
                main_process_only=True,
            )
        restarts = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0"))
        if restarts > 0 and os.environ.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE") != "1":
            logger.warning(f"--max_restarts {restarts}: {ELASTIC_RECIPE}", main_process_only=True)
    return accelerator


def check_world_size(accelerator: Accelerator) -> None:
    """Stop, saying why, if the launcher announced K processes but this Accelerator joined a different world."""
    world = launched_world_size()
    if accelerator.num_processes != world:
        raise WorldSizeMismatch(
            f"The launcher started WORLD_SIZE={world} processes, but this process (RANK="
            f"{os.environ.get('RANK', '?')}) joined a world of {accelerator.num_processes}. Each process would "
            "train alone on the full data set. On a host without CUDA, build the Accelerator with cpu=True (the "
            "Trainer does this) or launch with `accelerate launch --cpu`."
        )


@functools.cache  # register once, however many Accelerators a process builds
def _destroy_process_group_at_exit() -> None:
    """Why: a process that exits with its gloo group alive can abort (SIGABRT) during interpreter finalization, as
    gloo's worker threads still hold tensors (pytorch/pytorch#179291; seen here once in ~20 two-process runs)."""

    def destroy() -> None:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()

    atexit.register(destroy)


def num_machines(accelerator: Accelerator) -> int:
    """Machines in the job: processes divided by processes per machine (torchrun's LOCAL_WORLD_SIZE)."""
    per_machine = int(os.environ.get("LOCAL_WORLD_SIZE", accelerator.num_processes))
    return max(1, accelerator.num_processes // max(1, per_machine))
