"""Callbacks: any object with some of the Trainer's hook methods, called in order; one with ``state_dict()`` and
``load_state_dict()`` is also checkpointed and gets its state back at a resume. Shipped here: ``EarlyStopping``.

Hooks, each called as ``hook(trainer, ...)``: ``on_train_begin``, ``on_epoch_begin``, ``on_step_end`` (after that
step's logging and evaluation, before its checkpoint: a checkpoint holds every callback's state as of the step's
end), ``on_log(metrics)``, ``on_evaluate(metrics)``, ``on_train_end(result)``.
"""

from __future__ import annotations

from typing import Any, Iterable, Optional

from trainer.checkpoint.best import improves
from trainer.errors import ConfigError


def call(callbacks: Iterable[Any], hook: str, trainer: Any, **kwargs: Any) -> None:
    """``hook`` of every callback that has it, in order."""
    for callback in callbacks:
        method = getattr(callback, hook, None)
        if method is not None:
            method(trainer, **kwargs)


def asked_to_stop(rows: list[dict[str, Any]], reason: Optional[str]) -> Optional[str]:
    """Why every rank stops after this log: the ranks whose gathered row says ``should_stop`` (and ``reason``,
    ``trainer.stop_reason``), or None. The same rows, so the same answer, on every rank."""
    asked = [rank for rank, row in enumerate(rows) if row["stop"]]
    if not asked:
        return None
    why = f" ({reason})" if reason else ""
    return f"should_stop set on rank(s) {', '.join(map(str, asked))}{why}"


def stateful(callbacks: Iterable[Any]) -> dict[str, Any]:
    """The callbacks a checkpoint holds (those with ``state_dict`` and ``load_state_dict``), by a name that stays
    the same from run to run: the class name, then ``#2``, ``#3`` for more of one class."""
    named: dict[str, Any] = {}
    for callback in callbacks:
        if callable(getattr(callback, "state_dict", None)) and callable(getattr(callback, "load_state_dict", None)):
            name, count = type(callback).__name__, 1
            while (key := name if count == 1 else f"{name}#{count}") in named:
                count += 1
            named[key] = callback
    return named


class EarlyStopping:
    """Stop training when ``monitor`` has not improved for ``patience`` evaluations in a row.

    Improving means beating the best value so far by more than ``min_delta`` (lower is better with ``mode="min"``,
    higher with ``"max"``). Evaluation figures are the same on every rank, so every rank decides alike; the Trainer
    stops after its next step that logs, with a checkpoint when ``save_every`` is set. Its count is checkpointed: a
    resumed run goes on waiting where it stopped. Needs ``eval_every`` (or calls of ``evaluate()``)::

        Trainer(model, TrainConfig(eval_every=100, save_every=100), train_data=..., eval_data=...,
                callbacks=[EarlyStopping(monitor="eval_loss", patience=3)])
    """

    def __init__(self, monitor: str = "eval_loss", patience: int = 3, min_delta: float = 0.0, *, mode: str = "min"):
        if mode not in ("min", "max"):
            raise ValueError(f"EarlyStopping mode must be 'min' or 'max', got {mode!r}")
        if patience < 1:
            raise ValueError(f"EarlyStopping patience must be >= 1, got {patience!r}")
        self.monitor, self.patience, self.min_delta, self.mode = monitor, patience, min_delta, mode
        self.best: float | None = None
        self.best_step: int | None = None
        # Evaluations since the best one.
        self.waited = 0

    def on_evaluate(self, trainer: Any, metrics: dict) -> None:
        if self.monitor not in metrics:
            raise ConfigError(
                f"EarlyStopping watches {self.monitor!r}, but evaluate() gives {', '.join(metrics)}: "
                "set its monitor to one of them"
            )
        value = metrics[self.monitor]
        if improves(value, self.best, mode=self.mode, min_delta=self.min_delta):
            self.best, self.best_step, self.waited = value, trainer.global_step, 0
            return
        self.waited += 1
        if self.waited >= self.patience:
            trainer.should_stop = True
            trainer.stop_reason = (
                f"EarlyStopping: {self.monitor} has not improved on {self.best:.6g} (step "
                f"{self.best_step}) for {self.waited} evaluations"
            )

    def state_dict(self) -> dict[str, Any]:
        return {"monitor": self.monitor, "best": self.best, "best_step": self.best_step, "waited": self.waited}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # A best of another figure means nothing for this one.
        if state.get("monitor") == self.monitor:
            self.best, self.best_step, self.waited = state["best"], state["best_step"], state["waited"]
