"""A weight tied between the input embeddings and the output head (GPT-2's, Llama 3.2's) gets two gradients in every
backward, each as large as the vocabulary; torch's own path holds three such matrices at its end. Taken in place here,
the same sums bit for bit (a backward of several forwards' losses at once: the same sums in another order), so that
only the head's gradient is ever whole (docs/performance.md, "Sharded memory").

- The head: ``linear`` hands its weight's gradient on as a view, and autograd adds into a view out of place. An
  identity hands it on as a tensor of its own: the embeddings' gradient is then added to it in place.
- The embeddings: ``embedding``'s gradient is a zero-filled vocabulary-sized matrix with the batch's rows added into
  it. Here the rows are summed alone (the same kernel, over the batch's distinct tokens), the gradient handed on is an
  expanded zero (no memory), and a hook on the weight adds the sums into the whole gradient before it is accumulated.
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import torch
import torch.nn.functional as F


def tied_gradient_in_place(model: torch.nn.Module) -> bool:
    """Installs both forwards on a model whose output head is an ``nn.Linear`` sharing the input embeddings' weight;
    whether it did so now (a head whose forward was already replaced, by an earlier Trainer of the model or by
    chunked_loss, is left as it is). The embeddings' part needs torch's plain ``nn.Embedding`` (no ``max_norm``,
    ``scale_grad_by_freq`` or ``sparse``)."""
    try:
        # transformers' base class raises for a model that has no embeddings.
        head, embeddings = model.get_output_embeddings(), model.get_input_embeddings()
    except (AttributeError, NotImplementedError):
        return False
    if type(head) is not torch.nn.Linear or getattr(embeddings, "weight", None) is not head.weight:
        return False
    if "forward" in vars(head):
        return False
    # Instance attributes: the classes' forwards stay torch's for every other Linear and Embedding.
    head.forward = functools.partial(_linear_of_own_gradient, head)
    if type(embeddings) is torch.nn.Embedding and "forward" not in vars(embeddings):
        embeddings.forward = functools.partial(_embedding_summed_into_the_head, embeddings, _Sums())
    return True


def _linear_of_own_gradient(self: torch.nn.Linear, hidden: torch.Tensor) -> torch.Tensor:
    return F.linear(hidden, _OwnGradient.apply(self.weight), self.bias)


class _OwnGradient(torch.autograd.Function):
    """The identity; its gradient handed on as a tensor of its own (``detach``: no longer a view of another)."""

    @staticmethod
    def forward(ctx: Any, weight: torch.Tensor) -> torch.Tensor:
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad.detach()


def _embedding_summed_into_the_head(self: torch.nn.Embedding, sums: _Sums, ids: torch.Tensor) -> torch.Tensor:
    weight = self.weight
    plain = self.max_norm is None and not self.scale_grad_by_freq and not self.sparse
    # A batch of at least as many tokens as the vocabulary: its sums would be no smaller than the gradient. A
    # DTensor weight (tensor parallelism) and a compiled graph keep torch's own.
    ours = plain and torch.is_grad_enabled() and weight.requires_grad and weight.is_leaf
    ours = ours and type(weight) in (torch.Tensor, torch.nn.Parameter) and not torch.compiler.is_compiling()
    if not ours or ids.numel() >= weight.shape[0]:
        return torch.nn.Embedding.forward(self, ids)
    forward = _Forward(sums, ids, self.padding_idx)
    forward.hook = weight.register_hook(functools.partial(_add_rows, forward))
    return _RowsApart.apply(weight, forward)


class _Sums:
    """The embeddings' rows and sums, each with its backward's graph task, in the order their backwards ran, until
    the weight's hook."""

    def __init__(self) -> None:
        self.pending: list[tuple[int, torch.Tensor, torch.Tensor]] = []


class _Forward:
    """One forward's tokens, its padding token, and its hook on the weight until the hook has run."""

    def __init__(self, sums: _Sums, ids: torch.Tensor, padding_idx: Optional[int]) -> None:
        self.sums, self.ids, self.padding_idx = sums, ids, padding_idx
        self.hook: Optional[torch.utils.hooks.RemovableHandle] = None


class _RowsApart(torch.autograd.Function):
    """``embedding``, whose backward sums the rows apart and hands on an expanded zero of the weight's shape."""

    @staticmethod
    def forward(ctx: Any, weight: torch.Tensor, forward: _Forward) -> torch.Tensor:
        ctx.forward, ctx.rows = forward, weight.shape[0]
        return F.embedding(forward.ids, weight, forward.padding_idx)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Optional[torch.Tensor], ...]:
        ids = ctx.forward.ids
        padding = -1 if ctx.forward.padding_idx is None else ctx.forward.padding_idx
        if ctx.forward.hook is None or torch.is_grad_enabled():
            # A second backward through this graph (the hook has run), or one that builds a graph: torch's own.
            dense = torch.ops.aten.embedding_backward(grad, ids, ctx.rows, padding, False, False)
            return dense, None
        task = torch._C._current_graph_task_id()
        ctx.forward.sums.pending.append((task, *_summed_rows(ids, grad, padding)))
        return grad.new_zeros(()).expand(ctx.rows, grad.shape[-1]), None


def _summed_rows(ids: torch.Tensor, grad: torch.Tensor, padding: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, sums): each distinct token's row with the sum of its gradients, in the order and by the kernel torch's
    own backward takes, so the same floats. Of the batch's size, not the distinct count, so that the host never
    waits on the device for it: the rows past the distinct ones repeat the last with a sum of zero."""
    ids = ids.reshape(-1)
    count = ids.numel()
    ordered, order = torch.sort(ids, stable=True)
    first = torch.ones_like(ordered, dtype=torch.bool)
    first[1:] = ordered[1:] != ordered[:-1]
    distinct = first.cumsum(0) - 1
    inverse = torch.empty_like(distinct)
    inverse[order] = distinct
    sums = torch.ops.aten.embedding_dense_backward(grad.reshape(count, -1), inverse, count, -1, False)
    starts = torch.searchsorted(distinct, torch.arange(count, device=ids.device)).clamp_(max=count - 1)
    rows = ordered[starts]
    # As torch's backward: the padding token's row gets no gradient.
    sums.masked_fill_((rows == padding).unsqueeze(1), 0)
    return rows, sums


def _add_rows(forward: _Forward, grad: torch.Tensor) -> Optional[torch.Tensor]:
    """The weight's hook: adds the backward's sums into its whole gradient, in place, in the order they came. Every
    forward's hook removes itself when it runs, the first takes the sums: a forward whose hook ran before its backward
    (one forward, another, the second's backward) then takes torch's own path."""
    assert forward.hook is not None
    forward.hook.remove()
    forward.hook = None
    # Sums of another backward are of one that failed before its end (out of memory, say): never added.
    task = torch._C._current_graph_task_id()
    sums = [(rows, summed) for of, rows, summed in forward.sums.pending if of == task]
    forward.sums.pending = []
    if not sums:
        return None
    # The expanded zero alone (no head in this backward): a tensor of our own. (A backward that builds a graph has
    # no sums here: its embeddings took torch's own path.)
    fresh = not grad.is_contiguous()
    whole = grad.clone(memory_format=torch.contiguous_format) if fresh else grad
    for rows, summed in sums:
        whole.index_add_(0, rows, summed)
    return whole if fresh else None
