"""Whether a checkpoint is whole and holds only itself: every file its manifest lists is there with its size and
CRC-32, no name leads out of its folder, nothing in it is a link (docs/checkpoints.md). Read before anything else.
"""

from __future__ import annotations

import json
import os
import re
import zlib
from pathlib import Path
from typing import Any

from trainer.checkpoint import legacy
from trainer.errors import CheckpointError

STATE_FILE = "trainer_state.json"
PREFIX = "step-"
STEP_FOLDER = re.compile(rf"{PREFIX}[0-9]+")


def verify(path: Path, contents: bool = True) -> Path:
    """Check that ``path`` is a whole checkpoint: every file its manifest lists is there with its size, and (with
    ``contents``) holds what was written (its CRC-32)."""
    state_file = path / STATE_FILE
    if path.is_symlink():
        raise CheckpointError(
            f"checkpoint {path} is not to be trusted: it is a symbolic link (to {os.readlink(path)}), and a "
            f"checkpoint holds its own files; none was read. Pass the folder it names as resume=<path> if it is "
            f"a checkpoint you trust{others(path)}"
        )
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} does not exist{others(path)}")
    if not state_file.is_file():
        raise CheckpointError(f"checkpoint {path} is torn: it has no {STATE_FILE}{others(path)}")
    _no_links(path)
    state = read_state(path)
    listed_inside(path, state["files"])
    for name, size in state["files"].items():
        file = path / name
        if not file.is_file() or file.stat().st_size != size:
            raise CheckpointError(f"checkpoint {path} is torn: {name} is missing or truncated{others(path)}")
    # Older checkpoints have none.
    for name, crc in state.get("crc32", {}).items() if contents else ():
        if crc32(path / name) != crc:
            raise CheckpointError(
                f"checkpoint {path} is damaged: {name} does not hold what was written (its "
                f"CRC-32 differs){others(path)}"
            )
    return path


def listed_inside(path: Path, listed: dict[str, Any]) -> None:
    """Nothing outside a checkpoint's folder is read: no name in its manifest leads out of it (absolute, ``..``)."""
    for name in listed:
        parts = Path(name).parts
        if Path(name).is_absolute() or ".." in parts or not parts:
            raise CheckpointError(
                f"checkpoint {path} is not to be trusted: its manifest lists {name!r}, outside its "
                f"folder; none of its files was read{others(path)}"
            )


def _no_links(path: Path) -> None:
    """Nothing in a checkpoint is a symbolic link: a checkpoint holds its own files (a link to ``/etc/passwd``
    would be exported as the weights)."""
    # os.walk follows no link.
    for folder, subfolders, files in os.walk(path):
        for name in subfolders + files:
            if os.path.islink(os.path.join(folder, name)):
                link = Path(folder, name).relative_to(path)
                raise CheckpointError(
                    f"checkpoint {path} is not to be trusted: {link} is a symbolic link (to "
                    f"{os.readlink(os.path.join(folder, name))}); a checkpoint holds its own "
                    f"files, and none of them was read{others(path)}"
                )


def read_state(path: Path) -> dict[str, Any]:
    """A checkpoint's ``trainer_state.json``: every part's state by name (``trainer.checkpoint.manager``) and the
    manifest, checked to be a trainer state."""
    try:
        state = json.loads((path / STATE_FILE).read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"checkpoint {path}: cannot read {STATE_FILE}: {err}{others(path)}") from None
    if isinstance(state, dict) and "train" not in state and "global_step" in state:
        state = legacy.state_before_the_registry(state)
    position = state.get("train") if isinstance(state, dict) else None
    wrong = [] if isinstance(state, dict) and isinstance(state.get("files"), dict) else ["files"]
    wrong += [
        f"train.{key}"
        for key in ("global_step", "epoch", "batches_into_epoch")
        if not isinstance(position, dict) or not isinstance(position.get(key), int)
    ]
    if wrong:
        raise CheckpointError(
            f"checkpoint {path}: {STATE_FILE} is not a trainer state (no valid {', '.join(wrong)}){others(path)}"
        )
    return state


def without_alternatives(err: CheckpointError) -> str:
    """A checkpoint error's message without its list of the other checkpoints there."""
    return str(err).split(". Other checkpoints there")[0]


def crc32(path: Path) -> str:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            crc = zlib.crc32(chunk, crc)
    return f"{crc:08x}"


def others(path: Path) -> str:
    found = [str(p) for p in complete_checkpoints(path.parent) if p != path]
    if not found:
        return ""
    return f". Other checkpoints there: {', '.join(found)}; pass one as resume=<path> to continue from it"


def complete_checkpoints(root: Path) -> list[Path]:
    """Committed checkpoint folders, oldest first (``.tmp-*`` folders are unfinished writes). A ``step-N`` that is a
    link is none of this run's: never a candidate, never counted or pruned by keep_last."""
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if STEP_FOLDER.fullmatch(p.name) and p.is_dir() and not p.is_symlink())
