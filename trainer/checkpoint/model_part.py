"""The model's weights and the optimizer's state in a checkpoint: written in the format of the run, read into a
run of either format.

- **DDP**: accelerate's ``save_state`` files, ``model.safetensors`` (the whole model) and ``optimizer.bin``,
  written with the rest of accelerate's state (the model and optimizer were given to ``Accelerator.prepare``).
- **FSDP2**: every process's shards in ``shards/`` (torch.distributed.checkpoint, DCP), so that no process ever
  holds the whole model; DCP writes its index, ``shards/.metadata``, last.

Either loads into either: a DDP checkpoint into a sharded model (each process takes its part of the whole tensors,
the optimizer state keyed by parameter name), a sharded one into a DDP model (DCP reads every shard back whole), so
a run can move between DDP and FSDP2 at a resume, at the same global batch. One format was not kept for both
because DDP's is what accelerate writes and every tool reads (a plain ``model.safetensors``), and FSDP2's is the
only one in which no process holds the whole model.

Loading executes nothing from a checkpoint: DDP's files are read by safetensors and ``torch.load(weights_only=True)``;
DCP's index is a pickle, read here by an unpickler that admits DCP's own metadata classes alone and refuses anything
else by name, and the values DCP keeps as pickled bytes (an optimizer's settings) are checked to load with
``weights_only=True`` before DCP reads them.
"""

from __future__ import annotations

import contextlib
import functools
import json
import pickle
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Callable

import torch

from trainer.errors import CheckpointError, ExportError
from trainer.hf import peft_model

MODEL_CONFIG = "config.json"  # a transformers model's config, saved in each checkpoint for the export
TIED_WEIGHTS = "tied_weights.json"  # a plain module's tied weights' names: accelerate's model file keeps one of each
SHARDS = "shards"  # the folder of a checkpoint that holds a sharded model's weights and optimizer state
DDP, FULLY_SHARDED = "DDP", "FSDP2"  # how a checkpoint's weights are stored (its trainer_state.json's "sharding")
MODEL_FILE, OPTIMIZER_FILE = "model.safetensors", "optimizer.bin"  # accelerate's names, in a DDP checkpoint

# What DCP's index may hold: its metadata classes and the few values they carry (sizes, dtypes, a path).
_METADATA = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorProperties",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "pathlib": {"Path", "PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
    "builtins": {"set", "frozenset"},
}


