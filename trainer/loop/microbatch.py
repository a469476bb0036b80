"""``auto_microbatch``: a micro-batch that does not fit in memory is cut in pieces, on every rank alike, and the step
runs again: the same examples, the same global batch, the same updates (each piece's loss weighed as its share of
the window's, ``trainer.loop.weighing``), to the float floor of the other split.

Ranks learn of an out-of-memory (``torch.OutOfMemoryError``, raised on the host when an allocation fails) where no
collective can be pending: every piece runs its forward and backward without any gradient all-reduce (DDP's
``no_sync``), then the ranks compare notes (one small all-reduce on the host group). If any rank ran out of memory,
every rank drops the step's gradients, puts its random state back, doubles the pieces each micro-batch is cut into
and starts the step again; the main process says so in one line. Once every piece of the window got through, the
gradients are all-reduced (divided by the process count first, as DDP does) and the step goes on. So an OOM in any
forward or backward, on one rank or all, costs one rerun of that step. (An OOM elsewhere, in the optimizer's first
step as it allocates its state, say, is not caught: it ends the job as before.) The price, while it is on: the
gradient all-reduce waits for the window's last backward instead of overlapping it, and one host all-reduce per
piece. The number of pieces is kept in checkpoints, so a resumed run starts with the split that fit.

A sharded model (FSDP2) gathers its weights inside forward and backward and reduce-scatters its gradients inside
backward, where one rank's OOM would leave the others waiting in a collective. There every all-gather and
reduce-scatter FSDP2 issues while a piece runs goes through this module (``set_custom_all_gather`` /
``set_custom_reduce_scatter``), which first asks the host group whether any rank ran out: its buffers are
allocated by then, so a rank fails before the collective or not at all. A rank that ran out keeps answering
those questions until every rank has left the piece; the others stop at their next collective, and FSDP2's
per-iteration state is reset (``FSDPModule.reset_iter_state``) before the rerun. Each piece reduce-scatters its
own gradients (they add up in the shards). The price: one host all-reduce before each of FSDP2's collectives, a
tensor-parallel or hybrid (HSDP) mesh refused for now.

A piece of one example that still does not fit ends the job in one line naming the model's size and the memory.
"""

from __future__ import annotations

import gc
from typing import Any, Iterable, Optional

import torch
import torch.distributed as dist
from accelerate.utils import find_batch_size, recursively_apply

from trainer.errors import Refusal, ShardingError
from trainer.telemetry.console import say


class OutOfMemory(Refusal, RuntimeError):
    """A micro-batch of one example does not fit in the device's memory."""


class RanOutElsewhere(Exception):
    """Another rank ran out of memory in this piece: this one stops at its next collective (FSDP2)."""


