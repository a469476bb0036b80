"""``keep_best``: the checkpoint of the best evaluation so far, kept apart from ``keep_last`` (the ``best`` pointer
names it), and with ``load_best_at_end`` the weights ``fit()`` ends with (docs/checkpoints.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Optional

from trainer.console import say, warn
from trainer.errors import ConfigError


def improves(value: float, best: float | None, mode: str, *, min_delta: float = 0.0) -> bool:
    """``value`` beats ``best`` (None: nothing yet) by more than ``min_delta``: lower with mode "min", higher with
    "max". EarlyStopping and keep_best both judge by it."""
    if best is None:
        return True
    return value < best - min_delta if mode == "min" else value > best + min_delta


class KeepBest:
    """``keep_best``: which evaluation is the best so far (``{"figure", "value", "step"}``, checkpointed), so that
    its checkpoint is kept apart from ``keep_last``; with ``load_best_at_end``, its weights end the run."""

    def __init__(self, config: Any):
        self.figure, self.mode = config.keep_best, config.keep_best_mode
        self.load_at_end = config.load_best_at_end is not False
        self.best: Optional[dict[str, Any]] = None

    def judge(self, step: int, metrics: dict[str, float]) -> bool:
        """Whether step ``step``'s evaluation (``metrics``) is the best yet; then it is recorded."""
        if self.figure not in metrics:
            raise ConfigError(
                f"keep_best is {self.figure!r}, but evaluate() gives {', '.join(metrics)}: set keep_best to one of them"
            )
        value = metrics[self.figure]
        if not improves(value, self.best and self.best["value"], mode=self.mode):
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
        *,
        load_weights: Callable[[Path], None],
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
        number = (int, float)
        if state is not None and not (
            isinstance(state, dict)
            and type(state.get("step")) is int
            and isinstance(state.get("value"), number)
            and isinstance(state.get("figure"), str)
        ):
            raise ValueError(f"the keep_best record is {state!r}, not {{'figure': name, 'value': number, 'step': n}}")
        self.best = state
