"""What each micro-batch's loss weighs in its optimizer step, so that the step does not depend on how the
global batch was split into processes and accumulation micro-batches: every counted token alike for a
transformers model's own loss, a ``(loss_sum, count)`` loss by its count, any other loss as the window's mean
(docs/internals.md#weighing-the-loss, docs/same-updates.md).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Optional

import torch
import torch.distributed as dist

from trainer.hf import LossFunctionProbe, accepts_loss_kwargs, causal_lm, is_transformers_model
from trainer.loop import chunked
from trainer.loop.losses import LossFn, checked, model_loss
from trainer.loop.routing import RouterLoss
from trainer.parallel.gradients import scale_

if TYPE_CHECKING:
    from trainer.launch.run import Run

# The label of a token that is not counted (padding, a prompt), as in torch's cross-entropy.
IGNORE_INDEX = -100


def accumulation_windows(
    batches: Iterable,
    size: int,
    agree: Optional[Callable[[int], tuple[int, int]]] = None,
) -> Iterator[tuple[list, Optional[int]]]:
    """``(micro_batches, total)``: lists of up to ``size`` consecutive batches, one per optimizer step, and the number
    of micro-batches the window holds on all processes together. With ``agree`` (streams on several processes),
    ``agree(k)`` -> (fewest, total) over the processes; the windows end when any process has none left."""
    iterator = iter(batches)
    while True:
        window = []
        for batch in iterator:
            window.append(batch)
            if len(window) == size:
                break
        fewest, total = agree(len(window)) if agree is not None else (len(window), None)
        if fewest == 0:
            return
        yield window, total


class StepBatches:
    """One optimizer step's micro-batches (an accumulation window) and what their losses weigh."""

    def __init__(self, micro_batches: list, divisor: float):
        self.micro_batches = micro_batches
        # Plain losses: the window's micro-batches on all processes / K.
        self.divisor = divisor
        # Token-weighted: each micro-batch's own count, in order.
        self.counts: Iterator[torch.Tensor] = iter(())
        # Token-weighted: the window's count on all processes.
        self.tokens: Optional[torch.Tensor] = None
        # The all-reduce summing that count, until it is needed.
        self.pending: Optional[dist.Work] = None
        # (loss_sum, count) losses: the counts, for Weighing.finish()
        self.summed: list[Any] = []
        # fp16, (loss_sum, count): the first count, divided out before backward.
        self.prescale: Any = None

    def total_tokens(self) -> torch.Tensor:
        if self.pending is not None:
            # Issued a window ahead: done by now (on a GPU, the stream waits, not the host)
            self.pending.wait()
            self.pending = None
        return self.tokens


