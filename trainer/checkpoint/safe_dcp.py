"""Reading torch DCP's checkpoints without running anything from them (docs/checkpoints.md): DCP's index
(``shards/.metadata``) is a pickle, read by an unpickler that admits DCP's own metadata classes alone and refuses
anything else by name; the values DCP keeps as pickled bytes (an optimizer's settings) must load with
``weights_only=True`` before DCP reads them.
"""

from __future__ import annotations

import contextlib
import functools
import pickle
import re
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from trainer.errors import CheckpointError

# Without a process group (one process) DCP reads and writes as one process, and says in a warning at every call
# (from a background save's thread too) that it assumes so: it is so.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
# The folder of a checkpoint that holds the model's weights and the optimizer's state, DCP's files.
SHARDS = "shards"
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


def read_shards(state: dict[str, Any], folder: Path) -> None:
    """Fill ``state`` from ``folder/shards`` (collective), reading nothing that could run code."""
    import torch.distributed.checkpoint as dcp

    reader = safe_reader(folder)
    with _first_failure(folder):
        dcp.load(state, storage_reader=reader, planner=_safe_planner())


@contextlib.contextmanager
def _first_failure(folder: Path) -> Iterator[None]:
    """DCP's failure (a BaseException holding every rank's exception and traceback) as the first rank's exception:
    a ``CheckpointError`` as it is (a shard that is no plain tensor too), any other as a ``RuntimeError`` of one
    line."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except CheckpointException as err:
        first = next(iter(err.failures.values()), err)
        # (exception, its traceback)
        first = first[0] if isinstance(first, tuple) else first
        if isinstance(first, CheckpointError):
            raise first from None
        if isinstance(first, pickle.UnpicklingError):
            raise CheckpointError(
                f"checkpoint {folder}: a file of its {SHARDS} cannot be loaded safely "
                f"({refused_pickle(first)}); nothing in it was run"
            ) from None
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
        import torch.distributed.checkpoint as dcp

        state = {prefix + name: torch.empty(shapes[name].size, dtype=shapes[name].properties.dtype) for name in names}
        with _first_failure(folder):
            dcp.load(state, storage_reader=safe_reader(folder), planner=_safe_planner(), no_dist=True)
        return {name.removeprefix(prefix): tensor for name, tensor in state.items()}

    entries = [(name, entry.size.numel() * entry.properties.dtype.itemsize) for name, entry in shapes.items()]
    return entries, fetch


def safe_reader(folder: Path) -> Any:
    """DCP's reader of ``folder/shards``, its index read by ``_IndexUnpickler`` (refused by name, before
    anything else is read, when it holds anything but DCP's metadata)."""
    reader = _safe_classes()[0](str(folder / SHARDS))
    # Here, on every process: a refusal comes out whole, not inside DCP's collectives.
    reader.read_metadata()
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


def _stored_inside(shards: Path, storage: Any) -> None:
    """Every tensor and value DCP's index places is a slice of a file of ``shards`` itself, within its size: a
    crafted index (``../other-run/...``, ``/etc/passwd``) is refused before any of it is read."""
    sizes: dict[str, int] = {}
    for info in (storage or {}).values():
        name = getattr(info, "relative_path", None)
        plain = isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\\" not in name
        file = shards / name if plain else None
        if file is not None and name not in sizes and file.is_file() and not file.is_symlink():
            sizes[name] = file.stat().st_size
        offset, length = getattr(info, "offset", None), getattr(info, "length", None)
        fits = isinstance(offset, int) and isinstance(length, int) and 0 <= offset and 0 <= length
        if not plain or name not in sizes or not fits or offset + length > sizes[name]:
            raise CheckpointError(
                f"checkpoint {shards.parent}: {SHARDS}/.metadata places data at {name!r} (bytes {offset!r}, "
                f"length {length!r}), which is not within a file of its own {SHARDS} folder: the checkpoint is "
                "refused, and nothing outside it was read"
            )


def refused_pickle(err: BaseException) -> str:
    """What ``torch.load(weights_only=True)`` refused, in a few words (its message is mostly advice to load the
    file unsafely): ``Unsupported global: GLOBAL pathlib.PosixPath was not an allowed global by default``."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(err))
    why = text.split("WeightsUnpickler error: ", 1)[-1] if "WeightsUnpickler error: " in text else text
    return " ".join(why.split(". ")[0].split())[:300]


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
            _stored_inside(path.parent, getattr(metadata, "storage_data", None))
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    class SafePlanner(DefaultLoadPlanner):
        """DCP's planner, except that a value stored as pickled bytes (an optimizer's settings) is read with
        ``weights_only=True`` (no code runs), where DCP's own reads it with ``weights_only=False``."""

        def load_bytes(self, read_item: Any, value: Any) -> None:
            fqn = read_item.dest_index.fqn
            try:
                loaded = torch.load(value, weights_only=True)
            except pickle.UnpicklingError as err:
                raise CheckpointError(
                    f"a value of {fqn} in the checkpoint's shards is not plain "
                    f"data ({err}): the checkpoint is refused, and nothing in it was run"
                ) from None
            if not self.flatten_state_dict:
                self.state_dict[fqn] = loaded
                return
            # Where DCP flattened it from: keys and indices into the state dict given to load.
            *path, last = self.mappings[fqn]
            holder = self.original_state_dict
            for key in path:
                holder = holder[key]
            holder[last] = loaded

    return SafeReader, SafePlanner
