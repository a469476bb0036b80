"""Evaluation and prediction over a data set: every example counted exactly once, whatever the process count.
``Evaluator`` is the Trainer's ``evaluate()`` and ``predict()``.

Each process runs its own share, examples k, k+K, k+2K, ... (``trainer.data.loaders.ShardSampler``: no padded tail, so
no example twice), on the plain module under the launch's autocast. Shares may differ in length, so nothing collective
runs per batch (except a sharded model's forward, which every process runs in lockstep: ``in_lockstep``):
evaluation sums the loss and each metric per process and reduces the sums once at the end; prediction gathers each
process's outputs once and interleaves them back into dataset order.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Mapping
from typing import Any, Callable, ContextManager, Iterator, Optional

import torch
from accelerate import Accelerator
from accelerate.utils import broadcast_object_list, find_batch_size
from torch.utils.data import DataLoader

from trainer.data.loaders import ShardSampler
from trainer.errors import DataError, EvaluationError
from trainer.hf import generates
from trainer.loop.losses import LossFn, checked, model_loss
from trainer.telemetry.console import say

MetricsFn = Callable[[torch.nn.Module, Any], dict[str, torch.Tensor]]
PredictFn = Callable[[torch.nn.Module, Any], torch.Tensor]


class Evaluator:
    """``evaluate()`` and ``predict()`` on the plain module (no DDP: the processes' shares differ in length), in eval
    mode, then back as it was.

    Args:
        model: the plain module (``Parallelism.unwrap``; a sharded model is its own).
        loss_fn, metrics_fn: the Trainer's (``metrics_fn`` may be None).
        accelerator: the device; ``dp`` the data-parallel processes the sums are summed over
            (``trainer.parallel.strategy.DataParallel``); ``autocast``: the launch's.
        tokens: what a batch's loss weighs (``Weighing.count``: its counted tokens, or None for a batch's examples).
        lockstep: a sharded model's forwards run in lockstep (``in_lockstep``).
        host: the job's gloo group (``trainer.launch.agreement.host_group``; None with one process): ``predict()``
            gathers its rows on the CPU over it, never on a device.
        loader: builds the loader of a data set (each process its share, each example once).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        loss_fn: LossFn,
        metrics_fn: Optional[MetricsFn],
        accelerator: Accelerator,
        dp: Any,
        autocast: Callable[[], ContextManager],
        tokens: Callable[[Any], Optional[torch.Tensor]],
        lockstep: bool,
        host: Any,
        loader: Callable[..., DataLoader],
    ):
        self.model, self.loss_fn, self.metrics_fn, self.accelerator, self.dp = (
            model,
            loss_fn,
            metrics_fn,
            accelerator,
            dp,
        )
        self.autocast, self.tokens, self.lockstep, self.host, self.loader = autocast, tokens, lockstep, host, loader

    def evaluate(self, loaders: dict[str, DataLoader], step: int) -> dict[str, float]:
        """Mean loss (and each ``metrics_fn`` figure) over each whole eval set, every example counted once whatever
        the process count: ``eval_loss``, ``eval_examples``, ``eval_<metric>``, or for named sets (``loaders``'
        keys, '' for the one unnamed set) ``eval_<set>_loss``, ... as transformers names them; said in a line
        each. ``eval_perplexity`` is added for a language model's own loss (``model(**batch).loss`` of a
        transformers model that generates): elsewhere exp(loss) means nothing (a classifier's perplexity)."""
        if not loaders:
            raise EvaluationError("evaluate() needs eval_data: pass eval_data=... to the Trainer, or a data set here")
        metrics = {}
        for name, loader in loaders.items():
            with self._in_eval_mode():
                figures = evaluate(
                    self.model,
                    loader,
                    self.loss_fn,
                    self.metrics_fn,
                    self.accelerator,
                    self.dp,
                    self.autocast,
                    self.tokens,
                    lockstep=self.lockstep,
                )
            if self.loss_fn is model_loss and generates(self.model):
                figures["eval_perplexity"] = perplexity(figures["eval_loss"])
            figures = {key.replace("eval_", f"eval_{name}_", 1) if name else key: v for key, v in figures.items()}
            say(f"eval at step {step}: " + ", ".join(f"{k} {v:.6g}" for k, v in figures.items()))
            metrics.update(figures)
        return metrics

    def loaders(self, data: Any) -> dict[str, DataLoader]:
        """Each set of ``data`` (a data set, or a dict of named ones: ``named_sets``) as this process's loader."""
        return {
            name: self.loader(part, name=f"eval_data[{name!r}]" if name else "data")
            for name, part in named_sets(data).items()
        }

    def predict(self, data: Any, predict_fn: Optional[PredictFn]) -> torch.Tensor:
        """One row per example of the Dataset ``data``, in dataset order, on every process (on the CPU)."""
        if isinstance(data, DataLoader):
            raise DataError(
                "predict() takes the Dataset itself (each process predicts its share and the rows are put "
                "back in dataset order), not a DataLoader"
            )
        if len(data) == 0:
            raise DataError("predict() got a data set with no examples")
        loader = self.loader(data, name="data")
        with self._in_eval_mode():
            return predict(
                self.model,
                loader,
                predict_fn or model_logits,
                self.accelerator,
                self.dp,
                self.autocast,
                len(data),
                lockstep=self.lockstep,
                host=self.host,
            )

    @contextlib.contextmanager
    def _in_eval_mode(self):
        was_training = self.model.training
        self.model.eval()
        try:
            yield
        finally:
            self.model.train(was_training)