class Weighing:
    """What each micro-batch's loss counts for in its optimizer step (see the module docstring).

    ``windows`` readies each window; per micro-batch, ``loss`` -> (what to call backward on, the loss to log,
    its weight in the logged mean); after the window's last backward, ``finish`` (before clipping)."""

    def __init__(self, run: Run, model: torch.nn.Module, *, loss_fn: LossFn):
        # The data-parallel replicas, whose gradients are averaged.
        self.world, self.group = run.dp.size, run.dp.group
        self.loss_fn = loss_fn
        # fp16's loss scaler, if any.
        self.scaler = run.accelerator.scaler
        # Before the probe, which then wraps it.
        self.chunked = chunked.install(run, model, default_loss=loss_fn is model_loss)
        self.counts_tokens = loss_fn is model_loss and is_transformers_model(model)
        self.shifted = self.counts_tokens and causal_lm(model)
        self.passes_count = self.counts_tokens and accepts_loss_kwargs(model) and hasattr(model, "loss_function")
        self.probe = LossFunctionProbe.install(model) if self.passes_count else None
        # A mixture of experts' load-balancing loss, over the global batch (trainer.loop.routing).
        self.routing = RouterLoss.install(run, model) if self.counts_tokens else None

    def count(self, batch: Any) -> Optional[torch.Tensor]:
        """The tokens of ``batch`` the default loss averages over (a device tensor), or None when it does not
        weigh by tokens."""
        if not self.counts_tokens or not isinstance(batch, Mapping):
            return None
        # Already shifted by the collator (padding-free batches)
        labels = batch.get("shift_labels")
        if labels is None:
            labels = batch.get("labels")
            if not isinstance(labels, torch.Tensor):
                return None
            if self.shifted:
                labels = labels[..., 1:]
        return labels.ne(IGNORE_INDEX).sum()

    def windows(self, batches: Iterable[tuple[list, Optional[int]]]) -> Iterator[StepBatches]:
        """Each ``(micro_batches, total)`` of ``windows`` as ``StepBatches``. Token counts are summed over
        the processes by an all-reduce issued one window ahead, so that no step waits for it."""
        if self.world == 1 or not self.counts_tokens:
            yield from (self._ready(micro_batches, total) for micro_batches, total in batches)
            return
        ahead = None
        for micro_batches, total in batches:
            window = self._ready(micro_batches, total)
            if ahead is not None:
                yield ahead
            ahead = window
        if ahead is not None:
            yield ahead

    def _ready(self, micro_batches: list, total: Optional[int]) -> StepBatches:
        total = total if total is not None else len(micro_batches) * self.world
        window = StepBatches(micro_batches, total / self.world)
        counts = [self.count(batch) for batch in micro_batches]
        if counts and all(c is not None for c in counts):
            tokens = torch.stack(counts).sum() if len(counts) > 1 else counts[0]
            if self.world > 1:
                # Summed in place: each keeps its own count.
                tokens = tokens.clone() if len(counts) == 1 else tokens
                window.pending = dist.all_reduce(tokens, async_op=True, group=self.group)
            window.tokens, window.counts = tokens, iter(counts)
        return window

    def loss(
        self, window: StepBatches, model: torch.nn.Module, batch: Any, *, share: Optional[float] = None
    ) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """(objective to backward, loss to log, its weight) for one micro-batch of ``window``; or, with ``share``, for
        a piece of one holding that share of its examples (``auto_microbatch``)."""
        if window.tokens is not None:
            return self._token_loss(window, model, batch, piece=share is not None)
        loss, count = checked(self.loss_fn(model, batch), self.loss_fn)
        # (loss_sum, count): divided by the window's count in finish()
        if count is not None:
            window.summed.append(count)
            if self.scaler is None:
                return loss, loss.detach(), count
            # fp16: the loss scaler multiplies by 65536 before backward, where a sum's gradients (each term's at full
            # weight) overflow fp16's 65504: every step skipped until the scale is some count times smaller. Divided
            # by the window's first count here, multiplied back in finish(): a mean's magnitudes, the same step.
            if window.prescale is None:
                window.prescale = count.detach().clamp(min=1) if torch.is_tensor(count) else max(float(count), 1.0)
            return loss / window.prescale, loss.detach(), count
        # A piece of a micro-batch: its share of the micro-batch's mean.
        if share is not None and share != 1:
            return loss * share / window.divisor, loss.detach() * share, share
        objective = loss if window.divisor == 1 else loss / window.divisor
        return objective, loss.detach(), 1

    def _token_loss(
        self, window: StepBatches, model: torch.nn.Module, batch: Any, *, piece: bool = False
    ) -> tuple[torch.Tensor, ...]:
        tokens, here = window.total_tokens(), self.count(batch) if piece else next(window.counts)
        routed = self.routing.recording() if self.routing is not None else {}
        if self.passes_count:
            self.probe.passed = False
            loss = model_loss(model, batch, num_items_in_batch=tokens, **routed)
            honoured = self.probe.passed
        else:
            loss, honoured = model_loss(model, batch, **routed), False
        # Sum / tokens: this micro-batch's share of the window's mean already.
        if honoured:
            share, logged = loss, loss.detach() * tokens
        # A mean over its own tokens, weighed by its share of the window's.
        else:
            share, logged = loss * (here / tokens), loss.detach() * here
        if self.routing is not None:
            # Each micro-batch's load-balancing loss (of all processes' rows together) weighs 1 / micro-batches.
            balance = self.routing.loss(batch) / window.divisor
            share, logged = share + balance, logged + balance.detach() * tokens
        objective = share * self.world if self.world > 1 else share
        return objective, logged, here

    def finish(self, window: StepBatches, parameters: Iterable[torch.nn.Parameter]) -> None:
        """After the window's last backward: gradients of (loss_sum, count) losses divided by the window's count on
        all processes (times K: DDP averaged them)."""
        if not window.summed:
            return
        grads = [p.grad for p in parameters if p.grad is not None]
        device = grads[0].device
        # Counts given as numbers are summed here and added as a scalar: a number made a device tensor is a blocking
        # host-to-device copy each (a GPU waits for it); counts given as tensors stay where they are.
        tensors = [c.to(device=device, dtype=torch.float32) for c in window.summed if torch.is_tensor(c)]
        numbers = float(sum(c for c in window.summed if not torch.is_tensor(c)))
        if tensors:
            count = torch.stack(tensors).sum() + numbers if numbers else torch.stack(tensors).sum()
        else:
            count = torch.full((), numbers, dtype=torch.float32, device=device)
        if self.world > 1:
            dist.all_reduce(count, group=self.group)
        factor = self.world / count
        # fp16: what loss() divided out.
        if window.prescale is not None:
            prescale = window.prescale
            factor = factor * (prescale.to(device, torch.float32) if torch.is_tensor(prescale) else prescale)
        # Each process's pieces (a sharded tensor's per-parameter dispatch costs more).
        scale_(grads, factor)
