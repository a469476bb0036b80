"""The checkpoint store: full-state checkpoints written into ``.tmp-step-N`` by every rank, committed by the main
process (manifest with every file's size and CRC-32, rename, ``latest`` pointer), never torn; a damaged one set
aside; one job per output_dir (docs/internals.md#the-checkpoint-store, docs/checkpoints.md).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import shutil
import socket
from pathlib import Path
from typing import Any, Optional

from trainer.checkpoint.failures import root_cause
from trainer.checkpoint.integrity import (
    PREFIX,
    STATE_FILE,
    STEP_FOLDER,
    complete_checkpoints,
    crc32,
    verify,
    without_alternatives,
)
from trainer.console import warn
from trainer.errors import CheckpointError

POINTER_FILE = "latest"
# With keep_best: the checkpoint of the best evaluation, spared by keep_last.
BEST_FILE = "best"
LOCK_FILE = ".lock"
DAMAGED = "damaged-"
# output_dir locks this process holds, by path.
_HELD: dict[str, Any] = {}


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
        raise CheckpointError(f"output_dir {output_dir} cannot be written: {_why(Path(output_dir), err)}") from None


def _why(path: Path, err: OSError) -> str:
    """Why a folder cannot be made at ``path``, in words (``File exists`` for a link that leads nowhere, before)."""
    for part in [path, *path.parents]:
        if part.is_symlink() and not part.exists():
            return f"{part} is a symbolic link to {os.readlink(part)}, which leads to no folder (a loop of links?)"
        if part.exists() and not part.is_dir():
            return f"{part} is a file, not a folder"
    return err.strerror or str(err)


def newest_whole_checkpoint(root: Path) -> Optional[Path]:
    """``latest``, checked whole; if it is not (truncated, damaged, half-replaced), the newest checkpoint that is,
    with a warning, after moving each damaged one aside as ``damaged-step-N`` (kept, but no longer a candidate
    nor counted by keep_last). None when there is no checkpoint at all."""
    try:
        return latest_checkpoint(root)
    except CheckpointError as err:
        problem = without_alternatives(err)
    set_aside = []
    for candidate in reversed(complete_checkpoints(root)):
        try:
            found = verify(candidate)
        except CheckpointError:
            aside = candidate.with_name(DAMAGED + candidate.name)
            try:
                # Out of the way of keep_last, which would otherwise prune good ones.
                os.replace(candidate, aside)
                set_aside.append(f"{aside.name} moved aside, kept")
            # A read-only checkpoints folder: left where it is, and said.
            except OSError as err:
                set_aside.append(f"{candidate.name} damaged, left in place: cannot move it ({err.strerror or err})")
            continue
        moved = f" ({'; '.join(set_aside)})" if set_aside else ""
        warn(f"{problem}; continuing from the newest whole checkpoint, {found}{moved}")
        # latest names it from now on (a failed save said the damaged one was "still the latest").
        with contextlib.suppress(OSError):
            _write_atomically(root / POINTER_FILE, found.name)
        return found
    raise CheckpointError(f"{problem}, and no other checkpoint under {root} is whole")


def best_checkpoint(root: Path, record: Optional[dict[str, Any]]) -> Optional[Path]:
    """The committed checkpoint of the best evaluation keep_best ``record``s in this run's history (None when there
    is none, or it is not in ``root``). Never the ``best`` pointer's word alone: a pointer left by an abandoned
    timeline (a run rolled back to an older checkpoint) or damaged names another model."""
    if not record:
        return None
    folder = root / f"{PREFIX}{int(record['step']):08d}"
    return folder if folder.is_dir() else None


def pointed_at(pointer: Path) -> str:
    """The folder a pointer (``latest``, ``best``) names: only ever a ``step-<digits>`` folder beside it, so a
    pointer that was edited, damaged or left by another run can lead nowhere else (``../other-run/...``)."""
    # What a link leads to is none of this run's to read, nor to print.
    if pointer.is_symlink():
        raise CheckpointError(
            f"the {pointer.name} pointer {pointer} is a symbolic link (to {os.readlink(pointer)}), not the file "
            f"this trainer writes; it was not read"
        )
    try:
        raw = pointer.read_bytes()
    except OSError as err:
        raise CheckpointError(f"the {pointer.name} pointer {pointer} cannot be read: {err}") from None
    return checked_name(raw, f"the {pointer.name} pointer {pointer}")


def checked_name(raw: bytes, pointer: str) -> str:
    """What ``pointer`` (its words) holds, ``raw``, if it is the name of a ``step-<digits>`` folder beside it."""
    name = raw.decode("utf-8", errors="replace").strip()
    if not STEP_FOLDER.fullmatch(name):
        # Printable.
        shown = f"holds {ascii(raw[:60])}{'...' if len(raw) > 60 else ''}" if raw else "is empty"
        raise CheckpointError(f"{pointer} is corrupt: it {shown}, not the name of a {PREFIX}<digits> folder beside it")
    return name


def latest_checkpoint(root: Path) -> Optional[Path]:
    """The checkpoint the pointer names, checked to be whole; None when nothing was ever committed."""
    pointer = root / POINTER_FILE
    if not pointer.is_file() and not pointer.is_symlink():
        found = complete_checkpoints(root)
        # The pointer went missing: the newest committed folder is still a complete checkpoint.
        if found:
            return verify(found[-1])
        return None
    named = root / pointed_at(pointer)
    # Killed while re-saving this step.
    if not named.exists() and (root / f".old-{named.name}").is_dir():
        os.replace(root / f".old-{named.name}", named)
    return verify(named)


def final_folder(root: Path, step: int) -> Path:
    return root / f"{PREFIX}{step:08d}"


def staging_folder(root: Path, step: int) -> Path:
    """Where every rank writes its part of step ``step``'s checkpoint before it is committed."""
    return root / f".tmp-{final_folder(root, step).name}"


