"""Packed batches (``DataCollatorWithFlattening``): before the first packed step under the default loss the model
is asked once whether its attention stops at each document, and refused by name where it does not
(docs/internals.md#packed-batches, docs/recipes.md).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable, ContextManager, Optional

import torch

from trainer.errors import ConfigError
from trainer.parallel.gradients import whole

# Tokens in each probe document.
DOCUMENT = 4


def looks_packed(batch: Any) -> bool:
    """A batch as ``DataCollatorWithFlattening`` makes it: ``input_ids`` and ``position_ids``, no ``attention_mask``.
    Decided by the batch's keys, which the collate function sets alike on every rank."""
    return (
        isinstance(batch, Mapping)
        and "position_ids" in batch
        and "input_ids" in batch
        and "attention_mask" not in batch
    )


def refuse_attention_across_documents(
    model: torch.nn.Module, batch: Mapping, autocast: Callable[[], ContextManager], *, extra: Optional[dict] = None
) -> None:
    """Raise a ConfigError naming the model when its attention crosses the document boundaries of a packed row;
    ``model``: the module called under the default loss (unwrapped of DDP and torch.compile), ``extra``: keyword
    arguments the default loss adds (``use_cache=False``). Models without a vocabulary of at least 12 tokens or
    without logits are not asked."""
    vocabulary = _vocabulary(model)
    if vocabulary is None or vocabulary < 3 * DOCUMENT:
        return
    device = batch["input_ids"].device
    document = torch.arange(DOCUMENT, device=device)
    positions = torch.cat([document, document])[None]
    after = []
    # Each module's, as the user left them.
    modes = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.no_grad(), autocast():
            # Two different documents before the same one.
            for first in (DOCUMENT, 2 * DOCUMENT):
                ids = torch.cat([document + first, document])[None]
                logits = _logits(model(input_ids=ids, position_ids=positions, **(extra or {})))
                if logits is None:
                    return
                after.append(logits[0, DOCUMENT:])
    finally:
        for module, training in modes:
            module.training = training
    if not torch.equal(after[0], after[1]):
        name = type(model).__name__
        raise ConfigError(
            f"the batches are packed (position_ids restart inside a row and there is no attention_mask, "
            f"as DataCollatorWithFlattening makes them) but {name}'s attention crosses those restarts: a "
            f"document's logits changed with the document before it, so it would train on its "
            f"neighbours. Pad the documents instead (a collate_fn with an attention_mask), or use a "
            f"model whose attention reads packed position_ids (transformers' Llama, Mistral, GPT-2, "
            f"GPT-NeoX and most decoders)"
        )


def _vocabulary(model: torch.nn.Module) -> Optional[int]:
    embeddings = getattr(model, "get_input_embeddings", None)
    table = embeddings() if callable(embeddings) else None
    if isinstance(table, torch.nn.Embedding):
        return table.num_embeddings
    size = getattr(getattr(model, "config", None), "vocab_size", None)
    return size if isinstance(size, int) else None


def _logits(output: Any) -> Optional[torch.Tensor]:
    """The output's logits, ``(1, tokens, ...)``; a tensor-parallel model's whole."""
    logits = output.get("logits") if isinstance(output, Mapping) else getattr(output, "logits", output)
    if not isinstance(logits, torch.Tensor) or logits.ndim < 2:
        return None
    return whole(logits)
