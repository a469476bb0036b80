"""TrainConfig: everything a run needs to know, as plain data with strict validation (docs/project.md).

The hardware (processes, machines, mixed precision) is not here: the accelerate config chosen at launch decides it.
Every field has a real default, so a YAML file lists only what differs::

    config = TrainConfig.from_yaml("run.yaml", overrides=["lr=1e-3", "batch_size=16"])

Mistakes are caught when the config is built, before anything starts: each names its key.
"""

from trainer.config.fields import TrainConfig
from trainer.config.reading import parse_overrides, read_yaml

__all__ = ["TrainConfig", "parse_overrides", "read_yaml"]
