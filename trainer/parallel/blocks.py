"""Activation checkpointing: each transformer block keeps only its input in forward and recomputes the rest in
backward, trading about a third more compute for the activations' memory. ``activation_checkpointing: true`` in the
config (DDP and FSDP2 alike), or ``fsdp_activation_checkpointing: true`` in an FSDP accelerate config.

The block itself is wrapped (torch's non-reentrant ``checkpoint_wrapper``), not its children: wrapping each child
keeps most activations anyway (accelerate#4172 measured 29 GB of a 40.8 GB peak wasted that way). Under FSDP2 the
wrapping comes before sharding, so each wrapped block is also one FSDP group. The updates are the same as without
it, bit for bit (dropout's random state is replayed in the recomputation).
"""

from __future__ import annotations

import torch

from trainer.errors import ConfigError


def transformer_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's repeated blocks: modules of the classes transformers names in ``_no_split_modules``
    (GPT2Block, LlamaDecoderLayer, ...), outermost ones only."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    found = [module for module in model.modules() if module is not model and type(module).__name__ in names]
    if not found:
        raise ConfigError(
            f"activation_checkpointing: no transformer block found in {type(model).__name__} (it "
            "names none in _no_split_modules, as transformers models do): set it to false, or wrap "
            "your blocks with torch.utils.checkpoint yourself"
        )
    return outermost(found)


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
        config.use_cache = False  # a recomputed block would add its keys to the cache twice (transformers does this)
    chosen = {id(block) for block in blocks}
    apply_activation_checkpointing(
        model, checkpoint_wrapper_fn=checkpoint_wrapper, check_fn=lambda module: id(module) in chosen
    )
    return [module for module in model.modules() if isinstance(module, CheckpointWrapper)]
