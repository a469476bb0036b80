"""The checks between TrainConfig's fields about checkpoints: where they go, what resumes, keep_best, spike
rollbacks; each a ``ConfigError`` naming the keys (docs/checkpoints.md)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainer.errors import ConfigError

if TYPE_CHECKING:
    from trainer.config.fields import TrainConfig


def check_checkpoints(config: TrainConfig) -> None:
    """Refuse settings of checkpoints, resumes and rollbacks that cannot work together."""
    if config.checkpoint_storage is not None and "://" not in config.checkpoint_storage:
        raise ConfigError(
            f"checkpoint_storage must be an object store's URL (s3://bucket/run); got {config.checkpoint_storage!r}"
        )
    if "://" in config.output_dir:
        raise ConfigError(
            f"output_dir is a URL ({config.output_dir}); it is a local folder (logs, the lock, final/): keep the "
            f"checkpoints in a bucket with checkpoint_storage: {config.output_dir}, and a local output_dir"
        )
    if "://" in (config.resume or "") and not config.checkpoint_storage:
        raise ConfigError(f"resume is a URL ({config.resume}): set checkpoint_storage, the bucket checkpoints go to")
    if config.resume == "":
        raise ConfigError("resume must be null, 'auto' or a checkpoint path; got ''")
    if config.keep_best is not None and (
        config.eval_every is None or config.save_every is None or config.eval_every % config.save_every
    ):
        raise ConfigError(
            f"keep_best is {config.keep_best!r}, but eval_every is {config.eval_every} and save_every "
            f"{config.save_every}: the best evaluation's checkpoint is kept only if every evaluation "
            "step is saved. Set eval_every to a multiple of save_every (say both 500)"
        )
    if config.load_best_at_end and config.keep_best is None:
        raise ConfigError(
            "load_best_at_end needs keep_best (the evaluate() figure whose best is loaded), say keep_best: eval_loss"
        )
    if config.spike_policy not in (None, "rollback"):
        raise ConfigError(f"spike_policy must be null or 'rollback'; got {config.spike_policy!r}")
    if config.spike_policy and not config.save_every:
        raise ConfigError("spike_policy: rollback goes back to the last checkpoint: set save_every (say 100)")
    if config.spike_policy and config.checkpoint_storage:
        raise ConfigError("spike_policy: rollback reads checkpoints from output_dir: not with checkpoint_storage yet")
    if config.spike_threshold <= 1:
        raise ConfigError(
            f"spike_threshold is a factor over the recent loss, above 1 (say 3); got {config.spike_threshold!r}"
        )
    if config.spike_lr_factor is not None and not 0 < config.spike_lr_factor <= 1:
        raise ConfigError(f"spike_lr_factor must be in (0, 1], say 0.5 (or null); got {config.spike_lr_factor!r}")
