"""What every kind of parallelism provides the loop, as Lightning Fabric's ``Strategy`` does: place the model,
prepare it and its optimizer, reduce gradients, backward, clip, step, autocast, unwrap, evaluate in lockstep, the
hooks ``auto_microbatch`` and the stall reporter need, and the banner's words. ``DDP`` (trainer.parallel.ddp) and
``FSDP2`` (trainer.parallel.fsdp) fill it in; the loop never asks which one runs (docs/parallelism.md).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, ContextManager, Iterable, NamedTuple, Optional

import torch

from trainer.errors import ConfigError, Refusal
from trainer.launch.host import num_machines
from trainer.launch.run import Run
from trainer.parallel.compiling import Compilation, compile_in_place
from trainer.parallel.float8 import Float8
from trainer.parallel.tensor_parallel import ParallelizeFn


class Described(NamedTuple):
    """A strategy in the banner's words: the launch, what placing the model did, how many read different data, and
    what each of those is (a process, or a tensor-parallel group)."""

    launch: str
    placed: str
    readers: int
    reader: str


class Strategy:
    """The parts every strategy shares; a subclass owns what differs. One strategy serves one model and its
    optimizer (``prepare`` keeps the optimizer's step)."""

    name = ""
    # Every process must run as many forwards in evaluation (a sharded model's each gather weights).
    lockstep = False
    # auto_microbatch: each piece reduces its own gradients (else the window's are reduced once, at its end).
    pieces_reduce = False
    # compile: each block on its own whatever the accelerate config says (else as it says; whole by default).
    compiles_per_block = False

    def __init__(self, run: Run):
        self.run = run
        self.recompute = run.config.activation_checkpointing
        self.optimizer: Any = None
        self.compilation = Compilation.of(run.config.compile)
        # The banner's words for it ("compiled per block: 12 x GPT2Block and the loss (inductor)").
        self.compiled = ""
        self.float8 = Float8.of_launch(run.device)
        self.fp8 = ""

    def apply(
        self, model: torch.nn.Module, *, prebuilt_optimizer: bool, parallelize_fn: Optional[ParallelizeFn] = None
    ) -> torch.nn.Module:
        """``model`` placed on the device (or sharded) before its optimizer is built, so that the optimizer is
        built there (AdamW then fuses on a GPU); its blocks recompute their activations with
        ``activation_checkpointing``. ``prebuilt_optimizer``: the user built one over the parameters as they were."""
        raise NotImplementedError

    def in_fp8(self, model: torch.nn.Module, *, sharded: bool) -> None:
        """``mixed_precision: fp8``: the model's Linear layers made torchao's fp8 ones, before sharding."""
        if self.float8 is not None:
            self.fp8 = self.float8.convert(model, sharded=sharded)

    def compile(self, model: torch.nn.Module) -> None:
        """``compile: true`` or the accelerate config's torch dynamo answer: ``model`` compiled in place, the last
        thing ``apply`` does (trainer.parallel.compiling)."""
        if self.compilation is not None:
            per_block = self.compiles_per_block or self.compilation.per_block
            # Under tensor parallelism a block's input may be a view of a DTensor's local tensor.
            views = self.run.layout.tp > 1
            loss = not self.run.config.chunked_loss
            self.compiled = compile_in_place(model, self.compilation, per_block=per_block, copy_views=views, loss=loss)

    def prepare(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> torch.nn.Module:
        """The model as it trains (wrapped, or as it is), ``optimizer`` kept for ``step`` and ``zero_grad``."""
        self.optimizer = optimizer
        return model

    def unwrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """The plain module, without DDP's (or torch.compile's) wrapper: the same weights on every rank."""
        return self.run.accelerator.unwrap_model(model, keep_torch_compile=False)

    def gradient_sync(self, model: torch.nn.Module, *, sync: bool) -> ContextManager:
        """The context of one micro-batch's backward: gradients reduced across processes only when ``sync``."""
        return contextlib.nullcontext()

    def autocast(self, model: torch.nn.Module) -> Callable[[], ContextManager]:
        """The context forward and loss run under: autocast in the launch's mixed precision, or nothing. The loss
        function runs under it too, as torch's AMP recipe does (cross-entropy autocasts to fp32 by itself)."""
        acc = self.run.accelerator
        return acc.autocast if acc.native_amp else contextlib.nullcontext

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def clip(self, parameters: Iterable[torch.Tensor], max_norm: Optional[float], *, measure: bool) -> Any:
        """Clip the gradients to ``max_norm`` (None: leave them); their norm before clipping (a device tensor,
        the same on every rank) when clipped or ``measure``d, else None."""
        raise NotImplementedError

    def step(self) -> bool:
        """The optimizer step; whether it was taken (fp16's loss scaler skips one that overflowed)."""
        self.optimizer.step()
        return True

    def zero_grad(self) -> None:
        self.optimizer.zero_grad()

    def refusal_of(self, error: RuntimeError) -> Optional[Refusal]:
        """A forward's error this strategy explains in one line, or None."""
        return None

    def reshard(self, model: torch.nn.Module) -> None:
        """Let go of weights gathered for a forward, before the shards under them change (an EMA swapped in)."""

    def on_block_entered(self, model: torch.nn.Module, note: Callable[[], None]) -> None:
        """``note()`` each time a forward enters a block that waits for every rank (a sharded block's all-gather),
        for the stall reporter."""

    def ask_before_collectives(self, model: torch.nn.Module, ask: Callable[[], None]) -> None:
        """auto_microbatch: ``ask()`` before each collective a piece's forward and backward issues (it raises when
        another rank ran out of memory), or refuse the layout by name."""

    def forget_failed_try(self, model: torch.nn.Module) -> None:
        """auto_microbatch: after a try some rank ran out of memory in, the model's per-step state as at the start."""

    def reduce_pieces(self, model: torch.nn.Module) -> None:
        """auto_microbatch: the window's gradients reduced once every piece got through (unless ``pieces_reduce``)."""

    def describe(self) -> Described:
        """The banner's words for the launch and the model's placement."""
        run, acc = self.run, self.run.accelerator
        device = run.device
        threads = f", {torch.get_num_threads()} CPU threads per process" if device.type == "cpu" else ""
        launch = (
            f"{run.world} process(es) on {num_machines(run.world)} machine(s), device {device.type}"
            f"{f' ({kind})' if (kind := ', '.join(w for w in (self.kind(), self.compiled) if w)) else ''}"
            f"{threads}, mixed precision {acc.mixed_precision}{f', {self.fp8}' if self.fp8 else ''}"
        )
        tp = run.layout.tp
        reader = "process" if tp == 1 else f"tensor-parallel group of {tp}"
        return Described(launch, self.placed(), run.dp.size, reader)

    def kind(self) -> str:
        return self.name

    def placed(self) -> str:
        return ""


def trainable(model: torch.nn.Module) -> None:
    """A model with nothing to train is refused by name (DDP and FSDP2 fail on it raw)."""
    if not any(parameter.requires_grad for parameter in model.parameters()):
        raise ConfigError(
            f"the model ({type(model).__name__}) has no trainable parameter (requires_grad is False "
            "on every one): fit() would have nothing to update; unfreeze the part to train "
            "(parameter.requires_grad_(True), or a PEFT adapter)"
        )
