"""The Trainer: one training loop on Accelerate that runs unchanged on a CPU, one GPU, a node or a cluster; the
hardware is chosen at launch (``accelerate launch --config_file accelerate_configs/<yours>.yaml train.py``,
``torchrun``, or plain ``python train.py``), never here::

    trainer = Trainer(model, TrainConfig(output_dir="runs/mlp", batch_size=32, epochs=3), train_data=dataset)
    result = trainer.fit()      # {"global_step": ..., "train_loss": ..., ...}

The Trainer composes parts that each own their state, and holds the loop: ``Parallelism`` (DDP or FSDP2, and the
data-parallel coordinates), the loaders (``trainer.data.loaders``), ``StepRunner`` (one optimizer step), ``TrainState``
(where training stands), ``Telemetry`` (logs and sinks), ``Evaluator``, ``Checkpointer`` (a registry of everything
with state) and the callbacks.
"""

from __future__ import annotations

import contextlib
import functools
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

import torch
from accelerate.utils import set_seed
from torch.utils.data import DataLoader, Dataset

from trainer.checkpoint.manager import Checkpointer
from trainer.checkpoint.policy import RunSetup, find_resume_point
from trainer.checkpoint.store import best_checkpoint, check_writable, checkpoint_root
from trainer.config import TrainConfig
from trainer.data.loaders import batches_per_epoch, data_loader, examples_per_process, start_epoch
from trainer.data.streams import StreamShard
from trainer.errors import ConfigError, DataError, peer_loss_in_a_line
from trainer.launch.agreement import host_group
from trainer.launch.preemption import PreemptionWatch, stop
from trainer.loop import callbacks as hooks
from trainer.loop.evaluation import Evaluator, MetricsFn, PredictFn, named_sets
from trainer.loop.losses import LossFn, model_loss
from trainer.loop.microbatch import MicroBatchSplit
from trainer.loop.state import TrainState
from trainer.loop.step import StepRunner
from trainer.optim import build as optim
from trainer.optim.ema import WeightAverage
from trainer.parallel.strategy import Parallelism
from trainer.telemetry.console import banner, progress_bar, say
from trainer.telemetry.mfu import Utilisation
from trainer.telemetry.profiling import StepProfiler
from trainer.telemetry.sinks import new_run_id
from trainer.telemetry.stall import watch_stalls
from trainer.telemetry.telemetry import Telemetry


