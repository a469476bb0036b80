"""What a loss is here: ``loss_fn(model, batch)`` returns one scalar tensor, a mean; or ``(loss_sum, count)``, a
sum and what it sums over (tokens, examples), to be weighed by that count across the global batch
(``trainer.loop.weighing``). The default asks the model for its loss.

A ``loss_fn`` that returns something else (a float, None, a per-example vector) fails far from it in torch
(``'float' object has no attribute 'backward'``, ``grad can be implicitly created only for scalar outputs``); it is
named here instead, at the first batch.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Mapping
from typing import Any, Callable

import torch

from trainer.errors import LossFnError
from trainer.loop import chunked as chunks
from trainer.parallel.compiling import LOSS_ONLY, answers_loss_only

# -> a scalar tensor, or (loss_sum, count)
LossFn = Callable[[torch.nn.Module, Any], Any]


def model_loss(model: torch.nn.Module, batch: Any, **loss_kwargs: Any) -> torch.Tensor:
    """The default loss: ``model(**batch).loss``, as transformers models compute it when given labels (a model
    returning a plain dict: its ``"loss"``). ``loss_kwargs`` (``num_items_in_batch``) go to forward with the batch."""
    # A dict, or transformers' BatchEncoding from its collators.
    if not isinstance(batch, Mapping):
        raise LossFnError(
            f"the default loss calls model(**batch).loss, but the batch is a {type(batch).__name__}; "
            "pass loss_fn=lambda model, batch: ... to the Trainer"
        )
    if keeps_a_cache(model):
        loss_kwargs = {"use_cache": False, **loss_kwargs}
    if answers_loss_only(model):
        # Compiled whole: no gradient of zeros for outputs the loss does not read (the logits).
        loss_kwargs = {LOSS_ONLY: True, **loss_kwargs}
    chunked = chunks.of(model)
    with chunked.deferring() if chunked is not None and chunked.on else contextlib.nullcontext():
        output = model(**batch, **loss_kwargs)
    loss = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
    if loss is None:
        raise LossFnError(
            "the default loss calls model(**batch).loss, but the model returned no loss (no labels in "
            "the batch?); pass loss_fn=lambda model, batch: ... to the Trainer"
        )
    return loss


def keeps_a_cache(model: torch.nn.Module) -> bool:
    """Whether ``model`` (under DDP's or torch.compile's wrapper) is a transformers model that builds a key-value
    cache unless told not to (``config.use_cache``). A loss never reads one, and while one is built transformers
    reads no document boundaries from ``position_ids``: a packed batch (``DataCollatorWithFlattening``) would attend
    across its documents."""
    inner = getattr(model, "module", model)
    inner = getattr(inner, "_orig_mod", inner)
    if not getattr(getattr(inner, "config", None), "use_cache", False):
        return False
    return "use_cache" in _forward_parameters(type(inner))


@functools.lru_cache(maxsize=None)
def _forward_parameters(model_class: type) -> frozenset[str]:
    return frozenset(inspect.signature(model_class.forward).parameters)


def checked(loss: Any, loss_fn: LossFn) -> tuple[torch.Tensor, Any]:
    """``(loss, None)`` for a scalar tensor, ``(loss_sum, count)`` for such a pair (count: an int or a scalar
    tensor); else a LossFnError naming ``loss_fn`` and what it returned."""
    if isinstance(loss, torch.Tensor) and loss.ndim == 0:
        return loss, None
    if isinstance(loss, tuple) and len(loss) == 2 and isinstance(loss[0], torch.Tensor) and loss[0].ndim == 0:
        count = loss[1]
        if isinstance(count, int) or (isinstance(count, torch.Tensor) and count.ndim == 0):
            return loss
        got = f"a tensor of shape {tuple(count.shape)}" if isinstance(count, torch.Tensor) else repr(count)[:80]
        raise LossFnError(
            f"{_describe(loss_fn)} returned (loss_sum, count) with count {got}: count must be an int "
            "or a scalar tensor (the number of items loss_sum adds up)"
        )
    name = _describe(loss_fn)
    got = f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else repr(loss)[:80]
    hint = " (reduce it: .mean())" if isinstance(loss, torch.Tensor) else " (a float has no gradient)"
    raise LossFnError(
        f"{name} must return a scalar tensor, got {got}{hint}; or a pair (loss_sum, count) to weigh by count"
    )


def _describe(loss_fn: LossFn) -> str:
    return "the default loss (model(**batch).loss)" if loss_fn is model_loss else f"loss_fn {_name(loss_fn)}"


def _name(fn: Callable) -> str:
    return getattr(fn, "__qualname__", type(fn).__name__)
