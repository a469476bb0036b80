"""Streaming training data: an IterableDataset that every process reads its own part of, resumable at any step.

Each process keeps its own part of the stream:

- a ``datasets.IterableDataset`` (``load_dataset(..., streaming=True)``, ``Dataset.to_iterable_dataset()``) is
  split by datasets' own ``split_dataset_by_node``: whole shards per process when the shard count divides by the
  process count, else every K-th example;
- any other ``torch.utils.data.IterableDataset``: process k keeps examples k, k+K, k+2K, ... of the stream (as
  DistributedSampler deals a map-style data set). A stream that already yields each process its own part goes in
  a DataLoader instead, which is used as is.

Where each process's part stands is checkpointed with the step (JSON in ``trainer_state.json``, never a pickle):
the stream's own ``state_dict()`` as it was before the first example of the next batch, so a resume continues there
without re-reading what was consumed (datasets' ``IterableDataset.state_dict()``; a torch IterableDataset may offer
the same two methods). The loader reads ahead, so the state is noted at every batch boundary (about 0.1 ms) and
the one of the checkpointed batch is saved. A stream that cannot say where it is, or one read in worker processes
(``num_workers > 0``, where its state is out of reach), resumes only at the start of an epoch, and a resume
mid-stream is refused with a message saying so.

Caveat from datasets: a ``shuffle(buffer_size=...)`` buffer is not part of the state; a resumed stream refills it
and reads different examples than the uninterrupted run would have.
"""

from __future__ import annotations

import json
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist
from torch.utils.data import IterableDataset, get_worker_info

from trainer.errors import CheckpointError, StreamPositionError
from trainer.hf import is_stream
from trainer.loop.state import TrainState


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
        self.kept = read_ahead + 2  # positions remembered
        self.resumable = callable(getattr(stream, "state_dict", None)) and callable(
            getattr(stream, "load_state_dict", None)
        )
        self._positions: dict[int, Optional[dict[str, Any]]] = {}  # batches read -> position before the next one
        self._start: Optional[dict[str, Any]] = None  # where the next pass begins (a resume); None: the beginning

    @property
    def name(self) -> str:
        return type(self.stream).__name__

    def set_epoch(self, epoch: int) -> None:
        """A new pass over the stream (datasets' streams reshuffle their shards from the seed and the epoch)."""
        if hasattr(self.stream, "set_epoch"):
            self.stream.set_epoch(epoch)

    def __iter__(self) -> Iterator[Any]:
        start, self._start = self._start, None
        batches, read = 0, 0  # batches begun in this pass, examples of the whole stream read
        if start is not None:
            self.stream.load_state_dict(start["stream"])
            batches, read = start["batches"], start["read"]
        self._positions = {batches: start}
        noting = self.resumable and get_worker_info() is None  # a worker's state cannot reach the checkpoint
        kept = 0  # examples of this part yielded in this pass
        for example in self.stream:
            read += 1
            if (read - 1) % self.keep_every != self.offset:
                continue
            yield example
            kept += 1
            if kept % self.batch_size == 0:  # the next batch begins after this example
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
            return  # an epoch's beginning: nothing to skip
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

    def __init__(self, run: Any, stream: StreamShard, position: TrainState):
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