class ModelState:
    """This run's model and optimizer in its checkpoints (``model``: the plain or sharded module, not DDP's
    wrapper; ``optimizer``: the torch optimizer itself). Every method is collective: call it on every rank."""

    def __init__(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, sharded: bool, device: torch.device, main: bool
    ):
        self.model, self.optimizer, self.main = model, optimizer, main
        self.device = "cpu" if device.type == "cpu" else str(device)  # where loaded tensors go (not "cpu:0")
        self.format = FULLY_SHARDED if sharded else DDP
        self._stager: Any = None  # on a GPU, save_async's pinned copies, made at the first save, kept for the next

    def save(self, folder: Path, in_background: bool = False) -> None:
        """A sharded model's shards into ``folder/shards`` (unless ``in_background``: ``save_async`` then), a
        DDP model's files being accelerate's ``save_state``'s; and a transformers model's config, which
        ``python -m trainer.export`` puts beside the exported weights."""
        if self.format == FULLY_SHARDED and not in_background:
            import torch.distributed.checkpoint as dcp

            dcp.save(self._dcp_state(folder), checkpoint_id=str(folder / SHARDS))
        if self.main:
            save_model_config(self.model, folder)

    def save_async(self, folder: Path, process_group: Any) -> Future:
        """``save``, returning once the state is copied to CPU memory: the shards are written in the background
        (``trainer.checkpoint.background``), the collectives on ``process_group``."""
        import torch.distributed.checkpoint as dcp

        return dcp.async_save(
            self._dcp_state(folder),
            checkpoint_id=str(folder / SHARDS),
            process_group=process_group,
            async_stager=self._staging(),
        )

    def _staging(self) -> Any:
        """On a GPU, one stager for every background save of the run, as torchtitan keeps one: its copies of this
        process's shards, in pinned CPU memory, are allocated at the first save and refilled by the next (one save is
        in flight at a time), copied without blocking and synchronised once. DCP's default (None: on the CPU, where
        pinning gains nothing and kept copies would only hold memory) allocates fresh pageable memory at every save,
        which the step waits for. The price: the pinned copies stay allocated between saves."""
        if self._stager is None and self.device != "cpu" and torch.cuda.is_available():
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            options = StagingOptions(
                use_pinned_memory=True, use_shared_memory=False, use_async_staging=False, use_non_blocking_copy=True
            )
            self._stager = DefaultStager(options)
        return self._stager

    def load(self, folder: Path, state: dict[str, Any]) -> None:
        """The weights and optimizer state of checkpoint ``folder`` into this run's, in whichever format its
        ``state`` says they are."""
        written_as = state.get("sharding", DDP)
        if written_as == DDP and self.format == DDP:  # (no torch.distributed.checkpoint: its import takes a second)
            self.load_weights(folder, written_as)
            saved = torch.load(folder / OPTIMIZER_FILE, map_location=self.device, weights_only=True)
            self.optimizer.load_state_dict(saved)
            return
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

        if written_as == FULLY_SHARDED:  # DCP reads each process's part now, whatever the processes that wrote it
            state = self._dcp_state()
            read_shards(state, folder)
            set_state_dict(
                self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"]
            )
        else:  # whole tensors into a sharded model: each process keeps its part
            from safetensors.torch import load_file

            optimizer = self._by_name(torch.load(folder / OPTIMIZER_FILE, map_location="cpu", weights_only=True))
            set_state_dict(
                self.model,
                self.optimizer,
                model_state_dict=load_file(folder / MODEL_FILE),
                optim_state_dict=optimizer,
                options=StateDictOptions(full_state_dict=True),
            )

    def load_weights(self, folder: Path, written_as: str) -> None:
        """The weights alone of checkpoint ``folder`` (the best evaluation's, at the end of training)."""
        if written_as == DDP and self.format == DDP:
            from safetensors.torch import load_model

            load_model(self.model, folder / MODEL_FILE, device=self.device)
            return
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

        if written_as == FULLY_SHARDED:
            state = {"model": get_model_state_dict(self.model)}
            read_shards(state, folder)
            set_model_state_dict(self.model, state["model"])
        else:
            from safetensors.torch import load_file

            set_model_state_dict(
                self.model, load_file(folder / MODEL_FILE), options=StateDictOptions(full_state_dict=True)
            )

    def export(self, directory: Path, barrier: Callable[[], None], merged: bool = False) -> None:
        """The whole model, written into ``directory`` by the main process one file at a time
        (``trainer.tools.export.write_streamed``): a sharded model's tensors gathered one at a time, a file's worth kept
        on the main process's CPU, never the whole model anywhere. An earlier export's files in ``directory`` are
        replaced (they would mix with this one's); others, a tokenizer saved beside, stay. Every rank returns once
        it is written. ``merged``: a PEFT model's base model with its adapter folded in, not the adapter."""
        from trainer.tools.export import replacing, write_model, write_streamed

        if merged and not peft_model(self.model):
            raise ExportError(
                f"merged=True folds a PEFT adapter into its base model, and this model "
                f"({type(self.model).__name__}) has none: save it without merged"
            )
        if peft_model(self.model):
            return self._export_adapter(directory, barrier, merged)
        if self.format == DDP:  # (no torch.distributed.checkpoint here: its import costs a DDP run a second)
            if self.main:
                with replacing(directory) as staging:
                    write_model(_once_each(self.model.state_dict(), self.model), staging, self.model)
            barrier()
            return
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        state = _once_each(get_model_state_dict(self.model), self.model)  # this process's shards, by name

        def gather(names: list[str]) -> dict[str, torch.Tensor]:  # collective: every process gathers each tensor
            whole = {}
            for name in names:
                tensor = state[name].full_tensor() if hasattr(state[name], "full_tensor") else state[name]
                if self.main:
                    whole[name] = tensor.detach().to("cpu", copy=True)
            return whole

        entries = [(name, tensor.numel() * tensor.element_size()) for name, tensor in state.items()]
        with replacing(directory) if self.main else contextlib.nullcontext(directory) as target:
            write_streamed(entries, gather, target, self.model, self.main)
        barrier()

    def _export_adapter(self, directory: Path, barrier: Callable[[], None], merged: bool) -> None:
        """A PEFT model's export is its adapter, as PEFT writes it (``adapter_config.json``,
        ``adapter_model.safetensors``): what ``PeftModel.from_pretrained(base, directory)`` loads onto the base model,
        and ``merge_and_unload()`` folds in. A sharded model's trainable tensors (the adapter's) are gathered first.
        ``merged``: the base model with the adapter folded in, built from a copy of the whole state gathered on the
        main process's CPU (``trainer.checkpoint.peft``): the model that trains is left as it is."""
        from trainer.tools.export import replacing

        state = None
        if self.format != DDP or merged and self.main:  # sharded: every process gathers each tensor (collective)
            from torch.distributed.checkpoint.state_dict import get_model_state_dict

            trainable = {
                name.replace("_checkpoint_wrapped_module.", "")  # the state dict's names
                for name, p in self.model.named_parameters()
                if p.requires_grad
            }
            state = {}
            for name, tensor in get_model_state_dict(self.model).items():
                if merged or name in trainable:
                    whole = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
                    if self.main:  # the one that writes keeps them
                        state[name] = whole.detach().to("cpu", copy=True)
        if self.main:
            with replacing(directory) as staging:
                if merged:
                    from trainer.checkpoint.peft import write_merged

                    write_merged(self.model, state, staging)
                else:
                    self.model.save_pretrained(staging, state_dict=state)  # PEFT keeps the adapter's tensors of it
        barrier()

    def _dcp_state(self, folder: Path | None = None) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        if folder is not None:
            (folder / SHARDS).mkdir(parents=True, exist_ok=True)
        model_state, optimizer_state = get_state_dict(self.model, self.optimizer)
        return {"model": model_state, "optimizer": optimizer_state}

    def _by_name(self, saved: dict[str, Any]) -> dict[str, Any]:
        """A torch optimizer state dict (parameters by their index in the groups, as DDP's ``optimizer.bin``
        holds them) keyed by parameter name instead, as DCP's ``set_state_dict`` takes it: this run's optimizer
        lists its groups' parameters in the same order (the same config built both; a change is refused first)."""
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        names = [
            name
            for group in get_optimizer_state_dict(self.model, self.optimizer)["param_groups"]
            for name in group["params"]
        ]
        indices = [index for group in saved["param_groups"] for index in group["params"]]
        if len(names) != len(indices):
            raise ValueError(f"the checkpoint's optimizer has {len(indices)} parameters, this run's {len(names)}")
        name_of = dict(zip(indices, names, strict=True))
        return {
            "state": {name_of[index]: value for index, value in saved["state"].items()},
            "param_groups": [
                {**group, "params": [name_of[i] for i in group["params"]]} for group in saved["param_groups"]
            ],
        }


