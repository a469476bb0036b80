"""What this machine can and cannot do for a launch: GPUs per process, CPU threads, the process group's teardown,
workers that end with their launcher, and what a GPU's matmuls run in (docs/launching.md, docs/troubleshooting.md).
"""

from __future__ import annotations

import atexit
import functools
import os
import signal
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional

import torch
from accelerate.utils import parse_flag_from_env

from trainer.errors import LaunchMismatch, Refusal, wait_for_the_first_process

# Host (gloo) groups every rank made, in order: the teardown at exit waits on each of them too.
HOST_GROUPS: list = []
# The teardown barriers' Works, kept until the interpreter itself is torn down (_destroy_process_group_at_exit).
_TEARDOWN_WORK: list = []


def launched_world_size() -> int:
    """How many processes the launcher (accelerate launch, torchrun, Slurm + torchrun) says the job has."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def has_accelerator_device() -> bool:
    """A device DDP can use for K processes (CUDA, XPU, ...). Apple's MPS cannot host several processes."""
    if torch.cuda.is_available():
        return True
    if not torch.accelerator.is_available():
        return False
    return torch.accelerator.current_accelerator().type != "mps"


def use_cpu() -> bool:
    """Build the process state on the CPU: asked for (``use_cpu`` / ``--cpu`` at launch), or the fallback."""
    return parse_flag_from_env("ACCELERATE_USE_CPU") or needs_cpu_fallback()


def needs_cpu_fallback() -> bool:
    """K launched processes on a host without a device for them: one job over gloo, not K lone trainings."""
    return launched_world_size() > 1 and not has_accelerator_device()


def check_launch_fits_host() -> None:
    """Stop a launch this host cannot honour before anything is built, naming the command that works: more
    processes on this machine than it has GPUs, or several CPU processes asked of ``accelerate launch``'s CPU path
    (without mpirun it starts ONE, which would train alone)."""
    problem = None
    per_machine = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    # The GPUs CUDA_VISIBLE_DEVICES leaves.
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if per_machine > gpus > 0 and not parse_flag_from_env("ACCELERATE_USE_CPU"):
        problem = _too_many_processes(per_machine, gpus) + _bound_per_process(gpus)
    elif _lone_process_of_a_cpu_launch():
        problem = (
            "accelerate launch was asked for several CPU processes (use_cpu / --cpu, or a multi-CPU config from "
            "`accelerate config`) but started ONE: its CPU launcher starts more only through mpirun (a config with "
            "mpirun_hostfile). To run K processes on the CPU over gloo: `accelerate launch --config_file "
            "accelerate_configs/cpu.yaml --num_processes K ...`, or `torchrun --nproc_per_node K ...`; on several "
            "machines, a multi-GPU config (accelerate_configs/multi_node.yaml: without a GPU the trainer runs on the "
            "CPU)."
        )
    if problem is not None:
        _stop(problem, first=int(os.environ.get("LOCAL_RANK", "0")) == 0)


def _stop(problem: str, first: bool) -> None:
    """The launch ends: ``first`` says why; the others give it time to (``wait_for_the_first_process``)."""
    if first:
        raise LaunchMismatch(f"trainer: cannot start: {problem}")
    wait_for_the_first_process()
    raise LaunchMismatch(1)


def _too_many_processes(per_machine: int, gpus: int, shared: str = "") -> str:
    return (
        f"this launch starts {per_machine} processes on this machine, but it has {gpus} GPU(s){shared}: one "
        f"process per GPU. Run `accelerate launch --num_processes {gpus} ...` (or --config_file "
        f"accelerate_configs/single_gpu.yaml), or `torchrun --nproc_per_node {gpus} ...`; to run {per_machine} "
        f"processes on the CPU instead: `accelerate launch --config_file accelerate_configs/cpu.yaml "
        f"--num_processes {per_machine} ...`."
    )


