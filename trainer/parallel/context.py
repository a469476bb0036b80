"""Context parallelism (``cp_size`` in an FSDP config's ``parallelism_config``): the processes of a context-parallel
group read the same batch, and each computes one slice of every row's sequence. Attention is exchanged all-to-all over
heads (Ulysses, https://arxiv.org/abs/2309.14509): before it each process gives up the other slices' heads for its
own heads over the whole sequence, after it the reverse. Exact, and any attention kernel computes the middle
(docs/parallelism.md#context-parallelism).

Around the model's forward (hooks on it), each process takes its slice of ``input_ids``, the positions (so that a
slice's rotary or learned positions are the row's), and the labels shifted first (``shift_labels``: a slice's last
token predicts the next slice's first); the mask attention needs is built for the whole row (causal, each packed
document to itself, padding left out). Its loss, summed over the group (``num_items_in_batch``: each slice's sum over
the row's count), is the whole row's on every process, which is what the loop weighs and logs, and its gradient
reaches each slice once from every process. Without gradients (evaluation, ``predict()``) the logits are gathered whole.
"""

from __future__ import annotations

import inspect
import sys
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from trainer.console import say
from trainer.errors import ShardingError
from trainer.hf import loss_owner

# The names registered with transformers' attention and mask interfaces: the inner kernel's name after this prefix.
PREFIX = "trainer_cp_"
# Where a model keeps the ContextParallel that split it.
APPLIED = "_trainer_context_parallel"
IGNORE_INDEX = -100