class MicroBatchSplit:
    """How many pieces each micro-batch is cut into (1, 2, 4, ...), agreed by every rank; a checkpoint part."""

    def __init__(self, host_group: Any, world: int, dp_group: Any, device: torch.device):
        self.pieces = 1
        self.host_group, self.world, self.dp_group, self.device = host_group, world, dp_group, device
        self.rank = dist.get_rank() if world > 1 else 0
        self.sharded: Any = None  # the root FSDPModule of a sharded model
        self.armed = False  # inside a piece's forward and backward: FSDP2's collectives ask first

    @classmethod
    def for_run(
        cls, config: Any, parallel: Any, host_group: Any, model: torch.nn.Module
    ) -> Optional["MicroBatchSplit"]:
        if not config.auto_microbatch:
            return None
        acc = parallel.accelerator
        split = cls(host_group, parallel.dp.size, parallel.dp.group, acc.device)
        if parallel.sharded is not None:
            split.watch_collectives(model, parallel.layout)
        return split

    def watch_collectives(self, model: torch.nn.Module, layout: Any) -> None:
        """Every sharded module's all-gathers and reduce-scatters ask first (``AskFirstAllGather``)."""
        from torch.distributed.fsdp import FSDPModule

        if layout.tp > 1 or layout.hybrid:
            raise ShardingError(
                f"auto_microbatch is not supported with {layout.describe()} yet (its collectives "
                "run where one rank's out-of-memory would leave the others waiting): set "
                "auto_microbatch: false and choose batch_size, or shard without tp_size or "
                "dp_replicate_size"
            )
        if not hasattr(FSDPModule, "reset_iter_state"):
            raise ShardingError(
                f"auto_microbatch with a sharded model needs FSDPModule.reset_iter_state, which "
                f"torch {torch.__version__} lacks: use torch 2.13 or later, or set auto_microbatch: "
                "false and choose batch_size"
            )
        self.sharded = model
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_custom_all_gather(AskFirstAllGather(self))
                module.set_custom_reduce_scatter(AskFirstReduceScatter(self))

    def ask(self) -> None:
        """Before one of FSDP2's collectives in a piece: every rank's answer to whether it ran out; raises
        ``RanOutElsewhere`` when one did (that rank is in ``ran_out``, answering until all arrive)."""
        if not self.armed or self.world == 1:
            return
        notes = torch.zeros(self.world + 1, dtype=torch.int32)
        notes[self.world] = 1  # this rank is still inside the piece
        dist.all_reduce(notes, op=dist.ReduceOp.MAX, group=self.host_group)
        if notes[: self.world].any():
            raise RanOutElsewhere()

    def reset(self) -> None:
        """After a failed try of a sharded model: FSDP2's per-iteration state back to the start of a step, and the
        failed try's gradients dropped from the gathered weights of each module whose reduce-scatter had not run
        (the root's, say): ``reset_iter_state`` leaves them (torch 2.13), the rerun's backward would add to them,
        and each holds a whole module's memory."""
        if self.sharded is None:
            return
        from torch.distributed.fsdp import FSDPModule

        self.sharded.reset_iter_state()
        for module in self.sharded.modules():
            if isinstance(module, FSDPModule):
                for group in getattr(module._get_fsdp_state(), "_fsdp_param_groups", ()):
                    for param in group.fsdp_params:
                        if getattr(param, "_unsharded_param", None) is not None:
                            param._unsharded_param.grad = None
                        param.unsharded_accumulated_grad = None

    def state_dict(self) -> dict[str, int]:
        return {"pieces": self.pieces}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.pieces = int(state.get("pieces", 1))

    def ran_out(self, where: str, step: int, batch: Any, model: torch.nn.Module) -> bool:
        """Whether any rank ran out of memory (``where``: this rank's "forward" / "backward", "" if it did not) since
        the last call; the same answer on every rank. When one did, the pieces double (said once), or, at one example
        a piece already, the job ends."""
        codes = {"": 0, "forward": 1, "backward": 2}
        if self.world > 1:
            while True:  # until no rank is inside the piece: each round answers another rank's ask()
                notes = torch.zeros(self.world + 1, dtype=torch.int32)
                notes[self.rank] = codes[where]
                dist.all_reduce(notes, op=dist.ReduceOp.MAX, group=self.host_group)
                if not notes[self.world]:
                    break
            failed = {rank: code for rank, code in enumerate(notes[: self.world].tolist()) if code}
        else:
            failed = {0: codes[where]} if where else {}
        if not failed:
            return False
        names = {1: "forward", 2: "backward"}
        ranks = ", ".join(f"rank {rank} in {names[code]}" for rank, code in failed.items())
        size = find_batch_size(batch) or 1
        if self.pieces >= size:
            parameters = f"{sum(p.numel() for p in model.parameters()):,} parameters"  # sharded: all of them
            if self.sharded is not None:
                parameters, shard = f"{parameters}, sharded", "shard it over more processes"
            else:
                shard = "shard the model (accelerate_configs/fsdp.yaml)"
            raise OutOfMemory(
                f"out of memory at step {step} ({ranks}) with micro-batches of one example: the model "
                f"({parameters}) and one example do not fit in {memory_words(self.device)}; {shard}, "
                "recompute activations (activation_checkpointing: true), or shorten the examples"
            )
        before = -(-size // self.pieces)
        self.pieces *= 2
        say(
            f"out of memory at step {step} ({ranks}) with micro-batches of {before} example(s): every rank now cuts "
            f"each micro-batch into {self.pieces} pieces ({-(-size // self.pieces)} example(s) each) and reruns the "
            "step; the global batch and its updates stay the same"
        )
        return True

    def random_state(self) -> tuple:
        """The random state a rerun of the step starts from again (its dropout masks as the first try's)."""
        cuda = torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None
        return torch.get_rng_state(), cuda

    def rerun(self, state: tuple) -> None:
        """Before the step runs again: its random state back, what the failed try held freed."""
        torch.set_rng_state(state[0])
        if state[1] is not None:
            torch.cuda.set_rng_state(state[1], self.device)
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def reduce_gradients(self, parameters: Iterable[torch.nn.Parameter]) -> None:
        """The window's gradients averaged over the processes, as DDP would have (each divided by the process count,
        then summed). A parameter some rank has no gradient for gets zeros where another has one, so that every
        rank reduces the same tensors."""
        if self.world == 1 or self.sharded is not None:  # FSDP2: each piece reduce-scattered its own
            return
        trainable = [p for p in parameters if p.requires_grad]
        held = torch.tensor([p.grad is not None for p in trainable], dtype=torch.int32)
        dist.all_reduce(held, op=dist.ReduceOp.MAX, group=self.host_group)
        works = []
        for parameter, anyone in zip(trainable, held.tolist(), strict=True):
            if not anyone:
                continue
            if parameter.grad is None:
                parameter.grad = torch.zeros_like(parameter)
            parameter.grad.div_(self.world)
            works.append(dist.all_reduce(parameter.grad, group=self.dp_group, async_op=True))
        for work in works:
            work.wait()


class AskFirstAllGather:
    """FSDP2's all-gather, asking first whether a rank ran out (its buffers are allocated by then): the ``Comm``
    of ``set_custom_all_gather``."""

    def __init__(self, split: MicroBatchSplit):
        self.split = split

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, async_op: bool = False
    ) -> Any:
        self.split.ask()
        return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)


