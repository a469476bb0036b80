"""``optimizer: muon``: torch's Muon for the hidden 2-D weight matrices, AdamW for the rest (embeddings, the output
head, norms and biases), as the published recipes split them, in one optimizer: one state dict for checkpoints,
one set of groups for the schedule. Muon's step is scaled to AdamW's update size (``adjust_lr_fn=
"match_rms_adamw"``, Moonlight's rule), so one ``lr`` and ``weight_decay`` serve both
(https://docs.pytorch.org/docs/stable/generated/torch.optim.Muon.html).
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional

import torch

# Muon's norm of a matrix split over two mesh dimensions (tensor parallelism x FSDP) takes two all-reduces, which
# torch logs as "suboptimal" at every step: every rank gets the same result, and nothing a user can change. Kept out
# by a filter for the step's length (a filter costs a list append; setLevel clears every logger's cache, 15 us).
REDISTRIBUTE = logging.getLogger("torch.distributed.tensor._redistribute")


def _errors_only(record: logging.LogRecord) -> bool:
    return record.levelno >= logging.ERROR


class MuonWithAdamW(torch.optim.Optimizer):
    """Muon over the groups marked ``muon``, AdamW over the others. Each inner optimizer steps this one's own group
    dicts and state, so ``state_dict``, ``load_state_dict``, DCP and the lr schedule see one optimizer."""

    def __init__(self, muon_groups: list[dict], adamw_groups: list[dict], *, lr: float, adamw: dict[str, Any]):
        muon = torch.optim.Muon(muon_groups, lr=lr, adjust_lr_fn="match_rms_adamw") if muon_groups else None
        adam = torch.optim.AdamW(adamw_groups, lr=lr, **adamw) if adamw_groups else None
        groups = [
            {**group, "muon": inner is muon}
            for inner in (muon, adam)
            if inner is not None
            for group in inner.param_groups
        ]
        super().__init__(groups, {"lr": lr})
        self._inner = (muon, adam)
        self._link()

    def _link(self) -> None:
        """Point the inner optimizers at this one's groups and state (again after ``load_state_dict`` swaps them)."""
        muon, adam = self._inner
        for inner, marked in ((muon, True), (adam, False)):
            if inner is not None:
                inner.param_groups = [group for group in self.param_groups if group["muon"] is marked]
                inner.state = self.state

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        REDISTRIBUTE.addFilter(_errors_only)
        try:
            for inner in self._inner:
                if inner is not None:
                    inner.step()
        finally:
            REDISTRIBUTE.removeFilter(_errors_only)
        return loss

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        self._link()


def muon_parameters(model: torch.nn.Module, decayed: set[str]) -> set[str]:
    """Names of the weights Muon takes: 2-D, decayed (not a norm's or a bias), and not an embedding's or the output
    head's (the head is an embedding tied or not: Muon's orthogonal update suits hidden maps only)."""
    head = getattr(model, "get_output_embeddings", lambda: None)()
    skip = {id(p) for m in model.modules() if isinstance(m, torch.nn.Embedding) for p in m.parameters()}
    skip |= {id(p) for p in (head.parameters() if head is not None else ())}
    return {
        name
        for name, p in model.named_parameters()
        if p.requires_grad and p.ndim == 2 and name in decayed and id(p) not in skip
    }