def _bound_per_process(gpus: int) -> str:
    """A launcher that gives each process a GPU of its own through CUDA_VISIBLE_DEVICES cannot run: accelerate's
    barriers address GPU <local rank>, which a process that sees one GPU lacks from local rank 1 on."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return ""
    return (
        f" (CUDA_VISIBLE_DEVICES={visible!r} leaves this process {gpus}. If a launcher gives each process its "
        "own GPU this way, as srun --gpus-per-task does, let every process see the machine's GPUs instead, "
        "srun --gpu-bind=none: accelerate's barriers address GPU <local rank>, which a process that sees one "
        "does not have, and accelerate gives process k GPU k.)"
    )


def gpu_of_this_process(device: torch.device) -> tuple[str, str, Optional[str]]:
    """(machine, GPU UUID, CUDA_VISIBLE_DEVICES): what ``refuse_shared_gpus`` compares across the job."""
    import socket

    uuid = str(torch.cuda.get_device_properties(device).uuid)
    return socket.gethostname(), uuid, os.environ.get("CUDA_VISIBLE_DEVICES")


def refuse_shared_gpus(everyone: list[tuple[str, str, Optional[str]]], rank: int) -> None:
    """Two processes of one machine on one GPU (two launches of a multi-node job on one machine, each believing
    itself alone) stop here, named, rather than at NCCL's "Duplicate GPU detected". Every process decides alike,
    from the whole job's gathered ``gpu_of_this_process``."""
    on_gpu: dict[tuple[str, str], list[int]] = {}
    for index, (host, gpu, _) in enumerate(everyone):
        on_gpu.setdefault((host, gpu), []).append(index)
    shared = next((ranks for ranks in on_gpu.values() if len(ranks) > 1), None)
    if shared is None:
        return
    machine = everyone[shared[0]][0]
    processes = sum(1 for host, _, _ in everyone if host == machine)
    gpus = sum(1 for host, _ in on_gpu if host == machine)
    settings = {everyone[index][2] for index in shared}
    seen = f", CUDA_VISIBLE_DEVICES={settings.pop()!r} in each" if len(settings) == 1 and None not in settings else ""
    problem = _too_many_processes(processes, gpus, f" for them (ranks {shared[0]} and {shared[1]} share one{seen})")
    # No teardown barrier: NCCL would meet the shared GPU there.
    torch.distributed.destroy_process_group()
    _stop(problem, first=rank == shared[0])


def _lone_process_of_a_cpu_launch() -> bool:
    """accelerate's CPU launcher gives its one process MASTER_ADDR only when asked for several."""
    if not parse_flag_from_env("ACCELERATE_USE_CPU") or "MASTER_ADDR" not in os.environ:
        return False
    mpi_or_torchrun = ("WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE")
    if any(name in os.environ for name in mpi_or_torchrun):
        return False
    launcher = _launcher()
    return launcher is not None and "MASTER_ADDR" not in launcher[0]


