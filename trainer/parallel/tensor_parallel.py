"""Tensor parallelism: a transformers model's own plan (``base_model_tp_plan``) as torch's column / row styles,
applied module by module as the model is placed, or the user's ``parallelize_fn(model, tp_mesh)``
(docs/internals.md#tensor-parallelism, docs/parallelism.md).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from trainer.errors import ShardingError

# (model, the tensor-parallel mesh) -> anything.
ParallelizeFn = Callable[[torch.nn.Module, Any], Any]


def _styles() -> dict[str, Callable[[], Any]]:
    """transformers' plan names that are plain column / row splits, as torch's styles."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    gathered = lambda: ColwiseParallel(output_layouts=Replicate())  # noqa: E731 - the output whole on every process
    whole_input = lambda: RowwiseParallel(input_layouts=Replicate())  # noqa: E731
    return {
        "colwise": ColwiseParallel,
        "rowwise": RowwiseParallel,
        "colwise_rep": gathered,
        "colwise_gather_output": gathered,
        "rowwise_rep": whole_input,
        "rowwise_split_input": whole_input,
        "embedding_rowwise": whole_input,
    }


@dataclass
class TensorParallel:
    """How a model is split over the tensor-parallel ``mesh``: a style per module (by id), or the user's function."""

    mesh: Any
    styles: dict[int, Any] = field(default_factory=dict)
    function: Optional[ParallelizeFn] = None

    @property
    def size(self) -> int:
        return self.mesh.size()

    def split(self, modules: list[torch.nn.Module]) -> None:
        """Split those of ``modules`` the plan names (just placed whole on the device)."""
        from torch.distributed.tensor.parallel import parallelize_module

        for module in modules:
            if id(module) in self.styles:
                parallelize_module(module, self.mesh, self.styles[id(module)])


def tensor_parallel(model: torch.nn.Module, mesh: Any, function: Optional[ParallelizeFn]) -> TensorParallel:
    """The split of ``model`` over ``mesh``: ``function`` when given, else the model's own plan, checked first."""
    if function is not None:
        return TensorParallel(mesh, function=function)
    plan = model_plan(model)
    size, kind = mesh.size(), type(model).__name__
    if not plan:
        raise ShardingError(
            f"parallelism_config: tp_size {size}, but {kind} has no tensor-parallel plan (a "
            "transformers model's base_model_tp_plan): pass parallelize_fn=<function of (model, "
            "tp_mesh)> to the Trainer, or set tp_size 1"
        )
    config = getattr(model, "config", None)
    for heads in ("num_attention_heads", "num_key_value_heads"):
        count = getattr(config, heads, None)
        if isinstance(count, int) and count % size:
            raise ShardingError(
                f"parallelism_config: tp_size {size} does not divide {kind}'s {heads} ({count}): "
                "each process of a tensor-parallel group takes whole heads"
            )
    styles, known, modules = {}, _styles(), dict(model.named_modules())
    for pattern, style in plan.items():
        if style not in known:
            raise ShardingError(
                f"{kind}'s tensor-parallel plan splits {pattern} as {style!r}, which this trainer "
                f"does not apply (it applies {', '.join(sorted(known))}): pass parallelize_fn= to "
                "the Trainer, or set tp_size 1"
            )
        matcher = re.compile(re.escape(pattern).replace(r"\*", r"\d+"))
        for name in [n for n in modules if matcher.fullmatch(n)]:
            styles[id(modules[name])] = known[style]()
    return TensorParallel(mesh, styles)


def model_plan(model: torch.nn.Module) -> dict[str, str]:
    """A transformers model's tensor-parallel plan, module name patterns from the model's root ({} for none)."""
    plan = getattr(model, "tp_plan", None)
    if not isinstance(plan, dict):
        plan = getattr(model, "_tp_plan", None)
    if plan:
        return dict(plan)
    config, prefix = getattr(model, "config", None), getattr(model, "base_model_prefix", "")
    base = dict(getattr(config, "base_model_tp_plan", None) or {})
    # A head model: its base model's plan, under its name.
    if base and prefix and hasattr(model, prefix):
        base = {f"{prefix}.{name}": style for name, style in base.items()}
    return base
