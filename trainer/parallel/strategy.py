"""Parallelism in one place: how the model is spread over the processes, and everything that differs with it.

The launch's accelerate config decides: DDP (through ``Accelerator.prepare``: one whole copy per process, gradients
all-reduced), or FSDP2 (``fully_shard``: each process holds 1/K of the weights, gradients and optimizer state;
``trainer.parallel.fsdp``). What differs between the two lives here and nowhere else: wrapping the model (and activation
checkpointing, before sharding), gradient sync under accumulation, the model's state in checkpoints
(``trainer.checkpoint.model_part``), evaluation in lockstep, and the banner's words. The training loop never asks which
one runs, as in torchtitan's ``parallelize`` and Lightning Fabric's strategies.

The launch's ``parallelism_config`` (``trainer.launch.mesh``) shapes the device mesh: FSDP2 over a (replicate, shard)
mesh is HSDP, each replica sharded within a node, the replicas all-reducing across nodes.

It also hands out **data-parallel coordinates**: this process's rank among the processes that read different data,
and their number. The data loaders, the loss weighting, evaluation and the throughput figures read those, never the
process index and count, so that a tensor-parallel group (processes that share a batch) is a change here and in
the launch alone.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Optional

import torch

from trainer.checkpoint.model_part import ModelState
from trainer.config import TrainConfig
from trainer.errors import ConfigError, ShardingError, UnusedParameters
from trainer.launch.accelerate_config import blank_block_class_unset, refusal_of_the_launch
from trainer.launch.mesh import TP, data_mesh, data_parallel_group, requested_layout
from trainer.launch.run import build_accelerator, num_machines
from trainer.parallel.blocks import checkpoint_activations, transformer_blocks
from trainer.parallel.fsdp import FULLY_SHARDED, ShardedModel, requested_plugin, shard
from trainer.parallel.placement import built_on_meta, fill, initialise, region, to_upcast, upcast_words
from trainer.parallel.tensor_parallel import ParallelizeFn, tensor_parallel
from trainer.telemetry.console import say


@dataclass(frozen=True)
class DataParallel:
    """This process's place among the data-parallel replicas (each reads its own share of every global batch), and
    the process group they sum over (None: every process, as long as every process is a replica)."""

    rank: int
    size: int
    group: Any = None


class Parallelism:
    """DDP or FSDP2 for this launch, decided once; see the module docstring. Refuses an FSDP config it cannot
    honour before anything is built."""

    def __init__(self, config: TrainConfig):
        if (refused := refusal_of_the_launch()) is not None:  # DeepSpeed, Megatron-LM, fp8: said, not run as DDP
            raise ConfigError(refused)
        blank_block_class_unset()
        self.plugin = requested_plugin(config)  # an FSDP accelerate config, or None: DDP
        self.accelerator = acc = build_accelerator(config)
        self.layout = requested_layout(acc.num_processes, self.plugin is not None)  # a refused mesh stops here
        self.mesh = self.layout.build(acc.device.type) if self.layout.sharded else None
        tp = self.layout.tp  # a tensor-parallel group (consecutive processes) reads one batch
        self.dp = DataParallel(
            acc.process_index // tp,
            acc.num_processes // tp,
            data_parallel_group(self.layout, self.mesh) if self.mesh is not None else None,
        )
        self.recompute, self.seed = config.activation_checkpointing, config.seed
        self.reduce_every_micro_batch = config.reduce_every_micro_batch
        self.upcast: list[str] = []  # DDP's trainable tensors upcast to fp32 masters (a sharded model's say theirs)
        self.sharded: Optional[ShardedModel] = None  # what sharding did, once it has

    @property
    def name(self) -> str:
        return FULLY_SHARDED if self.plugin is not None else "DDP"

    @property
    def lockstep(self) -> bool:
        """Whether every process must run as many forwards in evaluation (a sharded model's each gather weights)."""
        return self.plugin is not None

    def apply(
        self, model: torch.nn.Module, own_optimizer: bool, parallelize_fn: Optional[ParallelizeFn] = None
    ) -> torch.nn.Module:
        """Ready ``model`` before its optimizer is built: sharded over the processes (FSDP2), or left whole for
        ``prepare`` to wrap in DDP; with ``activation_checkpointing`` its blocks recompute their activations. On the
        device either way, so that the optimizer is built there (AdamW then fuses on a GPU).

        Under FSDP2 an optimizer built before (a user's) holds the unsharded parameters, which sharding replaces:
        refused, as transformers' Trainer refuses one under FSDP; the config's, or a user's factory's, is built over
        the shards.
        With ``tp_size`` the model is split by its own plan or by ``parallelize_fn``
        (``trainer.parallel.tensor_parallel``)."""
        acc = self.accelerator
        if not any(parameter.requires_grad for parameter in model.parameters()):  # DDP and FSDP2 fail on it raw
            raise ConfigError(
                f"the model ({type(model).__name__}) has no trainable parameter (requires_grad is False "
                "on every one): fit() would have nothing to update; unfreeze the part to train "
                "(parameter.requires_grad_(True), or a PEFT adapter)"
            )
        if self.plugin is None:
            if parallelize_fn is not None:
                say("parallelize_fn is not called: tensor parallelism needs an FSDP config", once=True)
            self.upcast = whole_on_device(model, acc.device, self.seed)
            if self.recompute:
                checkpoint_activations(model, transformer_blocks(model))
            return model
        if own_optimizer:
            raise ShardingError(
                "with FSDP2 the optimizer must be built over the sharded parameters, after the Trainer "
                "shards the model: pass a factory the trainer calls then, optimizer=lambda groups: "
                "torch.optim.AdamW(groups, ...) (lr_scheduler=lambda optimizer, total_steps: ...), "
                "or choose them in the config (optimizer, lr, lr_scheduler, ...)"
            )
        if parallelize_fn is not None and self.layout.tp == 1:
            say("parallelize_fn is not called: the launch's parallelism_config has no tp_size", once=True)
        tp = tensor_parallel(model, self.mesh[TP], parallelize_fn) if self.layout.tp > 1 else None
        self.sharded = shard(
            model,
            self.plugin,
            data_mesh(self.layout, self.mesh),
            acc.device,
            acc.mixed_precision,
            self.recompute,
            self.seed,
            self.layout.describe(),
            tp,
        )
        return model

    def prepare(self, model: torch.nn.Module, optimizer: Any, loader: Any, scheduler: Any) -> tuple:
        """accelerate's ``prepare``: DDP, the optimizer and scheduler wrappers, the data. A sharded model and its
        optimizer stay the trainer's own; accelerate prepares the data and the schedule."""
        if self.sharded is None:
            return tuple(self.accelerator.prepare(model, optimizer, loader, scheduler))
        return (model, optimizer, *self.accelerator.prepare(loader, scheduler))

    def unwrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """The plain module, without DDP's (or torch.compile's) wrapper: the same weights on every rank."""
        return self.accelerator.unwrap_model(model, keep_torch_compile=False)

    def model_state(self, model: torch.nn.Module, optimizer: Any) -> ModelState:
        """The model and its optimizer as a checkpoint holds them (``trainer.checkpoint.model_part``)."""
        inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's wrapper holds the torch optimizer
        acc = self.accelerator
        return ModelState(self.unwrap(model), inner, self.sharded is not None, acc.device, acc.is_main_process)

    def gradient_sync(self, model: torch.nn.Module, sync: bool) -> ContextManager:
        """The context of one micro-batch's backward: gradients reduced across processes only when ``sync`` (the
        window's last micro-batch). DDP's ``no_sync``; a sharded model's ``set_requires_gradient_sync``, or every
        micro-batch's reduce-scatter with ``reduce_every_micro_batch`` (sharded gradients accumulate in place; under
        HSDP the all-reduce across replicas still waits for the window's end)."""
        if self.sharded is not None:
            if self.sharded.groups is None:  # tensor parallelism alone: no gradient crosses a data replica
                return contextlib.nullcontext()
            model.set_requires_gradient_sync(sync or self.reduce_every_micro_batch)
            if self.layout.hybrid:  # the replicas all-reduce once, at the window's end (the reduce-scatters add up)
                model.set_requires_all_reduce(sync)
            return contextlib.nullcontext()
        return contextlib.nullcontext() if sync else self.accelerator.no_sync(model)

    def autocast(self, model: torch.nn.Module) -> Callable[[], ContextManager]:
        """The context forward and loss run under: autocast in the launch's mixed precision, or nothing.

        Why not the forward ``prepare`` made: under mixed precision it wraps the model's forward in autocast *and*
        converts every output to fp32: a GPT-2's 16 x 1024 x 50257 logits copied each step, 1.5 GB more peak
        memory on an H100 and 1-3% of the step. The model keeps its own forward, and the loss function runs under
        the same autocast, as torch's AMP recipe does: losses such as cross-entropy autocast to fp32 by themselves."""
        acc = self.accelerator
        if not acc.native_amp:
            return contextlib.nullcontext
        inner = self.unwrap(model)
        original = inner.__dict__.pop("_original_forward", None)  # the forward before prepare, bound
        if original is not None:
            if getattr(original, "__func__", None) is type(inner).forward:
                del inner.forward  # the class's own forward again, as before prepare
            else:
                inner.forward = original  # a forward the user had set on the instance
        return acc.autocast

    def describe(self, device: torch.device) -> tuple[str, str, int, str]:
        """The banner's words: the launch, what sharding did ('' for DDP), how many read different data, and what
        each of those is (a process, or a tensor-parallel group)."""
        acc = self.accelerator
        kind = self.layout.kind if self.sharded else acc.distributed_type.value
        if self.recompute and not self.sharded:  # a sharded model's line says it
            kind += ", activation checkpointing"
        threads = f", {torch.get_num_threads()} CPU threads per process" if device.type == "cpu" else ""
        launch = (
            f"{acc.num_processes} process(es) on {num_machines(acc)} machine(s), device {device.type} ({kind})"
            f"{threads}, mixed precision {acc.mixed_precision}"
        )
        reader = "process" if self.layout.tp == 1 else f"tensor-parallel group of {self.layout.tp}"
        return launch, self.sharded.describe() if self.sharded else upcast_words(self.upcast), self.dp.size, reader


def whole_on_device(model: torch.nn.Module, device: torch.device, seed: int) -> list[str]:
    """A model for DDP, whole on ``device`` with fp32 master weights (AdamW state in bf16 stalls training without an
    error; fp16 weights cannot be unscaled): a model built on meta is initialised as a sharded one is
    (``trainer.parallel.placement``: the same weights, whatever the process count). Returns the names upcast."""
    upcast = to_upcast(model)
    if built_on_meta(model):
        modules = region(model, set())
        fill(modules, device, None, set(upcast))
        initialise(model, modules, seed, device)
        return list(upcast.values())
    for parameter in model.parameters():
        if id(parameter) in upcast:
            parameter.data = parameter.data.float()
    model.to(device)
    return list(upcast.values())


def unused_parameters(err: RuntimeError) -> Optional[UnusedParameters]:
    """DDP's error for a model some of whose parameters got no gradient (raised at the next forward), as a refusal
    naming the fix; None for any other error."""
    text = str(err)
    if "Expected to have finished reduction in the prior iteration" not in text:
        return None
    which = [line.strip() for line in text.splitlines() if line.strip().startswith("Parameter")]
    return UnusedParameters(
        "some parameters of the model took no part in the previous step's loss, which DDP cannot reduce by default"
        f"{': ' + ' '.join(which) if which else ''}. Set find_unused_parameters: true in the TrainConfig (DDP then "
        "looks for them after every forward, at some cost), or make every parameter take part in the loss."
    )