class Trainer:
    """Trains ``model`` on ``train_data`` across however many processes were launched: DDP, or the model sharded
    over them (FSDP2, HSDP, tensor parallelism) as the launch's accelerate config asks (``trainer.parallel.strategy``).

    Args:
        model: a plain ``torch.nn.Module``, built the same way on every process.
        config: a ``TrainConfig``; ``batch_size`` is per process.
        train_data: a map-style Dataset (each process its share, as DistributedSampler deals it), a stream (an
            IterableDataset, with ``max_steps``: ``trainer.data.streams``) or a DataLoader used as is
            (``trainer.data.loaders``). None: a Trainer for ``evaluate`` and ``predict`` alone (of a checkpoint:
        ``resume``). eval_data: optional Dataset, IterableDataset or DataLoader for ``evaluate``, each example counted
            once; or a dict of them by name, each evaluated apart (``eval_<name>_loss``, ...).
        loss_fn: ``loss_fn(model, batch) -> scalar tensor`` (a mean), or ``-> (loss_sum, count)`` to weigh every
            item it counts alike across the global batch (``trainer.loop.weighing``); default ``model(**batch).loss``,
            which for a transformers model weighs every counted token alike. It runs under the launch's autocast, on
            the prepared (DDP) model in training and the plain module in evaluation.
        metrics_fn: ``metrics_fn(model, batch) -> {name: tensor of shape [batch]}``, one number per example (say
            ``(logits.argmax(-1) == labels).float()``); ``evaluate`` adds ``eval_<name>``, its mean.
        optimizer: built from ``config`` when not given; or a factory, ``optimizer(parameter_groups)`` (say
            ``lambda groups: torch.optim.AdamW(groups, lr=6e-4, betas=(0.9, 0.95))``), called with the config's
            weight-decay groups once the model is wrapped or sharded: a sharded model takes a factory, not an
            optimizer already built over the unsharded parameters.
        lr_scheduler: built from ``config`` when not given; or a factory, ``lr_scheduler(optimizer, total_steps)``;
            stepped once a step.
        collate_fn: how the trainer's loaders batch examples (say ``DataCollatorWithPadding(tokenizer)``); an
            unformatted ``datasets.Dataset`` is readied as transformers' Trainer does (``trainer.data.columns``).
        callbacks: objects with some of the hooks of ``trainer.loop.callbacks``; one with ``state_dict`` and
            ``load_state_dict`` gets its state back at a resume. To stop early, a callback on any rank sets
            ``trainer.should_stop = True`` (and ``trainer.stop_reason``): every rank stops after the next step that
            logs, checkpointed when ``save_every`` is set, and ``fit()`` says why (``EarlyStopping``).
        parallelize_fn: with ``tp_size`` in the launch's parallelism_config, ``parallelize_fn(model, tp_mesh)``
            splits a model that has no tensor-parallel plan of its own (``trainer.parallel.tensor_parallel``).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        config: TrainConfig,
        train_data: Optional[Dataset | DataLoader],
        eval_data: Optional[Dataset | DataLoader] = None,
        loss_fn: Optional[LossFn] = None,
        metrics_fn: Optional[MetricsFn] = None,
        optimizer: Optional[torch.optim.Optimizer] = None,
        lr_scheduler: Optional[Any] = None,
        collate_fn: Optional[Callable] = None,
        callbacks: Iterable[Any] = (),
        parallelize_fn: Optional[Callable] = None,
    ):
        self.config, self.collate_fn, self.callbacks = config, collate_fn, list(callbacks)
        self.parallel = Parallelism(config)  # a refused FSDP config stops before anything starts
        acc = self.accelerator = self.parallel.accelerator
        check_writable(config.output_dir)
        set_seed(config.seed, device_specific=True)  # dropout etc.: reproducible, different on each rank
        self.loss_fn = loss_fn or model_loss
        loader = functools.partial(
            data_loader, config=config, accelerator=acc, dp=self.parallel.dp, collate_fn=collate_fn
        )
        train_loader = None if train_data is None else loader(train_data, model, "train_data")  # None: no fit()
        eval_loaders = {
            name: loader(part, model, f"eval_data[{name!r}]" if name else "eval_data", evaluation=True)
            for name, part in named_sets(eval_data).items()
        }
        per_epoch = None if train_loader is None else batches_per_epoch(train_loader)  # (a stream has no len())
        self.state = TrainState(per_epoch, config.gradient_accumulation_steps)
        self.total_steps = config.max_steps or config.epochs * (self.state.steps_per_epoch or 0)
        model = self.parallel.apply(model, optim.prebuilt(optimizer, lr_scheduler), parallelize_fn)
        optimizer, lr_scheduler, self.optimization = optim.build(
            model, config, optimizer, lr_scheduler, self.total_steps
        )
        self.model, self.optimizer, self.train_loader, self.lr_scheduler = self.parallel.prepare(
            model, optimizer, train_loader, lr_scheduler
        )
        self.eval_loaders = {name: acc.prepare(part) for name, part in eval_loaders.items()}  # '': the one set
        self.ema = WeightAverage.for_config(config, self.unwrapped_model)  # None without ema_decay
        self.host = host_group(acc.num_processes, config.collective_timeout_s)  # agreements off the device
        self.stream = getattr(self.train_loader, "dataset", None)
        self.stream = self.stream if isinstance(self.stream, StreamShard) else None
        self.telemetry = Telemetry(acc, self.parallel.dp.size)
        self.steps = StepRunner(
            self.model,
            self.optimizer,
            self.lr_scheduler,
            self.loss_fn,
            self.parallel,
            self.telemetry.window,
            config,
            self.optimization,
            self.host if self.stream else None,
        )
        self.weighing, self.nonfinite, self.autocast = self.steps.weighing, self.steps.nonfinite, self.steps.autocast
        self.steps.average = self.ema
        self.steps.split = MicroBatchSplit.for_run(config, self.parallel, self.host, self.model)  # (auto_microbatch)
        if (profiler := StepProfiler.for_run(config, acc)) is not None:  # profile_steps
            self.callbacks.append(profiler)
        self.telemetry.utilisation = Utilisation(self.unwrapped_model, config, acc.device, acc.num_processes)
        self.evaluator = Evaluator(
            self.unwrapped_model,
            self.loss_fn,
            metrics_fn,
            acc,
            self.parallel.dp,
            self.autocast,
            self.weighing.count,
            self.parallel.lockstep,
            self.host,
            functools.partial(loader, model=self.unwrapped_model, evaluation=True),
        )
        self.keep_best = hooks.KeepBest(config.keep_best, config.keep_best_mode, config.load_best_at_end is not False)
        self.should_stop, self.stop_reason, self.stopped = False, None, None  # stop_reason: said with the stop
        self.preemption: Optional[PreemptionWatch] = None  # while fit() runs: the signals it watches
        self.last_eval: Optional[tuple[int, dict[str, float]]] = None  # eval_data's latest evaluate(): (step, metrics)
        setup = RunSetup(
            config,
            self.parallel.dp.size,
            optimizer,
            lr_scheduler,
            self.optimization,
            bool(self.stream),
            acc.mixed_precision,
        )
        self.checkpoints = Checkpointer.for_run(
            config,
            acc,
            setup,
            self.parallel.model_state(self.model, optimizer),
            self.lr_scheduler,
            self.state,
            self.keep_best,
            self.callbacks,
            self.stream,
            self.host,
        )
        for name, part in (("ema", self.ema), ("microbatch", self.steps.split)):
            if part is not None:
                self.checkpoints.register(name, part)
        self.state.run_id, self.cannot_train_on = new_run_id(acc), None  # cannot_train_on: a loaded checkpoint's
        if (point := self.checkpoints.resume_point(lambda: find_resume_point(config))) is not None:
            self.load_checkpoint(point, verified=True)
        elif config.resume == "auto":
            say(f"resume='auto': no checkpoint in {checkpoint_root(config.output_dir).resolve()}: starting fresh")
        self.telemetry.open(config, self.state.run_id, self.state.step)

    # ---------------------------------------------------------------- the public API, each a line or two

    def log(self, values: dict[str, float | torch.Tensor]) -> None:
        """Add figures to this process's next log (every sink, ``log_history``, the step line): each name's mean
        over its calls since the last log, from any rank and anywhere in ``fit()``. A tensor is read only when the
        trainer logs, so logging one every step adds no host sync: ``trainer.log({"aux_loss": aux_loss})``."""
        self.telemetry.figures.add(values)

    def evaluate(self, data: Optional[Any] = None) -> dict[str, float]:
        """``eval_loss``, ``eval_examples``, ``eval_<name>`` of each ``metrics_fn`` figure (and ``eval_perplexity``
        for a language model's own loss): means over the whole eval set, every example counted once whatever the
        process count (``trainer.loop.evaluation``); for named sets (``eval_data={"val": ..., "test": ...}``)
        ``eval_val_loss``, ``eval_test_loss``, ... ``data``: other data than ``eval_data`` (a set or a dict), whose
        figures are logged and returned but not judged: ``keep_best`` and the callbacks' ``on_evaluate``
        (``EarlyStopping``) follow the evaluations of ``eval_data`` alone."""
        loaders = self.eval_loaders if data is None else self.evaluator.loaders(data)
        with self.ema.swapped_in() if self.ema and self.config.ema_eval else contextlib.nullcontext():
            step, metrics = self.state.step, self.evaluator.evaluate(loaders, self.state.step)
        self.telemetry.log_evaluation(metrics, step)
        self.nonfinite.check_evaluation(metrics, step, str(self.last_checkpoint or ""))
        if data is None:
            self.last_eval = (step, metrics)
            hooks.call(self.callbacks, "on_evaluate", self, metrics=metrics)
        return metrics

    def predict(self, data: Dataset, predict_fn: Optional[PredictFn] = None) -> torch.Tensor:
        """One row per example of ``data`` (a map-style Dataset), in dataset order, on every process (CPU, fp32);
        ``predict_fn(model, batch) -> tensor`` (default ``model(**batch).logits``) runs on the plain module in eval
        mode, without gradients, under the launch's autocast (``trainer.loop.evaluation``)."""
        return self.evaluator.predict(data, predict_fn)

    def save_checkpoint(self, wait: bool = True) -> Path:
        """A full-state checkpoint (every registered part: ``trainer.checkpoint.manager``) under
        ``<output_dir>/checkpoints/step-<N>``; call it on every rank. A non-finite loss stops it first. With
        ``save_async`` and ``wait=False`` it is committed later; the folder it will be is returned."""
        self.checkpoints.wait()  # one save in flight: the last good checkpoint is the one committed
        self.nonfinite.check(self.telemetry.window.first_bad_step(), str(self.last_checkpoint or ""))
        if self.config.keep_best is not None and self.last_eval is not None and self.last_eval[0] == self.state.step:
            self.keep_best.judge(*self.last_eval)  # the record this checkpoint holds, which the best pointer follows
        return self.checkpoints.save(self.state.step, wait=wait)

    def wait_for_checkpoint(self) -> None:
        """Until the checkpoint written in the background (``save_async``) is committed; every rank."""
        self.checkpoints.wait()

    def load_checkpoint(self, path: str | Path, verified: bool = False) -> None:
        """Continue from checkpoint ``path``: weights, optimizer, schedule, RNG, the position in the data, every
        stateful callback. On any number of processes and batch size; ``fit()`` then refuses a different global
        batch (``cannot_train_on``), while ``evaluate()`` and ``predict()`` use the weights as they are."""
        self.cannot_train_on = self.checkpoints.resume(Path(path), verified)

    def save_model(self, directory: str | Path | None = None, merged: bool = False) -> Path:
        """Export the weights once, from the global main process, to ``<output_dir>/final`` by default:
        ``model.safetensors`` (past 5 GB numbered files and an index) and a transformers model's config, written a
        file at a time (``trainer.tools.export``); a PEFT model's adapter, or with ``merged`` its base model with the
        adapter folded in (the whole model gathered on the main process's CPU). Every process calls it."""
        directory = Path(directory or Path(self.config.output_dir) / "final")
        self.model_state.export(directory, self.accelerator.wait_for_everyone, merged)
        return directory

    @property
    def unwrapped_model(self) -> torch.nn.Module:
        """The plain module without the DDP (or torch.compile) wrapper: the same weights on every rank."""
        return self.parallel.unwrap(self.model)

    @property
    def best_checkpoint(self) -> Optional[Path]:
        """With ``keep_best``: the checkpoint of the best evaluation so far (``load_checkpoint`` it), else None."""
        return best_checkpoint(checkpoint_root(self.config.output_dir), self.keep_best.best)

    global_step = property(lambda self: self.state.step, doc="Optimizer steps taken.")
    epoch = property(lambda self: self.state.epoch, doc="The epoch being read.")
    batches_per_epoch = property(lambda self: self.state.batches_per_epoch, doc="This process's, None for a stream.")
    step_lr = property(lambda self: self.steps.lr, doc="The lr the last optimizer step used.")
    epoch_progress = property(lambda self: self.state.epoch_progress, doc="Epochs done, as a fraction.")
    global_batch_size = property(lambda self: self.checkpoints.setup.split.global_batch, doc="Examples per step.")
    best = property(lambda self: self.keep_best.best, doc="keep_best's {figure, value, step}, or None.")
    last_checkpoint = property(lambda self: self.checkpoints.last, doc="The newest checkpoint committed or loaded.")
    log_history = property(lambda self: self.telemetry.log_history, doc="Each log's step figures, on this rank.")
    model_state = property(lambda self: self.checkpoints.parts["model"], doc="The model as checkpoints hold it.")

    # ------------------------------------------------------------------ training

    def fit(self) -> dict[str, Any]:
        """Train for ``max_steps`` optimizer steps, or ``epochs`` epochs; return ``global_step``, ``epoch``,
        ``train_loss`` (the last log window's mean; NaN when no step was trained), ``train_runtime_s``,
        ``skipped_steps``, ``stopped`` (None, or why it stopped early) and, with eval data, ``evaluate()``'s figures.
        A preemption signal on any rank stops every rank after the same step, with a checkpoint, raising
        ``trainer.Preempted`` (exit status 75): run it again with ``resume="auto"`` to continue."""
        if self.train_loader is None:
            raise ConfigError(
                "fit(): this Trainer was built with train_data=None, for evaluate() and predict() "
                "alone: pass train_data to train"
            )
        if self.cannot_train_on is not None:
            raise self.cannot_train_on  # the checkpoint's global batch or settings differ (trainer.resume_policy)
        say(self.describe())
        self.should_stop, self.stop_reason, self.stopped = False, None, None  # a second fit() trains on
        if self.state.step >= self.total_steps:  # resumed from a checkpoint of a run that already ended
            say(
                f"already finished at step {self.state.step} of {self.total_steps}: nothing to train; raise "
                "max_steps (or epochs) to train on"
            )
        hooks.call(self.callbacks, "on_train_begin", self)
        cfg, acc, started = self.config, self.accelerator, time.perf_counter()
        self.preemption = PreemptionWatch(cfg.signal_names, cfg.preemption_grace_s, self.host)
        with (
            peer_loss_in_a_line(),
            self.telemetry.closing(),
            self.checkpoints.cleaned_up_on_error(),
            watch_stalls(acc, cfg.stall_warning_s, cfg.preemption_grace_s) as self.steps.phases.reporter,
        ):
            self.steps.begin()
            with progress_bar(self.total_steps, self.state.step, show=acc.is_main_process) as bar, self.preemption:
                self._train(bar)
            self.checkpoints.wait()
            return self._finish(started)

    def _train(self, bar: Any) -> None:
        state = self.state
        while state.step < self.total_steps and self.stopped is None:
            loader = start_epoch(self.train_loader, state.epoch, state.batches_into_epoch, self.config.seed)
            fresh, stepped = state.batches_into_epoch == 0, False
            hooks.call(self.callbacks, "on_epoch_begin", self)
            for window in self.steps.windows(loader):  # accumulation windows: one optimizer step each
                self.steps.run(window, state.step + 1, measure_norm=self._logs(state.step + 1))
                state.stepped(len(window.micro_batches))
                stepped = True
                bar.update()
                self._after_step(bar)
                if signal_number := self.preemption.agreed(state.step):  # the same answer on every rank
                    if self.telemetry.window.steps:
                        self._log(bar)
                    now = functools.partial(self.checkpoints.of_step, state.step, self.save_checkpoint)
                    raise stop(
                        signal_number, state.step, self.total_steps, now, self.config.slurm_requeue, self.accelerator
                    )
                if state.step >= self.total_steps or self.stopped is not None:
                    break
            else:
                if fresh and not stepped:  # a stream that ended before its first batch on some process
                    raise DataError(
                        f"train_data gave some process no batch in epoch {state.epoch}: the stream is "
                        "empty, or too short for every process to get a batch",
                        job_wide=True,
                    )
                state.next_epoch()

    def _after_step(self, bar: Any) -> None:
        """Logging, evaluation and checkpoints due after optimizer step ``global_step``; then the callbacks."""
        cfg, step, phases = self.config, self.state.step, self.steps.phases
        if self._logs(step):
            phases(step, "log")
            self._log(bar)
        if cfg.eval_every and step % cfg.eval_every == 0 and self.eval_loaders:
            phases(step, "evaluate")
            self.evaluate()
        due = cfg.save_every and (step % cfg.save_every == 0 or step == self.total_steps or self.stopped is not None)
        if due and not self.preemption.agree_now():  # a signal noted: the preemption's save, not this one, comes next
            phases(step, "checkpoint")
            self.save_checkpoint(wait=False)  # save_async: written in the background, committed later
        hooks.call(self.callbacks, "on_step_end", self)

    def _logs(self, step: int) -> bool:
        return step % self.config.log_every == 0 or step == self.total_steps

    def _log(self, bar: Any) -> None:
        """The log of this step: every rank's window gathered once (loss, counts, timings, the stop flag and the
        first non-finite loss: the step's one agreement), then each rank's figures to its sinks."""
        rows = self.telemetry.gather(
            stop=bool(self.should_stop), lr=self.steps.current_lr, grad_norm=self.steps.take_grad_norm()
        )
        self.nonfinite.raise_if_bad([row["first_bad"] for row in rows], str(self.last_checkpoint or ""))
        on_log = lambda metrics: hooks.call(self.callbacks, "on_log", self, metrics=metrics)  # noqa: E731
        global_view = self.telemetry.log(rows, self.state, self.total_steps, on_log, bar)
        self.preemption.pace(global_view["global/step_time_max_s"])  # the same gathered figure on every rank
        asked = [rank for rank, row in enumerate(rows) if row["stop"]]
        if asked and self.stopped is None:  # every rank sees the same rows: all stop after this very step
            why = f" ({self.stop_reason})" if self.stop_reason else ""
            self.stopped = f"should_stop set on rank(s) {', '.join(map(str, asked))}{why}"
            say(f"stopping at step {self.state.step} of {self.total_steps}: {self.stopped}")

    def _finish(self, started: float) -> dict[str, Any]:
        self.nonfinite.check(self.telemetry.window.first_bad_step(), str(self.last_checkpoint or ""))
        result = {
            "global_step": self.state.step,
            "epoch": self.state.epoch_progress,
            "train_loss": self.log_history[-1]["train_loss"] if self.log_history else float("nan"),
            "train_runtime_s": time.perf_counter() - started,
            "skipped_steps": self.nonfinite.skipped_steps,
            "stopped": self.stopped,
        }  # stopped: None when it ran to the end, else why it stopped
        if self.eval_loaders:
            evaluated_now = self.last_eval is not None and self.last_eval[0] == self.state.step
            result.update(self.last_eval[1] if evaluated_now else self.evaluate())
        best = self.best_checkpoint if self.keep_best.loads_at(self.state.step) else None
        damage = self.checkpoints.damage(best) if best is not None else None  # its contents read once, here
        self.keep_best.load_best(best, self.state.step, self._load_weights, say, damage)  # final/: the best's
        if self.ema is not None and self.config.ema_final:
            self.ema.copy_to_model()  # final/ and the model from here on: the average
        self.save_model()
        hooks.call(self.callbacks, "on_train_end", self, result=result)
        return result

    def _load_weights(self, path: Path) -> None:
        """The weights (and their average) of checkpoint ``path``: the best evaluation's, at the end of fit()."""
        state = self.checkpoints.read(path, verified=True)
        self.model_state.load_weights(path, state["sharding"])
        if self.ema is not None:
            self.ema.load(path, state)

    def describe(self) -> str:
        """What ``fit()`` is about to do, as it says at its start: the launch, the global batch, steps, optimizer."""
        return banner(
            self.parallel.describe(self.accelerator.device),
            self.config,
            self.state,
            self.total_steps,
            examples_per_process(self.train_loader),
            self.weighing.counts_tokens,
            self.optimization.words,
        )