class AskFirstReduceScatter(AskFirstAllGather):
    """FSDP2's reduce-scatter of gradients, asking first: the ``Comm`` of ``set_custom_reduce_scatter``."""

    def __call__(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, op: Any, async_op: bool = False
    ) -> Any:
        self.split.ask()
        return dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group, async_op=async_op)


def cut(batch: Any, pieces: int) -> list[tuple[Any, float]]:
    """``batch`` cut along its first dimension into ``pieces`` (at most one example each), with the share of its
    examples each holds: accelerate's ``recursively_apply`` slices every tensor in its mappings, lists and tuples;
    anything else (a flag, a list of names) goes whole with every piece."""
    size = find_batch_size(batch) or 1
    parts = min(pieces, size)
    if parts == 1:
        return [(batch, 1.0)]
    lengths = [len(chunk) for chunk in torch.tensor_split(torch.arange(size), parts)]
    starts = [sum(lengths[:i]) for i in range(parts)]
    return [
        (recursively_apply(_rows, batch, slice(start, start + length)), length / size)
        for start, length in zip(starts, lengths, strict=True)
    ]


def _rows(tensor: torch.Tensor, rows: slice) -> torch.Tensor:
    return tensor[rows] if tensor.dim() else tensor  # a 0-dim tensor goes whole


def memory_words(device: torch.device) -> str:
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        return f"{torch.cuda.get_device_name(device)}'s {total / 2**30:.1f} GiB"
    return f"this {device.type} device's memory"
