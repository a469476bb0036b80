"""Expert parallelism: each MoE layer's experts split over ``ep_size`` processes (whole experts on each), the tokens
routed to them sent there all-to-all and back, composed with FSDP2 as torchtitan lays it out (docs/parallelism.md).

The mesh of the experts is (efsdp, ep), (replicate, efsdp, ep) under HSDP: the FSDP2 shards of the launch cut into
``shard / ep`` groups of ``ep`` neighbouring processes; in each group every process holds ``num_experts / ep``
experts, and each expert is sharded by FSDP2 over the ``shard / ep`` processes that hold it (its own FSDP group, on the
efsdp dimension; HSDP's replicas each hold the same). The rest of the model is sharded as without experts. The split
and the exchange are transformers' own (the ``grouped_gemm`` and ``ep_dispatch_experts`` styles of
``transformers.distributed.expert_parallel``), read from the model's ``ep_plan``, which transformers' MoE families
define (Qwen3-MoE, Mixtral, OLMoE, ...); a model of one's own gives an ``ep_plan`` attribute in the same words (experts
modules called as ``experts(hidden_states, top_k_index, top_k_weights)``, their weights' first dimension the experts).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

import torch

from trainer.errors import ShardingError

if TYPE_CHECKING:
    from trainer.launch.mesh import Layout

# The experts' mesh dimensions: HSDP's replicas, the FSDP2 shards of each expert, the expert-parallel group, and a
# tensor-parallel dimension of 1 (transformers' exchange asks for the processes that hold the same batch: each alone).
REPLICATE, EFSDP, EP, ETP = "dp_replicate", "efsdp", "ep", "etp"
DISPATCH, SPLIT = "ep_dispatch_experts", "grouped_gemm"


class Experts:
    """The experts modules of a model and the mesh they are split over; ``split(module)`` before FSDP2 shards it."""

    def __init__(self, model: torch.nn.Module, layout: Layout, device_type: str):
        from torch.distributed.device_mesh import init_device_mesh

        self.ep, self.shards, self.processes = layout.ep, layout.shard, layout.replicate * layout.shard
        self.modules = experts_of(model, self.ep)
        # Under HSDP the experts are replicated as the rest is: their FSDP2 mesh is (replicate, efsdp).
        sizes = ((REPLICATE, layout.replicate), (EFSDP, layout.shard // layout.ep), (EP, layout.ep), (ETP, 1))
        kept = [(name, size) for name, size in sizes if name != REPLICATE or size > 1]
        self.mesh = init_device_mesh(
            device_type, tuple(size for _, size in kept), mesh_dim_names=tuple(name for name, _ in kept)
        )
        self.data = self.mesh[(REPLICATE, EFSDP)] if layout.replicate > 1 else self.mesh[EFSDP]

    def __contains__(self, module: torch.nn.Module) -> bool:
        return id(module) in self.modules

    def split(self, module: torch.nn.Module) -> None:
        """Keep this process's experts of ``module`` (whole on every process until now) and route its tokens to the
        processes of its expert group all-to-all."""
        # Importing expert_parallel registers its styles.
        from transformers.distributed import expert_parallel  # noqa: F401
        from transformers.distributed.parallel_utils import ALL_PARALLEL_STYLES

        _, weights = self.modules[id(module)]
        if not hasattr(module, "num_experts"):
            # transformers' exchange reads it (its split divides it by ep_size).
            module.num_experts = getattr(module, weights[0]).shape[0]
        for name in weights:
            ALL_PARALLEL_STYLES[SPLIT].shard_param(module, name, self.mesh[EP])
        ALL_PARALLEL_STYLES[DISPATCH].install_forward(module, ep_mesh=self.mesh[EP], tp_mesh=self.mesh[ETP])

    def shard(self, module: torch.nn.Module, **fsdp: Any) -> None:
        """FSDP2 (HSDP under replicas) over the processes that hold the same experts. Each expert's gradient is the sum
        over every batch sent to it, by every process of its expert group, then over its copies: divided by all the
        data-parallel processes, it is the average the rest of the model's gradients are (torchtitan, transformers)."""
        from torch.distributed.fsdp import fully_shard

        fully_shard(module, mesh=self.data, **fsdp)
        module.set_gradient_divide_factor(float(self.processes))
        if self.shards // self.ep > 1:
            # A factor other than the reduce-scatter group's size is a PREMUL_SUM, which gloo refuses (and NCCL zeroes
            # in bf16 up to torch 2.13, pytorch/pytorch#190747): summed, then divided locally. Not with one shard of
            # each expert: FSDP2 then divides as it copies the gradient, and HSDP's all-reduce sums.
            module.set_force_sum_reduction_for_comms(True)


def experts_of(model: torch.nn.Module, ep: int) -> dict[int, tuple[torch.nn.Module, list[str]]]:
    """``{id(module): (module, its expert weights' names)}`` for each experts module of ``model``'s ``ep_plan``;
    refused by name: no plan, or a number of experts ``ep`` does not divide."""
    plan = dict(getattr(model, "ep_plan", None) or {})
    names = [name for name, style in plan.items() if style == DISPATCH]
    if not names:
        raise ShardingError(
            f"ep_size {ep}: {type(model).__name__} has no MoE layer the trainer can find (no ep_plan naming its "
            f"experts modules '{DISPATCH}', as transformers' MoE models have): use a transformers MoE model, give "
            "the model an ep_plan (docs/parallelism.md#expert-parallelism), or set ep_size 1"
        )
    found: dict[int, tuple[torch.nn.Module, list[str]]] = {}
    for name, module in model.named_modules():
        pattern = next((p for p in names if re.fullmatch(re.escape(p).replace(r"\*", r"\d+"), name)), None)
        if pattern is None:
            continue
        weights = [
            weight for weight, _ in module.named_parameters(recurse=False) if plan.get(f"{pattern}.{weight}") == SPLIT
        ]
        count = getattr(module, "num_experts", None)
        if count is None and weights:
            count = getattr(module, weights[0]).shape[0]
        if not weights or count is None:
            raise ShardingError(
                f"ep_size {ep}: {name} ({type(module).__name__}) has no expert weights named '{SPLIT}' in the "
                "model's ep_plan: name its weights whose first dimension is the experts"
            )
        if count % ep:
            raise ShardingError(
                f"ep_size {ep} does not divide the {count} experts of {name}: each process holds whole experts "
                f"(ep_size one of {', '.join(str(d) for d in range(2, count + 1) if count % d == 0)})"
            )
        found[id(module)] = (module, weights)
    if not found:
        raise ShardingError(
            f"ep_size {ep}: {type(model).__name__}'s ep_plan names experts modules ({', '.join(names)}) that it does "
            "not have: check the plan's names against model.named_modules()"
        )
    return found