def share_cpu_threads(device: torch.device) -> Optional[str]:
    """On CPU, each process of this machine gets an equal share of its cores, unless the user chose
    OMP_NUM_THREADS: the launchers set it to 1 when unset, which starves a lone CPU process (31% slower here).
    Returns a word of advice where the machine is busy with other work (``busy_host``), else None."""
    if device.type != "cpu" or _user_chose_threads():
        return None
    processes_here, cores = int(os.environ.get("LOCAL_WORLD_SIZE", "1")), len(os.sched_getaffinity(0))
    torch.set_num_threads(max(1, cores // processes_here))
    return busy_host(os.getloadavg()[0], cores=cores, threads=torch.get_num_threads())


def busy_host(load: float, *, cores: int, threads: int) -> Optional[str]:
    """Advice for a CPU job whose processes take several threads each on a machine already loaded past twice its
    cores: threads that wait for cores others hold stall each other (2 threads a process ran 10x slower than 1
    at load 30 on 2 cores)."""
    if threads < 2 or load <= 2 * cores:
        return None
    return (
        f"this machine is busy (load {load:.0f} on {cores} cores): {threads} CPU threads per process can run far "
        "slower than 1 on cores others hold; launch with OMP_NUM_THREADS=1 (or a share of the idle cores)"
    )


def _user_chose_threads() -> bool:
    """Inside a worker the launcher's 1 looks like a user's 1, so the launcher's own environment decides."""
    if "OMP_NUM_THREADS" not in os.environ:
        return False
    launched = "LOCAL_RANK" in os.environ or "ACCELERATE_USE_CPU" in os.environ
    if not launched:
        return True
    launcher = _launcher()
    if launcher is None:
        # Cannot tell (not Linux): the value is left alone.
        return True
    environment, command = launcher
    return "OMP_NUM_THREADS" in environment or b"num_cpu_threads_per_process" in command


def _launcher() -> Optional[tuple[set[str], bytes]]:
    """The names in the parent process's environment as it was started, and its command line (Linux only)."""
    try:
        parent = Path(f"/proc/{os.getppid()}")
        names = {v.split(b"=", 1)[0].decode(errors="replace") for v in (parent / "environ").read_bytes().split(b"\0")}
        return names, (parent / "cmdline").read_bytes()
    except OSError:
        return None


def num_machines(processes: int) -> int:
    """Machines in the job: processes divided by processes per machine (torchrun's LOCAL_WORLD_SIZE)."""
    per_machine = int(os.environ.get("LOCAL_WORLD_SIZE", processes))
    return max(1, processes // max(1, per_machine))


@functools.cache
def destroy_process_group_at_exit() -> None:
    """A clean exit barriers every group, then destroys the process group; a process that exits with its gloo group
    alive can abort (SIGABRT) in interpreter finalization (pytorch/pytorch#179291, #190489: a gloo thread freeing a
    finished collective's Python objects without the GIL). The barriers' Works stay referenced until the interpreter
    clears this module, so their last reference drops on the main thread. On a clean exit or a ``job_wide``
    refusal (the ranks decided together) only: after any other error a peer may never arrive."""

    def destroy() -> None:
        if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            return
        error = getattr(sys, "last_exc", getattr(sys, "last_value", None))
        nccl = torch.distributed.get_backend() == "nccl"
        if error is None or isinstance(error, Refusal) and error.job_wide:
            # On NCCL the barrier names this process's GPU (without it torch warns, guessing the device).
            on = {"device_ids": [torch.cuda.current_device()]} if nccl else {}
            works = [torch.distributed.barrier(async_op=True, **on)]
            works += [torch.distributed.barrier(group=group, async_op=True) for group in HOST_GROUPS]
            _TEARDOWN_WORK.extend(works)
            try:
                for work in works:
                    work.wait() if error is None else work.wait(timedelta(seconds=30))
            except RuntimeError:
                # A peer that did not come: tear down anyway, but not NCCL, whose teardown after a timed-out
                # collective can hang until its watchdog aborts (pytorch/pytorch#141510).
                if nccl:
                    return
        torch.distributed.destroy_process_group()

    atexit.register(destroy)


def say_where_on_abort() -> None:
    """A process ended by SIGABRT (NCCL's watchdog after ``collective_timeout_s``) prints where each of its threads
    was: no Python exception is raised, so this is the only word of where it waited."""
    import faulthandler

    if not faulthandler.is_enabled():
        faulthandler.enable(all_threads=True)


def end_with_the_launcher() -> None:
    """A worker gets SIGTERM when its launcher dies (kill -9, the OOM killer), as if preempted: it checkpoints and
    exits instead of training on headless. Linux's PR_SET_PDEATHSIG, under torch's elastic agent only (it starts
    the workers from its main thread; the death signal follows the parent *thread*)."""
    if not sys.platform.startswith("linux") or "TORCHELASTIC_RUN_ID" not in os.environ:
        return
    import ctypes

    launcher = os.getppid()
    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, int(signal.SIGTERM))
    # It died before the request was in place.
    if os.getppid() != launcher:
        os.kill(os.getpid(), signal.SIGTERM)


def apply_tf32(allowed: bool, device: torch.device) -> None:
    """``tf32: true``: fp32 matmuls and convolutions on a CUDA device's tensor cores (a 10-bit mantissa)."""
    if allowed and device.type == "cuda":
        torch.set_float32_matmul_precision("high")
        torch.backends.cudnn.allow_tf32 = True


def precision_words(device: torch.device, mixed_precision: str) -> Optional[str]:
    """A line for a GPU whose matmuls would run slower than they could (bf16 emulated, tensor cores idle), or
    None; nothing on a CPU."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    if mixed_precision == "bf16" and not torch.cuda.is_bf16_supported(including_emulation=False):
        return (
            f"mixed precision bf16 on {name}, which has no bf16 tensor cores: torch emulates it, slower than "
            "fp32; use accelerate_configs/fp16.yaml (fp16 with a loss scaler) on this GPU"
        )
    major, _ = torch.cuda.get_device_capability(device)
    if mixed_precision == "no" and major >= 8 and torch.get_float32_matmul_precision() == "highest":
        return (
            f"fp32 matmuls on {name} leave its tensor cores idle: set tf32: true (TF32 matmuls, a 10-bit "
            "mantissa) or train in bf16 (accelerate_configs/bf16.yaml)"
        )
    return None


def register_host_group(group: Any) -> None:
    """A host (gloo) group the teardown at exit waits on too."""
    HOST_GROUPS.append(group)
