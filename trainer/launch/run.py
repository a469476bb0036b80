"""Building the Accelerator, and the one place that knows about launchers and hosts with and without GPUs.

Why this module exists: on a host without CUDA, ``accelerate launch`` (or torchrun) with K processes starts K
processes that each build an Accelerator that believes it is alone: K silent, independent trainings. Building it
with ``cpu=True`` instead gives real DDP over gloo. We do that, say so once, and check that the world the launcher
announced (WORLD_SIZE) is the world the Accelerator joined. Before any of that, a launch this host cannot honour
stops with one message saying what to run instead: more processes on a machine than it has GPUs (each would
claim a GPU that does not exist), or several CPU processes asked of accelerate's CPU launcher, which starts one
unless it runs mpirun. Here too: each CPU process's share of the cores, the process group's teardown at exit,
each restart attempt's keys kept apart in the launcher's store, and workers that end with their launcher.
"""

from __future__ import annotations

import atexit
import functools
import os
import signal
import socket
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Optional

import torch
from accelerate import Accelerator, PartialState
from accelerate.utils import DataLoaderConfiguration, DistributedDataParallelKwargs, parse_flag_from_env

from trainer.config import TrainConfig
from trainer.errors import LaunchMismatch, Refusal, WorldSizeMismatch
from trainer.launch.precision import apply_tf32, precision_words
from trainer.parallel.fsdp import accelerate_without_sharding
from trainer.telemetry import console

ELASTIC_RECIPE = (
    "The trainer keeps each attempt's keys apart in the launcher's store (pytorch/pytorch#135712); if restarts "
    "still fail to reconnect, launch with --rdzv_backend c10d and TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, which "
    "gives each attempt a store of its own."
)


def launched_world_size() -> int:
    """How many processes the launcher (accelerate launch, torchrun, Slurm + torchrun) says the job has."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def has_accelerator_device() -> bool:
    """A device DDP can use for K processes (CUDA, XPU, ...). Apple's MPS cannot host several processes."""
    if torch.cuda.is_available():  # the common case, asked the way accelerate asks it
        return True
    if not torch.accelerator.is_available():
        return False
    return torch.accelerator.current_accelerator().type != "mps"


def distributed_state(collective_timeout_s: Optional[float] = None) -> PartialState:
    """This process's place in the job (``process_index``, ``num_processes``, ``main_process_first()``), joined
    with the same CPU fallback as the Trainer: call it to prepare data before the Trainer exists.

    ``collective_timeout_s``: how long a collective may wait for a missing rank before the job ends (torch's
    default, 30 minutes, when None). The first call joins the job and fixes it: pass the TrainConfig's value.
    """
    check_launch_fits_host()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    timeout = {} if collective_timeout_s is None else {"timeout": timedelta(seconds=collective_timeout_s)}
    try:
        _join_in_this_attempts_namespace(attempt, **timeout)
        # The same cpu flag the Accelerator will derive (accelerate's PartialState ignores ACCELERATE_USE_CPU, its
        # AcceleratorState does not): on a GPU host a CPU launch would otherwise put the state on the GPU first.
        state = PartialState(cpu=_use_cpu(), **timeout)
    except RuntimeError as err:
        if attempt == 0:
            raise
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        message = f"restart {attempt}: the processes could not reconnect ({first_line}). {ELASTIC_RECIPE}"
        raise RuntimeError(message) from err
    _destroy_process_group_at_exit()
    _end_with_the_launcher()
    _say_where_on_abort()
    if state.num_processes > 1 and state.device.type == "cuda":
        _check_each_process_has_a_gpu(state, collective_timeout_s)
    console.joined(state.process_index)
    return state


