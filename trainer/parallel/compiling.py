"""``torch.compile``, the same way under every strategy (docs/performance.md#compile), in place so that the model
keeps its module names (checkpoints and the export hold plain weights): either each transformer block's
``forward`` on its own (one graph per block type, compiled once and reused by every block; the hooks FSDP2 puts
on a block, its all-gather and reshard, run outside the graph, as in torchtitan, where a block is compiled before
``fully_shard``) and a transformers model's loss function, or the whole model (``Module.compile``; its ``forward``
alone when it is sharded), which the default loss then asks for the loss alone (``LossAlone``).

FSDP2, HSDP and TP x FSDP compile per block: compiled whole, a sharded model ran 2.4x slower than eager
(huggingface/accelerate#4022). DDP
compiles the whole model unless the accelerate config asks for regional compilation
(``dynamo_use_regional_compilation: true``): https://pytorch.org/tutorials/recipes/regional_compilation.html
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from trainer.hf import loss_owner
from trainer.parallel.blocks import largest_module_list, named_blocks

# What the default loss passes a model compiled whole (``LossAlone``): its forward returns the loss alone.
LOSS_ONLY = "_loss_only"


@dataclass(frozen=True)
class Compilation:
    """What ``torch.compile`` is called with, and whether the launch asked for it per block."""

    kwargs: dict
    per_block: bool

    @classmethod
    def of(cls, compile_: bool) -> Optional[Compilation]:
        """``compile: true`` (inductor), else the accelerate config's torch dynamo answer (``ACCELERATE_DYNAMO_*``:
        backend, mode, fullgraph, dynamic shapes if asked for, regional compilation) as accelerate reads it; None
        for neither."""
        from accelerate.utils import DynamoBackend, TorchDynamoPlugin

        plugin = TorchDynamoPlugin(backend="inductor") if compile_ else TorchDynamoPlugin()
        if plugin.backend == DynamoBackend.NO:
            return None
        kwargs = {"backend": "inductor", **plugin.to_kwargs()}
        if kwargs.get("dynamic") is False:
            # accelerate launch writes dynamic False whether or not it was asked for (its flag's default,
            # huggingface/accelerate#4254), which compiles a graph for every new sequence length until dynamo gives
            # up (8) and runs the rest eagerly. torch's default instead: a size that changes is made dynamic.
            del kwargs["dynamic"]
        return cls(kwargs=kwargs, per_block=plugin.use_regional_compilation)


def compile_in_place(
    model: torch.nn.Module, compilation: Compilation, *, per_block: bool, copy_views: bool = False, loss: bool = True
) -> str:
    """Compile ``model`` (lazily: the first forward traces it); the banner's words for what was compiled.
    ``per_block``: its blocks and loss (the rest runs eagerly), or the whole model where it has none. ``copy_views``:
    a block's inputs that are views copied first (``_own_inputs``: tensor parallelism). ``loss``: False leaves the
    loss eager (``chunked_loss`` replaces it)."""
    backend = compilation.kwargs["backend"]
    blocks = compiled_blocks(model) if per_block else []
    if not blocks:
        model.forward = LossAlone(model)
        if per_block:
            # No blocks to compile one by one: the model's forward, its hooks (a sharded root's all-gather) outside.
            model.forward = torch.compile(model.forward, **compilation.kwargs)
        else:
            model.compile(**compilation.kwargs)
        return f"compiled whole ({backend})"
    for block in blocks:
        # An attribute of the block, not of its class: the state dict and the hooks are the block's own.
        compiled = torch.compile(block.forward, **compilation.kwargs)
        block.forward = _own_inputs(compiled) if copy_views else compiled
    names = sorted({_block_name(block) for block in blocks})
    loss = " and the loss" if loss and _compile_the_loss(model, compilation) else ""
    return f"compiled per block: {len(blocks)} x {'/'.join(names)}{loss} ({backend})"


def _compile_the_loss(model: torch.nn.Module, compilation: Compilation) -> bool:
    """A transformers model's ``loss_function`` compiled on its own beside the blocks, as torchtitan compiles its
    loss: eager, a language model's cross-entropy writes its logits again in fp32, then their log-softmax (GPT-2 at
    16 x 1024 tokens: 3.3 GB each), and as much in backward; compiled, those passes are fused. Whether there was one."""
    owner = loss_owner(model)
    if owner is None:
        return False
    owner.loss_function = torch.compile(owner.loss_function, **compilation.kwargs)
    return True


class LossAlone:
    """A model's forward, which returns ``{"loss": loss}`` alone when called with ``_loss_only=True`` (the default
    loss does, ``answers_loss_only``). A compiled graph's outputs that the loss does not read still get a gradient:
    autograd fills the compiled function's with zeros before its backward. A GPT-2's logits (16 x 1024 x 50257 in
    bf16) got 1.5 GB of zeros and an add each step; left inside the graph, they get none (docs/performance.md#compile).
    An object rather than a closure: a copy of the model (``copy.deepcopy``, pickle) calls its own forward."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        # On the instance: torch.compile's wrapper copies it (its __dict__).
        self.answers_loss_only = True
        # A forward set on the instance before, else the class's; inspect.signature reads through to it.
        self.__wrapped__ = model.__dict__.get("forward") or type(model).forward.__get__(model)

    def __call__(self, *args: Any, _loss_only: bool = False, **kwargs: Any) -> Any:
        output = self.__wrapped__(*args, **kwargs)
        if not _loss_only:
            return output
        loss = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
        return output if loss is None else {"loss": loss}


def answers_loss_only(model: torch.nn.Module) -> bool:
    """Whether ``model`` (under DDP's wrapper) was compiled whole here: its forward takes ``_loss_only``."""
    inner = getattr(model, "module", model)
    return getattr(inner.forward, "answers_loss_only", False)


def _own_inputs(compiled: Callable) -> Callable:
    """A compiled block's forward, its inputs that are views of other tensors copied first. The first block's input
    after an embedding split by tensor parallelism is a view of the DTensor's local tensor, and AOTAutograd sent its
    gradient past the DTensor's backward: tried on TP 2 x FSDP 2 (a 2-block Llama, aot_eager), the embedding's
    gradient was 0.02 off at the first step; copied, every weight equals eager's bit for bit. One copy of the
    hidden states a step (the first block's), under tensor parallelism only."""

    @functools.wraps(compiled)
    def forward(*args: Any, **kwargs: Any) -> Any:
        args = tuple(_owned(value) for value in args)
        return compiled(*args, **{key: _owned(value) for key, value in kwargs.items()})

    return forward


def _owned(value: Any) -> Any:
    return value.clone() if isinstance(value, torch.Tensor) and value._base is not None else value


def compiled_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The blocks compiled one by one: modules of the classes transformers names in ``_no_split_modules``, else the
    children of the model's largest ModuleList (nanoGPT's ``transformer.h``); each inside its activation
    checkpointing wrapper where it has one (the recomputation is then compiled with it, as torchtitan does)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    found = named_blocks(model)
    if not found:
        children = largest_module_list(model)[1]
        found = [m for m in children if type(m) is type(children[0])]
    wrappers = {id(m._checkpoint_wrapped_module): m for m in model.modules() if isinstance(m, CheckpointWrapper)}
    found = [wrappers.get(id(block), block) for block in found]
    inner = {id(sub) for block in found for sub in block.modules() if sub is not block}
    return [block for block in found if id(block) not in inner]


def _block_name(block: Any) -> str:
    inner = getattr(block, "_checkpoint_wrapped_module", block)
    # fully_shard's subclass (FSDPGPT2Block) named as the model's class.
    return next(c for c in type(inner).__mro__ if not c.__name__.startswith("FSDP")).__name__
