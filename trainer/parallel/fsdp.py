"""FSDP2: each process holds 1/K of the weights, gradients and optimizer state (``trainer.parallel.sharding``), over
the launch's mesh: FSDP, HSDP (replicate x shard) or tensor parallelism x FSDP (docs/sharded.md,
docs/parallelism.md).
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Iterable, Optional

import torch
import torch.distributed as dist

from trainer.console import say
from trainer.errors import ShardingError
from trainer.launch.mesh import CP, TP, data_mesh
from trainer.parallel.context import ContextParallel
from trainer.parallel.experts import Experts
from trainer.parallel.gradients import clip_, total_norm
from trainer.parallel.sharding import ShardedModel, shard
from trainer.parallel.strategy import Strategy, trainable
from trainer.parallel.tensor_parallel import ParallelizeFn, tensor_parallel
from trainer.parallel.tied import tied_gradient_in_place

if TYPE_CHECKING:
    from trainer.launch.run import Run


class FSDP2(Strategy):
    """The model sharded by ``fully_shard`` group by group, the optimizer built over the shards."""

    name = "FSDP2"
    lockstep = True
    pieces_reduce = True
    # Compiled whole, a sharded model ran 2.4x slower than eager (huggingface/accelerate#4022).
    compiles_per_block = True

    def __init__(self, run: Run):
        from accelerate.utils import FullyShardedDataParallelPlugin

        super().__init__(run)
        # The launch's FSDP settings (wrap policy, reshard_after_forward, ...), read as accelerate reads them.
        self.plugin = FullyShardedDataParallelPlugin(fsdp_version=2)
        self.sharded: Optional[ShardedModel] = None

    def apply(
        self, model: torch.nn.Module, *, prebuilt_optimizer: bool, parallelize_fn: Optional[ParallelizeFn] = None
    ) -> torch.nn.Module:
        """Sharding replaces the parameters, so an optimizer built before (a user's) would hold the unsharded ones:
        refused, as transformers' Trainer refuses one under FSDP. With ``tp_size`` the model is split by its own
        plan or by ``parallelize_fn`` (``trainer.parallel.tensor_parallel``)."""
        trainable(model)
        tied_gradient_in_place(model)
        run = self.run
        if prebuilt_optimizer:
            raise ShardingError(
                "with FSDP2 the optimizer must be built over the sharded parameters, after the Trainer "
                "shards the model: pass a factory the trainer calls then, optimizer=lambda groups: "
                "torch.optim.AdamW(groups, ...) (lr_scheduler=lambda optimizer, total_steps: ...), "
                "or choose them in the config (optimizer, lr, lr_scheduler, ...)"
            )
        layout = run.layout
        if parallelize_fn is not None and layout.tp == 1:
            say("parallelize_fn is not called: the launch's parallelism_config has no tp_size", once=True)
        if layout.tp > 1 and self.float8 is not None:
            raise ShardingError(
                "mixed_precision: fp8 with tensor parallelism (tp_size > 1) is not supported yet (torchao's fp8 "
                "layers need their own tensor-parallel plan): use bf16, or shard without tp_size"
            )
        self.in_fp8(model, sharded=True)
        tp = tensor_parallel(model, run.mesh[TP], parallelize_fn) if layout.tp > 1 else None
        if layout.ep > 1 and self.compilation is not None:
            raise ShardingError(
                f"compile with ep_size {layout.ep} is not supported yet (the experts' all-to-all reads its split "
                "sizes on the host inside a compiled block): launch without one of the two"
            )
        experts = Experts(model, layout, run.device.type) if layout.ep > 1 else None
        self.sharded = shard(
            model,
            self.plugin,
            data_mesh(layout, run.mesh),
            device=run.device,
            mixed_precision=run.accelerator.mixed_precision,
            recompute=self.recompute,
            seed=run.config.seed,
            name=layout.describe(),
            tp=tp,
            experts=experts,
        )
        if run.device.type == "cpu":
            # gloo's reduce-scatter copies its whole input: each group's gradients held twice while they reduce.
            for module in _sharded_modules(model):
                getattr(module, "set_custom_reduce_scatter", lambda comm: None)(InPlaceReduceScatter())
        if layout.cp > 1:
            if self.compilation is not None:
                raise ShardingError(
                    f"compile with cp_size {layout.cp} is not supported yet (the attention's all-to-all inside a "
                    "compiled block): launch without one of the two"
                )
            cp = run.mesh[CP]
            ContextParallel(cp.get_group(), layout.cp, cp.get_local_rank()).apply(model)
        self.compile(model)
        return model

    def gradient_sync(self, model: torch.nn.Module, *, sync: bool) -> ContextManager:
        """``set_requires_gradient_sync``, or every micro-batch's reduce-scatter with ``reduce_every_micro_batch``
        (sharded gradients accumulate in place); under HSDP the replicas all-reduce once, at the window's end."""
        if self.sharded is None or self.sharded.groups is None:
            # Tensor parallelism alone: no gradient crosses a data replica.
            return contextlib.nullcontext()
        model.set_requires_gradient_sync(sync or self.run.config.reduce_every_micro_batch)
        if self.run.layout.hybrid:
            model.set_requires_all_reduce(sync)
        return contextlib.nullcontext()

    def clip(self, parameters: Iterable[torch.Tensor], max_norm: Optional[float], *, measure: bool) -> Any:
        if max_norm is not None:
            return clip_(parameters, max_norm)
        if not measure:
            return None
        grads = [p.grad for p in parameters if p.grad is not None]
        return total_norm(grads) if grads else None

    def reshard(self, model: torch.nn.Module) -> None:
        """FSDP2 keeps the root group's gathered weights after a forward (backward would gather them again at
        once): let go of them, or the next forward computes with the old ones."""
        for module in _sharded_modules(model):
            module.reshard()

    def on_block_entered(self, model: torch.nn.Module, note: Callable[[], None]) -> None:
        """A rank stuck in block 3 holds the others in block 4's all-gather, all "in forward": the stall reporter
        counts the blocks each rank entered."""
        for module in _sharded_modules(model):
            module.register_forward_pre_hook(lambda *_: note(), prepend=True)

    def ask_before_collectives(self, model: torch.nn.Module, ask: Callable[[], None]) -> None:
        """One rank's out-of-memory inside a forward or backward would leave the others waiting in a collective:
        every all-gather and reduce-scatter FSDP2 issues asks first (``set_custom_all_gather`` /
        ``set_custom_reduce_scatter``; its buffers are allocated by then, so a rank fails before it or not at all)."""
        layout = self.run.layout
        if layout.tp > 1 or layout.hybrid or layout.ep > 1:
            raise ShardingError(
                f"auto_microbatch is not supported with {layout.describe()} yet (its collectives "
                "run where one rank's out-of-memory would leave the others waiting): set "
                "auto_microbatch: false and choose batch_size, or shard without tp_size or "
                "dp_replicate_size (or ep_size)"
            )
        from torch.distributed.fsdp import FSDPModule

        if not hasattr(FSDPModule, "reset_iter_state"):
            raise ShardingError(
                f"auto_microbatch with a sharded model needs FSDPModule.reset_iter_state, which "
                f"torch {torch.__version__} lacks: use torch 2.13 or later, or set auto_microbatch: "
                "false and choose batch_size"
            )
        for module in _sharded_modules(model):
            module.set_custom_all_gather(AskFirstAllGather(ask))
            module.set_custom_reduce_scatter(AskFirstReduceScatter(ask))

    def forget_failed_try(self, model: torch.nn.Module) -> None:
        """FSDP2's per-iteration state back to the start of a step, and the failed try's gradients dropped from the
        gathered weights of each module whose reduce-scatter had not run: ``reset_iter_state`` leaves them (torch
        2.13), the rerun's backward would add to them, and each holds a whole module's memory."""
        model.reset_iter_state()
        for module in _sharded_modules(model):
            for group in getattr(module._get_fsdp_state(), "_fsdp_param_groups", ()):
                for param in group.fsdp_params:
                    if getattr(param, "_unsharded_param", None) is not None:
                        param._unsharded_param.grad = None
                    param.unsharded_accumulated_grad = None

    def kind(self) -> str:
        return self.run.layout.kind

    def placed(self) -> str:
        return self.sharded.describe() if self.sharded else ""


def _sharded_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    from torch.distributed.fsdp import FSDPModule

    return [module for module in model.modules() if isinstance(module, FSDPModule)]


class AskFirstAllGather:
    """FSDP2's all-gather, asking first whether a rank ran out: the ``Comm`` of ``set_custom_all_gather``."""

    def __init__(self, ask: Callable[[], None]):
        self.ask = ask

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, async_op: bool = False):
        self.ask()
        return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)


