"""The Trainer's evaluation and prediction: the whole eval set's figures and every example's prediction, each
example counted once whatever the process count (the per-batch work is ``trainer.evaluation``'s).

A mixin of :class:`trainer.Trainer`, which supplies the model, the loaders, the loss and metrics functions and the
accelerator.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch
from torch.utils.data import DataLoader, Dataset

from trainer.accumulation import generates
from trainer.columns import ready_columns
from trainer.data import DataError, build_eval_loader
from trainer.evaluation import PredictFn, model_logits, perplexity
from trainer.evaluation import evaluate as evaluate_shares
from trainer.evaluation import predict as predict_shares
from trainer.losses import model_loss


class Evaluating:
    """evaluate() and predict(), for the Trainer."""

    def evaluate(self) -> dict[str, float]:
        """Mean loss (and each ``metrics_fn`` figure) over the whole eval set, every example counted once whatever
        the process count: ``eval_loss``, ``eval_examples``, ``eval_<name>``. ``eval_perplexity`` is added for a
        language model's own loss (``model(**batch).loss`` of a transformers model that generates): elsewhere
        exp(loss) means nothing (a classifier's perplexity), and ``math.exp(metrics["eval_loss"])`` is at hand."""
        if self.eval_loader is None:
            raise ValueError("evaluate() needs eval_data: pass eval_data=... to the Trainer")
        with self._plain_model_in_eval_mode() as model:
            metrics = evaluate_shares(model, self.eval_loader, self.loss_fn, self.metrics_fn, self.accelerator,
                                      self.autocast, self.weighing.count, lockstep=bool(self.sharded))  # fmt: skip
        if self.loss_fn is model_loss and generates(model):
            metrics["eval_perplexity"] = perplexity(metrics["eval_loss"])
        self._say(f"eval at step {self.global_step}: " + ", ".join(f"{k} {v:.6g}" for k, v in metrics.items()))
        self.last_eval = (self.global_step, metrics)
        if self.accelerator.is_main_process:  # the same reduced figures on every rank: the main run holds them
            self.tracker.log({f"eval/{k.removeprefix('eval_')}": v for k, v in metrics.items()}, self.global_step)
        self.nonfinite.check_evaluation(metrics, self.global_step, str(self.last_checkpoint or ""))
        self._call("on_evaluate", metrics=metrics)
        return metrics

    def predict(self, data: Dataset, predict_fn: Optional[PredictFn] = None) -> torch.Tensor:
        """One row per example of ``data``, in dataset order, returned on every process (on the CPU).

        Args:
            data: a map-style Dataset; each process predicts its share, and one gather puts the rows in order.
            predict_fn: ``predict_fn(model, batch) -> tensor`` with one row per example, the same trailing shape
                for every batch; default ``model(**batch).logits``. Runs on the plain module in eval mode, without
                gradients, under the launch's autocast.

        Example::

            logits = trainer.predict(test_set)                     # [len(test_set), classes]
            labels = trainer.predict(test_set, lambda model, batch: model(**batch).logits.argmax(-1))
        """
        if isinstance(data, DataLoader):
            raise DataError("predict() takes the Dataset itself (each process predicts its share and the rows are put "
                            "back in dataset order), not a DataLoader")  # fmt: skip
        if len(data) == 0:
            raise DataError("predict() got a data set with no examples")
        data, _ = ready_columns(data, self.unwrapped_model, self.collate_fn is not None, "data")
        loader = build_eval_loader(data, self.config, self.accelerator, self.collate_fn)
        with self._plain_model_in_eval_mode() as model:
            return predict_shares(model, loader, predict_fn or model_logits, self.accelerator, self.autocast,
                                  len(data), lockstep=self.sharded is not None)  # fmt: skip

    @contextlib.contextmanager
    def _plain_model_in_eval_mode(self):
        """The plain module (no DDP: the processes' shares differ in length), in eval mode, then as it was."""
        model = self.unwrapped_model
        was_training = model.training
        model.eval()
        try:
            yield model
        finally:
            model.train(was_training)