def save_model_config(model: torch.nn.Module, folder: Path) -> None:
    """A transformers model's config beside its weights, naming the model's own class (not the sharded wrapper's),
    so that the export loads with ``from_pretrained``; a PEFT model's base config and adapter configs, from which
    the export rebuilds it (``trainer.checkpoint.peft``)."""
    if peft_model(model):
        from trainer.checkpoint.peft import save_adapter_configs

        save_adapter_configs(model, folder)
        model = model.get_base_model()
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "to_json_file"):
        if ties := tied_weights(model):  # from_pretrained ties a transformers model again; load_state_dict does not
            (folder / TIED_WEIGHTS).write_text(json.dumps(ties))
        return
    config.architectures = [type(model).__name__.removeprefix("FSDP")]
    config.to_json_file(str(folder / MODEL_CONFIG))


def _once_each(state: dict[str, Any], model: torch.nn.Module) -> dict[str, Any]:
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


def read_shards(state: dict[str, Any], folder: Path) -> None:
    """Fill ``state`` from ``folder/shards`` (collective), reading nothing that could run code."""
    import torch.distributed.checkpoint as dcp

    reader = safe_reader(folder)
    try:
        dcp.load(state, storage_reader=reader, planner=_safe_planner())
    except dcp.api.CheckpointException as err:  # a BaseException: said as the first failure, for CheckpointError
        first = next(iter(err.failures.values()), err)
        first = first[0] if isinstance(first, tuple) else first  # (exception, its traceback)
        if isinstance(first, CheckpointError):
            raise first from None
        raise RuntimeError(f"{type(first).__name__}: {first}") from err


