"""Checkpoints in object storage (``checkpoint_storage: s3://bucket/run``, or any fsspec URL; docs/checkpoints.md).

A bucket has no rename and no lock, so the commit is made another way. Each checkpoint is written as on a disk, into
``<output_dir>/checkpoints/.tmp-step-N`` on each machine; every process uploads its share of the files its machine
holds into ``step-N/``; then the main process writes the manifest (``trainer_state.json``: every object's size and
CRC-32) last, and the ``latest`` pointer after it. A ``step-N/`` without its manifest is an upload that did not finish:
never a candidate, never counted. A resume downloads the checkpoint on each machine and checks every byte against
the manifest before anything reads it. The lock, metrics and ``final/`` stay in the local ``output_dir``.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import socket
import uuid
from pathlib import Path
from typing import Any, Callable, Optional

from trainer.checkpoint import integrity
from trainer.checkpoint.integrity import PREFIX, STATE_FILE, STEP_FOLDER, crc32, without_alternatives
from trainer.checkpoint.store import BEST_FILE, POINTER_FILE, checked_name
from trainer.console import warn
from trainer.errors import CheckpointError, ConfigError, Refusal

# The job that writes here now (Bucket.claim).
OWNER_FILE = ".owner"
# A manifest moved aside: its checkpoint did not hold what the manifest says (kept, no longer a candidate).
DAMAGED = f"{STATE_FILE}.damaged"


class Damaged(CheckpointError):
    """A checkpoint in the bucket that is not whole (torn, damaged, not a trainer's): a fact about the checkpoint,
    unlike a failure of the store's own (the network), after which no older checkpoint is taken in its place."""


def _in_words(method: Callable) -> Callable:
    """A failure of the store's own (credentials, the network) as a ``CheckpointError`` naming the bucket: one line,
    which ``main_decides`` tells every rank."""

    @functools.wraps(method)
    def said(self: "Bucket", *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        except Refusal:
            raise
        except Exception as err:
            raise CheckpointError(f"checkpoint_storage {self.url}: {type(err).__name__}: {err}") from None

    return said


class Bucket:
    """The checkpoints under one object-store URL (``fs``: its fsspec file system, ``path``: the URL without its
    scheme); every method on the main process unless it says otherwise."""

    def __init__(self, url: str):
        import fsspec

        self.url = url.rstrip("/")
        # This job's name in OWNER_FILE, from its first save on.
        self.owner: Optional[str] = None
        try:
            self.fs, self.path = fsspec.core.url_to_fs(self.url)
        # fsspec names the package a scheme needs ("Install s3fs to access S3").
        except (ImportError, ValueError) as err:
            raise ConfigError(
                f"checkpoint_storage {url}: {err} (pip install s3fs for s3://, gcsfs for gs://)"
            ) from None

    @classmethod
    def checked(cls, url: Optional[str]) -> Optional["Bucket"]:
        """The bucket of ``checkpoint_storage``, checked writable on every rank; None when there is none."""
        if not url:
            return None
        bucket = cls(url)
        bucket.check_writable()
        return bucket

    def source_of(self, resume: Optional[str]) -> "Bucket":
        """The bucket a resume downloads from: ``resume``'s own (a checkpoint URL) or this one."""
        return Bucket(resume.rstrip("/").rpartition("/")[0]) if resume not in (None, "auto") else self

    @_in_words
    def best_url(self, record: Optional[dict[str, Any]]) -> Optional[str]:
        """The committed checkpoint of keep_best's ``record`` (None: none, or not committed here)."""
        name = f"{PREFIX}{int(record['step']):08d}" if record else None
        return self.url_of(name) if name in self.committed() else None

    def url_of(self, name: str) -> str:
        return f"{self.url}/{name}"

    def _key(self, name: str) -> str:
        return f"{self.path}/{name}"

    def check_writable(self) -> None:
        """Fail at start, on every rank, if the bucket cannot be written (credentials, a missing bucket)."""
        probe = self._key(f".write-test-{socket.gethostname()}-{os.getpid()}")
        try:
            self.fs.pipe_file(probe, b"")
            self.fs.rm_file(probe)
        except Exception as err:
            raise CheckpointError(
                f"checkpoint_storage {self.url} cannot be written: {type(err).__name__}: {err}"
            ) from None

    @_in_words
    def committed(self) -> list[str]:
        """The committed checkpoints (a ``step-N/`` holding its manifest), oldest first."""
        # Other processes and jobs write here: never a listing fsspec kept from before.
        self.fs.invalidate_cache()
        found = self.fs.glob(self._key(f"{PREFIX}*/{STATE_FILE}"))
        names = {Path(key).parent.name for key in found}
        return sorted(name for name in names if STEP_FOLDER.fullmatch(name))

    @_in_words
    def pointer(self, name: str = POINTER_FILE) -> Optional[str]:
        """The folder the ``latest`` (or ``best``) pointer names, checked to be a ``step-N`` beside it; None without."""
        try:
            raw = self.fs.cat_file(self._key(name))
        except FileNotFoundError:
            return None
        return checked_name(raw, f"the {name} pointer {self.url_of(name)}")

    def claim(self) -> None:
        """This job's name in ``.owner``, written at its first save, checked at every later one. A bucket has no
        lock that goes with a process, so the newest job to save wins: a job started again after a crash takes the
        folder over, and a job still running on it stops at its next commit, naming the other, rather than
        interleave their checkpoints. A job that only reads (evaluation, an export) claims nothing."""
        self.owner = f"{uuid.uuid4().hex[:12]} (pid {os.getpid()} on {socket.gethostname()})"
        self.fs.pipe_file(self._key(OWNER_FILE), self.owner.encode())

    def _check_owner(self, name: str) -> None:
        try:
            holder = self.fs.cat_file(self._key(OWNER_FILE)).decode("utf-8", errors="replace")
        except FileNotFoundError:
            holder = None
        if holder != self.owner:
            raise CheckpointError(
                f"checkpoint_storage {self.url} was taken over by another job ({holder or 'its owner file removed'}): "
                f"checkpoint {name} was not committed, the other job's are left as they are. Give each job a "
                "checkpoint_storage of its own"
            )

    @_in_words
    def resume_point(self, resume: Optional[str], local_root: Path) -> Optional[Path]:
        """``store.resume_point`` for the bucket: None refuses a bucket holding checkpoints; "auto" downloads the
        newest whole one into ``local_root`` (a damaged one's manifest moved aside, said); a URL downloads that one."""
        if resume is None:
            if self.committed() or self.pointer() is not None:
                raise CheckpointError(
                    f"{self.url} already holds checkpoints of an earlier run. Set resume='auto' to continue it, "
                    "resume=<checkpoint URL> to continue from one of them, or choose another checkpoint_storage."
                )
            return None
        if resume != "auto":
            return self.source_of(resume).fetch(resume.rstrip("/").rpartition("/")[2], local_root)
        try:
            latest = self.pointer()
        except CheckpointError as err:
            latest, problems = None, [str(err)]
        else:
            problems = []
        names = ([latest] if latest else []) + [name for name in reversed(self.committed()) if name != latest]
        for name in names:
            try:
                found = self.fetch(name, local_root)
            # A failure of the store itself (the network) is raised: an older checkpoint is no answer to it.
            except Damaged as err:
                problems.append(without_alternatives(err))
                self._set_aside(name)
                continue
            if problems:
                warn(f"{problems[0]}; continuing from the newest whole checkpoint, {self.url_of(name)}")
            return found
        if problems:
            raise CheckpointError(f"{problems[0]}, and no other checkpoint under {self.url} is whole")
        return None

    def _set_aside(self, name: str) -> None:
        """A checkpoint whose files are not what its manifest says: the manifest moved aside (the files kept)."""
        try:
            self.fs.mv(self._key(f"{name}/{STATE_FILE}"), self._key(f"{name}/{DAMAGED}"))
        # Not committed at all (the pointer named an unfinished upload), or read-only.
        except Exception:
            pass

    @_in_words
    def fetch(self, name: str, local_root: Path) -> Path:
        """Checkpoint ``name`` downloaded into ``local_root/name`` (on any rank) and checked whole there: every file
        its manifest lists, with its size and CRC-32, and nothing else."""
        if name in ("", ".", "..") or "/" in name:
            raise CheckpointError(f"checkpoint {self.url_of(name)} is not a checkpoint folder")
        remote, local = self._key(name), local_root / name
        try:
            manifest = self.fs.cat_file(f"{remote}/{STATE_FILE}")
        except FileNotFoundError:
            torn = f"is torn: it has no {STATE_FILE} (an upload that did not finish)"
            kind = torn if self.fs.exists(remote) else "does not exist"
            raise Damaged(f"checkpoint {self.url_of(name)} {kind}{self._others(name)}") from None
        shutil.rmtree(local, ignore_errors=True)
        local.mkdir(parents=True)
        (local / STATE_FILE).write_bytes(manifest)
        try:
            listed = integrity.read_state(local)["files"]
            integrity.listed_inside(local, listed)
            targets = [local / name for name in listed]
            for target in targets:
                target.parent.mkdir(parents=True, exist_ok=True)
            try:
                # fsspec fetches a list of objects concurrently.
                self.fs.get([f"{remote}/{name}" for name in listed], [str(target) for target in targets])
            except FileNotFoundError as err:
                missing = Path(str(err.filename or err)).name
                raise CheckpointError(f"checkpoint {self.url_of(name)} is torn: {missing} is missing") from None
            return integrity.verify(local)
        except CheckpointError as err:
            raise Damaged(str(err)) from None

    def _others(self, name: str) -> str:
        found = [self.url_of(other) for other in self.committed() if other != name]
        return (
            f". Other checkpoints there: {', '.join(found)}; pass one as resume=<URL> to continue from it"
            if found
            else ""
        )

    @_in_words
    def commit(self, name: str, state: dict[str, Any], *, uploaded: dict[str, tuple[int, str]], keep_last: int) -> str:
        """Every rank's files are in ``name/`` (their sizes and CRC-32 in ``uploaded``): the manifest written last,
        then the pointers, then the pruning, as ``store.commit`` does on a disk. Returns the checkpoint's URL."""
        self._check_owner(name)
        manifest = {"files": {n: size for n, (size, _) in uploaded.items()}}
        manifest["crc32"] = {n: crc for n, (_, crc) in uploaded.items()}
        # One PUT: a reader sees all of the manifest or none of it.
        self.fs.pipe_file(self._key(f"{name}/{STATE_FILE}"), json.dumps({**state, **manifest}, indent=1).encode())
        self.fs.pipe_file(self._key(POINTER_FILE), name.encode())
        record = state.get("best")
        committed = self.committed()
        best = f"{PREFIX}{int(record['step']):08d}" if record else None
        if best in committed:
            self.fs.pipe_file(self._key(BEST_FILE), best.encode())
        elif self.fs.exists(self._key(BEST_FILE)):
            self.fs.rm_file(self._key(BEST_FILE))
        for old in committed[:-keep_last]:
            if old not in (name, best):
                # The manifest first: a pruning cut short leaves an uncommitted folder, never a torn checkpoint.
                self.fs.rm_file(self._key(f"{old}/{STATE_FILE}"))
                self.fs.rm(self._key(old), recursive=True)
        return self.url_of(name)

    @_in_words
    def clear(self, name: str) -> None:
        """Before step ``name`` is uploaded: whatever an earlier save of that step left there, manifest first (the
        folder claimed by this job at its first save, checked to be still its own at every later one)."""
        if self.owner is None:
            self.claim()
        else:
            self._check_owner(name)
        self.fs.invalidate_cache()
        if self.fs.exists(self._key(f"{name}/{STATE_FILE}")):
            self.fs.rm_file(self._key(f"{name}/{STATE_FILE}"))
        if self.fs.exists(self._key(name)):
            self.fs.rm(self._key(name), recursive=True)

    def upload(self, staging: Path, names: list[str]) -> dict[str, tuple[int, str]]:
        """This rank's share of a checkpoint: ``names`` in ``staging`` put into its ``step-N/``; their sizes and
        CRC-32, read here before they leave."""
        sent = {name: ((staging / name).stat().st_size, crc32(staging / name)) for name in names}
        remote = self._key(staging.name.removeprefix(".tmp-"))
        if names:
            self.fs.put([str(staging / name) for name in names], [f"{remote}/{name}" for name in names])
        return sent
