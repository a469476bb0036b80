"""Small jobs the tests launch as real processes (python, accelerate launch, torchrun). One case per run:

job           a tiny classifier with eval data: evaluates before and after training, writes result.json
hf_export     a tiny transformers GPT-2 with the default loss: final/ written with save_pretrained
resume        dropout, AdamW, cosine, shuffling, checkpoints every 4 steps, resume="auto"; can signal one rank
              (--signal_at), or crash one rank (os._exit) after a given step, or make one rank's loss NaN at a
              given step; with --wandb_project it logs to wandb, and can raise on one rank or slow one rank down
user_loader   train_data is the user's own DataLoader (--sampler none|distributed|own_part: a self-splitting stream)
predict       evaluate() with a metrics_fn and predict() on 9 examples, printed by every rank
stop          rank 1 alone sets should_stop after --stop_at, or (--stop_at 0) EarlyStopping on a flat eval loss
patience      EarlyStopping(patience=3) and a user's stateful callback, preempted (--signal_at) and resumed
best          keep_best on a metric that peaks at step 4, keep_last=1
noisy         every rank logs the same library warnings at every step, and the main process prints in pieces
faults        one bad input (--fault): an unused parameter, a loss_fn returning float / None / a vector, no eval
too_small     fewer training examples than processes
world_guard   a plain Accelerator on a CPU host under a 2-process launch: the trainer's guard must stop it
nanogpt_meta  a model built as nanoGPT builds its GPT, on the meta device: its LayerNorm as placed, then 2 steps
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import sys
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from types import SimpleNamespace

import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from trainer import TrainConfig, Trainer, distributed_state  # noqa: E402


class TinyClassifier(torch.nn.Module):
    """Returns an object with ``.loss``, as transformers models do, so the Trainer's default loss applies."""

    def __init__(self, dim: int = 8, classes: int = 3):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(dim, 32), torch.nn.ReLU(), torch.nn.Linear(32, classes))

    def forward(self, x, labels):
        logits = self.net(x)
        return SimpleNamespace(logits=logits, loss=torch.nn.functional.cross_entropy(logits.float(), labels))


class Examples(torch.utils.data.Dataset):
    def __init__(self, n: int, dim: int = 8, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, dim, generator=g)
        self.labels = (self.x[:, 0] > 0).long() + (self.x[:, 1] > 0.5).long()

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        return {"x": self.x[i], "labels": self.labels[i]}


