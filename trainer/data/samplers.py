"""The samplers of the trainer's loaders: DistributedSampler's sharding table, resumable mid-epoch, and each
example once for evaluation; and the batches of processes that must run in lockstep (docs/same-updates.md)."""

from __future__ import annotations

import math
from typing import Any, Iterator

import torch
from torch.utils.data import DistributedSampler, Sampler

from trainer.errors import DataError


class ResumableSampler(DistributedSampler):
    """DistributedSampler that can start part-way into an epoch, for resuming mid-epoch.

    Skipping slices this process's index list, so its cost does not depend on how far into the epoch the run
    stopped, and no skipped example is ever loaded.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._skip = 0

    def skip_next(self, num_examples: int) -> None:
        """The next iteration starts ``num_examples`` into this process's share of the epoch."""
        self._skip = num_examples

    def __iter__(self):
        indices = list(super().__iter__())[self._skip :]
        self._skip = 0
        return iter(indices)


class ShardSampler(Sampler[int]):
    """Process ``rank`` of ``num_replicas`` gets examples rank, rank+K, ... exactly once, with no padding.

    Used for evaluation, where a padded tail would count some examples twice.
    """

    def __init__(self, num_examples: int, num_replicas: int, rank: int):
        self.indices = range(rank, num_examples, num_replicas)
        self.num_examples, self.num_replicas = num_examples, num_replicas

    def most_batches(self, batch_size: int) -> int:
        """The batches of the largest share (the first process's), which every process can work out alone."""
        return math.ceil(math.ceil(self.num_examples / self.num_replicas) / batch_size)

    def __iter__(self):
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


def in_lockstep(loader, device: torch.device) -> Iterator[tuple[Any, bool]]:
    """``(batch, counted)`` until no process has a batch left: a process whose share ran out repeats its last batch,
    not counted. Why: a sharded model's every forward gathers the weights from all processes, so every process runs
    as many forwards. For a data set of known length (the trainer's own loader, every process with an example)
    each process works out the largest share's batches itself: nothing is exchanged. Otherwise (a stream, your own
    loader) the processes agree batch by batch (one small all-reduce and a host read each), and a process with no
    example at all while others have some is refused on every process at once."""
    batches = getattr(loader, "batch_sampler", None)
    sampler = getattr(batches, "sampler", None)
    if isinstance(sampler, ShardSampler) and sampler.num_examples >= sampler.num_replicas and not batches.drop_last:
        last, taken = None, 0
        for last in loader:
            taken += 1
            yield last, True
        for _ in range(sampler.most_batches(batches.batch_size) - taken):
            yield last, False
        return
    iterator, last = iter(loader), None
    while True:
        batch = next(iterator, None)
        flags = torch.tensor([batch is not None, batch is None and last is None], dtype=torch.int64, device=device)
        torch.distributed.all_reduce(flags)
        have, never = flags.tolist()
        if have == 0:
            return
        if never:
            raise DataError(
                "the evaluation data gives some process no example: with a sharded model (FSDP2) every "
                "process evaluates, so give it at least as many examples as processes",
                job_wide=True,
            )
        if batch is None:
            yield last, False
        else:
            last = batch
            yield batch, True