class AskFirstReduceScatter(AskFirstAllGather):
    """FSDP2's reduce-scatter of gradients, asking first: the ``Comm`` of ``set_custom_reduce_scatter``."""

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, op: Any, async_op=False):
        self.ask()
        return reduce_scatter(output_tensor, input_tensor, group, op=op, async_op=async_op)


class InPlaceReduceScatter(AskFirstReduceScatter):
    """FSDP2's reduce-scatter of CPU gradients (gloo) without gloo's copy of its input (``reduce_scatter``)."""

    def __init__(self):
        super().__init__(lambda: None)


def reduce_scatter(output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, *, op: Any, async_op=False):
    """``reduce_scatter_tensor``, but for CPU tensors (gloo) an all-reduce in place of FSDP2's own copy-in buffer,
    then this rank's part copied out: gloo's reduce-scatter clones its whole input and all-reduces the clone
    (``ProcessGroupGloo::reduce_scatter_tensor_coalesced``), a second copy of each group's gradients while they
    reduce. The same sums, bit for bit, and no slower; NCCL's copies nothing and is left as it is."""
    if input_tensor.device.type != "cpu" or async_op:
        return dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group, async_op=async_op)
    dist.all_reduce(input_tensor, op=op, group=group)
    output_tensor.copy_(input_tensor.chunk(group.size())[group.rank()])
    return None