def say(line: str) -> None:
    """Print from any rank as one write, so that lines of different ranks never splice."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def job(args) -> None:
    torch.manual_seed(0)
    config = TrainConfig(
        output_dir=args.output_dir,
        epochs=4,
        batch_size=8,
        lr=3e-3,
        log_every=2,
        lr_scheduler="cosine",
        warmup_steps=2,
        max_grad_norm=1.0,
        profile_steps=args.profile_steps,
    )
    trainer = Trainer(TinyClassifier(), config, train_data=Examples(64), eval_data=Examples(9, seed=1))
    before = trainer.evaluate()
    result = trainer.fit()
    acc = trainer.accelerator
    with trainer.steps.autocast():  # the forward as a training step runs it
        logits = trainer.model(**next(iter(trainer.data.train))).logits
    if acc.is_main_process:
        Path(args.output_dir).mkdir(parents=True, exist_ok=True)
        Path(args.output_dir, "result.json").write_text(
            json.dumps(
                {
                    "world_size": acc.num_processes,
                    "device": acc.device.type,
                    "mixed_precision": acc.mixed_precision,
                    "before": before,
                    "result": result,
                    "log_history": trainer.log_history,
                    "logits_dtype": str(logits.dtype),
                    "fused_optimizer": bool(
                        getattr(trainer.optimizer, "optimizer", trainer.optimizer).defaults.get("fused")
                    ),
                    "pin_memory": trainer.data.train.base_dataloader.pin_memory,
                }
            )
        )


class DropoutClassifier(TinyClassifier):
    def __init__(self, hidden: int = 32, dim: int = 8, classes: int = 3):
        super().__init__(dim, classes)
        self.net = torch.nn.Sequential(
            torch.nn.Linear(dim, hidden), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(hidden, classes)
        )


class SignalAfter:
    """A real signal to this one process after optimizer step ``step`` on ``rank`` (the others receive none)."""

    def __init__(self, step: int, rank: int, name: str):
        self.step, self.rank, self.signal = step, rank, getattr(signal, name)

    def on_step_end(self, trainer) -> None:
        if trainer.global_step == self.step and trainer.accelerator.process_index == self.rank:
            say(f"SIGNAL {self.signal.name} to rank {self.rank} after step {self.step}")
            os.kill(os.getpid(), self.signal)


class CrashAfter:
    """Kills one rank the hard way after optimizer step ``step`` and any checkpoint of it (in the next step, whose
    checkpoint would come after its on_step_end), in the first attempt only: a restart by the elastic agent
    (TORCHELASTIC_RESTART_COUNT > 0) runs on."""

    def __init__(self, step: int, rank: int):
        self.step, self.rank = step, rank

    def on_step_end(self, trainer) -> None:
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if first_attempt and trainer.global_step == self.step + 1 and trainer.accelerator.process_index == self.rank:
            say(f"CRASH rank {self.rank} after step {self.step}")
            os._exit(1)


# The `resume` job's optimization, which tests/jobs/resume_cases.py's runs share.
ADAMW_COSINE = dict(
    epochs=3, batch_size=4, optimizer="adamw", lr=1e-2, weight_decay=0.01, lr_scheduler="cosine", warmup_steps=2
)


def resume(args) -> None:
    torch.manual_seed(0)
    config = TrainConfig(
        output_dir=args.output_dir,
        **ADAMW_COSINE,
        save_every=4,
        keep_last=2,
        resume=args.resume,
        log_every=3,
        nan_policy=args.nan_policy,
        experiment_name=args.experiment_name,
        wandb_project=args.wandb_project,
        stall_warning_s=args.stall_warning_s,
        collective_timeout_s=args.collective_timeout_s,
        compile=args.compile,
        max_steps=args.max_steps,
        preemption_grace_s=args.preemption_grace_s,
        slurm_requeue=args.slurm_requeue,
        save_async=args.save_async,
    )

    def loss_fn(model, batch):
        loss = model(**batch).loss
        step = trainer.global_step + 1
        rank = trainer.accelerator.process_index
        time.sleep(args.step_sleep)  # a step long enough for a test to signal the job mid-run
        if rank == args.slow_rank:
            time.sleep(0.1)  # a straggler: the others wait for it at every gradient all-reduce
        if step == args.raise_at and rank == args.raise_rank:
            raise RuntimeError(f"boom on rank {rank} at step {step}")
        if step == args.stall_at and rank != args.stall_rank and model.training:
            time.sleep(args.stall_lag)  # the others reach the all-reduce late too, as on a loaded host
        if step == args.stall_at and rank == args.stall_rank and model.training:
            say(f"STALL rank {rank} at step {step} for {args.stall_s} s")
            stalled_until = time.monotonic() + args.stall_s  # a hung loader or a frozen node: the others wait at the
            while time.monotonic() < stalled_until and (args.stall_deaf or not trainer.preemption.received):
                time.sleep(0.1)  # all-reduce; the launcher's SIGTERM, once the job is over, ends it (not its SIGKILL
                # 30 s later), unless the stall is deaf to signals, as a hung kernel is
        if step == args.nan_at and trainer.accelerator.process_index == args.nan_rank:
            loss = loss * float("nan")
        return loss

    if args.forbid_unsafe_load:  # every file a resume reads must load with weights_only=True
        real_load = torch.load

        def safe_load_only(*a, **kw):
            assert kw.get("weights_only", True) is not False, f"unsafe torch.load of {a[0]}"
            return real_load(*a, **kw)

        torch.load = safe_load_only
    callbacks = [CrashAfter(args.crash_at, args.crash_rank)] if args.crash_at else []
    if args.signal_at:
        callbacks.append(SignalAfter(args.signal_at, args.signal_rank, args.signal))
    trainer = Trainer(
        DropoutClassifier(args.hidden), config, train_data=Examples(48), loss_fn=loss_fn, callbacks=callbacks
    )
    # The part that writes the schedule and the random states, after the model's shards.
    written_last = trainer.checkpoints.parts["accelerate"]
    if args.kill_in_save_at:  # die after every rank wrote the step's files, before the checkpoint is committed
        save_state = written_last.save

        def save_then_die(*a, **kw):
            save_state(*a, **kw)
            if trainer.global_step == args.kill_in_save_at and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
                trainer.accelerator.wait_for_everyone()
                say(f"KILLED during the save of step {trainer.global_step}")
                os._exit(1)

        written_last.save = save_then_die
    if args.slow_background_write:  # a background write committed only that many seconds after DCP's write ends
        model_part = trainer.checkpoints.parts["model"]
        save_async = model_part.save_async

        def slow_save_async(folder, group):
            written, done = save_async(folder, group), Future()

            def later():
                time.sleep(args.slow_background_write)
                try:
                    done.set_result(written.result())
                except BaseException as err:
                    done.set_exception(err)

            threading.Thread(target=later, daemon=True).start()
            say(f"WRITING {folder.name.removeprefix('.tmp-')} in the background")
            return done

        model_part.save_async = slow_save_async
    if args.hang_in_preemption_save:  # a save that never ends: the deadline or a second signal must end it
        save_state = written_last.save

        def hang(*a, **kw):
            if trainer.global_step % 4:  # not a periodic save: the preemption's
                say(f"HANGING in the save of step {trainer.global_step}")
                time.sleep(600)
            save_state(*a, **kw)

        written_last.save = hang
    if args.signal_in_export:  # SIGTERM to every rank as final/ is being written (a job's time limit, say)
        save_model = trainer.save_model

        def signalled_save_model(*a, **kw):
            say(f"EXPORTING rank {trainer.accelerator.process_index}: SIGTERM to this process")
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.5)
            return save_model(*a, **kw)

        trainer.save_model = signalled_save_model
    result = trainer.fit()
    if trainer.accelerator.is_main_process:
        say("RESULT " + json.dumps(result))


def hf_export(args) -> None:
    """A tiny GPT-2 built from a config (nothing downloaded), trained a few steps with the default loss."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(
        GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2, bos_token_id=0, eos_token_id=0)
    )
    tokens = torch.randint(0, 64, (32, 16), generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": t, "labels": t} for t in tokens]
    config = TrainConfig(output_dir=args.output_dir, max_steps=3, batch_size=4, lr=1e-3, log_every=1)
    trainer = Trainer(model, config, train_data=data, eval_data=data[:6])
    result = trainer.fit()
    if trainer.accelerator.is_main_process and "eval_perplexity" in result:
        say(f"PERPLEXITY {result['eval_perplexity']:.4f}")


class OwnPart(torch.utils.data.IterableDataset):
    """A stream that yields its process its own part of 0..11 (every K-th, from the process index)."""

    def __iter__(self):
        state = distributed_state()
        for i in range(state.process_index, 12, state.num_processes):
            yield (torch.tensor([float(i)]),)


def user_loader(args) -> None:
    data = TensorDataset(torch.arange(12, dtype=torch.float32).unsqueeze(1))
    sampler = None
    if args.sampler == "distributed":  # as a DDP user builds it: rank and world from the running job
        state = distributed_state()
        sampler = DistributedSampler(data, num_replicas=state.num_processes, rank=state.process_index, shuffle=False)
    elif args.sampler == "own_part":  # an IterableDataset that splits itself
        data = OwnPart()
    seen = []

    def loss_fn(model, batch):
        (x,) = batch
        seen.append(x.squeeze(1).long().tolist())
        return model(x).pow(2).mean()

    config = TrainConfig(
        output_dir=args.output_dir,
        epochs=1,
        batch_size=3,
        optimizer="sgd",
        lr=0.1,
        shuffle=False,
        max_steps=2 if args.sampler == "own_part" else None,
    )
    trainer = Trainer(
        torch.nn.Linear(1, 1), config, train_data=DataLoader(data, batch_size=3, sampler=sampler), loss_fn=loss_fn
    )
    trainer.fit()
    say(f"SEEN rank{trainer.accelerator.process_index} {json.dumps(seen)}")


def predict(args) -> None:
    """Eval metrics and predictions of a fixed model on 9 examples: every example once, in dataset order."""
    torch.manual_seed(0)
    data = Examples(9, seed=1)

    def accuracy(model, batch):
        return {
            "accuracy": (model(**batch).logits.argmax(-1) == batch["labels"]).float(),
            "label": batch["labels"].float(),
        }

    config = TrainConfig(output_dir=args.output_dir, max_steps=1, batch_size=2, lr=0.0, shuffle=False)
    trainer = Trainer(TinyClassifier(), config, train_data=Examples(8), eval_data=data, metrics_fn=accuracy)
    metrics = trainer.evaluate()
    logits = trainer.predict(data)
    labels = trainer.predict(data, lambda model, batch: batch["labels"])
    say(
        f"PREDICT rank{trainer.accelerator.process_index} "
        + json.dumps(
            {
                "metrics": metrics,
                "logits": logits.tolist(),
                "labels": labels.tolist(),
                "expected_labels": data.labels.tolist(),
            }
        )
    )


class AskToStop:
    """Sets trainer.should_stop on one rank only, after optimizer step ``step``."""

    def __init__(self, step: int, rank: int):
        self.step, self.rank = step, rank

    def on_step_end(self, trainer) -> None:
        if trainer.global_step == self.step and trainer.accelerator.process_index == self.rank:
            trainer.should_stop = True


def stop(args) -> None:
    """Stopping early: one rank asks after step --stop_at, or EarlyStopping on an eval loss that cannot improve."""
    from trainer import EarlyStopping

    torch.manual_seed(0)
    early = args.stop_at == 0
    config = TrainConfig(
        output_dir=args.output_dir,
        max_steps=40,
        batch_size=4,
        log_every=3,
        save_every=4,
        eval_every=2,
        lr=0.0 if early else 1e-2,
    )
    callbacks = [EarlyStopping(monitor="eval_loss", patience=2)] if early else [AskToStop(args.stop_at, 1)]
    trainer = Trainer(
        TinyClassifier(), config, train_data=Examples(48), eval_data=Examples(9, seed=1), callbacks=callbacks
    )
    result = trainer.fit()
    say(f"STOPPED rank{trainer.accelerator.process_index} " + json.dumps(result))


class Remembers:
    """A user's callback with state (counts and a tensor): it gets them back at a resume."""

    def __init__(self, fail_load_rank: int = -1):
        self.seen, self.total, self.steps = 0, torch.zeros(1), 0
        # This rank's load_state_dict raises (a user's callback that cannot take what was saved).
        self.fail_load_rank = fail_load_rank

    def on_evaluate(self, trainer, metrics) -> None:
        self.seen += 1
        self.total += metrics["eval_loss"]

    def on_step_end(self, trainer) -> None:
        self.steps += 1

    def state_dict(self) -> dict:
        return {"seen": self.seen, "total": self.total, "steps": self.steps}

    def load_state_dict(self, state: dict) -> None:
        if int(os.environ.get("RANK", "0")) == self.fail_load_rank:
            raise KeyError("Remembers cannot take this state")
        self.seen, self.total, self.steps = state["seen"], state["total"], state["steps"]


def patience(args) -> None:
    """EarlyStopping(patience=3) on an eval loss that cannot improve (lr 0), evaluated every 2 steps: the best is
    step 2's, steps 4 and 6 wait. With --signal_at 5, rank 1 alone is signalled after step 5: the periodic save of
    step 6 asks every rank first, so the run is preempted with a checkpoint of step 6. Started again, it resumes
    there and must stop at the next log after one more evaluation (step 8's, asked; the log of step 10)."""
    from trainer import EarlyStopping

    torch.manual_seed(0)
    config = TrainConfig(
        output_dir=args.output_dir,
        max_steps=40,
        batch_size=4,
        log_every=2,
        save_every=2,
        eval_every=2,
        lr=0.0,
        resume="auto",
        ema_decay=args.ema_decay,
    )
    stopping, remembers = EarlyStopping(monitor="eval_loss", patience=3), Remembers(args.fail_load_rank)
    callbacks = [stopping, remembers] + ([SignalAfter(args.signal_at, 1, "SIGUSR1")] if args.signal_at else [])
    trainer = Trainer(
        TinyClassifier(), config, train_data=Examples(48), eval_data=Examples(9, seed=1), callbacks=callbacks
    )
    rank = trainer.accelerator.process_index
    say(
        f"BEGIN rank{rank} "
        + json.dumps(
            {
                "step": trainer.global_step,
                "waited": stopping.waited,
                "best_step": stopping.best_step,
                "seen": remembers.seen,
                "total": remembers.total.item(),
                "steps": remembers.steps,
            }
        )
    )
    say(f"STOPPED rank{rank} " + json.dumps(trainer.fit()))


def best(args) -> None:
    """keep_best on a figure that peaks at step 4 whatever the model does; keep_last=1. With --signal_at 3, rank 1
    alone is signalled after step 3: the evaluation due at step 4 gives way to the preemption's checkpoint."""
    trainer = None

    def peak(model, batch):
        return {"peak": torch.full((len(batch["labels"]),), -float((trainer.global_step - 4) ** 2))}

    torch.manual_seed(0)
    config = TrainConfig(
        output_dir=args.output_dir,
        max_steps=args.max_steps or 10,
        batch_size=4,
        log_every=5,
        eval_every=2,
        save_every=2,
        keep_last=1,
        keep_best="eval_peak",
        keep_best_mode="max",
        resume=args.resume,
    )
    signal_at = [SignalAfter(args.signal_at, 1, "SIGUSR1")] if args.signal_at else []
    trainer = Trainer(
        TinyClassifier(),
        config,
        train_data=Examples(48),
        eval_data=Examples(9, seed=1),
        metrics_fn=peak,
        callbacks=signal_at,
    )
    trainer.fit()
    say(f"BEST rank{trainer.accelerator.process_index} {trainer.best_checkpoint} {json.dumps(trainer.best)}")


class Noise:
    """What a job's console meets mid-training: libraries' warnings on every rank, a user's print in pieces."""

    def on_step_end(self, trainer) -> None:
        import logging

        from accelerate.logging import get_logger

        logging.getLogger("transformers.modeling_utils").warning("NOISE from transformers, on every rank")
        get_logger("accelerate.utils.other").warning("NOISE from accelerate, at every save", main_process_only=False)
        if trainer.accelerator.is_main_process:
            print("NOISE", "printed", "in", "pieces", flush=True)  # print() writes each piece apart
            time.sleep(0.05)  # the bar redraws between steps


def noisy(args) -> None:
    import transformers  # noqa: F401  (its logger set up before the trainer, as in a transformers job)

    config = TrainConfig(output_dir=args.output_dir, max_steps=args.max_steps or 8, batch_size=4, log_every=1)
    Trainer(TinyClassifier(), config, train_data=Examples(64), callbacks=[Noise()]).fit()


class Output(dict):
    """A dict whose keys read as attributes, as transformers' ModelOutput: DDP finds the tensors in a dict."""

    __getattr__ = dict.__getitem__


class HalfUsed(TinyClassifier):
    """A classifier with a head it never uses: fine on one process, DDP's error on two."""

    def __init__(self):
        super().__init__()
        self.unused_head = torch.nn.Linear(8, 3)

    def forward(self, x, labels):
        return Output(super().forward(x, labels).__dict__)


def faults(args) -> None:
    """One bad input per run (--fault): unused (a parameter outside the loss), loss_float / loss_vector /
    loss_none (what loss_fn returns), empty_eval (an eval set with no examples), metrics_shape (a metrics_fn
    figure of the wrong shape), frozen (no trainable parameter), tensorboard_file (<output_dir>/tensorboard is a
    file)."""
    config = TrainConfig(
        output_dir=args.output_dir,
        max_steps=4,
        batch_size=4,
        log_every=2,
        find_unused_parameters=args.find_unused_parameters,
        tensorboard=args.fault == "tensorboard_file",
    )
    returns = {
        "loss_float": lambda m, b: 1.0,
        "loss_none": lambda m, b: None,
        "loss_vector": lambda m, b: m(**b).logits.sum(-1),
    }
    model = HalfUsed() if args.fault == "unused" else TinyClassifier()
    if args.fault == "frozen":
        model.requires_grad_(False)
    eval_data = {"empty_eval": Examples(0), "metrics_shape": Examples(8)}.get(args.fault)
    metrics_fn = (lambda m, b: {"accuracy": torch.zeros(3)}) if args.fault == "metrics_shape" else None
    if args.fault == "tensorboard_file":
        os.makedirs(args.output_dir, exist_ok=True)
        Path(args.output_dir, "tensorboard").write_text("not a folder")
    trainer = Trainer(
        model,
        config,
        train_data=Examples(32),
        eval_data=eval_data,
        loss_fn=returns.get(args.fault),
        metrics_fn=metrics_fn,
    )
    say("RESULT " + json.dumps(trainer.fit()))


class DictClassifier(TinyClassifier):
    def forward(self, x, labels):
        out = super().forward(x, labels)
        return {"logits": out.logits, "loss": out.loss}


@dataclasses.dataclass
class OutputRecord:
    logits: torch.Tensor
    loss: torch.Tensor


class DataclassClassifier(TinyClassifier):
    def forward(self, x, labels):
        out = super().forward(x, labels)
        return OutputRecord(out.logits, out.loss)


def outputs(args) -> None:
    """The same classifier returning a SimpleNamespace, a dict and a dataclass: how far each weight moved in 4
    steps, or the refusal's text."""
    from trainer.errors import Refusal

    moved = {}
    for name, model_class in (
        ("namespace", TinyClassifier),
        ("dict", DictClassifier),
        ("dataclass", DataclassClassifier),
    ):
        torch.manual_seed(0)
        model = model_class()
        before = [p.detach().clone() for p in model.parameters()]
        config = TrainConfig(output_dir=f"{args.output_dir}/{name}", batch_size=8, max_steps=4, lr=3e-3)
        try:
            trainer = Trainer(model, config, train_data=Examples(64))
            trainer.fit()
        except Refusal as err:
            moved[name] = str(err)
            continue
        after = [getattr(p, "full_tensor", p.detach)() for p in trainer.model.parameters()]
        moved[name] = min(float((a - b).abs().max()) for a, b in zip(after, before, strict=True))
    say("RESULT " + json.dumps(moved))


def too_small(args) -> None:
    Trainer(TinyClassifier(), TrainConfig(output_dir=args.output_dir, batch_size=1), train_data=Examples(1))


def world_guard(args) -> None:
    from accelerate import Accelerator

    from trainer.launch.run import check_world_size

    check_world_size(Accelerator())  # without cpu=True each process believes it is alone


class NanoGPTLike(TinyClassifier):
    """Built as nanoGPT builds its GPT: its ``_init_weights`` applied to the Linear layers only, its LayerNorm
    keeping its own initialisation (ones and zeros)."""

    def __init__(self):
        torch.nn.Module.__init__(self)
        self.net = torch.nn.Sequential(
            torch.nn.Linear(8, 32), torch.nn.LayerNorm(32), torch.nn.ReLU(), torch.nn.Linear(32, 3)
        )
        self.apply(self._init_weights)

    def forward(self, x, labels):
        # A dict: FSDP2 finds the tensors in it.
        logits = self.net(x)
        return {"logits": logits, "loss": torch.nn.functional.cross_entropy(logits, labels)}

    def _init_weights(self, module: torch.nn.Module) -> None:
        if isinstance(module, torch.nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            torch.nn.init.zeros_(module.bias)


def lengths(args) -> None:
    """A tiny GPT-2 on 12 sequences of 12 lengths (batches of one, unpadded), compiled as the launch asks: how many
    graphs dynamo made for its 12 steps."""
    from torch._dynamo.utils import counters
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, n_positions=32, vocab_size=64))
    rows = [torch.randint(0, 64, (length,)) for length in range(8, 20)]
    config = TrainConfig(output_dir=args.output_dir, batch_size=1, epochs=1, compile=args.compile, log_every=6)
    trainer = Trainer(model, config, train_data=[{"input_ids": row, "labels": row} for row in rows])
    trainer.fit()
    if trainer.accelerator.is_main_process:
        say(f"GRAPHS {counters['stats']['unique_graphs']} for {len(rows)} lengths")