def make_staging(staging: Path) -> None:
    """The folder every rank writes a checkpoint into, empty (what a crash during an earlier save left, removed)."""
    try:
        if staging.exists():
            shutil.rmtree(staging)
        staging.mkdir(parents=True)
    except OSError as err:
        raise write_failed(staging, staging.parent, err) from None


def commit(staging: Path, trainer_state: dict[str, Any], keep_last: int) -> Path:
    """The main process, once every rank's files are in ``staging``: the manifest (every file's size and CRC-32)
    written last into it, the rename to ``step-N``, the pointers, the pruning. The ``best`` pointer names the
    checkpoint of the keep_best record in ``trainer_state`` (spared by the pruning), whatever it named before.
    Returns the committed folder."""
    root, final = staging.parent, staging.parent / staging.name.removeprefix(".tmp-")
    written = {p.relative_to(staging).as_posix(): p for p in sorted(staging.rglob("*")) if p.is_file()}
    manifest = {
        "files": {name: p.stat().st_size for name, p in written.items()},
        "crc32": {name: crc32(p) for name, p in written.items()},
    }
    try:
        _write_atomically(staging / STATE_FILE, json.dumps({**trainer_state, **manifest}, indent=1))
    except OSError as err:
        raise write_failed(staging, root, err) from err
    old = root / f".old-{final.name}"
    # The same step saved again (a run resumed from an older checkpoint): set the old aside.
    if final.exists():
        # Atomic; `latest` finds it there if a kill comes before the new one is in place.
        os.replace(final, old)
    os.replace(staging, final)
    _write_atomically(root / POINTER_FILE, final.name)
    shutil.rmtree(old, ignore_errors=True)
    # This run's record, whatever the pointer says.
    best_folder = best_checkpoint(root, trainer_state.get("best"))
    if best_folder is not None:
        _write_atomically(root / BEST_FILE, best_folder.name)
    # A pointer into another timeline, or damaged: it names nothing of this run's.
    elif (root / BEST_FILE).exists():
        (root / BEST_FILE).unlink()
    # A run resumed from an older checkpoint keeps what it just wrote.
    spared = {final, best_folder}
    for old in complete_checkpoints(root)[:-keep_last]:
        if old not in spared:
            shutil.rmtree(old, ignore_errors=True)
    return final


