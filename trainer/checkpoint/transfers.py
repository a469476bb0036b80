"""Which process uploads and downloads what, for checkpoints in object storage (``trainer.checkpoint.bucket``): every
process sends a share of the files its machine holds, none twice; a checkpoint to resume from is downloaded once per
machine (once in all where the machines share a disk). Every function is collective: call it on every rank.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional

from trainer.checkpoint import integrity
from trainer.checkpoint.bucket import Bucket
from trainer.checkpoint.failures import agreed_failure
from trainer.checkpoint.integrity import without_alternatives
from trainer.errors import CheckpointError

if TYPE_CHECKING:
    from trainer.launch.run import Run

# Where each machine keeps a checkpoint downloaded from the bucket, in <output_dir>/checkpoints: not a candidate for a
# resume from the disk (a hidden folder), removed once read.
DOWNLOADS = ".downloaded"


def shares(seen: list[list[str]]) -> list[list[str]]:
    """Each file of a checkpoint given to one of the ranks that see it (``seen``: every rank's listing of its
    machine's staging folder), in turn, so that the uploads are spread and no file is sent twice."""
    holders: dict[str, list[int]] = {}
    for rank, names in enumerate(seen):
        for name in names:
            holders.setdefault(name, []).append(rank)
    given: list[list[str]] = [[] for _ in seen]
    for turn, name in enumerate(sorted(holders)):
        ranks = holders[name]
        given[ranks[turn % len(ranks)]].append(name)
    return given


def stage_on_every_machine(run: Run, staging: Path) -> None:
    """Collective, once the main process has made ``staging``: each machine's own where no disk is shared, without
    what a crash there left (it would be uploaded)."""
    if not run.main and run.accelerator.is_local_main_process:
        shutil.rmtree(staging, ignore_errors=True)
    run.barrier()
    staging.mkdir(parents=True, exist_ok=True)


def commit_everywhere(run: Run, bucket: Bucket, staging: Path, *, state: dict[str, Any], keep_last: int) -> str:
    """Collective, once every rank's files of a checkpoint are in its machine's ``staging``: each rank uploads its
    share, the main process commits (``Bucket.commit``), each machine's staging folder goes. Returns its URL."""
    name = staging.name.removeprefix(".tmp-")
    mine = sorted(p.relative_to(staging).as_posix() for p in staging.rglob("*") if p.is_file())
    share = shares(run.gather(mine))[run.rank]
    run.main_decides(lambda: bucket.clear(name))
    sent: dict[str, tuple[int, str]] = {}
    failed = agreed_failure(run, lambda: sent.update(bucket.upload(staging, share)))
    if failed is not None:
        rank, err = failed.rank, failed.error
        # Another rank's failure comes in its words.
        said = str(err) if isinstance(err, CheckpointError) else f"{type(err).__name__}: {err}"
        latest = run.main_decides(bucket.pointer)
        kept = f"{bucket.url_of(latest)} is still the latest" if latest else "none was committed before"
        if run.accelerator.is_local_main_process:
            shutil.rmtree(staging, ignore_errors=True)
        raise CheckpointError(f"could not upload checkpoint {name} to {bucket.url}: {said} (rank {rank}); {kept}")
    uploaded = {file: tuple(sizes) for part in run.gather(sent) for file, sizes in part.items()}
    url = run.main_decides(lambda: bucket.commit(name, state, uploaded=uploaded, keep_last=keep_last))
    if run.accelerator.is_local_main_process:
        shutil.rmtree(staging, ignore_errors=True)
    return url


def committer(run: Run, bucket: Bucket, staging: Path, *, future: Any, state: dict[str, Any]) -> Callable[[], str]:
    """``save_async``'s commit to a bucket, for a thread of every process: the writes agreed on (each process's, or
    the first failure), then ``commit_everywhere`` (``run``'s host group: the background writes' own)."""

    def commit() -> str:
        failed = agreed_failure(run, future.result)
        if failed is not None:
            err = failed.error
            if run.accelerator.is_local_main_process:
                shutil.rmtree(staging, ignore_errors=True)
            said = str(err) if isinstance(err, CheckpointError) else f"{type(err).__name__}: {err}"
            raise CheckpointError(f"checkpoint {staging.name.removeprefix('.tmp-')} could not be written: {said}")
        return commit_everywhere(run, bucket, staging, state=state, keep_last=run.config.keep_last)

    return commit


def on_every_machine(run: Run, found: Optional[str], source: Bucket) -> Optional[Path]:
    """Collective: the checkpoint the main process downloaded (``found``, its local folder) on every machine too,
    each machine's first process downloading and checking its own copy unless it shares the main process's disk."""
    if found is None:
        return None
    path = Path(found)

    def copy() -> None:
        if run.main or not run.accelerator.is_local_main_process:
            return
        try:
            integrity.verify(path, contents=False)
        except CheckpointError:
            source.fetch(path.name, path.parent)

    failed = agreed_failure(run, copy)
    if failed is not None:
        raise CheckpointError(f"{failed.error} (rank {failed.rank})")
    return path


def best_on_every_machine(
    run: Run, bucket: Bucket, record: Optional[dict[str, Any]], *, local_root: Path
) -> tuple[Optional[Path], Optional[str]]:
    """Collective: keep_best's checkpoint (``record``'s) downloaded into ``local_root`` on every machine, or None; and
    why it is not whole (said by ``KeepBest.load_best``, which then keeps the weights as they are), or None."""

    def find() -> tuple[Optional[str], Optional[str]]:
        url = bucket.best_url(record)
        if url is None:
            return None, None
        try:
            return str(bucket.fetch(url.rpartition("/")[2], local_root)), None
        except CheckpointError as err:
            return url, without_alternatives(err)

    found, damage = run.main_decides(find)
    if damage is not None:
        return Path(found), damage
    return on_every_machine(run, found, bucket), None
