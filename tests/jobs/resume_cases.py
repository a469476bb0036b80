"""Resumes that trust nothing, as one 2-process job (tests/checkpoint/test_resume_changes.py reads what it prints); with
``--slow_saves S``, a preemption while periodic checkpoints take S seconds each.

A base run (dropout, AdamW with weight decay, cosine after 2 warm-up steps, 6 optimizer steps an epoch, 10 in all,
checkpoints at 3, 6, 9 and 10), then new Trainers in the same processes, each resuming one of its checkpoints with
one thing changed, or with its ``latest`` pointer damaged; then nan_policy skip on a BatchNorm model, an evaluation
that comes out NaN, an unwritable metrics file, keep_best and EarlyStopping on a figure evaluate() does not give,
figures a user logs (trainer.log, on_log) reaching every tracker, a relative output_dir, a data set smaller than one
global batch. Each case prints
``CASE <name> ...`` from the main process: what the resume said, what it refused, the lr its next step used.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import signal
import sys
import time
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from scenarios import ADAMW_COSINE, DropoutClassifier, Examples, TinyClassifier, say  # noqa: E402

from trainer import EarlyStopping, TrainConfig, Trainer  # noqa: E402
from trainer.errors import Refusal  # noqa: E402

BASE = dict(
    **ADAMW_COSINE,
    save_every=3,
    keep_last=4,
    log_every=5,
    max_steps=10,
)


def trainer_for(output_dir: Path, model=None, train=None, eval_data=None, own_optimizer=None, loss_fn=None, **changes):
    config = TrainConfig(output_dir=str(output_dir), **{**BASE, **changes})
    return Trainer(
        model or DropoutClassifier(),
        config,
        train_data=train or Examples(48),
        eval_data=eval_data,
        optimizer=own_optimizer,
        loss_fn=loss_fn,
    )


def captured(run) -> tuple[str, object]:
    """What ``run()`` printed (the main process's lines) and returned, or the refusal it raised."""
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        try:
            got = run()
        except Refusal as refusal:
            got = refusal
    return out.getvalue() + err.getvalue(), got


def report(name: str, printed: str, got: object, main: bool, **figures) -> None:
    if not main:
        return
    lines = [
        line
        for line in printed.splitlines()
        if line.startswith(("resumed", "loaded", "changed", "trainer:", "resume="))
    ]
    refused = f"REFUSED {got}" if isinstance(got, Exception) else ""
    say(f"CASE {name} | {' || '.join(lines)} | {refused} | {json.dumps(figures)}")


def next_lr(config_changes: dict, steps: int) -> float:
    """The lr a fresh run with these settings uses at optimizer step ``steps`` + 1 (the schedule alone)."""
    from trainer.optim.build import build_scheduler

    config = TrainConfig(**{**BASE, **config_changes})
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=config.lr)
    schedule = build_scheduler(optimizer, config, config.max_steps)
    for _ in range(steps):
        optimizer.step()
        schedule.step()
    return optimizer.param_groups[0]["lr"]


def changed_settings(root: Path, main: bool) -> None:
    ckpt = root / "base" / "checkpoints"
    cases = {  # name: (checkpoint step, changes, one more step to train)
        "optimizer_sgd": (9, dict(optimizer="sgd")),
        "optimizer_adam": (9, dict(optimizer="adam")),
        "lr": (9, dict(lr=1e-4)),
        "constant": (9, dict(lr_scheduler="constant", warmup_steps=0)),
        "max_steps": (10, dict(max_steps=20)),
        "seed_mid_epoch": (9, dict(seed=1)),
        "seed_at_epoch_end": (6, dict(seed=1)),
        "weight_decay_off": (9, dict(weight_decay=0.0)),
        "weight_decay": (9, dict(weight_decay=0.02, betas=(0.8, 0.99))),
        "unchanged": (9, {}),
    }
    for name, (step, change) in cases.items():
        path = ckpt / f"step-{step:08d}"

        def run(change=change, path=path, name=name, step=step):
            trainer = trainer_for(root / name, resume=str(path), **change)
            trainer.config.max_steps = trainer.total_steps = step + 1
            trainer.fit()
            group = trainer.optimizer.param_groups[0]
            return trainer.step_lr, group.get("betas"), group["weight_decay"]

        printed, got = captured(run)
        expected = next_lr(change, step)
        report(
            name,
            printed,
            got,
            main,
            next_lr=None if isinstance(got, Exception) else got[0],
            fresh_lr=expected,
            settings=None if isinstance(got, Exception) else got[1:],
        )
    wider = DropoutClassifier(64)
    printed, got = captured(lambda: trainer_for(root / "wider", model=wider, resume=str(ckpt / "step-00000009")))
    report("model_shape", printed, got, main)

    def rmsprop():
        model = DropoutClassifier()
        trainer = trainer_for(
            root / "rmsprop",
            model=model,
            own_optimizer=torch.optim.RMSprop(model.parameters()),
            resume=str(ckpt / "step-00000009"),
        )
        trainer.fit()

    report("user_optimizer", *captured(rmsprop), main)


