"""Evaluation over a data set: every example counted exactly once, whatever the process count (docs/project.md).

Each process runs its own share (``trainer.data.loaders.ShardSampler``: no padded tail) on the plain module under
the launch's autocast; the sums are reduced once at the end. A sharded model's forwards run in lockstep
(``in_lockstep``): each gathers weights from every process.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Iterator, Optional

import torch
from accelerate.utils import find_batch_size
from torch.utils.data import DataLoader

from trainer.console import say
from trainer.data.loaders import named_sets
from trainer.data.samplers import in_lockstep
from trainer.errors import ConfigError, DataError, EvaluationError
from trainer.hf import generates
from trainer.loop.losses import LossFn, checked, model_loss
from trainer.loop.prediction import PredictFn, model_logits, predict

if TYPE_CHECKING:
    from trainer.launch.run import Run
    from trainer.parallel.strategy import Strategy

MetricsFn = Callable[[torch.nn.Module, Any], dict[str, torch.Tensor]]


class Evaluator:
    """``evaluate()`` and ``predict()`` on the plain module (no DDP: the processes' shares differ in length), in eval
    mode, then back as it was.

    Args:
        run, strategy: the job and its strategy (the launch's autocast; a sharded model's lockstep).
        model: the plain module (``strategy.unwrap``).
        loss_fn, metrics_fn: the Trainer's (``metrics_fn`` may be None).
        weighing: what a batch's loss weighs (``Weighing.count``: its counted tokens, or None: its examples).
        data: the Trainer's loaders (``trainer.data.loaders.Loaders``): the eval sets', and those of data given later.
    """

    def __init__(
        self,
        run: Run,
        strategy: Strategy,
        model: torch.nn.Module,
        *,
        loss_fn: LossFn,
        metrics_fn: Optional[MetricsFn],
        weighing: Any,
        data: Any,
    ):
        self.run, self.model, self.loss_fn, self.metrics_fn = run, model, loss_fn, metrics_fn
        # A mixture of experts' eval_loss is its language model's: the load-balancing loss, a figure of the rows
        # each process holds (trainer.loop.routing), left out.
        self.measured = functools.partial(model_loss, output_router_logits=False) if weighing.routing else loss_fn
        self.tokens, self.data = weighing.count, data
        self.autocast, self.lockstep = strategy.autocast(model), strategy.lockstep

    def evaluate(self, data: Any = None, *, step: int) -> dict[str, float]:
        """Mean loss (and each ``metrics_fn`` figure) over each whole eval set (``data``'s, else the Trainer's):
        ``eval_loss``, ``eval_examples``, ``eval_<metric>``, or for named sets ``eval_<set>_loss``, ... as
        transformers names them; said in a line each. ``eval_perplexity`` for a language model's own loss
        (elsewhere exp(loss) means nothing: a classifier's perplexity)."""
        loaders = self.data.eval if data is None else self.loaders(data)
        if not loaders:
            raise EvaluationError("evaluate() needs eval_data: pass eval_data=... to the Trainer, or a data set here")
        metrics = {}
        for name, loader in loaders.items():
            figures = self._figures(name, loader)
            say(f"eval at step {step}: " + ", ".join(f"{k} {v:.6g}" for k, v in figures.items()))
            metrics.update(figures)
        return metrics

    def check_figures(self, keep_best: Optional[str], callbacks: Any) -> None:
        """Before the first step: the figure keep_best and each callback's ``monitor`` (EarlyStopping's) name are
        among those evaluate() gives, and ``metrics_fn`` gives one number per example, found from one batch of
        each eval set (every rank; the random state left as it was), not ``eval_every`` steps into the run."""
        # Who names a figure, the figure, and the fix: in the words of the check at an evaluation.
        wanted = [("keep_best is", keep_best, "set keep_best to one of them")] if keep_best else []
        for callback in callbacks:
            if isinstance(monitor := getattr(callback, "monitor", None), str):
                wanted.append((f"{type(callback).__name__} watches", monitor, "set its monitor to one of them"))
        if not self.data.eval or not wanted and self.metrics_fn is None:
            return
        device = self.run.device
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else [], device_type=device.type):
            names = [key for name, loader in self.data.eval.items() for key in self._figures(name, first(loader))]
        for who, figure, fix in wanted:
            if figure not in names:
                raise ConfigError(f"{who} {figure!r}, but evaluate() gives {', '.join(names)}: {fix}")

    def _figures(self, name: str, loader: Any) -> dict[str, float]:
        with self._in_eval_mode():
            figures = evaluate(
                self.model,
                loader,
                run=self.run,
                loss_fn=self.measured,
                metrics_fn=self.metrics_fn,
                autocast=self.autocast,
                tokens=self.tokens,
                lockstep=self.lockstep,
            )
        if self.loss_fn is model_loss and generates(self.model):
            figures["eval_perplexity"] = perplexity(figures["eval_loss"])
        return {key.replace("eval_", f"eval_{name}_", 1) if name else key: v for key, v in figures.items()}

    def loaders(self, data: Any) -> dict[str, DataLoader]:
        """Each set of ``data`` (a data set, or a dict of named ones: ``named_sets``) as this process's loader."""
        return {
            name: self.data.of(part, name=f"evaluate(data)[{name!r}]" if name else "evaluate(data)")
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
        loader = self.data.of(data, name="predict(data)")
        with self._in_eval_mode():
            return predict(
                self.model,
                loader,
                run=self.run,
                predict_fn=predict_fn or model_logits,
                autocast=self.autocast,
                num_examples=len(data),
                lockstep=self.lockstep,
            )

    @contextlib.contextmanager
    def _in_eval_mode(self):
        was_training = self.model.training
        self.model.eval()
        try:
            yield
        finally:
            self.model.train(was_training)


@torch.no_grad()
def evaluate(
    model: torch.nn.Module,
    loader: Any,
    *,
    run: Run,
    loss_fn: LossFn,
    metrics_fn: Optional[MetricsFn] = None,
    autocast: Callable[[], ContextManager],
    tokens: Callable[[Any], Optional[torch.Tensor]],
    lockstep: bool = False,
) -> dict[str, float]:
    """``eval_loss``, ``eval_examples`` and ``eval_<name>`` for each metric: means over the whole set.

    ``eval_loss`` weighs what the training loss weighs (``trainer.loop.weighing``): every counted token once for the
    default loss of a transformers model (``tokens(batch)``), the count of a ``(loss_sum, count)`` loss, else every
    example once. ``metrics_fn(model, batch)`` returns ``{name: tensor}`` with one number per example of the batch
    (shape ``[batch]``); each metric's mean counts every example once. The sums are summed over the data-parallel
    processes (``run.dp``). ``lockstep``: see ``in_lockstep``.
    """
    device, dp = run.device, run.dp
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
        # (loss_sum, count)
        if summed_over is not None:
            loss_sum += loss.double()
            loss_weight += summed_over
        else:
            weight = tokens(batch)
            weight = weight if weight is not None else size
            loss_sum += loss.double() * weight
            loss_weight += weight
        for name, value in values.items():
            # numpy, a CPU tensor: on the device.
            value = torch.as_tensor(value, device=device).reshape(-1)
            if value.numel() != size:
                raise EvaluationError(
                    f"metrics_fn's {name!r} has {value.numel()} values for a batch of {size} "
                    "examples: return one number per example (shape [batch])"
                )
            metric_sums[name] = metric_sums.get(name, 0) + value.double().sum()
        count += size
    names = sorted(metric_sums)
    if metrics_fn is not None:
        # A process whose share is empty saw no metric: the main process (it always has example 0) names them.
        names = run.main_decides(lambda: names)
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


def first(loader: Any) -> Any:
    """The first batch of ``loader`` alone (none where this process's share is empty), as a loader."""

    class First:
        def __iter__(self) -> Iterator[Any]:
            return itertools.islice(iter(loader), 1)

    return First()


def perplexity(loss: float) -> float:
    return math.exp(loss) if loss < 700 else math.inf
