"""``chunked_loss: true``: a causal language model's loss computed from its last hidden states through its output head a
chunk of tokens at a time, each chunk's logits recomputed in backward, so that no step holds the logits of the whole
batch (batch x sequence x vocabulary, in fp32, then their log-softmax and gradient: the largest tensors of a
language model's step). The same loss as the model's own: its labels shifted (or ``shift_labels``), ``ignore_index``
left out, a sum over ``num_items_in_batch`` or a mean (docs/performance.md#chunked-loss).

The model's forward is left as it is: while the default loss asks for a loss (``deferring``), the output head hands its
input on unchanged and the model's ``loss_function`` gets the hidden states where it got logits. A model whose forward
changes the logits between the two (Gemma 2's soft-capping, Cohere's scale) is refused by name.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import TYPE_CHECKING, Any, Iterator, Optional

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from trainer.errors import ConfigError
from trainer.hf import causal_lm, loss_owner

if TYPE_CHECKING:
    from trainer.launch.run import Run

# Where the installed ChunkedLoss is kept on the transformers model (for ``of``).
ATTRIBUTE = "_trainer_chunked_loss"


class ChunkedLoss:
    """Stands in for the model's ``loss_function`` (called as transformers calls it) and its head's ``forward``."""

    def __init__(self, head: torch.nn.Module, loss_function: Any, tokens: int):
        self.tokens = tokens
        # The model's own, for a forward the default loss did not ask for (predict() with labels, a user's call).
        self.head_forward, self.loss_function = head.forward, loss_function
        # True while the default loss runs the forward: the head hands its input on. on: the latest Trainer of this
        # model asked for it (one without chunked_loss turns it off).
        self.active, self.on = False, True

    def forward_head(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden if self.active else self.head_forward(hidden)

    @contextlib.contextmanager
    def deferring(self) -> Iterator[None]:
        self.active = True
        try:
            yield
        finally:
            self.active = False

    def __call__(
        self,
        logits: torch.Tensor,
        labels: Optional[torch.Tensor],
        vocab_size: Optional[int] = None,
        num_items_in_batch: Any = None,
        ignore_index: int = -100,
        shift_labels: Optional[torch.Tensor] = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        if not self.active:
            return self.loss_function(
                logits, labels, vocab_size, num_items_in_batch, ignore_index, shift_labels=shift_labels, **kwargs
            )
        hidden = logits
        if shift_labels is None:
            # As transformers' ForCausalLMLoss: the last position predicts nothing.
            shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
        targets = shift_labels.reshape(-1).to(hidden.device)
        # split, not slicing: its backward joins the chunks' gradients once, where each slice's would be a
        # zero-filled gradient of the whole hidden states.
        pieces = zip(hidden.reshape(-1, hidden.shape[-1]).split(self.tokens), targets.split(self.tokens), strict=True)
        if torch.is_grad_enabled():
            total = sum(
                checkpoint(self._summed, piece, target, ignore_index, use_reentrant=False, preserve_rng_state=False)
                for piece, target in pieces
            )
        else:
            total = sum(self._summed(piece, target, ignore_index) for piece, target in pieces)
        if num_items_in_batch is not None:
            if torch.is_tensor(num_items_in_batch):
                num_items_in_batch = num_items_in_batch.to(total.device)
            return total / num_items_in_batch
        # cross_entropy's mean: over the counted targets (0 / 0 when none, as there).
        return total / targets.ne(ignore_index).sum()

    def _summed(self, hidden: torch.Tensor, targets: torch.Tensor, ignore_index: int) -> torch.Tensor:
        logits = self.head_forward(hidden).float()
        return F.cross_entropy(logits, targets, ignore_index=ignore_index, reduction="sum")


def install(run: Run, model: torch.nn.Module, *, default_loss: bool) -> Optional[ChunkedLoss]:
    """With ``chunked_loss``: ``model`` (the plain module) computes its loss in chunks when the default loss asks;
    refused by name where it cannot. None without it."""
    config = run.config
    if not config.chunked_loss:
        if (before := of(model)) is not None:
            before.on = False
        return None
    if not default_loss:
        raise ConfigError(
            "chunked_loss computes the model's own loss, but a loss_fn was given: drop chunked_loss, or compute "
            "your loss in chunks inside loss_fn"
        )
    if run.layout.tp > 1:
        raise ConfigError(
            "chunked_loss with tensor parallelism (tp_size > 1) is not supported: the output head is split over the "
            "tensor-parallel group; drop one of the two"
        )
    owner = loss_owner(model)
    head = owner.get_output_embeddings() if owner is not None and causal_lm(owner) else None
    if head is None:
        raise ConfigError(
            f"chunked_loss needs a transformers causal language model with an output head; {type(model).__name__} "
            "is not one (its loss: pass loss_fn, without chunked_loss)"
        )
    _refuse_logits_changed(owner, head)
    chunked = getattr(owner, ATTRIBUTE, None)
    if chunked is None:
        chunked = ChunkedLoss(head, owner.loss_function, config.loss_chunk_tokens)
        # Instance attributes: the class's forward and loss stay the model's for every other instance.
        head.forward = chunked.forward_head
        owner.loss_function = chunked
        owner.__dict__[ATTRIBUTE] = chunked
    chunked.tokens, chunked.on = config.loss_chunk_tokens, True
    return chunked


def of(model: torch.nn.Module) -> Optional[ChunkedLoss]:
    """The ChunkedLoss installed on ``model`` (under DDP's or torch.compile's wrapper, or PEFT's), or None."""
    inner = getattr(model, "module", model)
    inner = getattr(inner, "_orig_mod", inner)
    chunked = inner.__dict__.get(ATTRIBUTE)
    if chunked is None and hasattr(inner, "get_base_model"):
        chunked = getattr(loss_owner(inner), "__dict__", {}).get(ATTRIBUTE)
    return chunked


def _refuse_logits_changed(owner: torch.nn.Module, head: torch.nn.Module) -> None:
    """A forward that calls the head, then changes the logits before its loss_function sees them, refused: the
    chunks would skip the change."""
    name = next((n for n, child in owner.named_children() if child is head), None)
    try:
        lines = inspect.getsource(type(owner).forward).splitlines()
    except (OSError, TypeError):
        lines = []
    called = next((i for i, line in enumerate(lines) if f"self.{name}(" in line), None) if name else None
    loss = next((i for i, line in enumerate(lines) if "self.loss_function(" in line), None)
    if called is None or loss is None or loss < called:
        raise ConfigError(
            f"chunked_loss: {type(owner).__name__}.forward does not call its output head and then self.loss_function, "
            "so its loss cannot be computed in chunks; drop chunked_loss"
        )
    changed = [
        line.strip() for line in lines[called + 1 : loss] if "logits" in line and not line.strip().startswith("#")
    ]
    if changed:
        raise ConfigError(
            f"chunked_loss: {type(owner).__name__} changes its logits between its output head and its loss "
            f"({changed[0]}), which a chunked loss would skip; drop chunked_loss"
        )
