"""One optimizer step: forward and backward over each micro-batch of an accumulation window, then the update
(docs/same-updates.md).

Each micro-batch's loss is weighed as its share of the global batch's mean (``trainer.loop.weighing``), only the last
backward reduces the gradients across processes, and the window's gradients are clipped, stepped and zeroed, each
through the run's strategy (``trainer.parallel``). ``Phases`` note where each rank is (for the stall reporter) and
the forward pass's time (for the log window); ``nan_policy: skip`` decides whether the update is taken; with
``auto_microbatch`` the window runs again, cut finer, after an out-of-memory on any rank.
"""

from __future__ import annotations

import contextlib
import time
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Optional

import torch

from trainer.data.streams import StreamAgreement
from trainer.loop.losses import keeps_a_cache, model_loss
from trainer.loop.microbatch import MicroBatchSplit, RanOutElsewhere, cut
from trainer.loop.nonfinite import NonFiniteGuard
from trainer.loop.offload import OffloadActivations
from trainer.loop.packing import looks_packed, refuse_attention_across_documents
from trainer.loop.spikes import SpikeGuard
from trainer.loop.weighing import StepBatches, Weighing, accumulation_windows
from trainer.telemetry.stall import stall_reporter
from trainer.telemetry.window import LogWindow, examples_in

if TYPE_CHECKING:
    from trainer.checkpoint.manager import Checkpointer
    from trainer.launch.run import Run
    from trainer.loop.losses import LossFn
    from trainer.optim.build import Optimization
    from trainer.parallel.strategy import Strategy
    from trainer.state import TrainState


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
            self.window.forward_took(time.perf_counter() - self.started)


