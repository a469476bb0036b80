"""Which modules of a model are its blocks: those activation checkpointing wraps, and the FSDP groups the
accelerate config's wrap policy makes (docs/sharded.md).

Activation checkpointing wraps the block itself (torch's non-reentrant ``checkpoint_wrapper``), not its children:
wrapping each child keeps most activations anyway (accelerate#4172: 29 GB of a 40.8 GB peak). Under FSDP2 the
wrapping comes before sharding, so each wrapped block is also one FSDP group; the updates are the same, bit for bit.
"""

from __future__ import annotations

from typing import Any

import torch

from trainer.console import say
from trainer.errors import ConfigError, ShardingError
from trainer.parallel.placement import region


def named_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Modules of the classes transformers names in ``_no_split_modules`` (GPT2Block, LlamaDecoderLayer, ...),
    outermost ones only; none for a model that names none."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    return outermost([module for module in model.modules() if module is not model and type(module).__name__ in names])


def largest_module_list(model: torch.nn.Module) -> tuple[str, list[torch.nn.Module]]:
    """The name and children of the model's largest ModuleList by parameters (nanoGPT's ``transformer.h``,
    torchtitan's ``layers``); ("", []) when it has none."""
    lists = [(name, m) for name, m in model.named_modules() if isinstance(m, torch.nn.ModuleList) and len(m)]
    if not lists:
        return "", []
    name, blocks = max(lists, key=lambda item: sum(p.numel() for p in item[1].parameters()))
    return name, list(blocks)


def transformer_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's repeated blocks, as ``named_blocks`` finds them; refused by name when there are none."""
    found = named_blocks(model)
    if not found:
        raise ConfigError(
            f"activation_checkpointing: no transformer block found in {type(model).__name__} (it "
            "names none in _no_split_modules, as transformers models do): set it to false, or wrap "
            "your blocks with torch.utils.checkpoint yourself"
        )
    return found


def outermost(modules: list[torch.nn.Module]) -> list[torch.nn.Module]:
    """Those of ``modules`` not inside another of them."""
    inner = {id(sub) for module in modules for sub in module.modules() if sub is not module}
    return [module for module in modules if id(module) not in inner]


def checkpoint_activations(model: torch.nn.Module, blocks: list[torch.nn.Module]) -> list[torch.nn.Module]:
    """Wrap each of ``blocks`` in place; return the wrappers. The state dict's keys do not change (checkpoints and
    exports are those of the plain model); ``named_parameters()`` names gain ``_checkpoint_wrapped_module.``."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointWrapper,
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )

    config = getattr(model, "config", None)
    if getattr(config, "use_cache", False):
        # A recomputed block would add its keys to the cache twice (transformers does this)
        config.use_cache = False
    chosen = {id(block) for block in blocks}
    apply_activation_checkpointing(
        model, checkpoint_wrapper_fn=checkpoint_wrapper, check_fn=lambda module: id(module) in chosen
    )
    return [module for module in model.modules() if isinstance(module, CheckpointWrapper)]


def wrap_groups(model: torch.nn.Module, plugin: Any) -> list[torch.nn.Module]:
    """The modules that become FSDP groups of their own, children before parents, as accelerate applies the
    config's policy: TRANSFORMER_BASED_WRAP the block classes (named, else the model's ``_no_split_modules``, else
    the children of its largest ModuleList, said in a line), SIZE_BASED_WRAP every module over ``min_num_params``,
    nested (a ModuleList, a container without forward, is no group), NO_WRAP none. A module holding a weight tied
    to one outside it is left to the group around it: FSDP2 keeps a tied weight in one group."""
    from accelerate.utils.fsdp_utils import fsdp2_prepare_auto_wrap_policy
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

    try:
        policy = fsdp2_prepare_auto_wrap_policy(plugin, model)
    # A block class the model does not have.
    except ValueError as err:
        raise ShardingError(f"fsdp_transformer_layer_cls_to_wrap: {err}") from None
    # NO_WRAP.
    if policy is None:
        return []
    candidates = [
        module
        for module in region(model, set())
        if module is not model and policy(module) and type(module).forward is not torch.nn.Module.forward
    ]
    by_class = getattr(plugin.auto_wrap_policy, "func", plugin.auto_wrap_policy) is transformer_auto_wrap_policy
    if not candidates and by_class and not plugin.transformer_cls_names_to_wrap:
        candidates = repeated_blocks(model)
    holders: dict[int, set[int]] = {}
    for module in model.modules():
        for parameter in module._parameters.values():
            if parameter is not None:
                holders.setdefault(id(parameter), set()).add(id(module))
    return [module for module in candidates if not _tied_outside(module, holders)]


def vocabulary_ends(model: torch.nn.Module, groups: list[torch.nn.Module]) -> list[torch.nn.Module]:
    """A transformers model's input embeddings and output head, each an FSDP group of its own when they share no
    weight and no group holds them (torchtitan's layout): in the root they stay gathered the whole step and their
    gradients the whole backward, two vocabulary-sized matrices each; apart, the embeddings are let go after their
    forward and the head's gradient is reduced as soon as its backward is done. Tied, they stay in the root."""
    get_in, get_out = getattr(model, "get_input_embeddings", None), getattr(model, "get_output_embeddings", None)
    if not groups or get_in is None or get_out is None:
        return []
    ends = [end for end in (get_in(), get_out()) if isinstance(end, torch.nn.Module)]
    inside = {id(sub) for end in ends for sub in end.modules()}
    grouped = {id(sub) for group in groups for sub in group.modules()}
    first, second = ({id(p) for p in end.parameters()} for end in ends) if len(ends) == 2 else (set(), set())
    # A weight also held outside them (tied to another module): the root keeps it.
    outside = {id(p) for m in model.modules() if id(m) not in inside for p in m._parameters.values() if p is not None}
    if len(ends) != 2 or inside & grouped or first & second or (first | second) & outside:
        return []
    return ends


def repeated_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """For a model that names no block class: the children of its largest ModuleList (nanoGPT's ``transformer.h``,
    torchtitan's ``layers``), said in a line; none (one group) when it has no ModuleList, also said."""
    name, blocks = largest_module_list(model)
    how = "name its block class in fsdp_transformer_layer_cls_to_wrap to choose the groups"
    if not blocks:
        say(
            f"FSDP2: {type(model).__name__} names no block class (_no_split_modules) and has no ModuleList: the "
            f"whole model is one group, gathered whole for every forward; {how}",
            once=True,
        )
        return []
    say(
        f"FSDP2: {type(model).__name__} names no block class (_no_split_modules): each of the {len(blocks)} "
        f"modules of {name} ({type(blocks[0]).__name__}) is one group; {how}",
        once=True,
    )
    return blocks


def _tied_outside(module: torch.nn.Module, holders: dict[int, set[int]]) -> bool:
    inside = {id(sub) for sub in module.modules()}
    return any(not holders[id(p)] <= inside for p in module.parameters())