class BrokenNorm(torch.nn.LayerNorm):
    """A user's module whose own initialisation raises (once its tensors are real)."""

    def reset_parameters(self) -> None:
        if not self.weight.is_meta:
            raise ValueError("BrokenNorm cannot initialise itself")


def nanogpt_meta(args) -> None:
    """NanoGPTLike built on the meta device: its weights as placed (the LayerNorm's whole), then 2 steps. --fault
    broken_reset: its LayerNorm's reset_parameters() raises; nan_range: a GPT-2 whose initializer_range is NaN."""
    from transformers import GPT2Config, GPT2LMHeadModel

    with torch.device("meta"):
        model = NanoGPTLike()
        if args.fault == "broken_reset":
            model.net[1] = BrokenNorm(32)
        elif args.fault == "nan_range":
            model = GPT2LMHeadModel(GPT2Config(vocab_size=16, n_positions=8, n_embd=8, n_layer=1, n_head=2))
            model.config.initializer_range = float("nan")
    config = TrainConfig(output_dir=args.output_dir, max_steps=2, batch_size=4, log_every=1)
    trainer = Trainer(model, config, train_data=Examples(16))
    norm = trainer.unwrapped_model.net[1]
    weight, bias = (getattr(t, "full_tensor", lambda t=t: t)().detach() for t in (norm.weight, norm.bias))
    placed = {"norm_ones": bool(torch.equal(weight, torch.ones(32))), "norm_zeros": bool(torch.equal(bias, 0 * bias))}
    result = trainer.fit()
    say("NANOGPT " + json.dumps({**placed, "loss": result["train_loss"]}))


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "case",
        choices=[
            "job",
            "resume",
            "hf_export",
            "user_loader",
            "too_small",
            "world_guard",
            "predict",
            "stop",
            "patience",
            "best",
            "noisy",
            "faults",
            "outputs",
            "nanogpt_meta",
            "lengths",
        ],
    )
    parser.add_argument("--resume", default="auto", type=lambda v: None if v == "none" else v)
    parser.add_argument("--crash_at", type=int, default=0)
    parser.add_argument("--crash_rank", type=int, default=1)
    parser.add_argument("--stop_at", type=int, default=0)
    parser.add_argument("--nan_at", type=int, default=0)
    parser.add_argument("--nan_rank", type=int, default=1)
    parser.add_argument("--nan_policy", default="raise")
    parser.add_argument("--hidden", type=int, default=32)
    parser.add_argument("--wandb_project", default=None)
    parser.add_argument("--experiment_name", default="scenario")
    parser.add_argument("--raise_at", type=int, default=0)
    parser.add_argument("--raise_rank", type=int, default=1)
    parser.add_argument("--slow_rank", type=int, default=-1)
    parser.add_argument("--stall_at", type=int, default=0)
    parser.add_argument("--stall_rank", type=int, default=1)
    parser.add_argument("--stall_s", type=float, default=0)
    parser.add_argument("--stall_lag", type=float, default=0, help="the other ranks' time in that forward")
    parser.add_argument("--stall_deaf", action="store_true", help="a signal does not end the stall")
    parser.add_argument("--stall_warning_s", type=float, default=300)
    parser.add_argument("--collective_timeout_s", type=float, default=1800)
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--max_steps", type=int, default=None)
    parser.add_argument("--kill_in_save_at", type=int, default=0)
    parser.add_argument("--forbid_unsafe_load", action="store_true")
    parser.add_argument("--output_dir", default="runs/scenario")
    parser.add_argument("--fail_load_rank", type=int, default=-1)
    parser.add_argument("--ema_decay", type=float, default=None)
    parser.add_argument("--signal_at", type=int, default=0)
    parser.add_argument("--signal_rank", type=int, default=1)
    parser.add_argument("--signal", default="SIGUSR1")
    parser.add_argument("--step_sleep", type=float, default=0)
    parser.add_argument("--hang_in_preemption_save", action="store_true")
    parser.add_argument("--signal_in_export", action="store_true")
    parser.add_argument("--save_async", action="store_true")
    parser.add_argument("--slow_background_write", type=float, default=0)
    parser.add_argument("--preemption_grace_s", type=float, default=180)
    parser.add_argument("--slurm_requeue", action="store_true")
    parser.add_argument("--fault", default="")
    parser.add_argument("--find_unused_parameters", action="store_true")
    parser.add_argument("--sampler", choices=["none", "distributed", "own_part"], default="none")
    parser.add_argument("--profile_steps", default=None)
    cli = parser.parse_args()
    globals()[cli.case](cli)
