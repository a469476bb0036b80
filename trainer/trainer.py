"""The Trainer: one training loop that runs unchanged on a CPU, one GPU, a node or a cluster; the hardware is chosen at
launch, never here (docs/index.md, docs/development.md for how the parts fit)::

    trainer = Trainer(model, TrainConfig(output_dir="runs/mlp", batch_size=32, epochs=3), train_data=dataset)
    result = trainer.fit()      # {"global_step": ..., "train_loss": ..., ...}
"""

from __future__ import annotations

import contextlib
import functools
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

import torch
from torch.utils.data import DataLoader, Dataset

from trainer import parallel
from trainer.checkpoint.best import KeepBest
from trainer.checkpoint.export import export_model
from trainer.checkpoint.manager import Checkpointer
from trainer.checkpoint.parts import AccelerateState, CallbackStates, ModelPart
from trainer.checkpoint.policy import RunSetup
from trainer.config import TrainConfig
from trainer.console import banner, progress_bar, say
from trainer.data.loaders import Loaders, batches_per_epoch, examples_per_process, start_epoch
from trainer.data.mixing import MixtureShares
from trainer.data.streams import StreamPositions
from trainer.errors import DataError, peer_loss_in_a_line
from trainer.launch.preemption import PreemptionWatch
from trainer.launch.run import Run
from trainer.loop import callbacks as hooks
from trainer.loop.evaluation import Evaluator, MetricsFn
from trainer.loop.losses import LossFn, model_loss
from trainer.loop.prediction import PredictFn
from trainer.loop.step import StepRunner
from trainer.optim import build as optim
from trainer.optim.ema import WeightAverage
from trainer.state import TrainState
from trainer.telemetry.mfu import Utilisation
from trainer.telemetry.profiling import StepProfiler
from trainer.telemetry.sinks import new_run_id
from trainer.telemetry.telemetry import Telemetry

NO_BATCH = "train_data gave some process no batch in epoch {epoch}: the stream is empty, or too short for every process"


