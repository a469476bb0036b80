"""Building the Accelerator, and the one place that knows about launchers and hosts without a GPU.

Why this module exists: on a host without CUDA, ``accelerate launch`` (or torchrun) with K processes starts K
processes that each build an Accelerator that believes it is alone: K silent, independent trainings. Building it
with ``cpu=True`` instead gives real DDP over gloo. We do that, say so once, and check that the world the launcher
announced (WORLD_SIZE) is the world the Accelerator joined. Here too: each CPU process's share of the cores, the
process group's teardown at exit, and what an elastic restart needs from its launcher.
"""

from __future__ import annotations

import atexit
import functools
import os
import sys
from datetime import timedelta
from pathlib import Path
from typing import Optional

import torch
from accelerate import Accelerator, PartialState
from accelerate.logging import get_logger
from accelerate.utils import DataLoaderConfiguration

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


def distributed_state(collective_timeout_s: Optional[float] = None) -> PartialState:
    """This process's place in the job (``process_index``, ``num_processes``, ``main_process_first()``), joined
    with the same CPU fallback as the Trainer: call it to prepare data before the Trainer exists.

    ``collective_timeout_s``: how long a collective may wait for a missing rank before the job ends (torch's
    default, 30 minutes, when None). The first call joins the job and fixes it: pass the TrainConfig's value.
    """
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    timeout = {} if collective_timeout_s is None else {"timeout": timedelta(seconds=collective_timeout_s)}
    try:
        state = PartialState(cpu=_needs_cpu_fallback(), **timeout)
    except RuntimeError as err:
        if attempt == 0:
            raise
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        message = f"restart {attempt}: the processes could not reconnect ({first_line}). {ELASTIC_RECIPE}"
        raise RuntimeError(message) from err
    _destroy_process_group_at_exit()
    return state


def build_accelerator(config: TrainConfig) -> Accelerator:
    """The Accelerator for this process: hardware and mixed precision from the accelerate config at launch.

    Steps the scheduler ourselves (``step_scheduler_with_optimizer=False``): accelerate would otherwise step it
    once per *process* per optimizer step, so a schedule would run K times faster on K processes.
    """
    distributed_state(config.collective_timeout_s)
    accelerator = Accelerator(
        cpu=_needs_cpu_fallback(),  # False still honours the accelerate config's use_cpu (ACCELERATE_USE_CPU)
        gradient_accumulation_steps=config.gradient_accumulation_steps,
        step_scheduler_with_optimizer=False,
        # Copies to the GPU overlap the step (the trainer's loaders pin memory on CUDA); a no-op on CPU.
        dataloader_config=DataLoaderConfiguration(non_blocking=True),
        **({"dynamo_backend": "inductor"} if config.compile else {}),  # else the accelerate config's choice
    )
    check_world_size(accelerator)
    share_cpu_threads(accelerator.device)
    if accelerator.is_main_process:
        world = accelerator.num_processes
        if _needs_cpu_fallback():
            logger.warning(
                f"No GPU on this host: running the {world} launched processes as real DDP on CPU over gloo "
                f"(accelerate would otherwise start {world} independent trainings).",
                main_process_only=True,
            )
        restarts = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0"))
        if restarts > 0 and os.environ.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE") != "1":
            logger.warning(f"--max_restarts {restarts}: {ELASTIC_RECIPE}", main_process_only=True)
    return accelerator


def share_cpu_threads(device: torch.device) -> None:
    """On CPU, give each process of this machine an equal share of its cores, unless the user chose
    OMP_NUM_THREADS (or accelerate's --num_cpu_threads_per_process).

    Why: ``accelerate launch`` (without --cpu) and torchrun set OMP_NUM_THREADS=1 when it is unset, which starves
    a lone CPU process (31% slower here), while K processes each using every core fight over them (seed 004).
    Inside the worker the launcher's 1 looks like a user's 1, so the launcher's own environment decides.
    """
    if device.type != "cpu" or _user_chose_threads():
        return
    processes_here = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // processes_here))


def _user_chose_threads() -> bool:
    if "OMP_NUM_THREADS" not in os.environ:
        return False
    launched = "LOCAL_RANK" in os.environ or "ACCELERATE_USE_CPU" in os.environ  # torchrun-style, or accelerate's
    if not launched:  # one-process launcher: started directly, the value is the user's
        return True
    try:  # the launcher's environment as it was started, and its command line
        launcher = Path(f"/proc/{os.getppid()}")
        environment = (launcher / "environ").read_bytes().split(b"\0")
        command = (launcher / "cmdline").read_bytes()
    except OSError:
        return True  # cannot tell (not Linux): leave the value alone
    return any(v.startswith(b"OMP_NUM_THREADS=") for v in environment) or b"num_cpu_threads_per_process" in command


def _needs_cpu_fallback() -> bool:
    return launched_world_size() > 1 and not has_accelerator_device()


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
    """Why: a process that exits with its gloo group alive can abort (SIGABRT, "terminate called without an
    active exception") during interpreter finalization (pytorch/pytorch#179291, #190489). Seen here in about 1 of
    15 two-process runs; destroying the group at exit alone still left 1 in 12; with a barrier first, on a clean
    exit, none in 36. After an uncaught exception there is no barrier: the other ranks may never arrive."""

    def destroy() -> None:
        if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            return
        if getattr(sys, "last_exc", getattr(sys, "last_value", None)) is None:
            torch.distributed.barrier()  # a clean exit: let every rank finish its collectives before teardown
        torch.distributed.destroy_process_group()

    atexit.register(destroy)


def num_machines(accelerator: Accelerator) -> int:
    """Machines in the job: processes divided by processes per machine (torchrun's LOCAL_WORLD_SIZE)."""
    per_machine = int(os.environ.get("LOCAL_WORLD_SIZE", accelerator.num_processes))
    return max(1, accelerator.num_processes // max(1, per_machine))
