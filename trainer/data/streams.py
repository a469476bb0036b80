"""Streaming training data: an IterableDataset every process reads its own part of, its position checkpointed as
JSON at every batch boundary so that a resume continues there (docs/internals.md#streams, docs/project.md).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any, Iterator, Optional

import torch
import torch.distributed as dist
from torch.utils.data import IterableDataset, get_worker_info

from trainer.errors import CheckpointError, StreamPositionError
from trainer.hf import is_stream
from trainer.state import TrainState

if TYPE_CHECKING:
    from trainer.launch.run import Run


class StreamShard(IterableDataset):
    """This process's part of ``stream``, read ``batch_size`` examples to a batch, with its position at each batch
    boundary kept for checkpoints.

    Args:
        stream: the user's IterableDataset.
        rank, world_size: this process and how many read the stream.
        batch_size: examples per batch (the positions are noted between batches).
        read_ahead: how many batches the trainer may read before it trains them (the last ones are kept).
        split: False when ``stream`` already is this process's part (from a user's DataLoader).
    """

    def __init__(
        self,
        stream: IterableDataset,
        rank: int,
        world_size: int,
        *,
        batch_size: int,
        read_ahead: int = 2,
        split: bool = True,
    ):
        self.keep_every, self.offset = 1, 0
        if split and world_size > 1:
            if is_stream(stream):
                from datasets.distributed import split_dataset_by_node

                stream = split_dataset_by_node(stream, rank=rank, world_size=world_size)
            else:
                self.keep_every, self.offset = world_size, rank
        self.stream = stream
        self.batch_size = batch_size
        # Positions remembered.
        self.kept = read_ahead + 2
        self.resumable = callable(getattr(stream, "state_dict", None)) and callable(
            getattr(stream, "load_state_dict", None)
        )
        # Batches read -> position before the next one.
        self._positions: dict[int, Optional[dict[str, Any]]] = {}
        # Where the next pass begins (a resume); None: the beginning.
        self._start: Optional[dict[str, Any]] = None

    @property
    def name(self) -> str:
        return type(self.stream).__name__

    def set_epoch(self, epoch: int) -> None:
        """A new pass over the stream (datasets' streams reshuffle their shards from the seed and the epoch)."""
        if hasattr(self.stream, "set_epoch"):
            self.stream.set_epoch(epoch)

    def __iter__(self) -> Iterator[Any]:
        start, self._start = self._start, None
        # Batches begun in this pass, examples of the whole stream read.
        batches, read = 0, 0
        if start is not None:
            self.stream.load_state_dict(start["stream"])
            batches, read = start["batches"], start["read"]
        self._positions = {batches: start}
        # A worker's state cannot reach the checkpoint.
        noting = self.resumable and get_worker_info() is None
        # Examples of this part yielded in this pass.
        kept = 0
        for example in self.stream:
            read += 1
            if (read - 1) % self.keep_every != self.offset:
                continue
            yield example
            kept += 1
            # The next batch begins after this example.
            if kept % self.batch_size == 0:
                batches += 1
                if noting:
                    self._note(batches, read)

    def _note(self, batches: int, read: int) -> None:
        self._positions[batches] = {"batches": batches, "read": read, "stream": self.stream.state_dict()}
        if len(self._positions) > self.kept:
            del self._positions[min(self._positions)]

    def position(self, batches: int) -> Optional[dict[str, Any]]:
        """Where this part stood after ``batches`` batches of the current pass (None: unknown)."""
        return self._positions.get(batches)

    def resume_at(self, position: Optional[dict[str, Any]], batches: int) -> None:
        """Start the next pass where a checkpoint left it: after ``batches`` batches, at ``position``."""
        if batches == 0:
            # An epoch's beginning: nothing to skip.
            return
        if position is None:
            raise StreamPositionError(
                f"the checkpoint is {batches} batches into an epoch of train_data ({self.name}), but it could not say "
                f"where it stood: {self._why_unknown()}. Resuming would re-read or skip part of the stream. Resume "
                "from a checkpoint at an epoch's start, or start afresh."
            )
        self._start = position

    def _why_unknown(self) -> str:
        if not self.resumable:
            return (
                "it has no state_dict() / load_state_dict() (a datasets streaming IterableDataset has them; "
                "give a torch IterableDataset the two methods to resume mid-stream)"
            )
        return "it was read by DataLoader workers (num_workers > 0), whose state does not reach the checkpoint"


class StreamPositions:
    """Where every process's part of the stream stands, as a checkpoint holds it (JSON, never a pickle): its
    ``state_dict`` gathers every process's position (collective); at a resume each process takes its own back."""

    def __init__(self, run: Run, stream: StreamShard, position: TrainState):
        self.run, self.stream, self.position = run, stream, position

    def state_dict(self) -> dict[str, Any]:
        # 0 at an epoch's end: the next one's start.
        batches = self.position.state_dict()["batches_into_epoch"]
        positions = self.run.gather(self.stream.position(batches) if batches else None)
        try:
            json.dumps(positions)
        except (TypeError, ValueError) as err:
            raise CheckpointError(
                f"train_data ({self.stream.name})'s state_dict() cannot be saved as JSON ({err}): "
                "return plain numbers, strings, lists and dicts from it"
            ) from None
        return {"streams": positions}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        positions = state.get("streams") or []
        rank = self.run.rank
        mine = positions[rank] if rank < len(positions) else None
        self.stream.resume_at(mine, self.position.batches_into_epoch)


class StreamAgreement:
    """How many micro-batches each process holds in a stream's accumulation window, ``(fewest, total)``, agreed over
    the host group (streams may end at different batches on different processes)."""

    def __init__(self, group: Any, world_size: int):
        """``group``: every process; ``world_size``: the data-parallel ones (a tensor-parallel group's processes
        read the same stream, so each holds what the others of its group hold)."""
        self.group = group
        self.counts = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size(group))]
        self.copies = len(self.counts) // world_size

    def __call__(self, held: int) -> tuple[int, int]:
        dist.all_gather(self.counts, torch.tensor([held], dtype=torch.int64), group=self.group)
        counts = [int(c) for c in self.counts]
        return min(counts), sum(counts) // self.copies