def damaged_pointers(root: Path, trainer: Trainer, main: bool) -> None:
    other = root / "other"
    for name, raw in {
        "elsewhere": f"../../{other.name}/checkpoints/step-00000003".encode(),
        "not_utf8": b"\xff\xfe",
        "empty": b"",
        "nul": b"\0" * 8,
    }.items():
        target = root / f"pointer_{name}"
        if main:
            shutil.copytree(root / "base" / "checkpoints", target / "checkpoints")
            (target / "checkpoints" / "latest").write_bytes(raw)
        trainer.accelerator.wait_for_everyone()
        printed, got = captured(lambda target=target: trainer_for(target, resume="auto"))
        report(
            f"pointer_{name}",
            printed,
            got,
            main,
            resumed=None if isinstance(got, Exception) else got.last_checkpoint.name,
        )


class BatchNormClassifier(TinyClassifier):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(8, 32), torch.nn.BatchNorm1d(32), torch.nn.ReLU(), torch.nn.Linear(32, 3)
        )


def nan_at(step: int, running: list):
    """A loss_fn whose input on rank 0 is NaN at optimizer step ``step``: the forward pass then puts NaN into
    BatchNorm's running statistics before the loss is seen."""

    def loss_fn(model, batch):
        trainer = running[0]
        if trainer.global_step + 1 == step and trainer.accelerator.process_index == 0 and model.training:
            batch = {**batch, "x": batch["x"] * float("nan")}
        return model(**batch).loss

    return loss_fn


def nan_buffers(root: Path, main: bool) -> None:
    def run():
        running = []
        trainer = trainer_for(
            root / "batchnorm",
            model=BatchNormClassifier(),
            eval_data=Examples(9, seed=1),
            nan_policy="skip",
            loss_fn=nan_at(3, running),
            save_every=None,
            eval_every=5,
        )
        running.append(trainer)
        result = trainer.fit()
        finite = all(torch.isfinite(b.float()).all() for b in trainer.unwrapped_model.buffers())
        return result["skipped_steps"], result["eval_loss"], finite

    printed, got = captured(run)
    report("nan_buffers", printed, got, main, skipped_eval_finite=None if isinstance(got, Exception) else got)
    bad_eval = Examples(9, seed=1)
    bad_eval.x[4] = float("nan")
    printed, got = captured(lambda: trainer_for(root / "bad_eval", eval_data=bad_eval, eval_every=5).fit())
    report("nan_eval", printed, got, main)


def unwritable_metrics(root: Path, main: bool) -> None:
    """Every rank's metrics file is a folder: as an output_dir turned read-only or a full disk fails the first log
    (a read-only folder would not do: the suite may run as root, who writes into it anyway)."""
    trainer = trainer_for(root / "unwritable", log_every=2)
    if main:
        for rank in range(trainer.accelerator.num_processes):
            (root / "unwritable" / "metrics" / f"rank{rank}.jsonl").mkdir()
    trainer.accelerator.wait_for_everyone()
    printed, got = captured(trainer.fit)
    report("unwritable_metrics", printed, got, main, rank=trainer.accelerator.process_index)
    if not main:  # the other rank's refusal, said here since report() speaks for the main process
        say(f"CASE unwritable_metrics_rank1 | {got}")


def misspelt_figures(root: Path, main: bool) -> None:
    """keep_best and EarlyStopping watching a figure evaluate() does not give: refused before the first step."""
    eval_data = Examples(9, seed=1)
    best = trainer_for(root / "misspelt_best", eval_data=eval_data, eval_every=3, keep_best="eval_los")
    report("misspelt_keep_best", *captured(best.fit), main, steps=best.global_step)
    stopping = trainer_for(root / "misspelt_stopping", eval_data=eval_data, eval_every=3)
    stopping.callbacks.append(EarlyStopping("eval_accuracy"))
    report("misspelt_early_stopping", *captured(stopping.fit), main, steps=stopping.global_step)


