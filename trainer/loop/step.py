"""One optimizer step: forward and backward over each micro-batch of an accumulation window, then the update.

Each micro-batch's loss is weighed as its share of the global batch's mean (``trainer.loop.weighing``), only the last
backward reduces the gradients across processes (``Parallelism.gradient_sync``), and the window's gradients are
clipped, stepped and zeroed. What watches the step wraps its phases (``Phases``: where each rank is, for the
stall reporter, and the forward pass's time, for the log window); the NaN guard decides whether the update is taken
(``nan_policy: skip``). With ``auto_microbatch``, the micro-batches are cut in pieces and the window runs again
after an out-of-memory on any rank (``trainer.loop.microbatch``). Under the default loss, the first packed batch's
model is asked once whether its attention keeps the documents apart (``trainer.loop.packing``).

The calls into accelerate's prepared optimizer go around what they cost when it buys nothing (measured):
``optimizer.step()`` without a grad scaler only forwards the call, after asking importlib twice whether the LOMO
package is installed (uncached: about 0.2 ms a step, a quarter of a tiny model's step here); ``zero_grad()``
inspects the optimizer's signature every time; ``backward()`` divides the loss by accelerate's accumulation steps,
one more kernel and autograd node even when that is 1 (the trainer weighs each micro-batch itself and keeps
accelerate's at 1). With a grad scaler (fp16), or a distributed type other than DDP, accelerate's are used.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Iterable, Iterator, Optional

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType

from trainer.config import TrainConfig
from trainer.launch.agreement import StreamAgreement
from trainer.loop.losses import keeps_a_cache, model_loss
from trainer.loop.microbatch import RanOutElsewhere, cut
from trainer.loop.nonfinite import NonFiniteGuard
from trainer.loop.packing import looks_packed, refuse_attention_across_documents
from trainer.loop.weighing import StepBatches, Weighing, accumulation_windows
from trainer.optim.build import Optimization
from trainer.parallel.gradients import clip_, total_norm
from trainer.parallel.strategy import Parallelism, unused_parameters
from trainer.telemetry.window import LogWindow, examples_in

# Distributed types whose backward and optimizer step are plain torch ones (DDP or none); FSDP, DeepSpeed, Megatron
# and XLA keep accelerate's.
PLAIN_TYPES = {
    DistributedType.NO,
    DistributedType.MULTI_CPU,
    DistributedType.MULTI_GPU,
    DistributedType.MULTI_XPU,
    DistributedType.MULTI_NPU,
    DistributedType.MULTI_MLU,
    DistributedType.MULTI_MUSA,
}


class Phases:
    """``with phases(step, "forward"):``: notes where this rank is (``trainer.telemetry.stall``) and, for the forward
    pass, adds its host time to the log window: this rank's own work before the gradients' all-reduce."""

    def __init__(self, reporter: Any, window: LogWindow):
        self.reporter, self.window = reporter, window
        self.name, self.started = "data", 0.0

    def __call__(self, step: int, name: str) -> "Phases":
        self.reporter.at(step, name)
        self.name = name
        self.started = time.perf_counter() if name == "forward" else 0.0
        return self

    def __enter__(self) -> None:
        return None

    def __exit__(self, *error: Any) -> None:
        if self.name == "forward":
            self.window.forward += time.perf_counter() - self.started


class Stepper:
    """backward, step and zero_grad of one prepared optimizer, through accelerate only where it does work."""

    def __init__(self, accelerator: Accelerator, optimizer: Any, spread: bool = False):
        self.accelerator = accelerator
        self.spread = spread  # the gradients are DTensors (a sharded or tensor-parallel model): trainer.gradients
        self.prepared = optimizer  # accelerate's AcceleratedOptimizer (a sharded model's: the optimizer itself)
        inner = getattr(optimizer, "optimizer", optimizer)
        plain = inner is optimizer or accelerator.scaler is None and accelerator.distributed_type in PLAIN_TYPES
        self._step = inner.step if plain else optimizer.step
        self.skipped = False  # the last step's: fp16's loss scaler found an overflow and skipped it
        self.zero_grad = inner.zero_grad if plain else optimizer.zero_grad
        self.backward: Callable[[torch.Tensor], None] = accelerator.backward
        if plain:
            self.backward = lambda loss: loss.backward()

    def clip(self, parameters: Iterable[torch.Tensor], max_norm: Optional[float], measure: bool) -> Optional[Any]:
        """Clip the gradients to ``max_norm`` (None: leave them), and return their norm before clipping when
        clipped or ``measure`` (a step that logs), else None: a device tensor, read only when the step logs."""
        if max_norm is not None:
            if self.spread:
                return clip_(parameters, max_norm)
            return self.accelerator.clip_grad_norm_(parameters, max_norm)
        if not measure:
            return None
        if self.spread:
            grads = [p.grad for p in parameters if p.grad is not None]
            return total_norm(grads) if grads else None
        self.accelerator.unscale_gradients()  # fp16: the true gradients' norm (the step then takes them unscaled)
        grads = [p.grad for p in parameters if p.grad is not None]
        if not grads:
            return None
        return torch.nn.utils.get_total_norm(grads)  # whole and the same on every process: no collective

    def step(self) -> None:
        """The optimizer step; under fp16, whether the loss scaler skipped it, read off the scale it backed off.
        Not accelerate's ``step_was_skipped``: that asks whether ``optimizer.step`` was called, and a fused AdamW
        (the CUDA default) is always called, skipping inside its kernel (huggingface/accelerate#4242). One host
        read per step under fp16, where the unfused path reads the overflow flag anyway."""
        scaler = self.accelerator.scaler
        if scaler is None or not scaler.is_enabled():
            return self._step()
        before = scaler._scale.clone() if scaler._scale is not None else None  # set at the first scale()
        self._step()
        self.skipped = before is not None and bool(scaler._scale < before)

    @property
    def step_was_skipped(self) -> bool:
        """fp16's loss scaler skipped the last step (an overflow): its scale backed off."""
        return self.skipped


class StepRunner:
    """Runs the optimizer steps of ``fit()``: see the module docstring. ``lr`` is the last step's (the scheduler
    has moved on since), ``grad_norm`` the gradients' norm before clipping at a step that logs."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: Any,
        scheduler: Any,
        loss_fn: Any,
        parallel: Parallelism,
        window: LogWindow,
        config: TrainConfig,
        optimization: Optimization,
        stream_group: Any = None,
    ):
        self.model, self.optimizer, self.scheduler, self.parallel, self.window = (
            model,
            optimizer,
            scheduler,
            parallel,
            window,
        )
        # What each loss counts for (and, under fp16, what the loss scaler may multiply).
        self.weighing = Weighing(parallel.dp, parallel.unwrap(model), loss_fn, parallel.accelerator)
        self.nonfinite = NonFiniteGuard(parallel.accelerator, config.nan_policy)
        self.accumulation, self.max_grad_norm = config.gradient_accumulation_steps, config.max_grad_norm
        self.schedule_moves = optimization.schedule_moves
        # A stream on several processes: they agree on each window's micro-batches (streams may end apart).
        self.agree = StreamAgreement(stream_group, parallel.dp.size) if stream_group is not None else None
        self.stepper = Stepper(parallel.accelerator, optimizer, spread=parallel.sharded is not None)
        self.autocast = parallel.autocast(model)  # forward and loss run under it
        self.phases = Phases(_NoReporter(), window)
        if parallel.sharded is not None:  # the stall report counts the sharded blocks each rank has entered
            from torch.distributed.fsdp import FSDPModule

            for module in model.modules():
                if isinstance(module, FSDPModule):
                    module.register_forward_pre_hook(lambda *_: self.phases.reporter.entered(), prepend=True)
        self.lr: Any = None
        self.grad_norm: Optional[torch.Tensor] = None
        self.average: Any = None  # an EMA of the weights (trainer.ema), updated after each step taken
        self.split: Any = None  # auto_microbatch: how the micro-batches are cut (trainer.microbatch)
        self.unasked = loss_fn is model_loss  # a packed batch's model is asked once (trainer.packing)

    def begin(self) -> None:
        """Before ``fit()``'s first step: the model in training mode, its buffers kept (nan_policy skip)."""
        self.model.train()
        self.nonfinite.keep_buffers(self.model)  # a skipped step puts them back

    def windows(self, loader: Iterable) -> Iterator[StepBatches]:
        """The accumulation windows of an epoch, the waits for data timed, the token counts summed a window ahead."""
        timed = self.window.timed(loader)
        return self.weighing.windows(accumulation_windows(timed, self.accumulation, self.agree))

    def run(self, window: StepBatches, step: int, measure_norm: bool) -> None:
        """Optimizer step ``step`` over ``window``; ``measure_norm``: it logs, so its gradient norm is measured."""
        phases = self.phases
        if self.unasked:
            self._ask_about_packing(window.micro_batches[0])
        if self.split is None:
            self._run_whole(window, step)
        else:  # auto_microbatch
            self._run_in_pieces(window, step)
        if not self.nonfinite.skip_this_step():
            with phases(step, "optimizer"):
                self.weighing.finish(window, self.model.parameters())
                self.grad_norm = self.stepper.clip(self.model.parameters(), self.max_grad_norm, measure=measure_norm)
                self.stepper.step()
                lr = self.optimizer.param_groups[0]["lr"]  # before the scheduler moves it on: a tensor lr (fused or
                self.lr = lr.clone() if torch.is_tensor(lr) else lr  # capturable optimizers) it moves in place
                if self.schedule_moves and not self.stepper.step_was_skipped:
                    self.scheduler.step()  # fp16 overflow skips the step, so the schedule waits too
                if self.average is not None and not self.stepper.step_was_skipped:
                    self.average.update(step)
        self.stepper.zero_grad()
        self.window.steps += 1
        phases(step, "data")

    def _run_whole(self, window: StepBatches, step: int) -> None:
        """The window's forwards and backwards, the gradients reduced across processes in the last backward."""
        last = len(window.micro_batches) - 1
        for index, batch in enumerate(window.micro_batches):
            with self.parallel.gradient_sync(self.model, sync=index == last):
                with self.phases(step, "forward"):
                    objective, loss, weight = self._loss(window, batch)
                with self.phases(step, "backward"):
                    self.stepper.backward(objective)
            self.window.add(self.nonfinite.observe(loss), step, batch, examples_in(batch), weight)

    def _run_in_pieces(self, window: StepBatches, step: int) -> None:
        """The window's forwards and backwards with each micro-batch cut in ``split.pieces``, no gradient all-reduce
        until every rank got through them all; run again, in twice the pieces, after an out-of-memory on any rank
        (``trainer.loop.microbatch``)."""
        first_try = self.split.random_state()
        while (done := self._pieces_once(window, step)) is None:
            self.split.reset()
            self.stepper.zero_grad()
            window.summed.clear()
            self.split.rerun(first_try)
        for loss, piece, weight in done:
            self.window.add(self.nonfinite.observe(loss), step, piece, examples_in(piece), weight)
        self.split.reduce_gradients(self.model.parameters())

    def _pieces_once(self, window: StepBatches, step: int) -> Optional[list]:
        """One try of the window: each piece's (loss, piece, weight), or None when some rank ran out of memory."""
        done, sharded = [], self.split.sharded is not None  # sharded: each piece reduce-scatters its gradients
        for batch in window.micro_batches:
            for piece, share in cut(batch, self.split.pieces):
                where = "forward"
                try:
                    self.split.armed = True  # FSDP2's collectives ask first (trainer.microbatch)
                    with self.parallel.gradient_sync(self.model, sync=sharded):
                        with self.phases(step, "forward"):
                            objective, loss, weight = self._loss(window, piece, share)
                        where = "backward"
                        with self.phases(step, "backward"):
                            self.stepper.backward(objective)
                    where = ""
                except torch.OutOfMemoryError:
                    pass  # (leaving the handler frees the failed try's tensors)
                except RanOutElsewhere:
                    where = ""
                finally:
                    self.split.armed = False
                objective = None
                if self.split.ran_out(where, step, batch, self.model):  # every rank, after every piece
                    return None
                done.append((loss, piece, weight))
        return done

    def _ask_about_packing(self, batch: Any) -> None:
        """At the first step, under the default loss: a packed batch's model must keep its documents apart."""
        self.unasked = False
        if looks_packed(batch):
            model = self.parallel.unwrap(self.model)
            extra = {"use_cache": False} if keeps_a_cache(model) else None
            refuse_attention_across_documents(model, batch, self.autocast, extra)

    def _loss(self, window: StepBatches, batch: Any, share: Optional[float] = None) -> tuple[torch.Tensor, ...]:
        try:
            with self.autocast():
                return self.weighing.loss(window, self.model, batch, share)
        except RuntimeError as err:  # free when nothing is raised
            refusal = unused_parameters(err)
            if refusal is None:
                raise
            raise refusal from err

    @property
    def current_lr(self) -> float:
        """The lr the last step used (before any step: the optimizer's)."""
        return self.lr if self.lr is not None else self.optimizer.param_groups[0]["lr"]

    def take_grad_norm(self) -> Optional[torch.Tensor]:
        norm, self.grad_norm = self.grad_norm, None
        return norm


class _NoReporter:
    def at(self, step: int, phase: str) -> None:
        pass

    def entered(self) -> None:
        pass
