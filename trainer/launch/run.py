"""This process's place in the job, joined once: the ``Run`` every part of the Trainer is built from
(docs/launching.md).

On a host without CUDA, ``accelerate launch`` (or torchrun) with K processes would start K processes that each
build an Accelerator believing it is alone: K silent, independent trainings. Here the Accelerator is built with
``cpu=True`` instead (real DDP over gloo), said once, and the world it joined is checked against the launcher's.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Optional, TypeVar

import torch
import torch.distributed as dist
from accelerate import Accelerator, PartialState
from accelerate.utils import DataLoaderConfiguration, DistributedDataParallelKwargs, set_seed

from trainer import console
from trainer.config import TrainConfig
from trainer.errors import ConfigError, Refusal, WorldSizeMismatch
from trainer.launch import host
from trainer.launch.accelerate_config import (
    accelerate_without_sharding,
    blank_block_class_unset,
    launch_asks_for_fp8,
    refusal_of_the_launch,
    sharding_requested,
)
from trainer.launch.mesh import Layout, data_parallel_group, requested_layout, with_experts

T = TypeVar("T")
ELASTIC_RECIPE = (
    "The trainer keeps each attempt's keys apart in the launcher's store (pytorch/pytorch#135712); if restarts "
    "still fail to reconnect, launch with --rdzv_backend c10d and TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, which "
    "gives each attempt a store of its own."
)


@dataclass(frozen=True)
class DataParallel:
    """This process's place among the processes that read different data (a tensor-parallel group reads one batch),
    and the group they sum over (None: every process)."""

    rank: int
    size: int
    group: Any = None


@dataclass(frozen=True)
class Run:
    """The job as this process sees it, as torchtitan's ``ParallelDims`` is: the config, the Accelerator (the
    launch's environment: device, mixed precision, data placement), the mesh's ``layout`` and ``mesh``, the
    data-parallel coordinates ``dp``, and ``host``, a gloo group for agreements off the device (None: one process).
    Built by ``Run.join``; nothing writes into it after."""

    config: TrainConfig
    accelerator: Accelerator
    layout: Layout
    mesh: Any
    dp: DataParallel
    host: Any

    @classmethod
    def join(cls, config: TrainConfig) -> "Run":
        """Join the launch's job (collective): what it cannot run is refused first, by name."""
        if (refused := refusal_of_the_launch()) is not None:
            raise ConfigError(refused)
        blank_block_class_unset()
        if launch_asks_for_fp8():
            # The strategy makes the fp8 layers (trainer.parallel.float8): accelerate's prepare() must not again
            # (it also reads `--fp8_backend ao`, lower case, as no backend at all and fails).
            os.environ["ACCELERATE_FP8_BACKEND"] = "NO"
        sharded = sharding_requested()
        if config.deterministic:
            # Read by cuBLAS when it makes its handle, at the first matmul on the device: before any.
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        accelerator = build_accelerator(config)
        # Dropout etc.: reproducible, and different on each rank.
        set_seed(config.seed, device_specific=True, deterministic=config.deterministic)
        world = accelerator.num_processes
        layout = with_experts(requested_layout(world, sharded), config.ep_size)
        mesh = layout.build(accelerator.device.type) if layout.sharded else None
        group = data_parallel_group(layout, mesh) if mesh is not None else None
        # A tensor- or context-parallel group reads one batch.
        split = layout.tp * layout.cp
        dp = DataParallel(accelerator.process_index // split, world // split, group)
        group = host_group(world, config.collective_timeout_s)
        return cls(config=config, accelerator=accelerator, layout=layout, mesh=mesh, dp=dp, host=group)

    device = property(lambda self: self.accelerator.device, doc="This process's device.")
    rank = property(lambda self: self.accelerator.process_index, doc="This process's rank in the job.")
    world = property(lambda self: self.accelerator.num_processes, doc="The job's processes.")
    main = property(lambda self: self.accelerator.is_main_process, doc="Whether this is the job's first process.")

    @property
    def global_batch(self) -> int:
        """Examples an optimizer step takes: data-parallel processes x batch_size x gradient_accumulation_steps."""
        return self.dp.size * self.config.batch_size * self.config.gradient_accumulation_steps

    def barrier(self) -> None:
        self.accelerator.wait_for_everyone()

    def main_decides(self, decide: Callable[[], T]) -> T:
        """``decide()`` on the main process; its value (plain data) on every rank, or the ``Refusal`` it raised,
        raised on every rank (the first process alone prints it): no rank waits for a peer that left."""
        chosen: list[Any] = [None]
        if self.main:
            try:
                chosen = [decide()]
            except Refusal as refusal:
                chosen = [refusal]
        if self.host is not None:
            dist.broadcast_object_list(chosen, src=0, group=self.host)
        if isinstance(chosen[0], Refusal):
            raise chosen[0]
        return chosen[0]

    def gather(self, mine: Any) -> list[Any]:
        """Every rank's ``mine`` (plain data), on every rank, over the host group."""
        return gather_objects(mine, self.host)


def distributed_state(collective_timeout_s: Optional[float] = None) -> PartialState:
    """This process's place in the job (``process_index``, ``num_processes``, ``main_process_first()``), joined
    with the same CPU fallback as the Trainer: call it to prepare data before the Trainer exists.

    ``collective_timeout_s``: how long a collective may wait for a missing rank before the job ends (torch's
    default, 30 minutes, when None). The first call joins the job and fixes it: pass the TrainConfig's value.
    """
    host.check_launch_fits_host()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    timeout = {} if collective_timeout_s is None else {"timeout": timedelta(seconds=collective_timeout_s)}
    try:
        _join_in_this_attempts_namespace(attempt, **timeout)
        # The cpu flag the Accelerator will derive (PartialState ignores ACCELERATE_USE_CPU): on a GPU host a CPU
        # launch would otherwise put the state on the GPU first.
        state = PartialState(cpu=host.use_cpu(), **timeout)
    except RuntimeError as err:
        if attempt == 0:
            raise
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        message = f"restart {attempt}: the processes could not reconnect ({first_line}). {ELASTIC_RECIPE}"
        raise RuntimeError(message) from err
    host.destroy_process_group_at_exit()
    host.end_with_the_launcher()
    host.say_where_on_abort()
    if state.num_processes > 1 and state.device.type == "cuda":
        _compare_gpus(state, collective_timeout_s or 1800.0)
    console.joined(state.process_index)
    return state


_GPUS_COMPARED: list[bool] = []


def _compare_gpus(state: PartialState, timeout_s: float) -> None:
    """Once per process: two processes on one GPU are refused, named (``host.refuse_shared_gpus``)."""
    if _GPUS_COMPARED:
        return
    _GPUS_COMPARED.append(True)
    everyone = gather_objects(host.gpu_of_this_process(state.device), host_group(state.num_processes, timeout_s))
    host.refuse_shared_gpus(everyone, state.process_index)


def _join_in_this_attempts_namespace(attempt: int, timeout: timedelta = timedelta(minutes=30)) -> None:
    """Join the process group with its keys under ``trainer/attempt-<n>/`` in the launcher's store, before accelerate
    would join it plainly. torch's elastic agent keeps one store for every restart attempt, so a restarted worker
    could read a dead attempt's addresses and wait for peers that no longer exist (pytorch/pytorch#135712). The
    backend is the one accelerate would pick (NCCL on CUDA, else gloo); on other accelerators accelerate joins."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or host.launched_world_size() <= 1 or dist.is_initialized():
        return
    if host.use_cpu():
        backend = "gloo"
    elif torch.cuda.is_available():
        backend = "nccl"
    else:
        return
    rank, world = int(os.environ["RANK"]), host.launched_world_size()
    store, _, _ = next(dist.rendezvous("env://", rank, world, timeout=timeout))
    namespaced = dist.PrefixStore(f"trainer/attempt-{attempt}", store)
    dist.init_process_group(backend, store=namespaced, rank=rank, world_size=world, timeout=timeout)


def build_accelerator(config: TrainConfig) -> Accelerator:
    """The Accelerator for this process: hardware and mixed precision from the accelerate config at launch. The
    trainer steps the scheduler (accelerate would step it once per process per step) and weighs accumulation
    itself (accelerate divides by the full window, a short last one included), so both stay off here."""
    distributed_state(config.collective_timeout_s)
    # A sharded model is the trainer's own (trainer.parallel.fsdp), on every host alike.
    with accelerate_without_sharding():
        accelerator = Accelerator(
            cpu=host.use_cpu(),
            step_scheduler_with_optimizer=False,
            # Copies to the GPU overlap the step (the trainer's loaders pin memory on CUDA); a no-op on CPU.
            dataloader_config=DataLoaderConfiguration(non_blocking=True),
            kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=config.find_unused_parameters)],
            # The strategy compiles, in place, per block or whole (trainer.parallel.compiling), not prepare().
            dynamo_backend="no",
            # fp8: torchao's fp8 matmuls in the strategy (trainer.parallel.float8), the rest in bf16.
            mixed_precision="bf16" if launch_asks_for_fp8() else None,
        )
    check_world_size(accelerator)
    if (advice := host.share_cpu_threads(accelerator.device)) is not None:
        console.say(advice, once=True)
    host.apply_tf32(config.tf32, accelerator.device)
    if (words := host.precision_words(accelerator.device, accelerator.mixed_precision)) is not None:
        console.say(words, once=True)
    if host.needs_cpu_fallback():
        world = accelerator.num_processes
        console.say(
            f"No GPU on this host is visible to the processes: running the {world} launched processes as "
            f"one job on CPU over gloo (accelerate would otherwise start {world} independent trainings)",
            once=True,
        )
    return accelerator


def check_world_size(accelerator: Accelerator) -> None:
    """Stop, saying why, if the launcher announced K processes but this Accelerator joined a different world."""
    world = host.launched_world_size()
    if accelerator.num_processes != world:
        raise WorldSizeMismatch(
            f"The launcher started WORLD_SIZE={world} processes, but this process (RANK="
            f"{os.environ.get('RANK', '?')}) joined a world of {accelerator.num_processes}. Each process would "
            "train alone on the full data set. On a host without CUDA, build the Accelerator with cpu=True (the "
            "Trainer does this) or launch with `accelerate launch --cpu`."
        )


@functools.cache
def host_group(world_size: int, timeout_s: float) -> Optional[Any]:
    """The job's gloo group for agreements about CPU-side facts (a stream's windows, a signal, a failed write):
    they neither wait behind the device's queued work nor add a host sync. None with one process. Collective
    the first time; its collectives give up after ``collective_timeout_s``, as the training ones do."""
    if world_size == 1:
        return None
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
    host.register_host_group(group)
    return group


def gather_objects(mine: Any, group: Any) -> list[Any]:
    """Every rank's ``mine`` (plain Python data: an error's text, a stream's position), on every rank."""
    if group is None:
        return [mine]
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, mine, group=group)
    return gathered