def _join_in_this_attempts_namespace(attempt: int, timeout: timedelta = timedelta(minutes=30)) -> None:
    """Join the process group with its keys under ``trainer/attempt-<n>/`` in the launcher's store, before
    accelerate would join it plainly (it then finds the group made and keeps it).

    Why: torch's elastic agent with static rendezvous (the shipped configs; ``accelerate launch --max_restarts``)
    keeps one store for every restart attempt, and torch assumes a new store per attempt, so a restarted worker
    can read the dead attempt's addresses and wait for peers that no longer exist (pytorch/pytorch#135712): the
    restart hangs or fails. Keys of this attempt's own cannot be confused. The backend is the one accelerate would
    pick (NCCL on CUDA, else gloo); on other accelerators accelerate joins as usual."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or launched_world_size() <= 1 or torch.distributed.is_initialized():
        return
    if _use_cpu():
        backend = "gloo"
    elif torch.cuda.is_available():
        backend = "nccl"
    else:
        return
    rank, world = int(os.environ["RANK"]), launched_world_size()
    store, _, _ = next(torch.distributed.rendezvous("env://", rank, world, timeout=timeout))
    namespaced = torch.distributed.PrefixStore(f"trainer/attempt-{attempt}", store)
    torch.distributed.init_process_group(backend, store=namespaced, rank=rank, world_size=world, timeout=timeout)


def build_accelerator(config: TrainConfig) -> Accelerator:
    """The Accelerator for this process: hardware and mixed precision from the accelerate config at launch.

    Steps the scheduler ourselves (``step_scheduler_with_optimizer=False``): accelerate would otherwise step it
    once per *process* per optimizer step, so a schedule would run K times faster on K processes. Accumulates
    gradients itself too (accelerate's steps stay 1): accelerate divides every micro-batch's loss by the full
    window, the last short window of an epoch included, where the trainer weighs each by what the window holds.
    """
    distributed_state(config.collective_timeout_s)
    with accelerate_without_sharding():  # a sharded model is the trainer's own (trainer.fsdp), on every host alike
        accelerator = Accelerator(
            cpu=_use_cpu(),
            step_scheduler_with_optimizer=False,
            # Copies to the GPU overlap the step (the trainer's loaders pin memory on CUDA); a no-op on CPU.
            dataloader_config=DataLoaderConfiguration(non_blocking=True),
            kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=config.find_unused_parameters)],
            **({"dynamo_backend": "inductor"} if config.compile else {}),  # else the accelerate config's choice
        )
    check_world_size(accelerator)
    share_cpu_threads(accelerator.device)
    apply_tf32(config.tf32, accelerator.device)
    if (words := precision_words(accelerator.device, accelerator.mixed_precision)) is not None:
        console.say(words, once=True)
    if _needs_cpu_fallback():
        world = accelerator.num_processes
        console.say(
            f"No GPU on this host is visible to the processes: running the {world} launched processes as "
            f"one job on CPU over gloo (accelerate would otherwise start {world} independent trainings)",
            once=True,
        )
    return accelerator


def share_cpu_threads(device: torch.device) -> None:
    """On CPU, give each process of this machine an equal share of its cores, unless the user chose
    OMP_NUM_THREADS (or accelerate's --num_cpu_threads_per_process).

    Why: ``accelerate launch`` (without --cpu) and torchrun set OMP_NUM_THREADS=1 when it is unset, which starves
    a lone CPU process (31% slower here), while K processes each using every core fight over them.
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
    launcher = _launcher()
    if launcher is None:
        return True  # cannot tell (not Linux): leave the value alone
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


def _use_cpu() -> bool:
    """Build the process state on the CPU: asked for (``use_cpu`` / ``--cpu`` at launch), or the fallback."""
    return parse_flag_from_env("ACCELERATE_USE_CPU") or _needs_cpu_fallback()


def _needs_cpu_fallback() -> bool:
    return launched_world_size() > 1 and not has_accelerator_device()


def check_launch_fits_host() -> None:
    """Stop a launch this host cannot honour before anything is built, naming the command that works.

    - More processes on this machine than it has GPUs: every process after the last GPU would die with "invalid
      device ordinal" (or NCCL's "invalid usage" where two share one), behind a wall of launcher tracebacks.
      A launcher binding each process to a GPU of its own (CUDA_VISIBLE_DEVICES per process) is told why it
      cannot run so. Once joined, the processes also compare their GPUs (``_check_each_process_has_a_gpu``).
    - Several CPU processes asked of ``accelerate launch``'s CPU path (``use_cpu`` / ``--cpu``, or the multi-CPU
      file ``accelerate config`` writes): without mpirun it starts ONE process, which would train alone. It gives
      that process MASTER_ADDR only when it was asked for more than one, so a MASTER_ADDR the launcher itself did
      not have, in a process no launcher gave a WORLD_SIZE (torchrun) or an MPI rank, says so.
    """
    problem = None
    per_machine = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0  # those CUDA_VISIBLE_DEVICES leaves
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
    if problem is None:
        return
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        raise LaunchMismatch(f"trainer: cannot start: {problem}")
    time.sleep(5)  # let the first process say it: the launcher stops the others once one of them exits
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
    """Where a launcher gave each process a GPU of its own through CUDA_VISIBLE_DEVICES, the count cannot tell, and
    the run could not go on: accelerate's barriers (``wait_for_everyone``, ``main_process_first``) name GPU <local
    rank>, which a process that sees one GPU lacks from local rank 1 on ("invalid device ordinal")."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return ""
    return (
        f" (CUDA_VISIBLE_DEVICES={visible!r} leaves this process {gpus}. If a launcher gives each process its "
        "own GPU this way, as srun --gpus-per-task does, let every process see the machine's GPUs instead, "
        "srun --gpu-bind=none: accelerate's barriers address GPU <local rank>, which a process that sees one "
        "does not have, and accelerate gives process k GPU k.)"
    )


_GPUS_COMPARED: list[bool] = []  # once per process (every rank joins, through distributed_state, as often)


def _check_each_process_has_a_gpu(state: PartialState, timeout_s: Optional[float]) -> None:
    """Two processes of one machine on one GPU (two launches of a multi-node job on one machine, each believing
    itself alone: local rank 0 twice) stop here, named, rather than at NCCL's first collective ("Duplicate GPU
    detected"): each process's GPU (its UUID, whatever CUDA_VISIBLE_DEVICES numbers it) gathered over the host
    group, once, on every multi-process CUDA job alike."""
    from trainer.launch.agreement import gather_objects, host_group

    if _GPUS_COMPARED:
        return
    _GPUS_COMPARED.append(True)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    mine = (socket.gethostname(), str(torch.cuda.get_device_properties(state.device).uuid), visible)
    everyone = gather_objects(mine, host_group(state.num_processes, timeout_s or 1800.0))
    on_gpu: dict[tuple[str, str], list[int]] = {}  # (machine, GPU) -> its processes, the whole job's
    for rank, (host, gpu, _) in enumerate(everyone):
        on_gpu.setdefault((host, gpu), []).append(rank)
    shared = next((ranks for ranks in on_gpu.values() if len(ranks) > 1), None)
    if shared is None:
        return  # (every process decides alike, from the same gathered list)
    machine = everyone[shared[0]][0]
    processes = sum(1 for host, _, _ in everyone if host == machine)
    gpus = sum(1 for host, _ in on_gpu if host == machine)
    settings = {everyone[rank][2] for rank in shared}
    seen = f", CUDA_VISIBLE_DEVICES={settings.pop()!r} in each" if len(settings) == 1 and None not in settings else ""
    problem = _too_many_processes(processes, gpus, f" for them (ranks {shared[0]} and {shared[1]} share one{seen})")
    torch.distributed.destroy_process_group()  # no teardown barrier: NCCL would meet the shared GPU there
    if state.process_index == shared[0]:  # said once for the job, on the machine it concerns
        raise LaunchMismatch(f"trainer: cannot start: {problem}")
    time.sleep(5)  # let the first process say it: the launcher stops the others once one of them exits
    raise LaunchMismatch(1)


def _lone_process_of_a_cpu_launch() -> bool:
    if not parse_flag_from_env("ACCELERATE_USE_CPU") or "MASTER_ADDR" not in os.environ:
        return False
    mpi_or_torchrun = ("WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE")
    if any(name in os.environ for name in mpi_or_torchrun):
        return False
    launcher = _launcher()
    return launcher is not None and "MASTER_ADDR" not in launcher[0]


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


# The teardown barrier's Work, kept until the interpreter itself is torn down (see below).
_TEARDOWN_WORK: list = []


@functools.cache  # register once, however many Accelerators a process builds
def _destroy_process_group_at_exit() -> None:
    """Why: a process that exits with its gloo group alive can abort (SIGABRT, "terminate called without an
    active exception") during interpreter finalization (pytorch/pytorch#179291, #190489). The cause, from a core
    dump: a gloo worker thread destroys a finished collective whose tensors still hold Python objects; freeing
    them needs the GIL, and a thread asking for the GIL while the interpreter finalizes is ended by pthread_exit
    inside a C++ destructor, which calls std::terminate. The work reaches a worker thread late through the barrier:
    gloo's barrier keeps (weakly) every collective still in progress when it starts, such as the script's last
    gather, and frees them only when the barrier's own Work goes. So the barrier's Work is kept referenced here:
    its last reference is then this process's, dropped on the main thread, with the GIL, when the interpreter
    clears this module. (2-process torchrun jobs, two at a time on 2 cores: 6 aborts in 150 before, 0 in 200 after.)
    The trainer's host (gloo) groups get the same barrier: one abort was still seen after a job that evaluated and
    predicted, in a full suite run on a loaded host.

    On a clean exit, and after a refusal every rank meets alike (``job_wide``: the ranks decided together, as on a
    locked output_dir), whose wait is bounded: after any other uncaught exception the other ranks may never arrive."""

    def destroy() -> None:
        if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            return
        error = getattr(sys, "last_exc", getattr(sys, "last_value", None))
        nccl = torch.distributed.get_backend() == "nccl"
        if error is None or isinstance(error, Refusal) and error.job_wide:
            # On NCCL the barrier names this process's GPU (without it torch warns, guessing the device).
            on = {"device_ids": [torch.cuda.current_device()]} if nccl else {}
            works = [torch.distributed.barrier(async_op=True, **on)]  # every rank's collectives are done first
            from trainer.launch.agreement import HOST_GROUPS  # the host (gloo) groups' collectives too, the same way

            works += [torch.distributed.barrier(group=group, async_op=True) for group in HOST_GROUPS]
            _TEARDOWN_WORK.extend(works)
            try:
                for work in works:
                    work.wait() if error is None else work.wait(timedelta(seconds=30))
            except RuntimeError:  # a peer that did not come: tear down anyway, but not NCCL, whose teardown after
                if nccl:  # a timed-out collective can hang until its watchdog aborts (pytorch/pytorch#141510)
                    return
        torch.distributed.destroy_process_group()

    atexit.register(destroy)


def _say_where_on_abort() -> None:
    """A process ended by SIGABRT prints where each of its threads was (Python's faulthandler, to stderr). NCCL's
    watchdog ends a rank that waited ``collective_timeout_s`` for a peer that way, with no Python exception: no
    traceback, no failed run in wandb (it shows the run crashed). This is then the only word of where it waited."""
    import faulthandler

    if not faulthandler.is_enabled():
        faulthandler.enable(all_threads=True)


def _end_with_the_launcher() -> None:
    """A worker gets SIGTERM when its launcher dies (kill -9, the OOM killer), as if preempted: it checkpoints the
    step reached and exits, instead of training on headless and colliding with the next launch. Linux's
    PR_SET_PDEATHSIG; only under torch's elastic agent (accelerate launch, torchrun), which starts the workers from
    its main thread (the death signal follows the parent *thread*)."""
    if not sys.platform.startswith("linux") or "TORCHELASTIC_RUN_ID" not in os.environ:
        return
    import ctypes

    launcher = os.getppid()
    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, int(signal.SIGTERM))
    if os.getppid() != launcher:  # it died before the request was in place
        os.kill(os.getpid(), signal.SIGTERM)


def num_machines(accelerator: Accelerator) -> int:
    """Machines in the job: processes divided by processes per machine (torchrun's LOCAL_WORLD_SIZE)."""
    per_machine = int(os.environ.get("LOCAL_WORLD_SIZE", accelerator.num_processes))
    return max(1, accelerator.num_processes // max(1, per_machine))
