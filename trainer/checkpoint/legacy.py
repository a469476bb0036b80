"""Checkpoints written before today's layout, read in this module alone: a DDP run's ``model.safetensors`` and
``optimizer.bin`` (before every strategy wrote DCP's ``shards/``), and a ``trainer_state.json`` with every key at its
top (before a checkpoint's parts were kept by name). A resume from one writes its next checkpoints in today's layout.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Callable

import torch

from trainer.checkpoint.hf_files import MODEL_FILE, TIED_WEIGHTS, write_model
from trainer.console import say

# DDP's optimizer file, beside MODEL_FILE.
OPTIMIZER_FILE = "optimizer.bin"


def read_before_dcp(model: torch.nn.Module, optimizer: Any, folder: Path) -> None:
    """A checkpoint of a DDP run written before every strategy wrote DCP: the whole model in ``model.safetensors``
    (read by safetensors) and the optimizer's state by parameter index in ``optimizer.bin`` (``torch.load`` with
    ``weights_only=True``), given to this run by parameter name: this run's optimizer lists its parameters in the
    same order (the same config built both; a change is refused first). Each process keeps its part."""
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_state_dict,
    )

    options = StateDictOptions(full_state_dict=True)
    weights = load_file(folder / MODEL_FILE)
    # set_model_state_dict of a whole state keeps a tensor the file lacks as it is: every name is checked here.
    aliases = {n for n, _ in model.named_parameters(remove_duplicate=False)} - {n for n, _ in model.named_parameters()}
    expected = set(get_model_state_dict(model)) - aliases
    if expected != set(weights) - aliases:
        missing, extra = sorted(expected - set(weights)), sorted(set(weights) - expected - aliases)
        raise ValueError(
            f"{MODEL_FILE} lacks {', '.join(missing) or 'nothing'} and holds {', '.join(extra) or 'nothing'} "
            "beyond this model's tensors"
        )
    if optimizer is None:
        return set_model_state_dict(model, weights, options=options)
    saved = torch.load(folder / OPTIMIZER_FILE, map_location="cpu", weights_only=True)
    # Said because the conversion is this resume: the old files are read here once, never written again.
    say(
        f"{folder.name} is in the layout before DCP ({MODEL_FILE}, {OPTIMIZER_FILE}): read once, converted by this "
        "resume; its checkpoints from here on are today's (shards/)"
    )
    groups = get_optimizer_state_dict(model, optimizer)["param_groups"]
    names = [name for group in groups for name in group["params"]]
    indices = [index for group in saved["param_groups"] for index in group["params"]]
    if len(names) != len(indices):
        raise ValueError(f"the checkpoint's optimizer has {len(indices)} parameters, this run's {len(names)}")
    name_of = dict(zip(indices, names, strict=True))
    by_name = {
        "state": {name_of[index]: value for index, value in saved["state"].items()},
        "param_groups": [{**group, "params": [name_of[i] for i in group["params"]]} for group in saved["param_groups"]],
    }
    set_state_dict(model, optimizer, model_state_dict=weights, optim_state_dict=by_name, options=options)


def export_before_dcp(folder: Path, directory: Path) -> Path:
    """The weights of checkpoint ``folder`` into ``directory`` as an export writes them: its ``model.safetensors``
    (a plain module's tied weights each under every name it has). Returns the file written."""
    if not (folder / TIED_WEIGHTS).is_file():
        shutil.copyfile(folder / MODEL_FILE, directory / MODEL_FILE)
        return directory / MODEL_FILE
    from safetensors.torch import load_file

    weights = load_file(folder / MODEL_FILE)
    for names in json.loads((folder / TIED_WEIGHTS).read_text()):
        kept = next(weights[name] for name in names if name in weights)
        weights.update({name: weights.get(name, kept) for name in names})
    return write_model(weights, directory)


def tensors_before_dcp(folder: Path) -> tuple[list[str], Callable[[list[str]], dict[str, torch.Tensor]]]:
    """The names of checkpoint ``folder``'s tensors, and a function reading some of them whole onto the CPU."""
    from safetensors import safe_open

    with safe_open(str(folder / MODEL_FILE), "pt") as weights:
        names = list(weights.keys())

    def fetch(wanted: list[str]) -> dict[str, torch.Tensor]:
        with safe_open(str(folder / MODEL_FILE), "pt") as weights:
            return {name: weights.get_tensor(name) for name in wanted}

    return names, fetch


def state_before_the_registry(flat: dict[str, Any]) -> dict[str, Any]:
    """A state written before its parts were kept by name (every key at the top), in today's layout."""
    keys = {
        "train": ("global_step", "epoch", "batches_into_epoch", "run_id"),
        "run": ("world_size", "batch_size", "gradient_accumulation_steps", "optimizer_class", "config"),
    }
    state = {part: {key: flat[key] for key in names if key in flat} for part, names in keys.items()}
    state.update(
        data={"streams": flat.get("streams")},
        best=flat.get("best"),
        sharding=flat.get("sharding", "DDP"),
        files=flat.get("files"),
        crc32=flat.get("crc32", {}),
    )
    return state
