"""Full-state checkpoints that are never torn, found again by a pointer written last.

Layout under ``<output_dir>/checkpoints/``::

    step-00000040/        accelerate's save_state (model.safetensors, optimizer.bin, scheduler.bin, scaler.pt,
                          random_states_<rank>.pkl for every rank) + trainer_state.json, written last
    step-00000080/
    latest                the name of the newest complete checkpoint, replaced atomically

A checkpoint is written into ``.tmp-step-N/`` by every rank, and only after all ranks are done does the main
process rename it and then move the ``latest`` pointer; a crash at any moment leaves the previous checkpoint as the
latest. Older checkpoints beyond ``keep_last`` are deleted only after that. Everything loads without arbitrary
pickles: accelerate loads its files with ``weights_only=True``, and the trainer's own state (the next step, the
position in the epoch, the config) is JSON rather than an object given to ``register_for_checkpointing``, which
accelerate unpickles with ``weights_only=False``.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Optional

from accelerate import Accelerator

from trainer.refusal import Refusal

STATE_FILE = "trainer_state.json"
POINTER_FILE = "latest"
BEST_FILE = "best"  # with keep_best: the checkpoint of the best evaluation, spared by keep_last
PREFIX = "step-"


class CheckpointError(Refusal, RuntimeError):
    """A checkpoint is missing, torn, or does not fit this run; the message names it."""


def checkpoint_root(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def check_writable(output_dir: str | Path) -> None:
    """Fail at start, on every rank, if ``output_dir`` cannot be written (rather than at the first checkpoint)."""
    probe = Path(output_dir) / f".write-test-{os.getpid()}"
    try:
        Path(output_dir).mkdir(parents=True, exist_ok=True)
        probe.write_text("")
        probe.unlink()
    except OSError as err:
        raise CheckpointError(f"output_dir {output_dir} cannot be written: {err}") from None


def find_resume_point(config) -> Optional[Path]:
    """The checkpoint ``config.resume`` asks for, or None to start fresh.

    None refuses an output_dir that already holds checkpoints (no silent overwrite of someone's run); "auto" takes
    the latest complete one, or starts fresh when there is none; a path must be a whole checkpoint.
    """
    root = checkpoint_root(config.output_dir)
    if config.resume is None:
        if complete_checkpoints(root) or (root / POINTER_FILE).exists():
            raise CheckpointError(
                f"{root} already holds checkpoints of an earlier run. Set resume='auto' to continue it, "
                "resume=<checkpoint path> to continue from one of them, or choose another output_dir."
            )
        return None
    if config.resume == "auto":
        return latest_checkpoint(root)
    return verify(Path(config.resume))


def step_of(path: Path) -> int:
    """The optimizer step a checkpoint folder holds (``step-00000012`` -> 12)."""
    return int(path.name.removeprefix(PREFIX))


def complete_checkpoints(root: Path) -> list[Path]:
    """Committed checkpoint folders, oldest first (``.tmp-*`` folders are unfinished writes)."""
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith(PREFIX))


def best_checkpoint(root: Path) -> Optional[Path]:
    """The checkpoint the ``best`` pointer names (keep_best), or None."""
    pointer = root / BEST_FILE
    return root / pointer.read_text().strip() if pointer.is_file() else None


def latest_checkpoint(root: Path) -> Optional[Path]:
    """The checkpoint the pointer names, checked to be whole; None when nothing was ever committed."""
    pointer = root / POINTER_FILE
    if not pointer.is_file():
        found = complete_checkpoints(root)
        if found:  # the pointer went missing: the newest committed folder is still a complete checkpoint
            return verify(found[-1])
        return None
    return verify(root / pointer.read_text().strip())


def verify(path: Path) -> Path:
    """Check that ``path`` is a whole checkpoint: every file its manifest lists is there with its size."""
    state_file = path / STATE_FILE
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} does not exist{_others(path)}")
    if not state_file.is_file():
        raise CheckpointError(f"checkpoint {path} is torn: it has no {STATE_FILE}{_others(path)}")
    manifest = read_state(path)["files"]
    for name, size in manifest.items():
        file = path / name
        if not file.is_file() or file.stat().st_size != size:
            raise CheckpointError(f"checkpoint {path} is torn: {name} is missing or truncated{_others(path)}")
    return path


def read_state(path: Path) -> dict[str, Any]:
    try:
        return json.loads((path / STATE_FILE).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise CheckpointError(f"checkpoint {path}: cannot read {STATE_FILE}: {err}") from None


def save(accelerator: Accelerator, root: Path, step: int, trainer_state: dict[str, Any], keep_last: int,
         best: bool = False) -> Path:  # fmt: skip
    """Write a checkpoint from every rank, then commit it (rename, then move the pointer), then prune all but the
    ``keep_last`` newest and the one the ``best`` pointer names (this one, when ``best``)."""
    final = root / f"{PREFIX}{step:08d}"
    staging = root / f".tmp-{final.name}"
    if accelerator.is_main_process and staging.exists():
        shutil.rmtree(staging)  # left by a crash during an earlier save
    accelerator.wait_for_everyone()
    accelerator.save_state(str(staging), safe_serialization=True)  # accelerate decides who writes what
    accelerator.wait_for_everyone()  # every rank's files are on disk
    if accelerator.is_main_process:
        files = {p.name: p.stat().st_size for p in sorted(staging.iterdir()) if p.is_file()}
        _write_atomically(staging / STATE_FILE, json.dumps({**trainer_state, "files": files}, indent=1))
        if final.exists():
            shutil.rmtree(final)  # the same step saved again (a resumed run ending where the last one did)
        os.replace(staging, final)
        _write_atomically(root / POINTER_FILE, final.name)
        if best:
            _write_atomically(root / BEST_FILE, final.name)
        spared = {final, best_checkpoint(root)}  # a run resumed from an older checkpoint keeps what it just wrote
        for old in complete_checkpoints(root)[:-keep_last]:
            if old not in spared:
                shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


def _write_atomically(path: Path, text: str) -> None:
    partial = path.with_name(path.name + ".partial")
    with open(partial, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(partial, path)


def _others(path: Path) -> str:
    found = [str(p) for p in complete_checkpoints(path.parent) if p != path]
    if not found:
        return ""
    return f". Other checkpoints there: {', '.join(found)}; pass one as resume=<path> to continue from it"