def named_sets(data: Any) -> dict[str, Any]:
    """``eval_data`` as ``{name: data set}``: a dict of named data sets (a datasets.DatasetDict too) as it is, one
    data set as ``{"": it}``, none as ``{}``. A dict whose values are not data sets is refused, naming them."""
    if data is None:
        return {}
    if not isinstance(data, Mapping):
        return {"": data}
    odd = {
        name: type(part).__name__
        for name, part in data.items()
        if not isinstance(name, str) or not name.isidentifier() or not _is_data_set(part)
    }
    if odd or not data:
        got = ", ".join(f"{name!r}: {kind}" for name, kind in odd.items()) or "an empty dict"
        raise DataError(
            f"eval_data is a dict, so each entry must be a named data set (a Dataset, a DataLoader or an "
            f"IterableDataset, under a name usable in eval_<name>_loss); got {got}"
        )
    return dict(data)


def _is_data_set(part: Any) -> bool:
    return isinstance(part, (DataLoader, torch.utils.data.IterableDataset)) or (
        hasattr(part, "__len__")
        and hasattr(part, "__getitem__")
        and not isinstance(part, (str, bytes, Mapping, torch.Tensor))
    )  # a column of a batch is no data set


@torch.no_grad()
def evaluate(
    model: torch.nn.Module,
    loader,
    loss_fn,
    metrics_fn: Optional[MetricsFn],
    accelerator: Accelerator,
    dp: Any,
    autocast: Callable[[], ContextManager],
    tokens: Callable[[Any], Optional[torch.Tensor]],
    lockstep: bool = False,
) -> dict[str, float]:
    """``eval_loss``, ``eval_examples`` and ``eval_<name>`` for each metric: means over the whole set.

    ``eval_loss`` weighs what the training loss weighs (trainer.weighing): every counted token once for the
    default loss of a transformers model (``tokens(batch)``), the count of a ``(loss_sum, count)`` loss, else every
    example once. ``metrics_fn(model, batch)`` returns ``{name: tensor}`` with one number per example of the batch
    (shape ``[batch]``); each metric's mean counts every example once. The sums are summed over the data-parallel
    processes (``dp``, ``trainer.parallel.strategy.DataParallel``). ``lockstep``: see ``in_lockstep``.
    """
    device = accelerator.device
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    loss_weight = torch.zeros((), dtype=torch.float64, device=device)
    metric_sums: dict[str, torch.Tensor] = {}
    count = 0
    for batch, counted in in_lockstep(loader, device) if lockstep else ((batch, True) for batch in loader):
        size = find_batch_size(batch)
        with autocast():
            loss, summed_over = checked(loss_fn(model, batch), loss_fn)
            values = metrics_fn(model, batch) if metrics_fn is not None else {}
        if not counted:
            continue
        if summed_over is not None:  # (loss_sum, count)
            loss_sum += loss.double()
            loss_weight += summed_over
        else:
            weight = tokens(batch)
            weight = weight if weight is not None else size
            loss_sum += loss.double() * weight
            loss_weight += weight
        for name, value in values.items():
            value = torch.as_tensor(value, device=device).reshape(-1)  # numpy, a CPU tensor: on the device
            if value.numel() != size:
                raise EvaluationError(
                    f"metrics_fn's {name!r} has {value.numel()} values for a batch of {size} "
                    "examples: return one number per example (shape [batch])"
                )
            metric_sums[name] = metric_sums.get(name, 0) + value.double().sum()
        count += size
    names = sorted(metric_sums)
    if accelerator.num_processes > 1 and metrics_fn is not None:
        # A process whose share is empty saw no metric: the main process (it always has example 0) names them.
        shared = [names]
        broadcast_object_list(shared)
        names = shared[0]
    sums = [metric_sums.get(name, torch.zeros((), dtype=torch.float64, device=device)) for name in names]
    totals = torch.stack([loss_sum, loss_weight, torch.tensor(count, dtype=torch.float64, device=device), *sums])
    if dp.size > 1:
        torch.distributed.all_reduce(totals, group=dp.group)
    loss_total, weight_total, examples, *metric_totals = totals.tolist()
    if examples == 0:
        raise EvaluationError("eval_data has no examples: evaluate() has nothing to average")
    metrics = {"eval_loss": loss_total / weight_total if weight_total else math.nan, "eval_examples": int(examples)}
    metrics.update({f"eval_{name}": total / examples for name, total in zip(names, metric_totals, strict=True)})
    return metrics


