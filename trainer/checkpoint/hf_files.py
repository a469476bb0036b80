"""The files a model is exported as, that ``from_pretrained`` (or safetensors, or PEFT) reads: weights written one
safetensors file at a time, a transformers model's config, a PEFT model's adapter configs (docs/checkpoints.md).
Leaf writers: nothing here decides what is exported or when.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch

from trainer.hf import peft_model

# A transformers model's config, saved in each checkpoint for the export.
MODEL_CONFIG = "config.json"
# A plain module's tied weights' names: the model file keeps one of each.
TIED_WEIGHTS = "tied_weights.json"
MODEL_FILE = "model.safetensors"
# PEFT's names for an adapter's config and weights.
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_FILE = "adapter_model.safetensors"
# An export's safetensors files: at most this much each, the most held at once.
MAX_FILE_BYTES = 5 * 2**30
# The files of an export written as several, as transformers names them.
INDEX = "model.safetensors.index.json"
# What an export.
EXPORTED = re.compile(
    r"model(-\d{5}-of-\d{5})?\.safetensors|model\.safetensors\.index\.json|config\.json|"
    r"generation_config\.json|adapter_model\.safetensors|adapter_config\.json"
)
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
    return write_streamed(entries, lambda names: {name: tensors[name].cpu() for name in names}, directory, model=model)


def write_streamed(
    entries: list[tuple[str, int]],
    fetch: Callable[[list[str]], dict[str, torch.Tensor]],
    directory: Path,
    *,
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
    failed: list[Exception] = []
    if main:
        directory.mkdir(parents=True, exist_ok=True)
    for tensors_of, file in zip(files, names, strict=True):
        tensors = fetch(tensors_of)
        # After a failed write the main process still fetches (a sharded model's gathers are collective).
        if main and not failed:
            try:
                save_file(tensors, str(directory / file), metadata={"format": "pt"})
            except Exception as err:
                failed.append(err)
        del tensors
    if failed:
        raise failed[0]
    if not main:
        return directory / names[0]
    if model is not None:
        save_model_config(model, directory)
        # What save_pretrained writes beside a generator's.
        generation = getattr(model, "generation_config", None)
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


def save_model_config(model: torch.nn.Module, folder: Path) -> None:
    """A transformers model's config beside its weights, naming the model's own class (not the sharded wrapper's),
    so that the export loads with ``from_pretrained``; a PEFT model's base config and adapter configs, from which
    the export rebuilds it (``trainer.checkpoint.peft``)."""
    if peft_model(model):
        save_adapter_configs(model, folder)
        model = model.get_base_model()
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "to_json_file"):
        # from_pretrained ties a transformers model again; load_state_dict does not.
        if ties := tied_weights(model):
            (folder / TIED_WEIGHTS).write_text(json.dumps(ties))
        return
    config.architectures = [type(model).__name__.removeprefix("FSDP")]
    config.to_json_file(str(folder / MODEL_CONFIG))


def once_each(state: dict[str, Any], model: torch.nn.Module) -> dict[str, Any]:
    """A transformers model's state without the second name of a tied weight (``from_pretrained`` ties it again,
    as ``save_pretrained`` leaves it out); a plain module's whole (``load_state_dict`` wants every name). The ties
    come from the module's structure, the same on every process (a sharded export gathers by these names)."""
    if not hasattr(model, "save_pretrained"):
        return state
    second = {name for names in tied_weights(model) for name in [n for n in state if n in names][1:]}
    return {name: tensor for name, tensor in state.items() if name not in second}


def tied_weights(model: torch.nn.Module) -> list[list[str]]:
    """The names of each weight ``model`` holds under several (tied embeddings), as the state dict names them."""
    names: dict[int, list[str]] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(parameter), []).append(name.replace("_checkpoint_wrapped_module.", ""))
    return [group for group in names.values() if len(group) > 1]


def save_adapter_configs(model: torch.nn.Module, folder: Path) -> None:
    """Each adapter's config of PEFT model ``model`` into checkpoint ``folder``, as PEFT lays them out."""
    for name, config in model.peft_config.items():
        config.save_pretrained(str(folder if name == "default" else folder / name))
