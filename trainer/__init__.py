"""trainer: a small PyTorch training loop on HuggingFace Accelerate.

The same script runs on a CPU, one GPU, a node or a cluster; the accelerate config chosen at launch decides::

    from trainer import Trainer, TrainConfig

    trainer = Trainer(model, TrainConfig(batch_size=8, epochs=3), train_data=dataset)
    trainer.fit()
"""

from trainer.config import TrainConfig
from trainer.errors import (
    PREEMPTED_EXIT,
    CheckpointError,
    ConfigError,
    DataError,
    LossSpike,
    NonFiniteLoss,
    Preempted,
    Refusal,
    WorldSizeMismatch,
    install_hook,
)
from trainer.launch.accelerate_config import accelerate_env
from trainer.launch.run import distributed_state
from trainer.loop.callbacks import EarlyStopping
from trainer.trainer import Trainer

# An uncaught Refusal ends the process with its one-line message, not a traceback.
install_hook()

__all__ = [
    "CheckpointError",
    "ConfigError",
    "DataError",
    "EarlyStopping",
    "LossSpike",
    "NonFiniteLoss",
    "PREEMPTED_EXIT",
    "Preempted",
    "Refusal",
    "TrainConfig",
    "Trainer",
    "WorldSizeMismatch",
    "accelerate_env",
    "distributed_state",
]
__version__ = "0.1.0"