def perplexity(loss: float) -> float:
    return math.exp(loss) if loss < 700 else math.inf


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
    loader,
    predict_fn: PredictFn,
    accelerator: Accelerator,
    dp: Any,
    autocast: Callable[[], ContextManager],
    num_examples: int,
    lockstep: bool = False,
    host: Any = None,
) -> torch.Tensor:
    """Every example's prediction, in dataset order, on every process, on the CPU (fp32 for predictions computed in
    bf16 or fp16 under mixed precision, which numpy cannot read).

    Each batch's rows leave the device as they are made (a language model's logits are examples x tokens x
    vocabulary: kept on the device, 1,000 GPT-2 sequences of 1,024 tokens would be 206 GB). Data-parallel process k
    of K (``dp``) holds rows for examples k, k+K, ...: each pads its rows to ceil(n / K), one gather over the
    ``host`` gloo group brings them all (rank-major), and reading them row by row across ranks restores the order.
    Every batch's predictions must have the same trailing shape.
    """
    rows = []
    for batch, counted in in_lockstep(loader, accelerator.device) if lockstep else ((b, True) for b in loader):
        with autocast():
            prediction = predict_fn(model, batch).detach()
        if counted:
            low = prediction.is_floating_point() and prediction.element_size() < 4
            rows.append((prediction.float() if low else prediction).cpu())
    local = torch.cat(rows) if rows else None
    world = dp.size
    if world == 1:
        return local
    # A process with no example (fewer examples than processes) learns the shape from the main process.
    template = [(tuple(local.shape[1:]), local.dtype) if local is not None else None]
    broadcast_object_list(template)
    trailing, dtype = template[0]
    per_process = math.ceil(num_examples / world)
    padded = torch.zeros((per_process, *trailing), dtype=dtype)
    if local is not None:
        padded[: len(local)] = local
    shares = [torch.empty_like(padded) for _ in range(torch.distributed.get_world_size(host))]
    torch.distributed.all_gather(shares, padded, group=host)  # on the CPU: every process's rows, on none's device
    shares = shares[:: len(shares) // world]  # a tensor-parallel group's processes hold the same rows: one each
    return torch.stack(shares, dim=1).reshape(world * per_process, *trailing)[:num_examples]


def in_lockstep(loader, device: torch.device) -> Iterator[tuple[Any, bool]]:
    """``(batch, counted)`` until no process has a batch left: a process whose share ran out repeats its last batch,
    not counted. Why: a sharded model's every forward gathers the weights from all processes, so every process runs
    as many forwards. For a data set of known length (the trainer's own loader, every process with an example)
    each process works out the largest share's batches itself: nothing is exchanged. Otherwise (a stream, your own
    loader) the processes agree batch by batch (one small all-reduce and a host read each), and a process with no
    example at all while others have some is refused on every process at once."""
    batches = getattr(loader, "batch_sampler", None)
    sampler = getattr(batches, "sampler", None)
    if isinstance(sampler, ShardSampler) and sampler.num_examples >= sampler.num_replicas and not batches.drop_last:
        last, taken = None, 0
        for last in loader:
            taken += 1
            yield last, True
        for _ in range(sampler.most_batches(batches.batch_size) - taken):
            yield last, False
        return
    iterator, last = iter(loader), None
    while True:
        batch = next(iterator, None)
        flags = torch.tensor([batch is not None, batch is None and last is None], dtype=torch.int64, device=device)
        torch.distributed.all_reduce(flags)
        have, never = flags.tolist()
        if have == 0:
            return
        if never:
            raise DataError(
                "the evaluation data gives some process no example: with a sharded model (FSDP2) every "
                "process evaluates, so give it at least as many examples as processes",
                job_wide=True,
            )
        if batch is None:
            yield last, False
        else:
            last = batch
            yield batch, True
