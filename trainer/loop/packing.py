"""Packed batches: documents laid end to end in one row, ``position_ids`` restarting at each, no padding and no
``attention_mask`` (transformers' ``DataCollatorWithFlattening``). They train as the same documents padded only where
the model's attention stops at each restart; transformers' Llama, Mistral, GPT-2, GPT-NeoX and most decoders build
that block-diagonal mask from ``position_ids``, while others (OPT, Bloom, BERT, a model of your own) attend across
documents without a word, and train on a different objective.

So, before the first step whose batch is packed and whose loss is the default one (``model(**batch).loss``: the
trainer knows how the model is called), the trainer asks the model once. The same document follows two different
documents in one packed row each; where the attention stops at the restart, the document's logits are bitwise
the same after both (the other document's keys weigh exactly zero), and where it does not they differ. Measured
on tiny transformers models: a difference of exactly 0 for GPT-2, Llama, Mistral, GPT-NeoX, GPT-J, Falcon and
Gemma 2 (eager and sdpa); 0.045 for OPT, 0.0017 for Bloom, 0.0025 for BERT. Two forwards of 8 tokens, in eval
mode with no gradients, the random state kept; every rank asks alike (a sharded model's forward gathers weights).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable, ContextManager, Optional

import torch

from trainer.errors import ConfigError
from trainer.parallel.gradients import whole

DOCUMENT = 4  # tokens in each probe document


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
    modes = [(module, module.training) for module in model.modules()]  # each module's, as the user left them
    model.eval()
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.no_grad(), autocast():
            for first in (DOCUMENT, 2 * DOCUMENT):  # two different documents before the same one
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
