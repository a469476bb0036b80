"""Callbacks shipped with the trainer (a callback is any object with some of the Trainer's hook methods)."""

from __future__ import annotations

from trainer.config import ConfigError


def improves(value: float, best: float | None, mode: str, min_delta: float = 0.0) -> bool:
    """``value`` beats ``best`` (None: nothing yet) by more than ``min_delta``: lower with mode "min", higher with
    "max". EarlyStopping and keep_best both judge by it."""
    if best is None:
        return True
    return value < best - min_delta if mode == "min" else value > best + min_delta


class EarlyStopping:
    """Stop training when ``monitor`` has not improved for ``patience`` evaluations in a row.

    Improving means beating the best value so far by more than ``min_delta`` (lower is better with ``mode="min"``,
    higher with ``"max"``). Evaluation figures are the same on every rank, so every rank decides alike; the Trainer
    stops after its next step that logs, with a checkpoint when ``save_every`` is set. Needs ``eval_every`` (or
    calls of ``evaluate()``) to have something to watch::

        Trainer(model, TrainConfig(eval_every=100, save_every=100), train_data=..., eval_data=...,
                callbacks=[EarlyStopping(monitor="eval_loss", patience=3)])
    """

    def __init__(self, monitor: str = "eval_loss", patience: int = 3, min_delta: float = 0.0, mode: str = "min"):
        if mode not in ("min", "max"):
            raise ValueError(f"EarlyStopping mode must be 'min' or 'max', got {mode!r}")
        if patience < 1:
            raise ValueError(f"EarlyStopping patience must be >= 1, got {patience!r}")
        self.monitor, self.patience, self.min_delta, self.mode = monitor, patience, min_delta, mode
        self.best: float | None = None
        self.best_step: int | None = None
        self.waited = 0  # evaluations since the best one

    def on_evaluate(self, trainer, metrics: dict) -> None:
        if self.monitor not in metrics:
            raise ConfigError(f"EarlyStopping watches {self.monitor!r}, but evaluate() gives {', '.join(metrics)}: "
                              "set its monitor to one of them")  # fmt: skip
        value = metrics[self.monitor]
        if improves(value, self.best, self.mode, self.min_delta):
            self.best, self.best_step, self.waited = value, trainer.global_step, 0
            return
        self.waited += 1
        if self.waited >= self.patience:
            trainer.should_stop = True
            trainer.stop_reason = (f"EarlyStopping: {self.monitor} has not improved on {self.best:.6g} (step "
                                   f"{self.best_step}) for {self.waited} evaluations")  # fmt: skip
