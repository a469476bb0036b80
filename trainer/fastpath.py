"""The per-step calls into accelerate's prepared objects, without what they cost when it buys nothing.

Measured, and the way around each that keeps the behaviour:

- **Mixed precision**: ``prepare`` wraps the model's forward in autocast *and* converts every output to fp32: a
  GPT-2's 16 x 1024 x 50257 logits copied to fp32 each step, 1.5 GB more peak memory on an H100 and 1-3% of the
  step. The model keeps its own forward here, and the loss function runs under the same autocast (accelerate's
  ``autocast()``), as torch's AMP recipe does: losses such as cross-entropy autocast to fp32 by themselves.
- **optimizer.step()**: without a grad scaler accelerate's wrapper only forwards the call, after asking importlib
  twice whether the LOMO package is installed (uncached: about 0.2 ms a step, a quarter of a tiny model's step
  here); **zero_grad()** inspects the optimizer's signature every time. With a scaler (fp16) its step is needed.
- **backward()**: divides the loss by accelerate's accumulation steps, one more kernel and autograd node even when
  that is 1 (the trainer weighs each micro-batch's loss itself and keeps accelerate's at 1: trainer.accumulation);
  plain ``loss.backward()`` is what it then calls.

What is prepared stays prepared: checkpoints, ``accelerator.optimizer``, DDP, the scaler and accumulation are
accelerate's, untouched.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, ContextManager, Iterable, Optional

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType

# Distributed types whose backward and optimizer step are plain torch ones (DDP or none); FSDP, DeepSpeed, Megatron
# and XLA keep accelerate's.
PLAIN_TYPES = {
    DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU, DistributedType.MULTI_XPU,
    DistributedType.MULTI_NPU, DistributedType.MULTI_MLU, DistributedType.MULTI_MUSA,
}


def keep_own_forward(accelerator: Accelerator, model: torch.nn.Module) -> Callable[[], ContextManager]:
    """Undo ``prepare``'s autocast-and-fp32 wrapper on the forward of ``model`` (prepared); return the context
    to run forward and loss under instead (autocast in the launch's mixed precision, or nothing)."""
    if not accelerator.native_amp:
        return contextlib.nullcontext
    inner = accelerator.unwrap_model(model, keep_torch_compile=False)
    original = inner.__dict__.pop("_original_forward", None)  # the forward before prepare, bound
    if original is not None:
        if getattr(original, "__func__", None) is type(inner).forward:
            del inner.forward  # the class's own forward again, as before prepare
        else:
            inner.forward = original  # a forward the user had set on the instance
    return accelerator.autocast


class Stepper:
    """backward, step and zero_grad of one prepared optimizer, through accelerate only where it does work."""

    def __init__(self, accelerator: Accelerator, optimizer):
        self.accelerator = accelerator
        self.prepared = optimizer  # accelerate's AcceleratedOptimizer (a sharded model's: the optimizer itself)
        inner = getattr(optimizer, "optimizer", optimizer)
        plain = inner is optimizer or accelerator.scaler is None and accelerator.distributed_type in PLAIN_TYPES
        self._step = inner.step if plain else optimizer.step
        self._zero_grad = inner.zero_grad if plain else optimizer.zero_grad
        self._backward = (lambda loss: loss.backward()) if plain else accelerator.backward

    def backward(self, loss: torch.Tensor) -> None:
        self._backward(loss)

    def step(self) -> None:
        """One optimizer step (call it when the accumulation window closes)."""
        self._step()

    def zero_grad(self) -> None:
        self._zero_grad()

    def clip(self, parameters: Iterable[torch.Tensor], max_norm: Optional[float], measure: bool) -> Optional[Any]:
        """Clip the gradients to ``max_norm`` (None: leave them), and return their norm before clipping when
        clipped or ``measure`` (a step that logs), else None: a device tensor, read only when the step logs."""
        if max_norm is not None:
            return self.accelerator.clip_grad_norm_(parameters, max_norm)
        if not measure:
            return None
        self.accelerator.unscale_gradients()  # fp16: the true gradients' norm (the step then takes them unscaled)
        grads = [p.grad for p in parameters if p.grad is not None]
        if not grads:
            return None
        if hasattr(torch.nn.utils, "get_total_norm"):  # torch >= 2.6; sharded (DTensor) gradients too
            return torch.nn.utils.get_total_norm(grads)
        return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))

    @property
    def step_was_skipped(self) -> bool:
        """fp16's loss scaler skipped the step (an overflow)."""
        return getattr(self.prepared, "step_was_skipped", False)
