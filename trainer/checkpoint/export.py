"""A model as files ``from_pretrained`` (or PEFT) loads, from the live model or from a checkpoint, on any strategy
(docs/checkpoints.md): the weights written one file at a time by the main process, a sharded model's tensors
gathered one at a time, never the whole model anywhere; a PEFT model's adapter, or the base model with it folded in.
"""

from __future__ import annotations

import contextlib
import errno
import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional

import torch
from safetensors import SafetensorError

from trainer.checkpoint import integrity, legacy
from trainer.checkpoint.hf_files import (
    ADAPTER_CONFIG,
    MODEL_CONFIG,
    once_each,
    replacing,
    write_streamed,
)
from trainer.checkpoint.peft import holds_adapter, saved_by_peft, write_adapter, write_merged
from trainer.checkpoint.safe_dcp import SHARDS, sharded_weights
from trainer.errors import ExportError
from trainer.hf import peft_model
from trainer.parallel.gradients import whole

if TYPE_CHECKING:
    from trainer.launch.run import Run

# What writing an export meets on a read-only or full disk (safetensors' own error is not an OSError).
WRITE_ERRORS = (OSError, SafetensorError)


def export_model(model: torch.nn.Module, directory: Path, *, run: Run, merged: bool = False) -> None:
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
        with _written_by_main(directory, run) as (target, failed):
            try:
                if target is not None and merged:
                    write_merged(model, tensors, target)
                # PEFT writes its adapter's tensors of them.
                elif target is not None:
                    model.save_pretrained(target, state_dict=tensors)
            except WRITE_ERRORS as err:
                failed.append(err)
        return
    state = once_each(state, model)
    entries = [(name, tensor.numel() * tensor.element_size()) for name, tensor in state.items()]
    with _written_by_main(directory, run) as (target, failed):
        fetch = lambda names: _gathered(state, names, main=run.main)  # noqa: E731
        try:
            # Every rank gathers each tensor; the main process writes them unless it cannot.
            write_streamed(entries, fetch, target or directory, model=model, main=target is not None)
        except WRITE_ERRORS as err:
            failed.append(err)


@contextlib.contextmanager
def _written_by_main(directory: Path, run: Run) -> Iterator[tuple[Optional[Path], list[BaseException]]]:
    """The folder the main process writes an export into (None elsewhere, and where it cannot be made), and a list
    for what failed; then every rank raises the main process's failure as one ``ExportError``, so that none waits
    for a peer that left (the folder as it was before)."""
    failed: list[BaseException] = []
    with contextlib.ExitStack() as stack:
        target = None
        if run.main:
            try:
                target = stack.enter_context(replacing(directory))
            except OSError as err:
                failed.append(err)
        yield target, failed
        run.main_decides(lambda: _refuse_failed(directory, failed))
    # The export in its place (replacing's end) before any rank returns.
    run.barrier()


def _refuse_failed(directory: Path, failed: list[BaseException]) -> None:
    if not failed:
        return
    err = failed[0]
    full = getattr(err, "errno", None) == errno.ENOSPC or "No space left on device" in str(err)
    free = shutil.disk_usage(directory.parent if directory.parent.exists() else ".").free
    why = f"the disk is full ({free / 2**20:.1f} MB free)" if full else getattr(err, "strerror", None) or str(err)
    raise ExportError(f"cannot write the export into {directory}: {why}; it was left as it was before")


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
    except WRITE_ERRORS as err:
        _refuse_failed(directory, [err])
    return directory / written.name


def _write(folder: Path, directory: Path, merged: bool) -> Path:
    if holds_adapter(folder):
        names, fetch = _tensors(folder)
        return write_adapter(folder, directory, names=names, fetch=fetch, merged=merged)
    # A file's worth read at a time.
    if (folder / SHARDS).is_dir():
        entries, fetch = sharded_weights(folder)
        written = write_streamed(entries, fetch, directory)
    else:
        written = legacy.export_before_dcp(folder, directory)
    if (folder / MODEL_CONFIG).is_file():
        shutil.copyfile(folder / MODEL_CONFIG, directory / MODEL_CONFIG)
    return written


def _tensors(folder: Path) -> tuple[list[str], Callable[[list[str]], dict[str, torch.Tensor]]]:
    """The names of checkpoint ``folder``'s tensors, and a function reading some of them whole onto the CPU."""
    if (folder / SHARDS).is_dir():
        entries, fetch = sharded_weights(folder)
        return [name for name, _ in entries], fetch
    return legacy.tensors_before_dcp(folder)
