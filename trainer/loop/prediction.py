"""Prediction over a data set: one row per example, in dataset order, on every process (docs/project.md)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Callable, ContextManager

import torch

from trainer.data.samplers import in_lockstep
from trainer.errors import EvaluationError

if TYPE_CHECKING:
    from trainer.launch.run import Run

PredictFn = Callable[[torch.nn.Module, Any], torch.Tensor]


def model_logits(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    """The default prediction: ``model(**batch).logits``, as transformers models return them."""
    if not isinstance(batch, Mapping):
        raise EvaluationError(
            f"the default prediction calls model(**batch).logits, but the batch is a "
            f"{type(batch).__name__}; pass predict_fn=lambda model, batch: ... to predict()"
        )
    return model(**batch).logits


@torch.no_grad()
def predict(
    model: torch.nn.Module,
    loader: Any,
    *,
    run: Run,
    predict_fn: PredictFn,
    autocast: Callable[[], ContextManager],
    num_examples: int,
    lockstep: bool = False,
) -> torch.Tensor:
    """Every example's prediction, in dataset order, on every process, on the CPU (fp32 for predictions computed in
    bf16 or fp16 under mixed precision, which numpy cannot read).

    Each batch's rows leave the device as they are made (a language model's logits are examples x tokens x
    vocabulary: kept on the device, 1,000 GPT-2 sequences of 1,024 tokens would be 206 GB). Data-parallel process k
    of K (``run.dp``) holds rows for examples k, k+K, ...: each pads its rows to ceil(n / K), one gather over the
    host gloo group (``run.host``) brings them all (rank-major), and reading them row by row across ranks restores the
    order. Every batch's predictions must have the same trailing shape.
    """
    rows = []
    for batch, counted in in_lockstep(loader, run.device) if lockstep else ((b, True) for b in loader):
        with autocast():
            prediction = predict_fn(model, batch).detach()
        if counted:
            low = prediction.is_floating_point() and prediction.element_size() < 4
            rows.append((prediction.float() if low else prediction).cpu())
    local = torch.cat(rows) if rows else None
    world, host = run.dp.size, run.host
    if world == 1:
        return local
    # A process with no example (fewer examples than processes) learns the shape from the main process.
    trailing, dtype = run.main_decides(lambda: (tuple(local.shape[1:]), local.dtype) if local is not None else None)
    per_process = math.ceil(num_examples / world)
    padded = torch.zeros((per_process, *trailing), dtype=dtype)
    if local is not None:
        padded[: len(local)] = local
    shares = [torch.empty_like(padded) for _ in range(torch.distributed.get_world_size(host))]
    # On the CPU: every process's rows, on none's device.
    torch.distributed.all_gather(shares, padded, group=host)
    # A tensor-parallel group's processes hold the same rows: one each.
    shares = shares[:: len(shares) // world]
    return torch.stack(shares, dim=1).reshape(world * per_process, *trailing)[:num_examples]
