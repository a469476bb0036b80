"""What the processes agree on off the device, over one gloo group of the job's: a stream's accumulation windows,
the preemption signal, the errors of a checkpoint written in the background.

Why a group of its own, on the host: these agreements are about CPU-side facts (how many batches a stream gave, a
signal, a failed write), so their tensors live on the CPU, and on a GPU job they then neither wait behind the
device's queued work nor add a host sync to a step. The group is made once per process (``new_group`` is collective:
every rank makes it at the same point, the Trainer's construction) with ``collective_timeout_s``, so a rank that
never comes ends these waits as it ends the training collectives, not after torch's default 30 minutes.

What must agree *on* the device, at each log step (the loss, the counts, the stop flag, the first non-finite loss),
rides one gather of one row (``trainer.telemetry.window``). A checkpoint written in the background runs its collectives
on a gloo group of its own from its own thread (``trainer.checkpoint.background``): two threads must never share a
group.
"""

from __future__ import annotations

import functools
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist

HOST_GROUPS: list = []  # every host group this process made, in order: the same on every rank (trainer.launch's exit)


@functools.cache
def host_group(world_size: int, timeout_s: float) -> Optional[Any]:
    """The job's host-side gloo group (None with one process). Collective the first time: every rank, together."""
    if world_size == 1:
        return None
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
    HOST_GROUPS.append(group)
    return group


class StreamAgreement:
    """How many micro-batches each process holds in a stream's accumulation window: ``(fewest, total)``."""

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


def gather_objects(mine: Any, group: Any) -> list[Any]:
    """Every rank's ``mine`` (plain Python data: an error's text, a stream's position), on every rank."""
    if group is None:
        return [mine]
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, mine, group=group)
    return gathered
