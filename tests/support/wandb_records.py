"""Read what wandb's offline mode wrote: the records of a ``run-<id>.wandb`` file, and every run under a folder.

wandb 0.31 ships no Python reader for these files. The format: a 7-byte header (``:W&B``, a 2-byte magic, a
version byte), then LevelDB-log framing: 32 KiB blocks of records, each with a 7-byte header (crc32, length, type:
1 full, 2 first, 3 middle, 4 last), whose payloads are ``wandb_internal_pb2.Record`` messages.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from pathlib import Path

from wandb.proto import wandb_internal_pb2

BLOCK, HEADER = 32 * 1024, 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: Path) -> list[wandb_internal_pb2.Record]:
    data = Path(path).read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a wandb run file"
    found, pending, pos = [], b"", HEADER
    while pos + HEADER <= len(data):
        left_in_block = BLOCK - pos % BLOCK
        if left_in_block < HEADER:  # a block's tail too short for a header is padding
            pos += left_in_block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + HEADER])
        if kind == 0:  # zero padding up to the end of the block
            pos += left_in_block
            continue
        pending += data[pos + HEADER : pos + HEADER + length]
        pos += HEADER + length
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            found.append(record)
            pending = b""
    return found


@dataclass
class OfflineRun:
    """One attempt of one run, as its offline file recorded it."""

    run_id: str
    name: str
    group: str
    config: dict
    history: list[dict] = field(default_factory=list)  # each wandb.log call, user keys and _step
    summary: dict = field(default_factory=dict)
    exit_code: int | None = None  # None: the process died before finishing the run
    preempting: bool = False  # the run was marked preempting (wandb.run.mark_preempting())


def read_run(path: Path) -> OfflineRun:
    """The run in ``run-<id>.wandb``. A process killed hard can leave the file with no records at all (wandb's
    service had not flushed them): then only the id, from the file name, is known."""
    run = OfflineRun(Path(path).stem.removeprefix("run-"), name="", group="", config={})
    for record in records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            config = {item.key: json.loads(item.value_json) for item in record.run.config.update}
            run = OfflineRun(record.run.run_id, record.run.display_name, record.run.run_group, config)
            assert run.run_id == Path(path).stem.removeprefix("run-")
        elif kind == "history":
            run.history.append({_key(item): json.loads(item.value_json) for item in record.history.item})
        elif kind == "summary":
            run.summary.update({_key(item): json.loads(item.value_json) for item in record.summary.update})
        elif kind == "exit":
            run.exit_code = record.exit.exit_code
        elif kind == "preempting":
            run.preempting = True
    return run


def _key(item) -> str:
    """A key with a slash ("rank/loss") is stored as its parts, in ``nested_key``."""
    return item.key or "/".join(item.nested_key)


def offline_runs(directory: Path) -> list[OfflineRun]:
    """Every offline run attempt under ``directory`` (``wandb/offline-run-*/run-*.wandb``), oldest first."""
    return [read_run(path) for path in sorted(Path(directory).glob("wandb/offline-run-*/run-*.wandb"))]