class ContextParallel:
    """Context parallelism over ``group`` (``size`` processes, this one ``rank``) for one transformers model."""

    def __init__(self, group: Any, size: int, rank: int):
        self.group, self.size, self.rank = group, size, rank
        # The whole rows of the forward under way: (positions or None, key padding or None, built masks by dtype),
        # their length (padded) and the padding added.
        self.rows: tuple[Optional[torch.Tensor], Optional[torch.Tensor], dict] = (None, None, {})
        self.length, self.pad, self.device = 0, 0, torch.device("cpu")
        self.inner: Callable = None

    def apply(self, model: torch.nn.Module) -> None:
        """Refuse what cannot be split by name, then wrap ``model``'s attention and hook its forward."""
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface

        config = getattr(model, "config", None)
        kind = getattr(config, "_attn_implementation", None)
        # A model a Trainer split before (another Trainer in the same process): its hooks replaced, its kernel kept.
        before = model.__dict__.get(APPLIED)
        if before is not None:
            kind = before.kind
            for handle in before.handles:
                handle.remove()
        if config is None or kind not in ("sdpa", "eager"):
            what = f"attention implementation {kind!r}" if config is not None else "no transformers config"
            raise ShardingError(
                f"cp_size {self.size}: {type(model).__name__} has {what}; context parallelism wraps a transformers "
                "model's sdpa or eager attention (attn_implementation='sdpa')"
            )
        for name in ("num_attention_heads", "num_key_value_heads"):
            heads = getattr(config, name, None) or getattr(config, "num_attention_heads", 0)
            if heads % self.size:
                raise ShardingError(
                    f"cp_size {self.size}: {type(model).__name__} has {name} {heads}, not divisible by {self.size}: "
                    "each process of a context-parallel group takes an equal share of the heads"
                )
        owner = loss_owner(model)
        if owner is None or "self.loss_function(" not in _source(type(owner).forward):
            raise ShardingError(
                f"cp_size {self.size}: {type(model).__name__} does not compute its loss through transformers' "
                "loss_function, which sums each slice over the row's token count: the slices' losses would not add "
                "up to the row's; launch without cp_size"
            )
        if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
            raise ShardingError(
                f"cp_size {self.size}: {type(model).__name__} has a sliding window ({config.sliding_window}), "
                "which context parallelism does not mask yet: launch without cp_size"
            )
        self.kind, self.inner, self.additive = kind, _kernel(model, kind), kind == "eager"
        # A name of this model's own: another model split in the same process keeps its state.
        name = f"{PREFIX}{kind}_{id(self)}"
        AttentionInterface.register(name, self.attention)
        # transformers' own mask is of the slice: never built (the whole row's is, here).
        AttentionMaskInterface.register(name, lambda *args, **kwargs: None)
        config._attn_implementation = name
        self.handles = [
            model.register_forward_pre_hook(self.split, with_kwargs=True),
            model.register_forward_hook(self.join),
        ]
        model.__dict__[APPLIED] = self

    def split(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """The forward's inputs made this process's slice of every row (padded to a multiple of the group)."""
        ids = kwargs.get("input_ids")
        if args or ids is None:
            raise ShardingError(
                f"cp_size {self.size}: the model is called without input_ids by name; call it as model(**batch)"
            )
        rows, length = ids.shape
        pad = -length % self.size
        positions, keys = kwargs.get("position_ids"), kwargs.get("attention_mask")
        labels, shifted = kwargs.get("labels"), kwargs.get("shift_labels")
        if shifted is None and labels is not None:
            shifted = F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]
        if kwargs.get("num_items_in_batch") is None and shifted is not None:
            # Each slice's sum over the row's count: the group's sum is the model's mean.
            kwargs["num_items_in_batch"] = shifted.ne(IGNORE_INDEX).sum()
        if pad:
            say(f"cp_size {self.size}: rows of {length} tokens padded to {length + pad} (masked, no label)", once=True)
            keys = F.pad(keys if keys is not None else torch.ones_like(ids), (0, pad))
            if positions is not None:
                positions = torch.cat([positions, positions[:, -1:] + torch.arange(1, pad + 1, device=ids.device)], 1)
            ids = F.pad(ids, (0, pad))
            shifted = F.pad(shifted, (0, pad), value=IGNORE_INDEX) if shifted is not None else None
        whole = torch.arange(length + pad, device=ids.device).expand(rows, -1)
        self.rows, self.length, self.pad, self.device = (positions, keys, {}), length + pad, pad, ids.device
        kwargs.update(
            input_ids=self._slice(ids),
            position_ids=self._slice(positions if positions is not None else whole),
            attention_mask=None,
        )
        if shifted is not None:
            kwargs.update(shift_labels=self._slice(shifted), labels=self._slice(shifted))
        return args, kwargs

    def join(self, module: torch.nn.Module, args: tuple, output: Any) -> Any:
        """The loss summed over the group (the whole rows'), and without gradients the logits gathered whole."""
        if not hasattr(output, "get"):
            raise ShardingError(
                f"cp_size {self.size}: the model returned a {type(output).__name__}, not a ModelOutput "
                "(return_dict=False?): its loss cannot be summed over the context-parallel group"
            )
        loss = output.get("loss")
        if loss is not None:
            output["loss"] = _Summed.apply(loss, self.group)
        logits = output.get("logits")
        if logits is not None and not torch.is_grad_enabled():
            pieces = [torch.empty_like(logits) for _ in range(self.size)]
            dist.all_gather(pieces, logits.contiguous(), group=self.group)
            output["logits"] = torch.cat(pieces, 1)[:, : self.length - self.pad]
        return output

    def _slice(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.chunk(self.size, dim=1)[self.rank].contiguous()

    def attention(self, module: torch.nn.Module, *tensors: Any, **kw: Any) -> tuple[torch.Tensor, None]:
        """transformers' attention interface, called with (query, key, value, the slice's mask): q, k, v of this slice
        ([batch, heads, slice, dim]) -> the output of this slice ([batch, slice, heads, dim]), each process attending
        with its heads over the whole rows (the mask: the rows', not the slice's)."""
        query, key, value = (self._heads(t) for t in tensors[:3])
        output, _ = self.inner(module, query, key, value, self._mask(query.dtype), **kw)
        return self._sequence(output), None

    def _heads(self, tensor: torch.Tensor) -> torch.Tensor:
        rows, heads, length, dim = tensor.shape
        send = tensor.reshape(rows, self.size, heads // self.size, length, dim).transpose(0, 1).contiguous()
        got = _exchange(send, self.group)
        # [slice, rows, heads / cp, length, dim] -> [rows, heads / cp, slices x length, dim]
        return got.permute(1, 2, 0, 3, 4).reshape(rows, heads // self.size, self.size * length, dim)

    def _sequence(self, tensor: torch.Tensor) -> torch.Tensor:
        rows, length, heads, dim = tensor.shape
        send = tensor.reshape(rows, self.size, length // self.size, heads, dim).transpose(0, 1).contiguous()
        got = _exchange(send, self.group)
        # [head group, rows, slice, heads / cp, dim] -> [rows, slice, heads, dim]
        return got.permute(1, 2, 0, 3, 4).reshape(rows, length // self.size, self.size * heads, dim)

    def _mask(self, dtype: torch.dtype) -> Optional[torch.Tensor]:
        """The whole rows' mask ([rows, 1, length, length], True or 0 where a query may look): causal, each packed
        document to itself (positions restart at 0), padding left out; None where causal alone says it (sdpa)."""
        positions, keys, built = self.rows
        additive = self.additive
        if positions is None and keys is None and not additive:
            return None
        if dtype in built:
            return built[dtype]
        index = torch.arange(self.length, device=self.device)
        allowed = (index[:, None] >= index[None, :])[None]
        if positions is not None:
            document = (positions == 0).cumsum(-1)
            allowed = allowed & (document[:, :, None] == document[:, None, :])
        if keys is not None:
            allowed = allowed & keys.bool()[:, None, :]
        # A query with nothing to attend to (a row's leading padding) attends to itself: no row wholly masked (its
        # softmax would be NaN, and its gradient).
        alone = torch.eye(self.length, dtype=torch.bool, device=index.device) & ~allowed.any(-1, keepdim=True)
        allowed = (allowed | alone)[:, None]
        if additive:
            allowed = torch.zeros(allowed.shape, dtype=dtype, device=index.device).masked_fill(
                ~allowed, torch.finfo(dtype).min
            )
        built[dtype] = allowed
        return allowed


def _source(function: Callable) -> str:
    try:
        return inspect.getsource(function)
    except (OSError, TypeError):
        return ""


def _kernel(model: torch.nn.Module, kind: str) -> Callable:
    """transformers' attention function of ``kind`` for ``model``: sdpa's is shared, eager's is each model's own."""
    from transformers import AttentionInterface

    if kind == "sdpa":
        return AttentionInterface._global_mapping["sdpa"]
    source = next(c for c in type(model).__mro__ if c.__module__.startswith("transformers.models."))
    return sys.modules[source.__module__].eager_attention_forward


def _exchange(send: torch.Tensor, group: Any) -> torch.Tensor:
    """All-to-all of ``send``'s first dimension (one piece per process), with its gradient exchanged back."""
    from torch.distributed._functional_collectives import all_to_all_single_autograd

    return all_to_all_single_autograd(send, None, None, group)


class _Summed(torch.autograd.Function):
    """A tensor summed over ``group``; its gradient summed likewise (each process's copy feeds every process's part)."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        summed = tensor.clone()
        dist.all_reduce(summed, group=group)
        return summed

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None
