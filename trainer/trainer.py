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
from trainer.data.loaders import Loaders, batches_per_epoch, examples_per_process, start_epoch
from trainer.data.mixing import MixtureShares
from trainer.data.streams import StreamPositions
from trainer.errors import DataError, peer_loss_in_a_line
from trainer.launch.preemption import PreemptionWatch, stop
from trainer.launch.run import Run
from trainer.loop import callbacks as hooks
from trainer.loop.evaluation import Evaluator, MetricsFn
from trainer.loop.losses import LossFn, model_loss
from trainer.loop.prediction import PredictFn
from trainer.loop.state import TrainerView, TrainState
from trainer.loop.step import StepRunner
from trainer.optim import build as optim
from trainer.optim.ema import WeightAverage
from trainer.telemetry.console import banner, progress_bar, say
from trainer.telemetry.mfu import Utilisation
from trainer.telemetry.profiling import StepProfiler
from trainer.telemetry.sinks import new_run_id
from trainer.telemetry.telemetry import Telemetry

FINISHED = "already finished at step {step} of {total}: nothing to train; raise max_steps (or epochs) to train on"
NO_BATCH = "train_data gave some process no batch in epoch {epoch}: the stream is empty, or too short for every process"


class Trainer(TrainerView):
    """Trains ``model`` on ``train_data`` across however many processes were launched: DDP, or the model sharded
    over them (FSDP2, HSDP, tensor parallelism) as the launch's accelerate config asks. ``config.batch_size`` is per
    process; ``train_data`` a Dataset, a stream or a DataLoader (None: ``evaluate`` and ``predict`` alone); the
    keywords are ``eval_data``, ``loss_fn``, ``metrics_fn``, ``optimizer``, ``lr_scheduler`` (each a factory or
    built from the config), ``collate_fn``, ``callbacks`` and ``parallelize_fn``: docs/api.md says what each takes.
    """

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
        self.steps = StepRunner(
            run, strategy, self.model, optimization=built, loss_fn=loss, window=window, ema=self.ema, stream=stream
        )
        self.evaluator = Evaluator(
            run, strategy, plain, loss_fn=loss, metrics_fn=metrics_fn, weighing=self.steps.weighing, data=data
        )
        # The trainer's own figures first, so that a user's on_log sees them.
        self.callbacks = [*MixtureShares.for_loader(data.train, run.dp.size), *callbacks, *StepProfiler.for_run(run)]
        self.should_stop, self.stop_reason, self.stopped = False, None, None
        # preemption: the signals fit() watches while it runs; last_eval: eval_data's latest (step, metrics).
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
        }
        setup, watch = RunSetup(run, built, data=data), self.steps.reporter.watching
        self.checkpoints = Checkpointer(run, parts=parts, setup=setup, best=self.keep_best, watch=watch)
        # Why fit() cannot go on from a loaded checkpoint (another global batch, a setting), or None.
        self.cannot_train_on = self.checkpoints.start()
        self.telemetry.open(self.state.run_id, step=self.state.step)

    def log(self, values: dict[str, float | torch.Tensor]) -> None:
        """Add figures to this process's next log (every sink, ``log_history``, the step line): each name's mean over
        its calls since the last log. A tensor is read only when the trainer logs: ``trainer.log({"aux": aux})``."""
        self.telemetry.figures.add(values)

    def evaluate(self, data: Optional[Any] = None) -> dict[str, float]:
        """``eval_loss``, ``eval_examples``, ``eval_<name>`` of each ``metrics_fn`` figure (``eval_perplexity`` for a
        language model's own loss): means over the whole eval set, every example counted once whatever the process
        count; for named sets ``eval_<set>_loss``, ... ``data``: other data than ``eval_data``, whose figures are
        logged and returned but not judged by ``keep_best`` or the callbacks' ``on_evaluate``."""
        step = self.state.step
        with self.ema.swapped_in() if self.ema and self.config.ema_eval else contextlib.nullcontext():
            metrics = self.evaluator.evaluate(data, step=step)
        self.telemetry.log_evaluation(metrics, step)
        self.steps.nonfinite.check_evaluation(metrics, step, str(self.last_checkpoint or ""))
        if data is None:
            self.last_eval = (step, metrics)
            hooks.call(self.callbacks, "on_evaluate", self, metrics=metrics)
        return metrics

    def predict(self, data: Dataset, predict_fn: Optional[PredictFn] = None) -> torch.Tensor:
        """One row per example of ``data`` (a map-style Dataset), in dataset order, on every process (CPU, fp32);
        ``predict_fn(model, batch) -> tensor`` (default ``model(**batch).logits``) runs on the plain module in eval
        mode, without gradients, under the launch's autocast."""
        return self.evaluator.predict(data, predict_fn)

    def save_checkpoint(self, wait: bool = True) -> Path | str:
        """A full-state checkpoint, ``<output_dir>/checkpoints/step-<N>`` (or in checkpoint_storage); every rank calls
        it. A non-finite loss stops it first. With ``save_async`` and ``wait=False`` it is committed later."""
        # One save in flight: the last good checkpoint is the one committed.
        self.checkpoints.wait()
        self.steps.nonfinite.check(self.telemetry.window.first_bad_step(), str(self.last_checkpoint or ""))
        return self.checkpoints.save(self.state.step, wait=wait, evaluated=self.last_eval)

    def wait_for_checkpoint(self) -> None:
        """Until the checkpoint written in the background (``save_async``) is committed; every rank."""
        self.checkpoints.wait()

    def load_checkpoint(self, path: str | Path, verified: bool = False) -> None:
        """Continue from checkpoint ``path`` (weights, optimizer, schedule, RNG, the position in the data, every
        stateful callback), on any number of processes and batch size; ``fit()`` then refuses a different global
        batch (``cannot_train_on``), while ``evaluate()`` and ``predict()`` use the weights as they are."""
        self.cannot_train_on = self.checkpoints.resume(Path(path), verified=verified)

    def save_model(self, directory: str | Path | None = None, merged: bool = False) -> Path:
        """Export the weights to ``<output_dir>/final`` by default: ``model.safetensors`` (past 5 GB numbered files
        and an index) and a transformers model's config, written a file at a time by the main process; a PEFT model's
        adapter, or with ``merged`` its base model with the adapter folded in. Every process calls it."""
        directory = Path(directory or Path(self.config.output_dir) / "final")
        export_model(self.unwrapped_model, directory, run=self.run, merged=merged)
        return directory

    best_checkpoint = property(
        lambda self: self.checkpoints.best_checkpoint(),
        doc="With ``keep_best``: the checkpoint of the best evaluation so far (``load_checkpoint`` it), else None.",
    )

    def fit(self) -> dict[str, Any]:
        """Train for ``max_steps`` optimizer steps, or ``epochs`` epochs; return ``global_step``, ``epoch``,
        ``train_loss`` (the last log window's mean; NaN when no step was trained), ``train_runtime_s``,
        ``skipped_steps``, ``stopped`` (None, or why it stopped early) and, with eval data, ``evaluate()``'s figures.
        A preemption signal on any rank stops every rank after the same step with a checkpoint, raising ``Preempted``
        (exit status 75; run it again with ``resume="auto"``); one after the last step lets final/ be written first."""
        self.data.require_train()
        if self.cannot_train_on is not None:
            raise self.cannot_train_on
        say(self.describe())
        self.evaluator.check_figures(self.keep_best.figure, self.callbacks)
        self.should_stop, self.stop_reason, self.stopped = False, None, None
        if self.state.step >= self.total_steps:
            say(FINISHED.format(step=self.state.step, total=self.total_steps))
        hooks.call(self.callbacks, "on_train_begin", self)
        started, self.preemption = time.perf_counter(), PreemptionWatch.of(self)
        with (
            peer_loss_in_a_line(),
            self.telemetry.closing(),
            self.checkpoints.cleaned_up_on_error(),
            self.steps.reporter.watching(),
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
        state = self.state
        while state.step < self.total_steps and self.stopped is None:
            skip, seed = state.batches_into_epoch, self.config.seed
            loader = start_epoch(self.data.train, state.epoch, skip_batches=skip, seed=seed)
            fresh, stepped = skip == 0, False
            hooks.call(self.callbacks, "on_epoch_begin", self)
            # Accumulation windows: one optimizer step each.
            for window in self.steps.windows(loader):
                self.steps.run(window, state.step + 1, measure_norm=self._logs(state.step + 1))
                state.stepped(len(window.micro_batches))
                stepped = True
                bar.update()
                self._after_step(bar)
                # The same answer on every rank.
                if signalled := self.preemption.agreed(state.step):
                    if self.telemetry.window.steps:
                        self._log(bar)
                    now = functools.partial(self.checkpoints.of_step, state.step, self.save_checkpoint)
                    raise stop(signalled, state.step, total_steps=self.total_steps, checkpoint_now=now, run=self.run)
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
        self.steps.nonfinite.raise_if_bad([row["first_bad"] for row in rows], str(self.last_checkpoint or ""))
        on_log = functools.partial(hooks.call, self.callbacks, "on_log", self)
        total = self.total_steps
        global_view = self.telemetry.log(rows, state=self.state, total_steps=total, on_log=on_log, progress=bar)
        self.preemption.pace(global_view["global/step_time_max_s"])
        if self.stopped is None and (stopped := hooks.asked_to_stop(rows, self.stop_reason)):
            self.stopped = stopped
            say(f"stopping at step {self.state.step} of {self.total_steps}: {stopped}")

    def _finish(self, started: float) -> dict[str, Any]:
        nonfinite = self.steps.nonfinite
        nonfinite.check(self.telemetry.window.first_bad_step(), str(self.last_checkpoint or ""))
        skipped, stopped = nonfinite.skipped_steps, self.stopped
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
        share, weighs = examples_per_process(self.data.train), self.steps.weighing.counts_tokens
        words = dict(share=share, weighs=weighs, words=self.optimization.words, callbacks=self.callbacks)
        return banner(self.strategy.describe(), self.config, self.state, total_steps=self.total_steps, **words)
