"""Callbacks: any object with some of the Trainer's hook methods, called in order; one with ``state_dict()`` and
``load_state_dict()`` is also checkpointed and gets its state back at a resume. Shipped here: ``EarlyStopping``,
and ``KeepBest``, the trainer's own ``keep_best``.

Hooks, each called as ``hook(trainer, ...)``: ``on_train_begin``, ``on_epoch_begin``, ``on_step_end`` (after that
step's logging, evaluation and checkpoint), ``on_log(metrics)``, ``on_evaluate(metrics)``, ``on_train_end(result)``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Iterable, Optional

from trainer.errors import ConfigError
from trainer.telemetry.console import warn


def call(callbacks: Iterable[Any], hook: str, trainer: Any, **kwargs: Any) -> None:
    """``hook`` of every callback that has it, in order."""
    for callback in callbacks:
        method = getattr(callback, hook, None)
        if method is not None:
            method(trainer, **kwargs)


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
    stops after its next step that logs, with a checkpoint when ``save_every`` is set. Its count is checkpointed: a
    resumed run goes on waiting where it stopped. Needs ``eval_every`` (or calls of ``evaluate()``)::

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

    def on_evaluate(self, trainer: Any, metrics: dict) -> None:
        if self.monitor not in metrics:
            raise ConfigError(
                f"EarlyStopping watches {self.monitor!r}, but evaluate() gives {', '.join(metrics)}: "
                "set its monitor to one of them"
            )
        value = metrics[self.monitor]
        if improves(value, self.best, self.mode, self.min_delta):
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
        if state.get("monitor") == self.monitor:  # a best of another figure means nothing for this one
            self.best, self.best_step, self.waited = state["best"], state["best_step"], state["waited"]


class KeepBest:
    """``keep_best``: which evaluation is the best so far (``{"figure", "value", "step"}``, checkpointed), so that
    its checkpoint is kept apart from ``keep_last``; with ``load_best_at_end``, its weights end the run."""

    def __init__(self, figure: str, mode: str, load_at_end: bool):
        self.figure, self.mode, self.load_at_end = figure, mode, load_at_end
        self.best: Optional[dict[str, Any]] = None

    def judge(self, step: int, metrics: dict[str, float]) -> bool:
        """Whether step ``step``'s evaluation (``metrics``) is the best yet; then it is recorded."""
        if self.figure not in metrics:
            raise ConfigError(
                f"keep_best is {self.figure!r}, but evaluate() gives {', '.join(metrics)}: set keep_best to one of them"
            )
        value = metrics[self.figure]
        if not improves(value, self.best and self.best["value"], self.mode):
            return False
        self.best = {"figure": self.figure, "value": value, "step": step}
        return True

    def loads_at(self, step: int) -> bool:
        """Whether the run ending at ``step`` reads the best evaluation's checkpoint back (an earlier step's)."""
        return self.load_at_end and self.best is not None and self.best["step"] != step

    def load_best(
        self,
        checkpoint: Optional[Path],
        step: int,
        load_weights: Callable[[Path], None],
        say: Callable[[str], None],
        damage: Optional[str] = None,
    ) -> None:
        """At the end of ``fit()``, before the model is exported: the best evaluation's weights (those of
        ``checkpoint``, which the ``best`` pointer names) back in the model, said in one line. Every rank.
        ``damage``: why that checkpoint is not whole; then final/ keeps the last step's weights, and says why."""
        if not self.load_at_end or self.best is None:
            return
        figure = f"{self.best['figure']} {self.best['value']:.6g}"
        if damage is not None:
            warn(
                f"load_best_at_end: {damage}: final/ holds the last step's weights, {step}, not the best "
                f"evaluation's (step {self.best['step']}, {figure}); that checkpoint is left as it is",
                main_only=True,
            )
            return
        if checkpoint is None and self.best["step"] != step:
            say(
                f"load_best_at_end: the best evaluation's checkpoint (step {self.best['step']}, {figure}) is not "
                f"among this output_dir's checkpoints: final/ holds the last step's weights, {step}"
            )
            return
        if self.best["step"] == step:
            say(f"the best evaluation is this last step's ({figure}): final/ holds its weights")
            return
        load_weights(checkpoint)
        say(
            f"load_best_at_end: final/ holds the weights of step {self.best['step']}, the best evaluation "
            f"({figure}), not those of the last step, {step}"
        )

    def state_dict(self) -> Optional[dict[str, Any]]:
        return self.best

    def load_state_dict(self, state: Optional[dict[str, Any]]) -> None:
        self.best = state
