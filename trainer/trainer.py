"""The Trainer: one training loop on Accelerate that runs unchanged on a CPU, one GPU, a node or a cluster.

The hardware is chosen at launch, never here::

    python train.py                                                        # one process
    accelerate launch --config_file accelerate_configs/multi_gpu.yaml train.py   # K processes, DDP
    torchrun --standalone --nproc_per_node 2 train.py                      # the same, through torchrun
    accelerate launch --config_file accelerate_configs/fsdp.yaml train.py        # K processes, model sharded

Example::

    from trainer import Trainer, TrainConfig

    config = TrainConfig(output_dir="runs/mlp", batch_size=32, epochs=3, lr=1e-3)
    trainer = Trainer(model, config, train_data=dataset, loss_fn=lambda model, batch: ...)
    result = trainer.fit()      # {"global_step": ..., "train_loss": ..., ...}
"""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

import torch
from accelerate.utils import find_batch_size, set_seed
from torch.utils.data import DataLoader, Dataset
from tqdm.auto import tqdm

from trainer.accumulation import StepBatches, StreamAgreement, Weighing, windows
from trainer.background_save import background_saves
from trainer.checkpoint import check_writable
from trainer.columns import ready_columns
from trainer.config import TrainConfig
from trainer.console import progress_bar
from trainer.data import DataError, batches_per_epoch, build_eval_loader, build_train_loader, start_epoch
from trainer.distributed import build_accelerator
from trainer.evaluating import Evaluating
from trainer.evaluation import MetricsFn
from trainer.fastpath import Stepper, keep_own_forward
from trainer.losses import LossFn, model_loss, unused_parameters
from trainer.nonfinite import NonFiniteGuard
from trainer.optim import build_optimizer, build_scheduler, describe
from trainer.preemption import Preempted, PreemptionWatch
from trainer.report import STEP_FIGURES, banner, step_line
from trainer.resume import Checkpoints
from trainer.sharding import gradient_sync, prepare, requested_plugin, spread
from trainer.stall import watch_stalls
from trainer.streams import StreamShard
from trainer.tracking import WINDOW_FIELDS, LoggedFigures, StepWindow, Tracker, memory_gb, new_run_id, summarize


