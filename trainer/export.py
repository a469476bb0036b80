"""A checkpoint's weights as a model you can load anywhere, on one process, with no process group and no merge tool::

    python -m trainer.export runs/gpt2/checkpoints/step-00000200 exported/
    # exported/model.safetensors (+ config.json for a transformers model: AutoModel*.from_pretrained("exported"))

Works on the checkpoints of any run: a sharded model's (FSDP2: the shards of every process read back into whole
tensors) and a DDP one's. The checkpoint is verified first (every file's size and CRC-32). The trainer writes
``<output_dir>/final`` the same way at the end of ``fit()``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path
from typing import Any, Optional

import torch

from trainer import checkpoint
from trainer.hf import no_progress_bars_off_a_terminal
from trainer.model_state import MODEL_CONFIG, MODEL_FILE, SHARDS, TIED_WEIGHTS, read_sharded_weights


def write_model(state_dict: dict[str, Any], directory: Path, model: Optional[torch.nn.Module] = None) -> None:
    """``state_dict`` (whole tensors) as ``save_pretrained`` writes it when ``model`` is a transformers model, else
    as ``model.safetensors``."""
    if hasattr(model, "save_pretrained"):
        with no_progress_bars_off_a_terminal():
            model.save_pretrained(directory, state_dict=state_dict)
        return
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    seen: set[int] = set()
    tensors = {}
    for name, tensor in state_dict.items():  # weights tied in the model: safetensors stores each storage once
        storage = tensor.untyped_storage().data_ptr()
        tensors[name] = tensor.clone() if storage in seen else tensor.contiguous()
        seen.add(storage)
    tensors = {name: tensor.cpu() for name, tensor in tensors.items()}  # a DDP model's own, on its device
    save_file(tensors, str(directory / MODEL_FILE), metadata={"format": "pt"})


def export(folder: Path, directory: Path) -> Path:
    """Write checkpoint ``folder``'s model into ``directory``; return the weights file."""
    checkpoint.verify(folder)
    directory.mkdir(parents=True, exist_ok=True)
    if (folder / SHARDS).is_dir():
        write_model(read_sharded_weights(folder), directory)
    elif (folder / TIED_WEIGHTS).is_file():  # a plain module's tied weights, each under every name it has
        from safetensors.torch import load_file

        weights = load_file(folder / MODEL_FILE)
        for names in json.loads((folder / TIED_WEIGHTS).read_text()):
            kept = next(weights[name] for name in names if name in weights)
            weights.update({name: weights.get(name, kept) for name in names})
        write_model(weights, directory)
    else:
        shutil.copyfile(folder / MODEL_FILE, directory / MODEL_FILE)
    if (folder / MODEL_CONFIG).is_file():
        shutil.copyfile(folder / MODEL_CONFIG, directory / MODEL_CONFIG)
    return directory / MODEL_FILE


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m trainer.export", description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", type=Path, help="a checkpoint folder, <output_dir>/checkpoints/step-N")
    parser.add_argument("directory", type=Path, help="where to write model.safetensors (and config.json)")
    args = parser.parse_args(argv)
    written = export(args.checkpoint, args.directory)
    loads = "AutoModel*.from_pretrained" if (args.directory / MODEL_CONFIG).is_file() else "safetensors.torch.load_file"
    sys.stdout.write(f"exported {args.checkpoint} to {written} ({loads})\n")


if __name__ == "__main__":
    main()
