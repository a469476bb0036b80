"""A mixture of experts' load-balancing loss over the whole global batch, and the experts' load for the logs.

A transformers MoE model adds ``router_aux_loss_coef`` x its router's load-balancing loss (Switch Transformer's:
``num_experts`` x the sum over experts of the share of tokens routed to each times its mean router probability) to
its loss, computed over the rows of the batch it was given. That is a product of two means: over K processes each
adding its own, the step would differ from one process's over the global batch (and count K times over). Here the
model's own is turned off (``output_router_logits=False``), each router's logits are recorded as the model runs, the
token counts (no gradient) and rows are summed over the data-parallel processes (one all-reduce of ``num_experts + 1``
numbers per micro-batch), and each process adds its rows' part of the global loss: summed over the processes, the
loss of the global batch, as transformers computes it on one process (``load_balancing_loss_func``, padding left out
by the attention mask). Under gradient accumulation each micro-batch's loss weighs 1 / (micro-batches of a step).
See docs/parallelism.md#expert-parallelism.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.distributed as dist

from trainer.errors import ConfigError

if TYPE_CHECKING:
    from trainer.launch.run import Run


class RouterLoss:
    """Records the router logits of each forward (``recording``) and turns them into this process's part of the
    global batch's load-balancing loss (``loss``)."""

    def __init__(self, run: Run, model: torch.nn.Module, router: type, *, index: int):
        self.group, self.world = run.dp.group, run.dp.size
        self.coef = float(model.router_aux_loss_coef)
        self.experts, self.top_k = int(model.num_experts), int(model.num_experts_per_tok)
        self.logits: Optional[list[torch.Tensor]] = None
        # Tokens each expert got since the last log, all layers and processes (the imbalance logged).
        self.load: Optional[torch.Tensor] = None
        for module in model.modules():
            if isinstance(module, router):
                module.register_forward_hook(self._record(index))

    @classmethod
    def install(cls, run: Run, model: torch.nn.Module) -> Optional["RouterLoss"]:
        """For a transformers MoE model whose loss adds its router's load-balancing loss; None for any other."""
        config = getattr(model, "config", None)
        if not getattr(config, "output_router_logits", False) or not getattr(model, "router_aux_loss_coef", 0):
            return None
        base = getattr(model, "base_model", model)
        recorder = (getattr(base, "_can_record_outputs", None) or {}).get("router_logits")
        router, index = getattr(recorder, "target_class", recorder), getattr(recorder, "index", 0)
        accepts = "output_router_logits" in inspect.signature(model.forward).parameters
        if not isinstance(router, type) or not accepts or not hasattr(model, "num_experts_per_tok"):
            return None
        # Context parallelism splits the rows' tokens, auto_microbatch the rows: each part's loss is not its share.
        other = f"cp_size {run.layout.cp}" if run.layout.cp > 1 else ""
        other = other or ("auto_microbatch" if run.config.auto_microbatch else "")
        if other:
            raise ConfigError(
                f"{type(model).__name__}'s load-balancing loss (router_aux_loss_coef {model.router_aux_loss_coef}) "
                f"with {other} is not supported yet: set router_aux_loss_coef 0 (or output_router_logits false) in "
                f"the model's config, or train without {other}"
            )
        return cls(run, model, router, index=index)

    def _record(self, index: int):
        def hook(module: torch.nn.Module, inputs: Any, output: Any) -> None:
            if self.logits is not None:
                self.logits.append(output[index] if isinstance(output, (tuple, list)) else output)

        return hook

    def recording(self) -> dict[str, Any]:
        """Start recording the next forward's routers; the keywords that forward takes (the model's own loss off)."""
        self.logits = []
        return {"output_router_logits": False}

    def loss(self, batch: Any) -> torch.Tensor:
        """This process's part of the global batch's ``coef`` x load-balancing loss, from the forward recorded."""
        layers, self.logits = self.logits or [], None
        if not layers:
            raise ConfigError("the MoE model's forward ran no router the trainer could record")
        device = layers[0].device
        mask = batch.get("attention_mask") if isinstance(batch, Mapping) else None
        flat = mask.reshape(-1).to(device=device, dtype=torch.float32) if mask is not None else None
        counts = torch.zeros(self.experts, dtype=torch.float32, device=device)
        probs = torch.zeros(self.experts, dtype=torch.float32, device=device)
        rows = torch.zeros((), dtype=torch.float32, device=device)
        for logits in layers:
            weights = torch.softmax(logits, dim=-1)
            chosen = torch.topk(weights, self.top_k, dim=-1).indices.reshape(-1)
            if flat is None:
                counts = counts.index_add(0, chosen, torch.ones_like(chosen, dtype=torch.float32))
                probs, rows = probs + weights.float().sum(dim=0), rows + weights.shape[0]
            else:
                counts = counts.index_add(0, chosen, flat.repeat_interleave(self.top_k))
                probs, rows = probs + (weights.float() * flat.unsqueeze(-1)).sum(dim=0), rows + flat.sum()
        total = torch.cat([counts, rows.reshape(1)])
        if self.world > 1:
            dist.all_reduce(total, group=self.group)
        counts, rows = total[:-1], total[-1]
        self.load = counts if self.load is None else self.load + counts
        return self.coef * self.experts * torch.sum((counts / rows) * (probs / rows))

    def imbalance(self) -> Optional[torch.Tensor]:
        """The most tokens any expert got since the last call over the mean (1: balanced), or None."""
        load, self.load = self.load, None
        return None if load is None else load.max() / load.mean().clamp(min=1e-9)