class Trainer(Checkpoints, Evaluating):
    """Trains ``model`` on ``train_data`` across however many processes were launched: DDP, or the model sharded
    over them (FSDP2) when the launch's accelerate config asks for FSDP (``trainer.sharding``).

    Args:
        model: a plain ``torch.nn.Module``, built the same way on every process.
        config: a :class:`TrainConfig`; ``batch_size`` is per process.
        train_data: a map-style Dataset (sharded here as DistributedSampler does), a stream (an IterableDataset,
            with ``max_steps``: each process reads its own part, resumable mid-stream; ``trainer.streams``) or a
            DataLoader (used as is: with several processes it needs a DistributedSampler, or an IterableDataset
            that yields each process its own part).
        eval_data: optional Dataset, IterableDataset or DataLoader for :meth:`evaluate`, each example counted once.
        loss_fn: ``loss_fn(model, batch) -> scalar tensor`` (a mean), or ``-> (loss_sum, count)`` to weigh every
            item it counts alike across the global batch; default ``model(**batch).loss``, which for a transformers
            model with labels weighs every counted token of the global batch alike (``trainer.accumulation``). In
            training ``model`` is the prepared (DDP-wrapped) model, in evaluation the plain module. Under mixed
            precision it runs inside the launch's autocast, as torch's AMP recipe does, and the model's outputs
            keep its dtype.
        metrics_fn: ``metrics_fn(model, batch) -> {name: tensor of shape [batch]}``, one number per example (say
            ``(logits.argmax(-1) == labels).float()`` for accuracy); :meth:`evaluate` adds ``eval_<name>``, the mean
            over the eval set with every example counted once.
        optimizer: built from ``config`` when not given (always, for a sharded model: it is built over the
            shards).
        lr_scheduler: built from ``config`` when not given (always, for a sharded model); it steps once per
            optimizer step.
        collate_fn: how the trainer's own loaders batch examples (torch's default collate when None); say
            ``DataCollatorWithPadding(tokenizer)`` for dynamic padding. An unformatted ``datasets.Dataset`` is readied
            as transformers' Trainer does (``trainer.columns``): the columns ``model.forward`` does not take left
            out, and without a collate_fn the rest formatted as torch tensors; a formatted one is used as is.
        callbacks: objects with any of ``on_train_begin(trainer)``, ``on_epoch_begin(trainer)``,
            ``on_step_end(trainer)`` (after that step's logging, evaluation and checkpoint),
            ``on_log(trainer, metrics)``, ``on_evaluate(trainer, metrics)``, ``on_train_end(trainer, result)``.
            Figures ``on_log`` adds to ``metrics`` are stored as :meth:`log`'s are, and on the step line. To stop
            early, a callback on any rank sets ``trainer.should_stop = True`` (and ``trainer.stop_reason``): every
            rank stops after the next step that logs, saves a checkpoint when ``save_every`` is set, and ``fit()``
            returns with ``"stopped"`` saying why (see :class:`trainer.EarlyStopping`).
    """

    def __init__(self, model: torch.nn.Module, config: TrainConfig, train_data: Dataset | DataLoader,
                 eval_data: Optional[Dataset | DataLoader] = None, loss_fn: Optional[LossFn] = None,
                 metrics_fn: Optional[MetricsFn] = None, optimizer: Optional[torch.optim.Optimizer] = None,
                 lr_scheduler: Optional[Any] = None, collate_fn: Optional[Callable] = None,
                 callbacks: Iterable[Any] = ()):  # fmt: skip
        self.config = config
        sharding = requested_plugin(config)  # an FSDP accelerate config; a refused one stops before anything starts
        self.accelerator = build_accelerator(config)
        check_writable(config.output_dir)
        set_seed(config.seed, device_specific=True)  # dropout etc.: reproducible, different on each rank
        self.loss_fn = loss_fn or model_loss
        self.metrics_fn = metrics_fn
        self.collate_fn = collate_fn
        self.callbacks = list(callbacks)

        train_data = self._ready_columns(train_data, model, "train_data")
        train_loader = build_train_loader(train_data, config, self.accelerator, collate_fn)
        eval_loader = None
        if eval_data is not None:
            eval_data = self._ready_columns(eval_data, model, "eval_data")
            eval_loader = build_eval_loader(eval_data, config, self.accelerator, collate_fn)
        self.batches_per_epoch = batches_per_epoch(train_loader)  # None for an IterableDataset
        if self.batches_per_epoch is None and config.max_steps is None:
            raise DataError("train_data has no length (an IterableDataset?): set max_steps to say when to stop")
        accumulation = config.gradient_accumulation_steps
        self.steps_per_epoch = math.ceil(self.batches_per_epoch / accumulation) if self.batches_per_epoch else None
        self.total_steps = config.max_steps or config.epochs * self.steps_per_epoch

        built = (optimizer is None, lr_scheduler is None)
        # FSDP2: the model is sharded before its optimizer is built over the shards (trainer.sharding).
        recompute = config.activation_checkpointing
        self.sharded = spread(model, sharding, self.accelerator, recompute, optimizer, lr_scheduler)
        if optimizer is None:
            model.to(self.accelerator.device)  # prepare() would move it anyway; on the device first, AdamW fuses
            optimizer = build_optimizer(model, config)
        # Per-step work that changes nothing is skipped (each costs tens of microseconds, which a small model's
        # step notices): the scheduler of a constant lr without warm-up, built here. A user's is always stepped.
        self._schedule_moves = lr_scheduler is not None or config.lr_scheduler != "constant" or config.warmup_steps > 0
        lr_scheduler = lr_scheduler or build_scheduler(optimizer, config, self.total_steps)
        self.optimization = describe(optimizer, lr_scheduler, config, *built)  # for the banner
        self.built_from_config = built  # (optimizer, scheduler): a resume applies this run's settings to them
        self.model, self.optimizer, self.train_loader, self.lr_scheduler = prepare(
            self.accelerator, self.sharded, model, optimizer, train_loader, lr_scheduler
        )
        self.autocast = keep_own_forward(self.accelerator, self.model)  # forward and loss run under it
        self.stepper = Stepper(self.accelerator, self.optimizer)
        self.weighing = Weighing(self.accelerator, model, self.loss_fn)  # what each micro-batch's loss counts for
        self.background_saves = background_saves(config.save_async, self.accelerator, bool(self.sharded))
        self.stream = self.train_loader.dataset if isinstance(self.train_loader.dataset, StreamShard) else None
        # Processes may reach a stream's end at different batches: they agree on each window (a map-style data set
        # gives every process as many batches).
        many = self.accelerator.num_processes > 1
        self._agree = StreamAgreement(self.accelerator.num_processes) if many and self.stream is not None else None
        self.eval_loader = self.accelerator.prepare(eval_loader) if eval_loader is not None else None

        # Where training stands: optimizer steps taken, the epoch being read, micro-batches read of it.
        self.global_step = self.epoch = self.batches_into_epoch = 0
        self.step_lr: Any = None  # the lr the last optimizer step used (the scheduler has moved on since)
        # Any callback on any rank may set should_stop (and say why in stop_reason): the ranks compare flags when
        # they next log, and all stop after that same step, checkpointed when save_every is set.
        self.should_stop, self.stop_reason = False, None
        self.stopped: Optional[str] = None
        self.best: Optional[dict[str, Any]] = None  # keep_best: {"figure", "value", "step"} of the best evaluation
        self.nonfinite = NonFiniteGuard(self.accelerator, config.nan_policy)
        self.preemption: Optional[PreemptionWatch] = None  # while fit() runs: the signals it watches
        self.log_history: list[dict[str, float]] = []
        self.figures = LoggedFigures(reserved=(*STEP_FIGURES, "grad_norm"))  # trainer.log's, until the next log
        self.grad_norm: Optional[torch.Tensor] = None  # a logging step's gradient norm before clipping
        self.last_eval: Optional[tuple[int, dict[str, float]]] = None  # (step, metrics) of the latest evaluate()
        self.run_id = new_run_id(self.accelerator)  # names every rank's wandb run; a resume reads it back
        self.cannot_train_on: Optional[Exception] = None  # why fit() cannot continue the loaded checkpoint
        self.last_checkpoint: Optional[Path] = self._agreed_resume_point()
        if self.last_checkpoint is not None:
            self.load_checkpoint(self.last_checkpoint)
        self.tracker = Tracker(config, self.accelerator, self.run_id)

    def log(self, values: dict[str, float | torch.Tensor]) -> None:
        """Add figures to this process's next log: its metrics file, wandb run and TensorBoard, ``log_history``
        and ``python -m trainer.plot``, and the step line for the main process's. Each name's mean over its calls
        since the last log; call it on any rank, from a ``loss_fn``, a callback or anywhere in ``fit()``. A tensor
        is read only when the trainer logs, so logging one every step adds no host sync::

            trainer.log({"aux_loss": aux_loss, "router_entropy": entropy})
        """
        self.figures.add(values)

    @property
    def unwrapped_model(self) -> torch.nn.Module:
        """The plain module without the DDP (or torch.compile) wrapper: the same weights on every rank."""
        return self.accelerator.unwrap_model(self.model, keep_torch_compile=False)

    @property
    def epoch_progress(self) -> float:
        """Epochs done, as a fraction (the epoch index when the data has no length)."""
        return self.global_step / self.steps_per_epoch if self.steps_per_epoch else float(self.epoch)

    @property
    def global_batch_size(self) -> int:
        return self.config.batch_size * self.accelerator.num_processes * self.config.gradient_accumulation_steps

    # ------------------------------------------------------------------ training

    def fit(self) -> dict[str, float]:
        """Train for ``max_steps`` optimizer steps, or ``epochs`` epochs; return the final figures: ``global_step``,
        ``epoch``, ``train_loss`` (the mean loss of the last log window: the last ``log_every`` steps, every rank's
        micro-batches; NaN when this call trained no step), ``train_runtime_s``, ``skipped_steps``, ``stopped``
        (None, or why it stopped early) and, with eval data, the final ``evaluate()`` figures.

        An exception on this rank ends its wandb run marked as failed, with the error in it, before it propagates.
        A preemption signal (``preemption_signals``, any rank) ends it differently: every rank stops after the same
        step, commits a checkpoint there and raises :class:`trainer.Preempted`, a ``SystemExit`` with status 75, so
        an uncaught one ends the script; start it again with ``resume="auto"`` to continue.
        """
        if self.cannot_train_on is not None:
            raise self.cannot_train_on  # the checkpoint's global batch differs (trainer.resume)
        self._say(banner(self))
        self.should_stop, self.stop_reason, self.stopped = False, None, None  # a second fit() trains on
        if self.global_step >= self.total_steps:  # resumed from a checkpoint of a run that already ended
            self._say(f"already finished at step {self.global_step} of {self.total_steps}: nothing to train; raise "
                      "max_steps (or epochs) to train on")  # fmt: skip
        self._call("on_train_begin")
        self.stall = watch_stalls(self.accelerator, self.config.stall_warning_s)  # its thread lives while fit() runs
        try:
            result = self._train()
        except Preempted as stop:
            self.tracker.preempted(stop.message)
            self._say(stop.message)
            raise
        except BaseException as err:
            self.tracker.fail(err)
            raise
        finally:
            self.stall.stop()
        self.tracker.finish()
        return result

    def _train(self) -> dict[str, float]:
        window = StepWindow(self.accelerator.device)
        self.model.train()
        self.nonfinite.keep_buffers(self.model)  # nan_policy skip: a skipped step puts them back
        started = time.perf_counter()
        cfg, acc = self.config, self.accelerator
        self.preemption = PreemptionWatch(cfg.signal_names, cfg.preemption_grace_s, acc.num_processes)
        with progress_bar(self.total_steps, self.global_step, show=acc.is_main_process) as progress, self.preemption:
            self._train_epochs(window, progress, self.preemption)
        self.wait_for_checkpoint()
        return self._finish(started)

    def _train_epochs(self, window: StepWindow, progress: tqdm, watch: PreemptionWatch) -> None:
        accumulation = self.config.gradient_accumulation_steps
        while self.global_step < self.total_steps and self.stopped is None:
            loader = start_epoch(self.train_loader, self.epoch, self.batches_into_epoch, self.config.seed)
            fresh, stepped = self.batches_into_epoch == 0, False
            self._call("on_epoch_begin")
            for step_batches in self.weighing.windows(windows(window.timed(loader), accumulation, self._agree)):
                self._optimizer_step(step_batches, window)
                self.global_step += 1
                window.steps += 1
                stepped = True
                progress.update()
                self._after_step(window, progress)
                signal_number = watch.agreed(self.global_step)  # the same answer on every rank, at this same step
                if signal_number:
                    self._preempt(signal_number, window, progress)
                if self.global_step >= self.total_steps or self.stopped is not None:
                    break
            else:
                if fresh and not stepped:  # a stream that ended before its first batch on some process
                    raise DataError(f"train_data gave some process no batch in epoch {self.epoch}: the stream is "
                                    "empty, or too short for every process to get a batch", job_wide=True)  # fmt: skip
                self.epoch, self.batches_into_epoch = self.epoch + 1, 0

    def _optimizer_step(self, step_batches: StepBatches, window: StepWindow) -> None:
        """Forward and backward on each micro-batch of one accumulation window, then the optimizer step. Each loss
        is weighed as its share of the global batch's mean (trainer.accumulation); only the last backward
        all-reduces the gradients."""
        step, last = self.global_step + 1, len(step_batches.micro_batches) - 1
        for index, batch in enumerate(step_batches.micro_batches):
            self.batches_into_epoch += 1
            with gradient_sync(self.model, self.accelerator, sync=index == last):
                self.stall.at(step, "forward")
                started = time.perf_counter()
                try:
                    with self.autocast():
                        objective, loss, weight = self.weighing.loss(step_batches, self.model, batch)
                except RuntimeError as err:  # free when nothing is raised
                    refusal = unused_parameters(err)
                    if refusal is None:
                        raise
                    raise refusal from err
                window.forward += time.perf_counter() - started  # host time: this rank's own work before all-reduce
                self.stall.at(step, "backward")
                self.stepper.backward(objective)
            window.add(self.nonfinite.observe(loss, step=step), batch, find_batch_size(batch), weight)
        if not self.nonfinite.skip_this_step():
            self.stall.at(step, "optimizer")
            self.weighing.finish(step_batches, self.model.parameters())
            logs = step % self.config.log_every == 0 or step == self.total_steps  # the norm is logged: measure it
            self.grad_norm = self.stepper.clip(self.model.parameters(), self.config.max_grad_norm, measure=logs)
            self.stepper.step()
            self.step_lr = self.optimizer.param_groups[0]["lr"]  # before the scheduler moves it on
            if self._schedule_moves and not self.stepper.step_was_skipped:
                self.lr_scheduler.step()  # fp16 overflow skips the step, so the schedule waits too
        self.stepper.zero_grad()
        self.stall.at(step, "data")

    def _after_step(self, window: StepWindow, progress: tqdm) -> None:
        """Logging, evaluation and checkpoints due after optimizer step ``global_step``; then the callbacks."""
        cfg, step, last = self.config, self.global_step, self.global_step == self.total_steps
        if step % cfg.log_every == 0 or last:
            self.stall.at(step, "log")
            self._log(window, progress)
        if cfg.eval_every and step % cfg.eval_every == 0 and self.eval_loader is not None:
            self.stall.at(step, "evaluate")
            self.evaluate()
        due = cfg.save_every and (step % cfg.save_every == 0 or last or self.stopped is not None)
        if due and not self.preemption.agree_now():  # a signal noted: the preemption's save, not this one, comes next
            self.stall.at(step, "checkpoint")
            self.save_checkpoint(wait=False)  # save_async: written in the background, committed later
        self._call("on_step_end")

    def _finish(self, started: float) -> dict[str, float]:
        self.nonfinite.check(str(self.last_checkpoint or ""))
        result = {
            "global_step": self.global_step,
            "epoch": self.epoch_progress,
            "train_loss": self.log_history[-1]["train_loss"] if self.log_history else float("nan"),
            "train_runtime_s": time.perf_counter() - started,
            "skipped_steps": self.nonfinite.skipped_steps,
            "stopped": self.stopped,  # None when it ran to the end, else why it stopped early
        }
        if self.eval_loader is not None:
            evaluated_now = self.last_eval is not None and self.last_eval[0] == self.global_step
            result.update(self.last_eval[1] if evaluated_now else self.evaluate())
        self._load_best_weights()  # load_best_at_end: final/ is the best evaluation's model
        self.save_model()
        self._call("on_train_end", result=result)
        return result

    def _log(self, window: StepWindow, progress: tqdm) -> None:
        """Every rank's window since the last log, gathered once: the only host synchronisation in the loop.
        Each rank logs its own figures; the main process adds the global view and the stragglers."""
        self.nonfinite.check(str(self.last_checkpoint or ""))
        rows = self.accelerator.gather(window.row(stop=bool(self.should_stop))).tolist()
        window.restart()
        asked = [rank for rank, row in enumerate(rows) if row[WINDOW_FIELDS.index("stop")]]
        own, global_view = summarize(rows, self.accelerator.process_index)
        if self.preemption is not None:
            self.preemption.pace(global_view["global/step_time_max_s"])  # the same gathered figure on every rank
        metrics = {
            "step": self.global_step,
            "epoch": round(self.epoch_progress, 4),
            "train_loss": global_view["global/train_loss"],
            "lr": float(self.step_lr if self.step_lr is not None else self.optimizer.param_groups[0]["lr"]),
            "examples_per_s": global_view["global/examples_per_s"],
        }
        if "global/tokens_per_s" in global_view:
            metrics["tokens_per_s"] = global_view["global/tokens_per_s"]
        if self.grad_norm is not None:  # the norm before clipping of this step's gradients, the same on every rank
            norm, self.grad_norm = self.grad_norm, None
            metrics["grad_norm"] = global_view["global/grad_norm"] = float(getattr(norm, "full_tensor", lambda: norm)())
        metrics.update(self.figures.take())  # trainer.log's: this rank's own
        self.log_history.append(metrics)
        own.update({"rank/lr": metrics["lr"], "rank/epoch": metrics["epoch"],
                    "rank/memory_gb": memory_gb(self.accelerator.device)})  # fmt: skip
        if self.accelerator.is_main_process:
            progress.set_postfix(loss=f"{metrics['train_loss']:.4g}", lr=f"{metrics['lr']:.3g}",
                                 ex_s=f"{metrics['examples_per_s']:.4g}", refresh=False)  # fmt: skip
        self._call("on_log", metrics=metrics)  # before the line: figures a callback adds go on it (gpt2.py: MFU)
        added = {key: value for key, value in metrics.items() if key not in self.figures.reserved}
        global_view = global_view if self.accelerator.is_main_process else {}
        self.tracker.log({**own, **global_view, **added}, self.global_step)  # yours stored as the trainer's are
        self._say(step_line(metrics, self.total_steps))
        if asked and self.stopped is None:  # every rank sees the same rows: all stop after this very step
            why = f" ({self.stop_reason})" if self.stop_reason else ""
            self.stopped = f"should_stop set on rank(s) {', '.join(map(str, asked))}{why}"
            self._say(f"stopping at step {self.global_step} of {self.total_steps}: {self.stopped}")

    # ------------------------------------------------------------------- helpers

    def _say(self, text: str) -> None:
        """A line on the main process, as one write (print() writes the newline apart, and other ranks' lines
        could land between); while the progress bar is up, stdout goes around it (trainer.console)."""
        if self.accelerator.is_main_process:
            sys.stdout.write(text + "\n")
            sys.stdout.flush()

    def _ready_columns(self, data: Any, model: torch.nn.Module, name: str) -> Any:
        """An unformatted datasets.Dataset's model inputs, as tensors (trainer.columns), said once; else as is."""
        data, change = ready_columns(data, model, self.collate_fn is not None, name)
        if change:
            self._say(f"trainer | {change}")
        return data

    def _call(self, hook: str, **kwargs: Any) -> None:
        for callback in self.callbacks:
            method = getattr(callback, hook, None)
            if method is not None:
                method(self, **kwargs)
