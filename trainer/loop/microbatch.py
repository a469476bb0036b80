"""``auto_microbatch``: a micro-batch that does not fit in memory is cut in pieces, on every rank alike, and the step
runs again: the same examples, the same global batch, the same updates, to the float floor (docs/recipes.md).

Ranks learn of an out-of-memory where no collective can be pending: every piece runs without its gradients reduced
(or, where a strategy's collectives run inside forward and backward, each asks first: ``Strategy.ask_before_
collectives``), then the ranks compare notes over the host group. If any rank ran out, every rank drops the step's
gradients, puts its random state back, doubles the pieces and reruns the step, said in one line; the pieces are kept
in checkpoints. A piece of one example that still does not fit ends the job in one line.
"""

from __future__ import annotations

import contextlib
import gc
from typing import TYPE_CHECKING, Any, Iterator

import torch
import torch.distributed as dist
from accelerate.utils import find_batch_size, recursively_apply

from trainer.console import say
from trainer.errors import OutOfMemory

if TYPE_CHECKING:
    from trainer.launch.run import Run
    from trainer.parallel.strategy import Strategy


class RanOutElsewhere(Exception):
    """Another rank ran out of memory in this piece: this one stops at its next collective."""


class MicroBatchSplit:
    """How many pieces each micro-batch is cut into (1, 2, 4, ...), agreed by every rank; a checkpoint part."""

    def __init__(self, run: Run, strategy: Strategy, model: torch.nn.Module):
        self.pieces = 1
        self.strategy, self.model = strategy, model
        self.host, self.world, self.device = run.host, run.dp.size, run.device
        self.rank = dist.get_rank() if self.world > 1 else 0
        # Inside a piece's forward and backward: collectives ask first.
        self.armed = False
        strategy.ask_before_collectives(model, self.ask)

    @contextlib.contextmanager
    def inside_a_piece(self) -> Iterator[None]:
        """A piece's forward and backward: the collectives inside ask first."""
        self.armed = True
        try:
            yield
        finally:
            self.armed = False

    def ask(self) -> None:
        """Before a collective inside a piece: every rank's answer to whether it ran out; raises
        ``RanOutElsewhere`` when one did (that rank is in ``ran_out``, answering until all arrive)."""
        if not self.armed or self.world == 1:
            return
        notes = torch.zeros(self.world + 1, dtype=torch.int32)
        # This rank is still inside the piece.
        notes[self.world] = 1
        dist.all_reduce(notes, op=dist.ReduceOp.MAX, group=self.host)
        if notes[: self.world].any():
            raise RanOutElsewhere()

    def state_dict(self) -> dict[str, int]:
        return {"pieces": self.pieces}

    def load_state_dict(self, state: dict[str, int]) -> None:
        pieces = state.get("pieces", 1)
        # 1, 2, 4, ...: what ran_out() writes; anything else was written by hand.
        if type(pieces) is not int or pieces < 1 or pieces & (pieces - 1):
            raise ValueError(f"pieces is {pieces!r}, where auto_microbatch writes 1, 2, 4, ...")
        self.pieces = pieces

    def ran_out(self, where: str, step: int, batch: Any) -> bool:
        """Whether any rank ran out of memory (``where``: this rank's "forward" / "backward", "" if it did not) since
        the last call; the same answer on every rank. When one did, the pieces double (said once), or, at one example
        a piece already, the job ends."""
        codes = {"": 0, "forward": 1, "backward": 2}
        if self.world > 1:
            # Until no rank is inside the piece: each round answers another rank's ask().
            while True:
                notes = torch.zeros(self.world + 1, dtype=torch.int32)
                notes[self.rank] = codes[where]
                dist.all_reduce(notes, op=dist.ReduceOp.MAX, group=self.host)
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
            raise OutOfMemory(self._too_big(step, ranks))
        before = -(-size // self.pieces)
        self.pieces *= 2
        say(
            f"out of memory at step {step} ({ranks}) with micro-batches of {before} example(s): every rank now cuts "
            f"each micro-batch into {self.pieces} pieces ({-(-size // self.pieces)} example(s) each) and reruns the "
            "step; the global batch and its updates stay the same"
        )
        return True

    def _too_big(self, step: int, ranks: str) -> str:
        # A sharded model's parameters() are all of them.
        parameters = f"{sum(p.numel() for p in self.model.parameters()):,} parameters"
        if self.strategy.pieces_reduce:
            parameters, shard = f"{parameters}, sharded", "shard it over more processes"
        else:
            shard = "shard the model (accelerate_configs/fsdp.yaml)"
        return (
            f"out of memory at step {step} ({ranks}) with micro-batches of one example: the model "
            f"({parameters}) and one example do not fit in {memory_words(self.device)}; {shard}, "
            "recompute activations (activation_checkpointing: true), or shorten the examples"
        )

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
    # A 0-dim tensor goes whole.
    return tensor[rows] if tensor.dim() else tensor


def memory_words(device: torch.device) -> str:
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        return f"{torch.cuda.get_device_name(device)}'s {total / 2**30:.1f} GiB"
    return f"this {device.type} device's memory"
