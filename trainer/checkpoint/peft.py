"""A PEFT model's checkpoint (LoRA and the like, ``get_peft_model``) exported as PEFT and transformers load it:

    python -m trainer.export runs/lora/checkpoints/step-00000200 adapter/            # PeftModel.from_pretrained
    python -m trainer.export runs/lora/checkpoints/step-00000200 merged/ --merged    # AutoModel*.from_pretrained

A checkpoint holds the whole model's state under PEFT's module names (``...c_attn.lora_A.default.weight``), and,
written beside it at each save, the base model's ``config.json`` and each adapter's ``adapter_config.json`` (the
``default`` adapter's in the folder, another's in a folder of its name: PEFT's own layout). From those two the export
builds the PEFT model on the ``meta`` device (no memory, no download), puts the checkpoint's tensors into it, and
lets PEFT write it: ``save_pretrained``'s adapter (its names, its files) reads only the adapter's tensors; the
merged model (``merge_and_unload``, then transformers' ``save_pretrained``) reads them all, the whole model held
in CPU memory once. ``Trainer.save_model(directory, merged=True)`` writes the same merged model from the
trained one.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any, Callable

import torch

from trainer.checkpoint.hf_files import ADAPTER_CONFIG, ADAPTER_FILE, save_model_config
from trainer.errors import ExportError


def holds_adapter(folder: Path) -> bool:
    """Checkpoint ``folder`` is a PEFT model's (written by a trainer that saves its adapter configs)."""
    return (folder / ADAPTER_CONFIG).is_file()


def write_adapter(
    folder: Path,
    directory: Path,
    *,
    names: list[str],
    fetch: Callable[[list[str]], dict[str, torch.Tensor]],
    merged: bool,
) -> Path:
    """Write checkpoint ``folder``'s adapter (``merged``: the base model with it folded in) into ``directory``;
    ``names``: the checkpoint's tensors, ``fetch(names)``: those tensors whole on the CPU. Returns the main file."""
    model = _meta_model(folder)
    wanted = names if merged else saved_by_peft(model, names)
    model.load_state_dict(fetch(wanted), strict=False, assign=True)
    if not merged:
        model.save_pretrained(str(directory))
        return directory / ADAPTER_FILE
    base = model.get_base_model()
    # A tied weight is stored once (the input embedding's); from_pretrained ties it again.
    base.tie_weights()
    left = [name for name, tensor in model.state_dict().items() if tensor.is_meta]
    if left:
        raise ExportError(
            f"checkpoint {folder} holds no tensor for {', '.join(left[:3])}"
            f"{' and others' if len(left) > 3 else ''}: it cannot be merged"
        )
    from transformers.utils import logging as hf_logging

    # save_pretrained's "Writing model shards" bar, for a file or two, would be a bar in the job's log.
    shown = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model.merge_and_unload().save_pretrained(str(directory))
    finally:
        if shown:
            hf_logging.enable_progress_bar()
    written = sorted(directory.glob("model*.safetensors*"))
    return next((path for path in written if path.name.endswith(".json")), written[0])


def write_merged(model: torch.nn.Module, state: dict[str, torch.Tensor], directory: Path) -> Path:
    """PEFT model ``model``'s base model with its adapter folded in, from ``state`` (its whole state on the CPU),
    written into ``directory`` as a checkpoint's ``--merged`` export is: through a copy built on the meta device
    from its configs, so that ``model`` itself stays as it is."""
    with tempfile.TemporaryDirectory() as configs:
        # The base model's config and the adapters', as a checkpoint's.
        save_model_config(model, Path(configs))
        fetch = lambda wanted: {name: state[name] for name in wanted}  # noqa: E731
        return write_adapter(Path(configs), directory, names=list(state), fetch=fetch, merged=True)


def saved_by_peft(model: torch.nn.Module, names: list[str]) -> list[str]:
    """Which of the checkpoint's tensors PEFT's ``save_pretrained`` writes for ``model``'s adapters: asked of PEFT
    itself, over a state dict of empty markers whose identity says which name each came from (it renames them). Its
    adapters' tensors, and any base layer it saves with them (an adapted ``embed_tokens``)."""
    from peft.utils import get_peft_model_state_dict

    markers = {name: torch.empty(0, device="meta") for name in names}
    name_of = {id(marker): name for name, marker in markers.items()}
    saved: set[str] = set()
    for adapter in model.peft_config:
        kept = get_peft_model_state_dict(model, state_dict=markers, adapter_name=adapter)
        saved |= {name_of[id(marker)] for marker in kept.values() if id(marker) in name_of}
    return [name for name in names if name in saved]


def _meta_model(folder: Path) -> torch.nn.Module:
    """The checkpoint's PEFT model, every tensor on the meta device: the base model's class and config from its
    ``config.json``, the adapters from their configs."""
    import transformers
    from peft import get_peft_model

    try:
        # A config.json naming code of its own (auto_map) is refused, never run.
        config = transformers.AutoConfig.from_pretrained(str(folder), trust_remote_code=False)
    except (ValueError, LookupError, OSError, TypeError) as err:
        raise ExportError(
            f"checkpoint {folder}: its config.json is not a transformers config this export can build "
            f"({type(err).__name__}: {' '.join(str(err).split())[:300]}); nothing in it was run"
        ) from None
    architecture = str((config.architectures or [""])[0])
    model_class = getattr(transformers, architecture, None)
    # Only a model class: a config naming any other attribute of transformers (a function) is not called.
    if not (isinstance(model_class, type) and issubclass(model_class, transformers.PreTrainedModel)):
        raise ExportError(
            f"checkpoint {folder} holds a PEFT adapter over a {architecture or 'model with no class'} "
            "(its config.json), which is not a transformers model class: load the checkpoint with the "
            "Trainer and call save_pretrained"
        )
    with torch.device("meta"):
        base = model_class(config)
        model = get_peft_model(base, _adapter_config(folder))
        for extra in sorted(p.parent for p in folder.glob(f"*/{ADAPTER_CONFIG}")):
            model.add_adapter(extra.name, _adapter_config(extra))
    return model


def _adapter_config(folder: Path) -> Any:
    from peft import PeftConfig

    try:
        return PeftConfig.from_pretrained(str(folder))
    except (ValueError, LookupError, OSError, TypeError) as err:
        raise ExportError(
            f"{folder / ADAPTER_CONFIG} is not an adapter config PEFT can read ({type(err).__name__}: {err})"
        ) from None
