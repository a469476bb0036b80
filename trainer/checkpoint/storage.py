"""Where checkpoints are committed and found: a folder on the disk (``LocalStorage``: the store's commit protocol,
``trainer.checkpoint.store``) or a bucket in object storage (``BucketStorage``: staged on each machine, uploaded in
shares, downloaded to resume; ``trainer.checkpoint.bucket`` and ``transfers``). The checkpoint manager asks one of
them and never which, as torchtitan's checkpointer reaches its storage through one interface. Every method is
collective (call it on every rank) but ``resume_point``, the main process's.
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional

from trainer.checkpoint import integrity, store, transfers
from trainer.checkpoint.bucket import Bucket
from trainer.checkpoint.transfers import DOWNLOADS
from trainer.console import say
from trainer.errors import CheckpointError

if TYPE_CHECKING:
    from trainer.launch.run import Run


class LocalStorage:
    """Checkpoints in ``root`` (``<output_dir>/checkpoints``), committed by the main process."""

    def __init__(self, run: Run, root: Path):
        self.run, self.root = run, root
        # Said when there is nothing to resume from.
        self.where = str(root.resolve())

    def resume_point(self, resume: Optional[str]) -> Optional[Path]:
        """The main process's: the checkpoint ``resume`` asks for (a damaged one set aside), or None."""
        return store.resume_point(self.root, resume)

    def fetched(self, found: Optional[str]) -> Optional[Path]:
        """The checkpoint the main process found, as a folder every rank reads."""
        return None if found is None else Path(found)

    def resumed(self, path: Path) -> Path | str:
        """Once every rank has read ``path``: what the checkpoint resumed from is called."""
        return path

    def stage(self, staging: Path) -> None:
        """Once the main process has made ``staging``, before every rank writes into it."""

    def commit(self, staging: Path, state: dict[str, Any]) -> Path | str:
        """Every rank's files are in ``staging``: the main process commits them (every rank learns whether)."""

        def commit() -> Path:
            try:
                return store.commit(staging, state, self.run.config.keep_last)
            except OSError as err:
                raise store.write_failed(staging, self.root, err) from None

        return self.run.main_decides(commit)

    def committer(self, staging: Path, state: dict[str, Any], *, write: Any, group: Any) -> tuple[Callable, bool]:
        """``save_async``'s commit once ``write`` (every rank's background write) is done, and whether it runs on
        the main process alone (a rename) rather than on every rank."""
        return (lambda: store.commit(staging, state, self.run.config.keep_last)), True

    def final(self, step: int) -> Path | str:
        """What step ``step``'s checkpoint is called once committed."""
        return store.final_folder(self.root, step)

    def best(self, record: Optional[dict[str, Any]]) -> tuple[Optional[Path], Optional[str]]:
        """keep_best's checkpoint (``record``'s) as a folder every rank reads, or None; and why it is not whole (the
        main process checks it, contents included), or None."""
        best = store.best_checkpoint(self.root, record)
        if best is None:
            return None, None

        def damage() -> Optional[str]:
            try:
                integrity.verify(best)
            except CheckpointError as err:
                return integrity.without_alternatives(err)
            return None

        return best, self.run.main_decides(damage)

    def best_name(self, record: Optional[dict[str, Any]]) -> Optional[Path | str]:
        """What keep_best's checkpoint is called, or None."""
        return store.best_checkpoint(self.root, record)


class BucketStorage(LocalStorage):
    """Checkpoints in ``bucket``, staged in ``root`` on each machine and uploaded, downloaded into it to resume: each
    of ``LocalStorage``'s answers, given by the bucket."""

    def __init__(self, run: Run, root: Path, bucket: Bucket):
        super().__init__(run, root)
        self.bucket, self.where = bucket, bucket.url
        # Where a resume's checkpoint comes from: this run's bucket, or the one ``resume`` names.
        self.source = bucket.source_of(run.config.resume)

    def resume_point(self, resume: Optional[str]) -> Optional[Path]:
        return self.bucket.resume_point(resume, self.root / DOWNLOADS)

    def fetched(self, found: Optional[str]) -> Optional[Path]:
        path = transfers.on_every_machine(self.run, found, self.source)
        if path is not None:
            say(f"downloaded {self.source.url_of(path.name)} into {path}")
        return path

    def resumed(self, path: Path) -> Path | str:
        # Every rank has read its part (a failed read leaves the download, replaced by the next).
        self.run.barrier()
        if self.run.accelerator.is_local_main_process:
            shutil.rmtree(path, ignore_errors=True)
        return self.source.url_of(path.name)

    def stage(self, staging: Path) -> None:
        transfers.stage_on_every_machine(self.run, staging)

    def commit(self, staging: Path, state: dict[str, Any]) -> Path | str:
        return transfers.commit_everywhere(
            self.run, self.bucket, staging, state=state, keep_last=self.run.config.keep_last
        )

    def committer(self, staging: Path, state: dict[str, Any], *, write: Any, group: Any) -> tuple[Callable, bool]:
        # Its collectives on the background writes' own group, from their thread.
        run = dataclasses.replace(self.run, host=group)
        return transfers.committer(run, self.bucket, staging, future=write, state=state), False

    def final(self, step: int) -> Path | str:
        return self.bucket.url_of(store.final_folder(self.root, step).name)

    def best(self, record: Optional[dict[str, Any]]) -> tuple[Optional[Path], Optional[str]]:
        return transfers.best_on_every_machine(self.run, self.bucket, record, local_root=self.root / DOWNLOADS)

    def best_name(self, record: Optional[dict[str, Any]]) -> Optional[Path | str]:
        return self.bucket.best_url(record)


def storage_for(run: Run, root: Path) -> LocalStorage:
    """The run's storage: ``checkpoint_storage``'s bucket (checked: it exists, this run may write it), else ``root``."""
    bucket = Bucket.checked(run.config.checkpoint_storage)
    return LocalStorage(run, root) if bucket is None else BucketStorage(run, root, bucket)
