"""A checkpoint's weights as a model you can load anywhere, on one process, with no process group and no merge tool::

    python -m trainer.export runs/gpt2/checkpoints/step-00000200 exported/
    # exported/model.safetensors (+ config.json for a transformers model: AutoModel*.from_pretrained("exported"))

into a new or empty folder (``--replace``: any, replaced whole; never one inside the checkpoint).

Works on the checkpoints of any run: a sharded model's (FSDP2: the shards of every process read back into whole
tensors, one file's worth at a time: past 5 GB the weights go into numbered files with transformers' index) and a
DDP one's. The checkpoint is verified first (every file's size and CRC-32). The trainer writes
``<output_dir>/final`` the same way at the end of ``fit()``, gathering a sharded model one tensor at a time.
A PEFT model's checkpoint exports as its adapter, or with ``--merged`` as the base model with the adapter folded in
(``trainer.checkpoint.peft``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import sys
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch

from trainer.checkpoint import store as checkpoint
from trainer.checkpoint.model_part import (
    MODEL_CONFIG,
    MODEL_FILE,
    SHARDS,
    TIED_WEIGHTS,
    read_sharded_weights,
    save_model_config,
    sharded_weights,
)
from trainer.checkpoint.peft import ADAPTER_CONFIG, ADAPTER_FILE, holds_adapter, write_adapter
from trainer.errors import ExportError

__all__ = ["export", "read_sharded_weights", "replacing", "write_model", "write_streamed"]
MAX_FILE_BYTES = 5 * 2**30  # an export's safetensors files: at most this much each, the most held at once
INDEX = "model.safetensors.index.json"  # the files of an export written as several, as transformers names them
EXPORTED = re.compile(
    r"model(-\d{5}-of-\d{5})?\.safetensors|model\.safetensors\.index\.json|config\.json|"
    r"generation_config\.json|adapter_model\.safetensors|adapter_config\.json"
)  # what an export
# writes (and may replace): a PEFT model's is its adapter


def write_model(state_dict: dict[str, Any], directory: Path, model: Optional[torch.nn.Module] = None) -> Path:
    """Whole tensors already in memory (a DDP checkpoint's, with its tied names), written as ``write_streamed``
    writes them; a tensor held under two names is written under both (safetensors stores each storage once)."""
    seen: set[int] = set()
    tensors = {}
    for name, tensor in state_dict.items():
        storage = tensor.untyped_storage().data_ptr()
        tensors[name] = tensor.clone() if storage in seen else tensor.contiguous()
        seen.add(storage)
    entries = [(name, tensor.numel() * tensor.element_size()) for name, tensor in tensors.items()]
    return write_streamed(entries, lambda names: {name: tensors[name].cpu() for name in names}, directory, model)


def write_streamed(
    entries: list[tuple[str, int]],
    fetch: Callable[[list[str]], dict[str, torch.Tensor]],
    directory: Path,
    model: Optional[torch.nn.Module] = None,
    main: bool = True,
    max_file_bytes: int = MAX_FILE_BYTES,
) -> Path:
    """Write a model's weights into ``directory`` one safetensors file at a time, so that no process ever holds more
    than one file's tensors: ``entries`` names each tensor and its bytes, in order; ``fetch(names)`` returns one
    file's tensors whole on the CPU (on the main process; others may return {}: a sharded model's gather is
    collective, so every process calls it). Over ``max_file_bytes`` the files are numbered with an index beside
    them, as ``save_pretrained`` writes them; ``from_pretrained`` reads either (with ``model``'s config, which a
    transformers model writes too). Returns the weights file, or the index."""
    from safetensors.torch import save_file

    files: list[list[str]] = [[]]
    size = 0
    for name, nbytes in entries:
        if files[-1] and size + nbytes > max_file_bytes:
            files.append([])
            size = 0
        files[-1].append(name)
        size += nbytes
    names = (
        [MODEL_FILE]
        if len(files) == 1
        else [f"model-{i:05d}-of-{len(files):05d}.safetensors" for i in range(1, len(files) + 1)]
    )
    if main:
        directory.mkdir(parents=True, exist_ok=True)
    for tensors_of, file in zip(files, names, strict=True):
        tensors = fetch(tensors_of)
        if main:
            save_file(tensors, str(directory / file), metadata={"format": "pt"})
        del tensors
    if not main:
        return directory / names[0]
    if model is not None:
        save_model_config(model, directory)
        generation = getattr(model, "generation_config", None)  # what save_pretrained writes beside a generator's
        if generation is not None and getattr(model, "can_generate", lambda: False)():
            generation.save_pretrained(directory)
    if len(files) == 1:
        return directory / MODEL_FILE
    weight_map = {name: file for tensors_of, file in zip(files, names, strict=True) for name in tensors_of}
    index = {"metadata": {"total_size": sum(nbytes for _, nbytes in entries)}, "weight_map": weight_map}
    (directory / INDEX).write_text(json.dumps(index, indent=2))
    return directory / INDEX


@contextlib.contextmanager
def replacing(directory: Path, whole: bool = False) -> Iterator[Path]:
    """A fresh folder beside ``directory`` to write an export into, whose files then take the place of the earlier
    export's: no file of an earlier export is left to mix with the new one (a stale config or index would load
    another model). ``whole``: ``directory`` is replaced whole; else files no export writes (a tokenizer saved
    beside the model) stay. Removed if writing fails, ``directory`` untouched."""
    staging, old = directory.parent / f".{directory.name}.writing", directory.parent / f".{directory.name}.old"
    for leftover in (staging, old):
        shutil.rmtree(leftover, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        yield staging
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if whole or not directory.is_dir():
        if directory.exists():
            os.replace(directory, old)
        os.replace(staging, directory)
        shutil.rmtree(old, ignore_errors=True)
        return
    for earlier in [p for p in directory.iterdir() if EXPORTED.fullmatch(p.name)]:
        earlier.unlink()
    for written in staging.iterdir():
        os.replace(written, directory / written.name)
    staging.rmdir()


def export(folder: Path, directory: Path, replace: bool = False, merged: bool = False) -> Path:
    """Write checkpoint ``folder``'s model into ``directory`` (new or empty; any with ``replace``, replaced whole);
    return the weights file (or the index of several). A PEFT model's checkpoint: its adapter, or with ``merged``
    the base model with the adapter folded in (``trainer.checkpoint.peft``)."""
    checkpoint.verify(folder)
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
        with replacing(directory, whole=True) as staging:  # new, empty, or --replace
            written = _write(folder, staging, merged)
    except OSError as err:
        raise ExportError(f"cannot write the export into {directory}: {err.strerror or err}") from None
    return directory / written.name


def _write(folder: Path, directory: Path, merged: bool) -> Path:
    written = directory / MODEL_FILE
    if holds_adapter(folder):
        names, fetch = _tensors(folder)
        return write_adapter(folder, directory, names, fetch, merged)
    if (folder / SHARDS).is_dir():  # read a file's worth at a time
        entries, fetch = sharded_weights(folder)
        written = write_streamed(entries, fetch, directory)
    elif (folder / TIED_WEIGHTS).is_file():  # a plain module's tied weights, each under every name it has
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


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m trainer.export", description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", type=Path, help="a checkpoint folder, <output_dir>/checkpoints/step-N")
    parser.add_argument(
        "directory", type=Path, help="where to write model.safetensors (and config.json): a new or empty folder"
    )
    parser.add_argument("--replace", action="store_true", help="replace what the folder holds, whole")
    parser.add_argument(
        "--merged",
        action="store_true",
        help="a PEFT model's checkpoint: the base model with the "
        "adapter folded in (merge_and_unload), not the adapter alone",
    )
    args = parser.parse_args(argv)
    written = export(args.checkpoint, args.directory, replace=args.replace, merged=args.merged)
    if written.name == ADAPTER_FILE:
        loads = "PeftModel.from_pretrained(base_model, directory)"
    elif (args.directory / MODEL_CONFIG).is_file():
        loads = "AutoModel*.from_pretrained"
    else:
        loads = "safetensors.torch.load_file"
    sys.stdout.write(f"exported {args.checkpoint} to {written} ({loads})\n")


if __name__ == "__main__":
    main()