def read_sharded_weights(folder: Path, part: str = "model") -> dict[str, torch.Tensor]:
    """The whole model's tensors from a sharded checkpoint's ``shards/``, read on this one process (no process
    group); ``part="ema"`` with ``folder`` a checkpoint's ``ema``: the average of the weights
    (``trainer.optim.ema``)."""
    entries, fetch = sharded_weights(folder, part)
    return fetch([name for name, _ in entries])


def sharded_weights(
    folder: Path,
    part: str = "model",
) -> tuple[list[tuple[str, int]], Callable[[list[str]], dict[str, torch.Tensor]]]:
    """A sharded checkpoint's model tensors on this one process (no process group): each name and its bytes, and a
    function that reads the named ones whole (and nothing else)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader, prefix = safe_reader(folder), f"{part}."
    shapes = {
        name.removeprefix(prefix): entry
        for name, entry in reader.read_metadata().state_dict_metadata.items()
        if name.startswith(prefix) and isinstance(entry, TensorStorageMetadata)
    }

    def fetch(names: list[str]) -> dict[str, torch.Tensor]:
        import warnings

        import torch.distributed.checkpoint as dcp

        state = {prefix + name: torch.empty(shapes[name].size, dtype=shapes[name].properties.dtype) for name in names}
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, storage_reader=safe_reader(folder), planner=_safe_planner(), no_dist=True)
        return {name.removeprefix(prefix): tensor for name, tensor in state.items()}

    entries = [(name, entry.size.numel() * entry.properties.dtype.itemsize) for name, entry in shapes.items()]
    return entries, fetch


def safe_reader(folder: Path) -> Any:
    """DCP's reader of ``folder/shards``, its index read by ``_IndexUnpickler`` (refused by name, before
    anything else is read, when it holds anything but DCP's metadata)."""
    reader = _safe_classes()[0](str(folder / SHARDS))
    reader.read_metadata()  # here, on every process: a refusal comes out whole, not inside DCP's collectives
    return reader


def _safe_planner() -> Any:
    return _safe_classes()[1]()


class _IndexUnpickler(pickle.Unpickler):
    """Python's unpickler, admitting only the classes DCP's index is made of (pickle's "restricting globals")."""

    def find_class(self, module: str, name: str) -> Any:
        if name in _METADATA.get(module, ()) or module == "torch" and (name == "Size" or _is_dtype(name)):
            return super().find_class(module, name)
        raise CheckpointError(
            f"{SHARDS}/.metadata names {module}.{name}, which is not part of a checkpoint's index: "
            "the checkpoint is refused, and nothing in it was run"
        )


def _is_dtype(name: str) -> bool:
    return isinstance(getattr(torch, name, None), torch.dtype)


@functools.cache
def _safe_classes() -> tuple[type, type]:
    """DCP's file reader and load planner, made safe (built when DCP is first needed: its import takes a second)."""
    from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            path = Path(self.path) / ".metadata"
            with open(path, "rb") as file:
                try:
                    metadata = _IndexUnpickler(file).load()
                except CheckpointError as refusal:
                    raise CheckpointError(f"checkpoint {path.parent.parent}: {refusal}") from None
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    class SafePlanner(DefaultLoadPlanner):
        """DCP's planner, except that a value stored as pickled bytes must load with ``weights_only=True`` (no
        code runs) before DCP reads it as it does."""

        def load_bytes(self, read_item: Any, value: Any) -> None:
            try:
                torch.load(value, weights_only=True)
            except pickle.UnpicklingError as err:
                raise CheckpointError(
                    f"a value of {read_item.dest_index.fqn} in the checkpoint's shards is not plain "
                    f"data ({err}): the checkpoint is refused, and nothing in it was run"
                ) from None
            value.seek(0)
            super().load_bytes(read_item, value)

    return SafeReader, SafePlanner