class AddsAFigure:
    def on_log(self, trainer, metrics) -> None:
        metrics["callback_figure"] = 7.0


def figures(root: Path, main: bool) -> None:
    """trainer.log from the loss_fn every step (rank k logs 100 k + step), a figure an on_log callback adds, the
    gradient norm; wandb turned on by WANDB_PROJECT alone (offline), TensorBoard by its field."""
    running = []

    def loss_fn(model, batch):
        trainer = running[0]
        step = trainer.global_step + 1
        trainer.log({"rank_figure": torch.tensor(100.0 * trainer.accelerator.process_index + step)})
        return model(**batch).loss

    os.environ.update(WANDB_PROJECT="figures", WANDB_MODE="offline", WANDB_SILENT="true")
    try:
        trainer = trainer_for(root / "figures", loss_fn=loss_fn, max_steps=4, log_every=2, tensorboard=True)
        running.append(trainer)
        trainer.callbacks.append(AddsAFigure())
        trainer.fit()
    finally:
        os.environ.update(WANDB_MODE="disabled")
        del os.environ["WANDB_PROJECT"]
    report("figures", "", None, main, log_history=trainer.log_history)


def tensorboard_resumed(root: Path) -> None:
    """TensorBoard on, steps 1-4 logged; then a run resumed from step 2 logs 3 and 4 again."""
    settings = dict(max_steps=4, log_every=1, save_every=2, tensorboard=True)
    trainer_for(root / "tensorboard", **settings).fit()
    trainer_for(
        root / "tensorboard", resume=str(root / "tensorboard" / "checkpoints" / "step-00000002"), **settings
    ).fit()


def small_data_and_relative_dir(root: Path, main: bool) -> None:
    here = os.getcwd()
    os.chdir(root)
    try:
        printed, got = captured(lambda: trainer_for(Path("relative"), resume="auto"))
    finally:
        os.chdir(here)
    report("relative_output_dir", printed, got, main)
    trainer = trainer_for(root / "small", train=Examples(20), batch_size=16)
    if main:
        say("CASE small_data | " + trainer.describe().replace("\n", " "))


def slow_saves(root: Path, save_s: float, signal_name: str) -> None:
    """Steps of 0.05 s, a checkpoint every 4 steps that takes ``save_s`` more (a slow shared filesystem), and after
    step 5 ``signal_name`` to the whole job, launcher included, as Slurm sends it."""

    def loss_fn(model, batch):
        time.sleep(0.05)
        return model(**batch).loss

    trainer = trainer_for(root, loss_fn=loss_fn, save_every=4, log_every=2, max_steps=200, epochs=100)
    written_last = trainer.checkpoints.parts["accelerate"]  # the schedule and random states, after the shards
    save_state = written_last.save

    def slow_save_state(*args, **kwargs):
        save_state(*args, **kwargs)
        say(f"SAVED step {trainer.global_step} on rank {trainer.accelerator.process_index}, sleeping {save_s} s")
        time.sleep(save_s)

    written_last.save = slow_save_state

    class SignalTheJob:
        def on_step_end(self, trainer) -> None:
            if trainer.global_step == 5 and trainer.accelerator.is_main_process:
                say(f"SIGNAL {signal_name} to the job after step 5 at {time.time():.3f}")
                os.killpg(os.getpgrp(), getattr(signal, signal_name))

    trainer.callbacks.append(SignalTheJob())
    trainer.fit()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--output_dir", type=Path, required=True)
    parser.add_argument("--slow_saves", type=float, default=0.0, help="seconds a save takes; then signal the job")
    parser.add_argument("--signal", default="SIGHUP")
    args = parser.parse_args()
    root = args.output_dir
    if args.slow_saves:
        return slow_saves(root, args.slow_saves, args.signal)
    torch.manual_seed(0)
    base = trainer_for(root / "base")
    base.fit()
    main = base.accelerator.is_main_process
    other = trainer_for(root / "other", max_steps=3)  # another run's checkpoints, a pointer must not reach
    other.fit()
    changed_settings(root, main)
    damaged_pointers(root, base, main)
    nan_buffers(root, main)
    unwritable_metrics(root, main)
    misspelt_figures(root, main)
    figures(root, main)
    tensorboard_resumed(root)
    small_data_and_relative_dir(root, main)
    base.accelerator.wait_for_everyone()


if __name__ == "__main__":
    main()
