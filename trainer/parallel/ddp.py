"""DDP: one whole copy of the model per process, wrapped by ``Accelerator.prepare``, gradients all-reduced in the
window's last backward (docs/parallelism.md).

The calls into accelerate's prepared optimizer go around what they cost when it buys nothing (measured):
``optimizer.step()`` without a grad scaler only forwards the call after asking importlib twice whether LOMO is
installed (about 0.2 ms a step); ``zero_grad()`` inspects its signature every time; ``backward()`` divides the loss by
accelerate's accumulation steps, one more kernel even when that is 1. With a grad scaler (fp16) accelerate's are used.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Iterable, Optional

import torch
import torch.distributed as dist
from accelerate.utils import DistributedType

from trainer.console import say
from trainer.errors import UnusedParameters
from trainer.parallel.blocks import checkpoint_activations, transformer_blocks
from trainer.parallel.placement import upcast_words, whole_on_device
from trainer.parallel.strategy import Strategy, trainable
from trainer.parallel.tensor_parallel import ParallelizeFn
from trainer.parallel.tied import tied_gradient_in_place

if TYPE_CHECKING:
    from trainer.launch.run import Run

# Distributed types whose backward and optimizer step are plain torch ones.
PLAIN_TYPES = {
    DistributedType.NO,
    DistributedType.MULTI_CPU,
    DistributedType.MULTI_GPU,
    DistributedType.MULTI_XPU,
    DistributedType.MULTI_NPU,
    DistributedType.MULTI_MLU,
    DistributedType.MULTI_MUSA,
}


class DDP(Strategy):
    """DistributedDataParallel through ``Accelerator.prepare``; fp32 master weights; fp16 through accelerate's
    loss scaler."""

    name = "DDP"

    def __init__(self, run: Run):
        super().__init__(run)
        # Trainable tensors of a lower precision upcast to fp32 masters.
        self.upcast: list[str] = []
        self._step: Callable[[], Any] = lambda: None
        self._zero_grad: Callable[[], Any] = lambda: None
        self._backward: Callable[[torch.Tensor], None] = lambda loss: loss.backward()

    def apply(
        self, model: torch.nn.Module, *, prebuilt_optimizer: bool, parallelize_fn: Optional[ParallelizeFn] = None
    ) -> torch.nn.Module:
        trainable(model)
        tied_gradient_in_place(model)
        if parallelize_fn is not None:
            say("parallelize_fn is not called: tensor parallelism needs an FSDP config", once=True)
        self.upcast = whole_on_device(model, self.run.device, self.run.config.seed)
        self.in_fp8(model, sharded=False)
        if self.recompute:
            checkpoint_activations(model, transformer_blocks(model))
        self.compile(model)
        return model

    def prepare(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> torch.nn.Module:
        acc = self.run.accelerator
        wrapped, prepared = acc.prepare(model, optimizer)
        self.optimizer = optimizer
        plain = acc.scaler is None and acc.distributed_type in PLAIN_TYPES
        self._step = optimizer.step if plain else prepared.step
        self._zero_grad = optimizer.zero_grad if plain else prepared.zero_grad
        self._backward = (lambda loss: loss.backward()) if plain else acc.backward
        return wrapped

    def gradient_sync(self, model: torch.nn.Module, *, sync: bool) -> ContextManager:
        return contextlib.nullcontext() if sync else self.run.accelerator.no_sync(model)

    def autocast(self, model: torch.nn.Module) -> Callable[[], ContextManager]:
        """The launch's autocast, around the model's own forward: under mixed precision the forward ``prepare``
        made also converts every output to fp32 (a GPT-2's 16 x 1024 x 50257 logits copied each step: 1.5 GB more
        peak memory on an H100 and 1-3% of the step), so it is taken off again."""
        inner = self.unwrap(model)
        if self.run.accelerator.native_amp:
            original = inner.__dict__.pop("_original_forward", None)
            if original is not None:
                if getattr(original, "__func__", None) is type(inner).forward:
                    del inner.forward
                else:
                    # A forward the user had set on the instance.
                    inner.forward = original
        return super().autocast(model)

    def backward(self, loss: torch.Tensor) -> None:
        self._backward(loss)

    def clip(self, parameters: Iterable[torch.Tensor], max_norm: Optional[float], *, measure: bool) -> Any:
        acc = self.run.accelerator
        if max_norm is not None:
            return acc.clip_grad_norm_(parameters, max_norm)
        if not measure:
            return None
        # fp16: the true gradients' norm (the step then takes them unscaled).
        acc.unscale_gradients()
        grads = [p.grad for p in parameters if p.grad is not None]
        # Whole and the same on every process: no collective.
        return torch.nn.utils.get_total_norm(grads) if grads else None

    def step(self) -> bool:
        """Under fp16, whether the loss scaler skipped the step is read off the scale it backed off, not accelerate's
        ``step_was_skipped``: a fused AdamW (the CUDA default) is always called and skips inside its kernel
        (huggingface/accelerate#4242). One host read per step under fp16, where the unfused path reads it anyway."""
        scaler = self.run.accelerator.scaler
        if scaler is None or not scaler.is_enabled():
            self._step()
            return True
        # Set at the first scale().
        before = scaler._scale.clone() if scaler._scale is not None else None
        self._step()
        return before is None or not bool(scaler._scale < before)

    def zero_grad(self) -> None:
        self._zero_grad()

    def refusal_of(self, error: RuntimeError) -> Optional[UnusedParameters]:
        """DDP's error for parameters that got no gradient (raised at the next forward), naming the fix."""
        text = str(error)
        if "Expected to have finished reduction in the prior iteration" not in text:
            return None
        which = [line.strip() for line in text.splitlines() if line.strip().startswith("Parameter")]
        return UnusedParameters(
            "some parameters of the model took no part in the previous step's loss, which DDP cannot reduce by "
            f"default{': ' + ' '.join(which) if which else ''}. Set find_unused_parameters: true in the TrainConfig "
            "(DDP then looks for them after every forward, at some cost), or make every parameter take part in the "
            "loss."
        )

    def reduce_pieces(self, model: torch.nn.Module) -> None:
        """The window's gradients averaged over the processes, as DDP would have (each divided by the process
        count, then summed). A parameter some rank has no gradient for gets zeros where another has one, so that
        every rank reduces the same tensors."""
        run = self.run
        if run.dp.size == 1:
            return
        trainable_ = [p for p in model.parameters() if p.requires_grad]
        held = torch.tensor([p.grad is not None for p in trainable_], dtype=torch.int32)
        dist.all_reduce(held, op=dist.ReduceOp.MAX, group=run.host)
        works = []
        for parameter, anyone in zip(trainable_, held.tolist(), strict=True):
            if not anyone:
                continue
            if parameter.grad is None:
                parameter.grad = torch.zeros_like(parameter)
            parameter.grad.div_(run.dp.size)
            works.append(dist.all_reduce(parameter.grad, group=run.dp.group, async_op=True))
        for work in works:
            work.wait()

    def kind(self) -> str:
        kind = self.run.accelerator.distributed_type.value
        # accelerate's name for one process ("NO": not distributed) says nothing to a reader.
        kind = "" if kind == "NO" else kind
        return ", ".join(word for word in (kind, "activation checkpointing" if self.recompute else "") if word)

    def placed(self) -> str:
        return upcast_words(self.upcast)
