"""A model as files ``from_pretrained`` (or PEFT) loads, from the live model or from a checkpoint, on any strategy
(docs/checkpoints.md): the weights written one file at a time by the main process, a sharded model's tensors
gathered one at a time, never the whole model anywhere; a PEFT model's adapter, or the base model with it folded in.
"""

from __future__ import annotations

import contextlib
import json
import shutil
from pathlib import Path
from typing import Any, Callable

import torch

from trainer.checkpoint import integrity
from trainer.checkpoint.hf_files import (
    ADAPTER_CONFIG,
    MODEL_CONFIG,
    MODEL_FILE,
    TIED_WEIGHTS,
    once_each,
    replacing,
    write_model,
    write_streamed,
)
from trainer.checkpoint.peft import holds_adapter, saved_by_peft, write_adapter, write_merged
from trainer.checkpoint.safe_dcp import SHARDS, sharded_weights
from trainer.errors import ExportError
from trainer.hf import peft_model
from trainer.parallel.gradients import whole


def export_model(model: torch.nn.Module, directory: Path, *, run: Any, merged: bool = False) -> None:
    """The live ``model`` (the plain or sharded module) into ``directory``; every rank returns once it is written.
    An earlier export's files there are replaced (they would mix with this one's); others, a tokenizer saved beside,
    stay. ``merged``: a PEFT model's base model with its adapter folded in, built from a copy of the whole state
    on the main process's CPU, the model that trains left as it is; else a PEFT model's adapter."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    if merged and not peft_model(model):
        raise ExportError(
            f"merged=True folds a PEFT adapter into its base model, and this model "
            f"({type(model).__name__}) has none: save it without merged"
        )
    # This process's tensors (a sharded model's shards), by name.
    state = get_model_state_dict(model)
    if peft_model(model):
        wanted = list(state) if merged else saved_by_peft(model, list(state))
        tensors = _gathered(state, wanted, main=run.main)
        if run.main:
            with replacing(directory) as staging:
                if merged:
                    write_merged(model, tensors, staging)
                else:
                    # PEFT writes its adapter's tensors of them.
                    model.save_pretrained(staging, state_dict=tensors)
        run.barrier()
        return
    state = once_each(state, model)
    entries = [(name, tensor.numel() * tensor.element_size()) for name, tensor in state.items()]
    with replacing(directory) if run.main else contextlib.nullcontext(directory) as target:
        write_streamed(
            entries, lambda names: _gathered(state, names, main=run.main), target, model=model, main=run.main
        )
    run.barrier()


def _gathered(state: dict[str, Any], names: list[str], *, main: bool) -> dict[str, torch.Tensor]:
    """The named tensors whole, copied to the main process's CPU (collective: every process gathers each)."""
    tensors = {}
    for name in names:
        tensor = whole(state[name])
        if main:
            tensors[name] = tensor.detach().to("cpu", copy=True)
    return tensors


def export(folder: Path, directory: Path, *, replace: bool = False, merged: bool = False) -> Path:
    """Write checkpoint ``folder``'s model into ``directory`` (new or empty; any with ``replace``, replaced whole);
    return the weights file (or the index of several). A PEFT model's checkpoint: its adapter, or with ``merged``
    the base model with the adapter folded in (``trainer.checkpoint.peft``)."""
    integrity.verify(folder)
    architecture = (
        (json.loads((folder / MODEL_CONFIG).read_text()).get("architectures") or [""])[0]
        if (folder / MODEL_CONFIG).is_file()
        else ""
    )
    if str(architecture).startswith("Peft") and not holds_adapter(folder):
        raise ExportError(
            f"checkpoint {folder} holds a PEFT model but not its adapter's config (it was written "
            f"before checkpoints carried {ADAPTER_CONFIG}): resume the run with this trainer for a "
            "step, and export that checkpoint"
        )
    if merged and not holds_adapter(folder):
        raise ExportError(
            f"--merged folds a PEFT adapter into its base model, and checkpoint {folder} holds no "
            f"adapter ({ADAPTER_CONFIG}): export it without --merged"
        )
    inside = directory.resolve() == folder.resolve() or folder.resolve() in directory.resolve().parents
    if inside:
        raise ExportError(
            f"{directory} is inside the checkpoint {folder}, which holds exactly what its manifest "
            "lists: export into a folder of its own"
        )
    if directory.is_file() or directory.is_dir() and any(directory.iterdir()) and not replace:
        held = sorted(p.name for p in directory.iterdir()) if directory.is_dir() else []
        what = f"already holds {', '.join(held[:3])}{', ...' if len(held) > 3 else ''}" if held else "is a file"
        raise ExportError(
            f"the export's folder {directory} {what}: export into a new or empty folder, or pass "
            "--replace to replace it whole"
        )
    try:
        # New, empty, or --replace.
        with replacing(directory, whole=True) as staging:
            written = _write(folder, staging, merged)
    except OSError as err:
        raise ExportError(f"cannot write the export into {directory}: {err.strerror or err}") from None
    return directory / written.name


def _write(folder: Path, directory: Path, merged: bool) -> Path:
    written = directory / MODEL_FILE
    if holds_adapter(folder):
        names, fetch = _tensors(folder)
        return write_adapter(folder, directory, names=names, fetch=fetch, merged=merged)
    # A file's worth read at a time.
    if (folder / SHARDS).is_dir():
        entries, fetch = sharded_weights(folder)
        written = write_streamed(entries, fetch, directory)
    # Written before every strategy wrote DCP: a plain module's tied weights, each under every name it has.
    elif (folder / TIED_WEIGHTS).is_file():
        from safetensors.torch import load_file

        weights = load_file(folder / MODEL_FILE)
        for names in json.loads((folder / TIED_WEIGHTS).read_text()):
            kept = next(weights[name] for name in names if name in weights)
            weights.update({name: weights.get(name, kept) for name in names})
        written = write_model(weights, directory)
    else:
        shutil.copyfile(folder / MODEL_FILE, directory / MODEL_FILE)
    if (folder / MODEL_CONFIG).is_file():
        shutil.copyfile(folder / MODEL_CONFIG, directory / MODEL_CONFIG)
    return written


def _tensors(folder: Path) -> tuple[list[str], Callable[[list[str]], dict[str, torch.Tensor]]]:
    """The names of checkpoint ``folder``'s tensors, and a function reading some of them whole onto the CPU."""
    if (folder / SHARDS).is_dir():
        entries, fetch = sharded_weights(folder)
        return [name for name, _ in entries], fetch
    from safetensors import safe_open

    with safe_open(str(folder / MODEL_FILE), "pt") as weights:
        names = list(weights.keys())

    def fetch(wanted: list[str]) -> dict[str, torch.Tensor]:
        with safe_open(str(folder / MODEL_FILE), "pt") as weights:
            return {name: weights.get_tensor(name) for name in wanted}

    return names, fetch