def lock_output_dir(output_dir: str | Path):
    """Hold ``<output_dir>/.lock`` for this process's life (the main process's: one job per output_dir). A second
    job is refused, naming the first; the lock goes with the process, however it ends (flock), so none is stale."""
    path = (Path(output_dir) / LOCK_FILE).resolve()
    # This process holds it already (a second Trainer on the same output_dir)
    if str(path) in _HELD:
        return _HELD[str(path)]
    handle = open(path, "a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        handle.seek(0)
        holder = handle.read().strip() or "another process"
        handle.close()
        raise CheckpointError(
            f"output_dir {output_dir} is in use by another job ({holder}): two jobs would "
            "overwrite each other's checkpoints. Wait for it, stop it, or choose another "
            "output_dir."
        ) from None
    handle.seek(0)
    handle.truncate()
    handle.write(f"pid {os.getpid()} on {socket.gethostname()}")
    handle.flush()
    _HELD[str(path)] = handle
    return handle


def write_failed(staging: Path, root: Path, err: BaseException, *, rank: Optional[int] = None) -> CheckpointError:
    """A checkpoint that could not be written (on ``rank``, when another rank's failure is reported): its unfinished
    folder removed (a full disk gets its space back), the disk named when it is full, the latest checkpoint said."""
    shutil.rmtree(staging, ignore_errors=True)
    failing, err = root_cause(err)
    rank = rank if rank is not None else failing
    free = shutil.disk_usage(root).free
    full = isinstance(err, OSError) and err.errno == errno.ENOSPC or free < (1 << 20)
    full = full or any(words in str(err) for words in ("iostream error", "No space left on device"))
    # Another rank's failure comes in words (trainer.checkpoint.failures.agreed_failure).
    said = str(err) if isinstance(err, CheckpointError) else f"{type(err).__name__}: {err}"
    why = f"the disk is full ({free / 2**20:.1f} MB free at {root})" if full else said
    why += f" (rank {rank})" if rank is not None else ""
    pointer = root / POINTER_FILE
    kept = "none was written before"
    if pointer.is_file():
        try:
            kept = f"{root / pointed_at(pointer)} is still the latest"
        except CheckpointError as err:
            kept = str(err)
    return CheckpointError(
        f"could not write checkpoint {staging.name.removeprefix('.tmp-')}: {why}. The unfinished "
        f"folder was removed; {kept}."
    )


def _write_atomically(path: Path, text: str) -> None:
    partial = path.with_name(path.name + ".partial")
    with open(partial, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(partial, path)


def resume_point(root: Path, resume: Optional[str]) -> Optional[Path]:
    """The checkpoint ``resume`` asks for, or None to start fresh: None refuses a ``root`` that already holds
    checkpoints (no silent overwrite of someone's run); "auto" takes the newest whole one, or none; a path must be a
    whole checkpoint."""
    if resume is None:
        if complete_checkpoints(root) or (root / POINTER_FILE).exists():
            raise CheckpointError(
                f"{root} already holds checkpoints of an earlier run. Set resume='auto' to continue it, "
                "resume=<checkpoint path> to continue from one of them, or choose another output_dir."
            )
        return None
    if resume == "auto":
        return newest_whole_checkpoint(root)
    return verify(Path(resume))


def warn_of_a_slow_save(config: Any, seconds: float) -> None:
    """Once: a checkpoint that took longer than ``preemption_grace_s``, so that a preemption's would be cut off (the
    grace must also stay under the launcher's: Kubernetes' terminationGracePeriodSeconds, Slurm's signal lead)."""
    global _SLOW_SAVE_SAID
    if _SLOW_SAVE_SAID or not config.signal_names or seconds <= config.preemption_grace_s:
        return
    _SLOW_SAVE_SAID = True
    warn(
        f"a checkpoint took {seconds:.1f} s, longer than preemption_grace_s ({config.preemption_grace_s:g} s): a "
        "preemption would exit before its checkpoint is committed. Raise preemption_grace_s, and keep the "
        "launcher's grace above it (Kubernetes' terminationGracePeriodSeconds, Slurm's --signal lead time)",
        main_only=True,
    )


_SLOW_SAVE_SAID = False
