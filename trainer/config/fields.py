"""TrainConfig's fields, their defaults and their checks (docs/project.md lists them)."""

from __future__ import annotations

import dataclasses
import signal
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from trainer.config.checks import check_checkpoints
from trainer.config.reading import built_from_yaml, check_choice, check_keys, coerce, env_overrides, steps_of
from trainer.errors import ConfigError

OPTIMIZERS = ("sgd", "adam", "adamw", "muon")
NAN_POLICIES = ("raise", "skip")
# transformers' step-based schedules (get_scheduler; trainer.schedules), each after warmup_steps of linear warm-up.
LR_SCHEDULERS = (
    "constant",
    "linear",
    "cosine",
    "cosine_with_min_lr",
    "warmup_stable_decay",
    "polynomial",
    "inverse_sqrt",
    # nanoGPT's own: warm-up from lr / (warmup + 1), cosine to min_lr_ratio over lr_scheduler_kwargs.lr_decay_steps.
    "nanogpt",
)


@dataclass
class TrainConfig:
    """What to train for and how. Batch size is per process, as in DDP.

    Global batch = ``batch_size`` x processes x ``gradient_accumulation_steps``; the trainer prints it at start.
    Steps (``max_steps``, ``warmup_steps``, ``log_every``, ``eval_every``, ``save_every``) count optimizer steps.
    """

    output_dir: str = "runs/experiment"
    experiment_name: str = "experiment"
    seed: int = 0

    epochs: int = 3
    # Wins over epochs when set.
    max_steps: Optional[int] = None
    # Per process.
    batch_size: int = 8
    gradient_accumulation_steps: int = 1

    # sgd, adam, adamw, or muon: Muon on the hidden weight matrices, AdamW on the rest (trainer/optim/muon.py).
    optimizer: str = "adamw"
    lr: float = 3e-4
    # Decays weight matrices and embeddings, not biases or normalisation weights.
    weight_decay: float = 0.0
    # True: weight_decay on every parameter.
    decay_biases_and_norms: bool = False
    # SGD only.
    momentum: float = 0.0
    # Adam and AdamW.
    betas: tuple[float, float] = (0.9, 0.999)
    # Adam and AdamW.
    eps: float = 1e-8
    lr_scheduler: str = "constant"
    warmup_steps: int = 0
    # The floor a decaying schedule ends at, as a fraction of lr (nanoGPT's 0.1): cosine_with_min_lr,
    # warmup_stable_decay, polynomial.
    min_lr_ratio: Optional[float] = None
    # The schedule's other settings, by transformers' names (warmup_stable_decay: num_decay_steps, decay_type, ...).
    lr_scheduler_kwargs: dict = dataclasses.field(default_factory=dict)
    # Clip the global gradient norm when set.
    max_grad_norm: Optional[float] = None

    shuffle: bool = True
    # train_data={"web": ..., "code": ...}: each set's weight by name ({web: 0.7, code: 0.3}), or [steps done,
    # weight] pairs from 0 ({web: [[0, 0.7], [1000, 0.5]], ...}); {}: each set's share of the examples. Every step
    # draws in these shares, in an order drawn from the seed (trainer/data/mixing.py).
    data_weights: dict = dataclasses.field(default_factory=dict)
    # Drop the M mod K tail examples instead of padding (DistributedSampler's).
    drop_last: bool = False
    num_workers: int = 0
    # torch.compile (inductor): each block under FSDP2, the whole model under DDP; pays off on GPUs
    # (docs/performance.md#compile).
    compile: bool = False
    # Each transformer block recomputes its activations in backward instead of keeping them (DDP and FSDP2): less
    # memory for about a third more compute; the same updates.
    activation_checkpointing: bool = False
    # The activations a forward saves wait in pinned CPU memory until backward needs them (not the weights, nor
    # tensors under 1 MB): less device memory for the copies' bus time; the same updates. Alone or with checkpointing.
    activation_offloading: bool = False
    # FSDP2 with gradient accumulation: reduce-scatter every micro-batch's gradients, so that a process never holds
    # the whole model's unsharded gradients during the window (1/K of them), for one reduce-scatter per micro-batch
    # instead of one per step. Off: the gradients are reduced once, at the window's end, as DDP does (and in DDP's
    # float order: at 2 processes the same weights bit for bit). No effect under DDP.
    reduce_every_micro_batch: bool = False
    # A causal LM's default loss from its last hidden states, loss_chunk_tokens at a time, recomputed in backward: the
    # whole batch's logits never held (trainer/loop/chunked.py); the same loss to float order.
    chunked_loss: bool = False
    loss_chunk_tokens: int = 256
    # Expert parallelism under an FSDP config: each MoE layer's experts split over ep_size processes, tokens sent to
    # them all-to-all (trainer/parallel/experts.py). Accelerate's parallelism_config has no key for it yet.
    ep_size: int = 1
    # DDP: parameters that get no gradient in some step (a branch not taken, a frozen head used only sometimes) must
    # be looked for after each forward, at some cost; without it such a model fails at its second step.
    find_unused_parameters: bool = False

    log_every: int = 10
    eval_every: Optional[int] = None
    # Full-state checkpoint every N optimizer steps and at the end; None: none.
    save_every: Optional[int] = None
    # Checkpoints kept; older ones are deleted once a newer one is committed.
    keep_last: int = 2
    # Checkpoints written in the background while training goes on (DDP and FSDP2 alike): the step waits only for the
    # copy to CPU memory. Committed once every process's files are written; one save in flight at a time.
    save_async: bool = False
    # Checkpoints in object storage (docs/checkpoints.md): an fsspec URL (s3://bucket/run, gs://bucket/run) where every
    # process uploads its files of each checkpoint, committed by a manifest written last; output_dir keeps the rest.
    checkpoint_storage: Optional[str] = None
    # An evaluate() figure (eval_loss, eval_accuracy, ...): the checkpoint of its best evaluation is kept apart from
    # keep_last (the "best" pointer names it). Needs checkpoints at evaluation steps (save_every a multiple of
    # eval_every); keep_best_mode "min" (lower is better) or "max".
    keep_best: Optional[str] = None
    keep_best_mode: str = "min"
    # With keep_best: final/ (the model fit() ends with) holds the best evaluation's weights, not the last step's.
    # None: true when keep_best is set.
    load_best_at_end: Optional[bool] = None
    # A micro-batch that runs out of device memory (on any rank) is cut in two, on every rank alike, and the step
    # reruns: the same global batch and updates (trainer/loop/microbatch.py). DDP, FSDP2 and one process; not with
    # tp_size or HSDP yet.
    auto_microbatch: bool = False
    # An exponential moving average of the trainable weights (trainer/optim/ema.py): after each optimizer step taken,
    # average <- average + (1 - ema_decay) * (weights - average); until step ema_start_step it follows the weights.
    # ema_eval: evaluations use the average; ema_final: final/ (and the model after fit()) holds it.
    ema_decay: Optional[float] = None
    ema_start_step: int = 0
    ema_eval: bool = True
    ema_final: bool = True
    # None (refuses an output_dir holding checkpoints) | "auto" | a checkpoint path.
    resume: Optional[str] = None
    # Non-finite loss: "raise" (stop, naming step and rank) | "skip" (drop that step).
    nan_policy: str = "raise"
    # "rollback": a step whose loss is over spike_threshold x the mean of the last 10 steps' goes back to the last
    # checkpoint, skips the batches since it and, with spike_lr_factor, lowers the lr (trainer/loop/spikes.py).
    spike_policy: Optional[str] = None
    spike_threshold: float = 3.0
    spike_lr_factor: Optional[float] = None
    # A collective waiting this long ends the job; no progress for stall_warning_s: the rank(s) waited for are named.
    collective_timeout_s: float = 1800.0
    stall_warning_s: Optional[float] = 60.0
    # Set it (or WANDB_PROJECT) to log to wandb from every process: run <experiment_name>-rank<k>, group the name.
    wandb_project: Optional[str] = None
    # Every process writes TensorBoard events to <output_dir>/tensorboard/rank<k>.
    tensorboard: bool = False
    # "10-12": a torch.profiler trace of those optimizer steps on every rank, <output_dir>/profile/rank<k>/trace.json
    profile_steps: Optional[str] = None
    # MFU on the step line (trainer/telemetry/mfu.py): forward + backward FLOPs per token (a transformers model's are
    # computed), a device's peak FLOP/s (a GPU in the table: its bf16 peak)
    flops_per_token: Optional[float] = None
    peak_flops: Optional[float] = None
    # fp32 matmuls on a GPU's tensor cores (TF32, a 10-bit mantissa; trainer/launch/precision.py). Off, as in torch.
    tf32: bool = False
    # Bitwise-repeatable GPU runs: torch's deterministic algorithms (an op without one raises, naming itself), cuBLAS's
    # fixed workspace (CUBLAS_WORKSPACE_CONFIG=:4096:8, set before the first matmul); some speed is the price.
    deterministic: bool = False
    # Preemption (trainer/launch/preemption.py): on any of these signals, every rank stops after the same step, commits
    # a checkpoint there and exits with status 75 ("": signals left alone). A second signal, or preemption_grace_s
    # after the first, exits at once. slurm_requeue: then `scontrol requeue` the job. SIGHUP (the ssh session went
    # away) and SIGQUIT (torchrun's agent treats it as SIGTERM) end a job as much as SIGTERM does.
    preemption_signals: str = "SIGTERM,SIGINT,SIGUSR1,SIGHUP,SIGQUIT"
    preemption_grace_s: float = 180.0
    slurm_requeue: bool = False

    def __new__(cls, *args: Any, **kwargs: Any) -> "TrainConfig":
        # A misspelt keyword gets the YAML path's suggestion, not a TypeError.
        check_keys(cls, kwargs, "TrainConfig")
        return super().__new__(cls)

    def __post_init__(self) -> None:
        hints, overrides = typing.get_type_hints(type(self)), env_overrides(type(self))
        for f in dataclasses.fields(self):
            setattr(self, f.name, coerce(f.name, overrides.get(f.name, getattr(self, f.name)), hints[f.name]))
        self._validate()

    # ---------------------------------------------------------------- loading

    @classmethod
    def from_dict(cls, values: dict[str, Any], source: str = "config") -> "TrainConfig":
        """Build from a mapping; an unknown key is an error naming the closest valid ones."""
        if not isinstance(values, dict):
            raise ConfigError(f"{source}: expected a mapping of TrainConfig keys, got {type(values).__name__}")
        check_keys(cls, values, source)
        try:
            return cls(**values)
        # A value of the wrong type or range: said with the file it came from.
        except ConfigError as err:
            if source == "config":
                raise
            raise ConfigError(f"{source}: {err}") from None

    @classmethod
    def from_yaml(cls, path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> "TrainConfig":
        """Load a YAML file of TrainConfig keys, then apply ``key=value`` overrides (values parsed as YAML).

        Example::

            TrainConfig.from_yaml("run.yaml", overrides=["lr=1e-3", "max_steps=100"])
        """
        return built_from_yaml(cls, Path(path), overrides)

    @property
    def signal_names(self) -> tuple[str, ...]:
        """``preemption_signals`` as names: ``("SIGTERM", "SIGINT", "SIGUSR1")``."""
        return tuple(name.strip() for name in self.preemption_signals.split(",") if name.strip())

    def replace(self, **changes: Any) -> "TrainConfig":
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    # ------------------------------------------------------------- validation

    def _validate(self) -> None:
        at_least = {
            "epochs": 1,
            "batch_size": 1,
            "gradient_accumulation_steps": 1,
            "warmup_steps": 0,
            "num_workers": 0,
            "log_every": 1,
            "keep_last": 1,
            "max_steps": 1,
            "eval_every": 1,
            "save_every": 1,
            "lr": 0.0,
            "weight_decay": 0.0,
            "eps": 0.0,
            "collective_timeout_s": 1.0,
            "stall_warning_s": 0.1,
            "preemption_grace_s": 1.0,
            "ema_start_step": 0,
            "flops_per_token": 1.0,
            "peak_flops": 1.0,
            "loss_chunk_tokens": 1,
            "ep_size": 1,
        }
        for key, low in at_least.items():
            value = getattr(self, key)
            if value is not None and value < low:
                raise ConfigError(f"{key} must be >= {low}, got {value!r}")
        if self.max_grad_norm is not None and self.max_grad_norm <= 0:
            raise ConfigError(f"max_grad_norm must be > 0 (or null to disable clipping), got {self.max_grad_norm!r}")
        if not 0.0 <= self.momentum < 1.0:
            raise ConfigError(f"momentum must be in [0, 1), got {self.momentum!r}")
        if not all(0.0 <= b < 1.0 for b in self.betas):
            raise ConfigError(f"betas must both be in [0, 1), got {self.betas!r}")
        check_choice("optimizer", self.optimizer, OPTIMIZERS)
        check_choice("lr_scheduler", self.lr_scheduler, LR_SCHEDULERS)
        floors = ("cosine_with_min_lr", "warmup_stable_decay", "polynomial", "nanogpt")
        if self.min_lr_ratio is not None and (self.lr_scheduler not in floors or not 0 <= self.min_lr_ratio <= 1):
            raise ConfigError(
                f"min_lr_ratio {self.min_lr_ratio!r} is a fraction of lr in [0, 1] that "
                f"{', '.join(floors)} end at; lr_scheduler is {self.lr_scheduler!r}"
            )
        if self.ema_decay is not None and not 0.0 < self.ema_decay < 1.0:
            raise ConfigError(
                f"ema_decay must be in (0, 1), say 0.999 (or null for no average); got {self.ema_decay!r}"
            )
        check_choice("nan_policy", self.nan_policy, NAN_POLICIES)
        check_choice("keep_best_mode", self.keep_best_mode, ("min", "max"))
        check_checkpoints(self)
        for name in self.signal_names:
            if name not in signal.Signals.__members__:
                raise ConfigError(
                    f"preemption_signals: {name!r} is not a signal name (say 'SIGTERM,SIGUSR1'; '' for none)"
                )
        if self.profile_steps is not None:
            steps_of(self.profile_steps)
        if self.wandb_project == "":
            raise ConfigError("wandb_project must be a wandb project name, or null to log without wandb; got ''")