class StepRunner:
    """Runs the optimizer steps of ``fit()`` through ``strategy``. ``lr`` is the last step's (the scheduler has moved
    on since), ``grad_norm`` the gradients' norm before clipping at a step that logs.

    Args:
        run, strategy, model: the job, its strategy, and the model as it trains (prepared).
        optimization: the optimizer and schedule (``trainer.optim.build``); loss_fn: the loss.
        window: the log window each micro-batch is counted in; ``reporter`` (``trainer.telemetry.stall``) is told
            where this rank is. ema: the average of the weights, updated after each step taken, or None.
        stream: the training data is a stream (the processes agree on each window's micro-batches).
    """

    def __init__(
        self,
        run: Run,
        strategy: Strategy,
        model: torch.nn.Module,
        *,
        optimization: Optimization,
        loss_fn: LossFn,
        window: LogWindow,
        ema: Any = None,
        stream: bool = False,
    ):
        self.strategy, self.model, self.window, self.average = strategy, model, window, ema
        self.optimizer, self.scheduler = optimization.optimizer, optimization.scheduler
        config = run.config
        self.weighing = Weighing(run, strategy.unwrap(model), loss_fn=loss_fn)
        self.nonfinite = NonFiniteGuard(run, policy=config.nan_policy)
        # spike_policy: rollback; spiked: the last step's loss was a spike, and its update not taken.
        self.spikes = SpikeGuard.for_run(run, optimizer=self.optimizer, scheduler=self.scheduler)
        self.spiked = False
        self.accumulation, self.max_grad_norm = config.gradient_accumulation_steps, config.max_grad_norm
        self.schedule_moves = optimization.schedule_moves
        # A stream on several processes: they agree on each window's micro-batches (streams may end apart).
        self.agree = StreamAgreement(run.host, run.dp.size) if stream and run.host is not None else None
        self.autocast = strategy.autocast(model)
        # activation_offloading: what the forward saves waits in CPU memory (trainer.loop.offload).
        self.offload = OffloadActivations if config.activation_offloading else contextlib.nullcontext
        # Where this rank is, for the stall reporter (fit() watches while it runs).
        self.reporter = stall_reporter(run)
        self.phases = Phases(self.reporter, window)
        strategy.on_block_entered(model, self.reporter.entered)
        # auto_microbatch: how the micro-batches are cut.
        self.split = MicroBatchSplit(run, strategy, model) if config.auto_microbatch else None
        # A packed batch's model is asked once (trainer.loop.packing).
        self.unasked = loss_fn is model_loss
        self.lr: Any = None
        self.grad_norm: Optional[torch.Tensor] = None

    def begin(self) -> None:
        """Before ``fit()``'s first step: the model in training mode, its buffers kept (nan_policy skip)."""
        self.model.train()
        self.nonfinite.keep_buffers(self.model)

    def windows(self, loader: Iterable) -> Iterator[StepBatches]:
        """The accumulation windows of an epoch, the waits for data timed, the token counts summed a window ahead."""
        timed = self.window.timed(loader)
        return self.weighing.windows(accumulation_windows(timed, self.accumulation, self.agree))

    def run(self, window: StepBatches, step: int, *, measure_norm: bool) -> None:
        """Optimizer step ``step`` over ``window``; ``measure_norm``: it logs, so its gradient norm is measured."""
        phases, strategy = self.phases, self.strategy
        if self.unasked:
            self._ask_about_packing(window.micro_batches[0])
        if self.split is None:
            self._run_whole(window, step)
        else:
            self._run_in_pieces(window, step)
        skip = self.nonfinite.skip_this_step()
        # Asked every step (it sums each step afresh); a NaN is nan_policy's, never a spike.
        self.spiked = self.spikes is not None and self.spikes.spiked(step) and not skip
        if not (skip or self.spiked):
            with phases(step, "optimizer"):
                self.weighing.finish(window, self.model.parameters())
                self.grad_norm = strategy.clip(self.model.parameters(), self.max_grad_norm, measure=measure_norm)
                taken = strategy.step()
                # Before the scheduler moves it on: a tensor lr (fused or capturable optimizers) moves in place.
                lr = self.optimizer.param_groups[0]["lr"]
                self.lr = lr.clone() if torch.is_tensor(lr) else lr
                # fp16 overflow skips the step, so the schedule and the average wait too.
                if self.schedule_moves and taken:
                    self.scheduler.step()
                if self.average is not None and taken:
                    self.average.update(step)
        strategy.zero_grad()
        load = self.weighing.routing.imbalance() if self.weighing.routing is not None else None
        if load is not None and self.window.figures is not None:
            # The most tokens an expert got over the mean (1: balanced), every layer and process together.
            self.window.figures.add({"expert_load": load})
        self.window.stepped()
        phases(step, "data")

    def _run_whole(self, window: StepBatches, step: int) -> None:
        """The window's forwards and backwards, the gradients reduced across processes in the last backward."""
        last = len(window.micro_batches) - 1
        for index, batch in enumerate(window.micro_batches):
            with self.strategy.gradient_sync(self.model, sync=index == last):
                with self.phases(step, "forward"):
                    objective, loss, weight = self._loss(window, batch)
                with self.phases(step, "backward"):
                    self.strategy.backward(objective)
            self._count(loss, step, batch, weight=weight)

    def _run_in_pieces(self, window: StepBatches, step: int) -> None:
        """The window with each micro-batch cut in ``split.pieces``, run again in twice the pieces after an
        out-of-memory on any rank; the gradients reduced once every rank got through (``trainer.loop.microbatch``)."""
        first_try = self.split.random_state()
        while (done := self._pieces_once(window, step)) is None:
            self.strategy.forget_failed_try(self.model)
            self.strategy.zero_grad()
            window.summed.clear()
            self.split.rerun(first_try)
        for loss, piece, weight in done:
            self._count(loss, step, piece, weight=weight)
        self.strategy.reduce_pieces(self.model)

    def roll_back(self, checkpoints: Checkpointer, state: TrainState, **progress: Any) -> None:
        """After a step whose loss spiked (``spiked``): back to the last checkpoint (``SpikeGuard.roll_back``)."""
        self.spikes.roll_back(checkpoints, state, **progress)

    def _count(self, loss: torch.Tensor, step: int, batch: Any, *, weight: Any) -> None:
        """One micro-batch's loss into the log window, and into the spike guard's step."""
        self.window.add(self.nonfinite.observe(loss), step, batch, examples=examples_in(batch), weight=weight)
        if self.spikes is not None:
            self.spikes.observe(loss, weight)

    def _pieces_once(self, window: StepBatches, step: int) -> Optional[list]:
        """One try of the window: each piece's (loss, piece, weight), or None when some rank ran out of memory."""
        done, split, strategy = [], self.split, self.strategy
        for batch in window.micro_batches:
            for piece, share in cut(batch, split.pieces):
                where = "forward"
                try:
                    with split.inside_a_piece(), strategy.gradient_sync(self.model, sync=strategy.pieces_reduce):
                        with self.phases(step, "forward"):
                            objective, loss, weight = self._loss(window, piece, share)
                        where = "backward"
                        with self.phases(step, "backward"):
                            strategy.backward(objective)
                    where = ""
                except torch.OutOfMemoryError:
                    # Leaving the handler frees the failed try's tensors.
                    pass
                except RanOutElsewhere:
                    where = ""
                objective = None
                # Every rank, after every piece.
                if split.ran_out(where, step, batch):
                    return None
                done.append((loss, piece, weight))
        return done

    def _ask_about_packing(self, batch: Any) -> None:
        """At the first step, under the default loss: a packed batch's model must keep its documents apart."""
        self.unasked = False
        if looks_packed(batch):
            model = self.strategy.unwrap(self.model)
            extra = {"use_cache": False} if keeps_a_cache(model) else None
            refuse_attention_across_documents(model, batch, autocast=self.autocast, extra=extra)

    def _loss(self, window: StepBatches, batch: Any, share: Optional[float] = None) -> tuple[torch.Tensor, ...]:
        try:
            with self.autocast(), self.offload():
                return self.weighing.loss(window, self.model, batch, share=share)
        except RuntimeError as err:
            refusal = self.strategy.refusal_of(err)
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