class Trainer:
    """Trains ``model`` on ``train_data`` (a Dataset, a stream or a DataLoader; None: ``evaluate`` and ``predict``
    alone) over however many processes were launched, DDP or sharded as the launch's accelerate config asks;
    ``config.batch_size`` is per process. What each keyword takes: docs/api.md."""

    def __init__(
        self,
        model: torch.nn.Module,
        config: TrainConfig,
        train_data: Optional[Dataset | DataLoader],
        *,
        eval_data: Any = None,
        loss_fn: Optional[LossFn] = None,
        metrics_fn: Optional[MetricsFn] = None,
        optimizer: Any = None,
        lr_scheduler: Any = None,
        collate_fn: Optional[Callable] = None,
        callbacks: Iterable[Any] = (),
        parallelize_fn: Optional[Callable] = None,
    ):
        # A refused launch stops before anything is built.
        run = self.run = Run.join(config)
        loss = self.loss_fn = loss_fn or model_loss
        self.config, self.accelerator = config, run.accelerator
        strategy = self.strategy = parallel.for_run(run)
        data = self.data = Loaders(run, model=model, train_data=train_data, eval_data=eval_data, collate_fn=collate_fn)
        per_epoch = None if data.train is None else batches_per_epoch(data.train)
        self.state = TrainState(per_epoch, config.gradient_accumulation_steps, run_id=new_run_id(run))
        self.total_steps = config.max_steps or config.epochs * (self.state.steps_per_epoch or 0)
        prebuilt = optim.prebuilt(optimizer, lr_scheduler)
        model = strategy.apply(model, prebuilt_optimizer=prebuilt, parallelize_fn=parallelize_fn)
        built = self.optimization = optim.build(
            model, config, optimizer=optimizer, lr_scheduler=lr_scheduler, total_steps=self.total_steps
        )
        self.optimizer, self.lr_scheduler = built.optimizer, built.scheduler
        self.model = strategy.prepare(model, self.optimizer)
        plain = self.unwrapped_model
        self.ema = WeightAverage.for_run(run, strategy, plain)
        self.telemetry = Telemetry(run, utilisation=Utilisation(run, plain))
        window, stream = self.telemetry.window, data.stream
        steps = self.steps = StepRunner(
            run, strategy, self.model, optimization=built, loss_fn=loss, window=window, ema=self.ema, stream=stream
        )
        # The step's parts the Trainer asks too: the loss's weighing, nan_policy's guard, the stall reporter.
        self.weighing, self.nonfinite, self.reporter = steps.weighing, steps.nonfinite, steps.reporter
        self.evaluator = Evaluator(
            run, strategy, plain, loss_fn=loss, metrics_fn=metrics_fn, weighing=self.weighing, data=data
        )
        # The trainer's own figures first, so that a user's on_log sees them.
        self.callbacks = [*MixtureShares.for_loader(data.train, run.dp.size), *callbacks, *StepProfiler.for_run(run)]
        # preemption: the signals fit() watches while it runs; last_eval: eval_data's latest (step, metrics).
        self.should_stop, self.stop_reason, self.stopped = False, None, None
        self.preemption, self.last_eval = None, None
        self.keep_best = KeepBest(config)
        # What a checkpoint holds, by name (trainer.checkpoint.manager).
        parts = {
            "model": ModelPart(run, plain, self.optimizer),
            "accelerate": AccelerateState(run, self.lr_scheduler),
            "train": self.state,
            "best": self.keep_best,
            "callbacks": CallbackStates(run, self.callbacks, named=hooks.stateful),
            "data": stream and StreamPositions(run, stream, self.state),
            "ema": self.ema,
            "microbatch": self.steps.split,
            "spikes": self.steps.spikes,
        }
        setup, watch = RunSetup(run, built, data=data), self.reporter.watching
        self.checkpoints = Checkpointer(run, parts=parts, setup=setup, best=self.keep_best, watch=watch)
        # Why fit() cannot go on from a loaded checkpoint (another global batch, a setting), or None.
        self.cannot_train_on = self.checkpoints.start()
        self.telemetry.open(self.state.run_id, step=self.state.step)

    def log(self, values: dict[str, float | torch.Tensor]) -> None:
        """Add figures to this process's next log (every sink, ``log_history``, the step line): each name's mean over
        its calls since the last log. A tensor is read only when the trainer logs: ``trainer.log({"aux": aux})``."""
        self.telemetry.add(values)

    def evaluate(self, data: Optional[Any] = None) -> dict[str, float]:
        """``eval_loss``, ``eval_examples`` and ``eval_<name>`` of each ``metrics_fn`` figure (``eval_perplexity`` for a
        language model): means over the whole eval set, each example counted once (``eval_<set>_...`` for named sets).
        ``data``: other data, its figures logged and returned but not judged by ``keep_best`` or ``on_evaluate``."""
        step = self.state.step
        with self.ema.swapped_in() if self.ema and self.config.ema_eval else contextlib.nullcontext():
            metrics = self.evaluator.evaluate(data, step=step)
        self.telemetry.log_evaluation(metrics, step)
        self.nonfinite.check_evaluation(metrics, step, self.last_checkpoint)
        if data is None:
            self.last_eval = (step, metrics)
            hooks.call(self.callbacks, "on_evaluate", self, metrics=metrics)
        return metrics

    def predict(self, data: Dataset, predict_fn: Optional[PredictFn] = None) -> torch.Tensor:
        """One row per example of ``data`` (a map-style Dataset), in its order, on every process (CPU, fp32) from
        ``predict_fn(model, batch)`` (default ``model(**batch).logits``): the plain module, eval mode, no gradients."""
        return self.evaluator.predict(data, predict_fn)

    def save_checkpoint(self, wait: bool = True) -> Path | str:
        """A full-state checkpoint, ``<output_dir>/checkpoints/step-<N>`` (or in checkpoint_storage); every rank calls
        it. A non-finite loss stops it first. With ``save_async`` and ``wait=False`` it is committed later."""
        # One save in flight: the last good checkpoint is the one committed.
        self.checkpoints.wait()
        self.nonfinite.check(self.telemetry.first_bad_step(), self.last_checkpoint)
        return self.checkpoints.save(self.state.step, wait=wait, evaluated=self.last_eval)

    def wait_for_checkpoint(self) -> None:
        """Until the checkpoint written in the background (``save_async``) is committed; every rank."""
        self.checkpoints.wait()

    def load_checkpoint(self, path: str | Path, verified: bool = False) -> None:
        """Continue from checkpoint ``path`` (its whole state) on any number of processes; ``fit()`` then refuses a
        different global batch (``cannot_train_on``), ``evaluate()`` and ``predict()`` take the weights as they are."""
        self.cannot_train_on = self.checkpoints.resume(Path(path), verified=verified)

    def save_model(self, directory: str | Path | None = None, merged: bool = False) -> Path:
        """Export the weights (default ``<output_dir>/final``) as transformers reads them, a PEFT model's adapter as
        PEFT does (``merged``: the base model with it folded in); every process calls it (docs/checkpoints.md)."""
        directory = Path(directory or Path(self.config.output_dir) / "final")
        export_model(self.unwrapped_model, directory, run=self.run, merged=merged)
        return directory

    def fit(self) -> dict[str, Any]:
        """Train for ``max_steps`` optimizer steps (or ``epochs``); return ``global_step``, ``epoch``, ``train_loss``
        (the last log window's mean; NaN when no step was trained), ``train_runtime_s``, ``skipped_steps``, ``stopped``
        (None, or why it stopped early) and, with eval data, ``evaluate()``'s figures. A preemption signal stops every
        rank after the same step with a checkpoint, raising ``Preempted`` (docs/launching.md#how-a-job-ends)."""
        self.data.require_train()
        if self.cannot_train_on is not None:
            raise self.cannot_train_on
        say(self.describe())
        self.evaluator.check_figures(self.keep_best.figure, self.callbacks)
        self.should_stop, self.stop_reason, self.stopped = False, None, None
        hooks.call(self.callbacks, "on_train_begin", self)
        at_step = functools.partial(self.checkpoints.of_step, save=self.save_checkpoint)
        started, self.preemption = time.perf_counter(), PreemptionWatch(self.run, save_at=at_step)
        with (
            peer_loss_in_a_line(),
            self.telemetry.closing(),
            self.checkpoints.cleaned_up_on_error(),
            self.reporter.watching(),
        ):
            if self.state.evaluation_owed and self.data.eval:
                say(f"step {self.state.step}'s evaluation, put off by the preemption for its checkpoint, runs first")
                self._evaluate_due(self.state.step, owed=True), self._save_due(self.state.step)
            self.steps.begin()
            with progress_bar(self.total_steps, self.state.step, show=self.run.main) as bar, self.preemption:
                self._train(bar)
                self.checkpoints.wait()
                return self._finish(started)

    def _train(self, bar: Any) -> None:
        state, seed = self.state, self.config.seed
        while state.step < self.total_steps and self.stopped is None:
            fresh, stepped = state.batches_into_epoch == 0, False
            loader = start_epoch(self.data.train, state.epoch, skip_batches=state.batches_into_epoch, seed=seed)
            hooks.call(self.callbacks, "on_epoch_begin", self)
            # Accumulation windows: one optimizer step each.
            for window in self.steps.windows(loader):
                self.steps.run(window, state.step + 1, measure_norm=self._logs(state.step + 1))
                state.stepped(len(window.micro_batches))
                stepped = True
                if self.steps.spiked:
                    self.steps.roll_back(self.checkpoints, state, forget=self.telemetry.forget_unlogged, bar=bar)
                    continue
                bar.update()
                self._after_step(bar)
                # The same answer on every rank.
                if signalled := self.preemption.agreed(state.step):
                    if self.telemetry.steps_unlogged:
                        self._log(bar)
                    raise self.preemption.stop(signalled, state.step, total_steps=self.total_steps)
                if state.step >= self.total_steps or self.stopped is not None:
                    break
            else:
                if fresh and not stepped:
                    raise DataError(NO_BATCH.format(epoch=state.epoch), job_wide=True)
                state.next_epoch()

    def _after_step(self, bar: Any) -> None:
        """The log and evaluation due after step ``global_step``, ``on_step_end``, then the checkpoint (of them all)."""
        step = self.state.step
        if self._logs(step):
            self.steps.phases(step, "log")
            self._log(bar)
        self._evaluate_due(step)
        hooks.call(self.callbacks, "on_step_end", self)
        self._save_due(step)

    def _evaluate_due(self, step: int, owed: bool = False) -> None:
        """The evaluation due at ``step``. A signal noted puts it off (an evaluation can outlast the launcher's grace):
        the resumed run evaluates first (``owed``) and saves the step's checkpoint again where one was due."""
        if owed or (self.config.eval_every and step % self.config.eval_every == 0 and self.data.eval):
            self.state.evaluation_owed = self.preemption.agree_now()
            if not self.state.evaluation_owed:
                self.steps.phases(step, "evaluate")
                self.evaluate()

    def _save_due(self, step: int) -> None:
        cfg = self.config
        due = cfg.save_every and (step % cfg.save_every == 0 or step == self.total_steps or self.stopped is not None)
        if due and not self.preemption.agree_now():  # a signal noted: the preemption's save comes next, not this one
            self.steps.phases(step, "checkpoint")
            self.save_checkpoint(wait=False)

    def _logs(self, step: int) -> bool:
        return step % self.config.log_every == 0 or step == self.total_steps

    def _log(self, bar: Any) -> None:
        """Every rank's window gathered once (loss, counts, timings, the stop flag and the first non-finite loss: the
        step's one agreement), then each rank's figures to its sinks; every rank stops after a step some rank asked."""
        norm, lr = self.steps.take_grad_norm(), self.steps.current_lr
        rows = self.telemetry.gather(stop=bool(self.should_stop), lr=lr, grad_norm=norm)
        self.nonfinite.raise_if_bad([row["first_bad"] for row in rows], self.last_checkpoint)
        on_log = functools.partial(hooks.call, self.callbacks, "on_log", self)
        view = self.telemetry.log(rows, state=self.state, total_steps=self.total_steps, on_log=on_log, progress=bar)
        self.preemption.pace(view["global/step_time_max_s"])
        if self.stopped is None and (stopped := hooks.asked_to_stop(rows, self.stop_reason)):
            self.stopped = stopped
            say(f"stopping at step {self.state.step} of {self.total_steps}: {stopped}")

    def _finish(self, started: float) -> dict[str, Any]:
        self.nonfinite.check(self.telemetry.first_bad_step(), self.last_checkpoint)
        skipped, stopped = self.nonfinite.skipped_steps, self.stopped
        result = self.telemetry.result(self.state, started=started, skipped=skipped, stopped=stopped)
        if self.data.eval:
            evaluated_now = self.last_eval is not None and self.last_eval[0] == self.state.step
            result.update(self.last_eval[1] if evaluated_now else self.evaluate())
        # final/: the best evaluation's weights, or with ema_final their average.
        self.checkpoints.load_best(self.state.step)
        if self.ema is not None and self.config.ema_final:
            self.ema.copy_to_model()
        self.save_model()
        hooks.call(self.callbacks, "on_train_end", self, result=result)
        return result

    def describe(self) -> str:
        """What ``fit()`` is about to do, as it says at its start: the launch, the global batch, steps, optimizer."""
        share, weighs = examples_per_process(self.data.train), self.weighing.counts_tokens
        words = dict(share=share, weighs=weighs, words=self.optimization.words, callbacks=self.callbacks)
        return banner(self.strategy.describe(), self.config, self.state, total_steps=self.total_steps, **words)

    # What a callback reads of where training stands.
    unwrapped_model = property(lambda self: self.strategy.unwrap(self.model), doc="The plain module, on every rank.")
    global_step = property(lambda self: self.state.step, doc="Optimizer steps taken.")
    epoch = property(lambda self: self.state.epoch, doc="The epoch being read.")
    epoch_progress = property(lambda self: self.state.epoch_progress, doc="Epochs done, as a fraction.")
    batches_per_epoch = property(lambda self: self.state.batches_per_epoch, doc="This process's, None for a stream.")
    global_batch_size = property(lambda self: self.run.global_batch, doc="Examples an optimizer step takes.")
    step_lr = property(lambda self: self.steps.lr, doc="The lr the last optimizer step used.")
    log_history = property(lambda self: self.telemetry.log_history, doc="Each log's step figures, on this rank.")
    last_checkpoint = property(lambda self: self.checkpoints.last, doc="The newest checkpoint committed or loaded.")
    best = property(lambda self: self.keep_best.best, doc="keep_best's {figure, value, step}, or None.")
    best_checkpoint = property(lambda self: self.checkpoints.best_checkpoint(), doc="keep_best's checkpoint, or None.")
