"""A sharded model's weights and optimizer state in a checkpoint: every process writes its own shards and reads
back what it holds (torch.distributed.checkpoint, DCP), so no process ever holds the whole model.

The shards live in ``shards/`` inside the checkpoint folder, beside what accelerate saves of the rest (scheduler,
every rank's RNG) and the trainer's state: the same ``.tmp-step-N`` folder, committed by the same rename, listed by
the same CRC-checked manifest as a DDP checkpoint (``trainer.checkpoint``). DCP writes its ``.metadata`` last.
"""

from __future__ import annotations

from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch

SHARDS = "shards"  # the folder of a checkpoint that holds a sharded model's weights and optimizer state


def save(model: torch.nn.Module, optimizer: torch.optim.Optimizer, folder: Path) -> None:
    """Every process writes its shards of the weights and the optimizer state into ``folder/shards`` (collective)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optimizer_state = get_state_dict(model, optimizer)
    (folder / SHARDS).mkdir(parents=True, exist_ok=True)
    dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=str(folder / SHARDS))


def save_async(model: torch.nn.Module, optimizer: torch.optim.Optimizer, folder: Path, process_group: Any) -> Future:
    """``save``, returning once the state is copied to CPU memory: the files are written in the background
    (trainer.background_save), the collectives on ``process_group``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optimizer_state = get_state_dict(model, optimizer)
    (folder / SHARDS).mkdir(parents=True, exist_ok=True)
    return dcp.async_save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=str(folder / SHARDS),
                          process_group=process_group)  # fmt: skip


def load(model: torch.nn.Module, optimizer: torch.optim.Optimizer, folder: Path) -> None:
    """Every process reads the part of ``folder/shards`` it holds now (collective): the weights and the optimizer
    state continue exactly, whatever the number of processes that wrote them."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_state, optimizer_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state}
    try:
        dcp.load(state, checkpoint_id=str(folder / SHARDS))
    except dcp.api.CheckpointException as err:  # a BaseException: said as the first failure, for CheckpointError
        first = next(iter(err.failures.values()), err)
        first = first[0] if isinstance(first, tuple) else first  # (exception, its traceback)
        raise RuntimeError(f"{type(first).__name__}: {first}") from err
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


def load_model(model: torch.nn.Module, folder: Path) -> None:
    """Every process reads its part of the weights in ``folder/shards`` alone, not the optimizer state
    (collective): the best checkpoint's weights at the end of training."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    state = {"model": get_model_state_dict(model)}
    dcp.load(state, checkpoint_id=str(folder / SHARDS))
    set_model_state_dict(model, state["model"])


def full_model_state(model: torch.nn.Module) -> dict[str, Any]:
    """The whole model's weights on the main process's CPU, one tensor at a time (collective; the other processes
    get an empty dict): for the exported model only, never for a checkpoint."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
