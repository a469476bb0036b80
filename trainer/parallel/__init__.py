"""Parallelism: one strategy per kind, behind one interface (``Strategy``), as Lightning Fabric's strategies are:
DDP through ``Accelerator.prepare``, and FSDP2 (with HSDP and tensor parallelism x FSDP through the launch's mesh).
Where a model's weights come from, which modules are its blocks, and the gradients' maths over shards live here too;
no module outside this package knows FSDP2 exists (docs/parallelism.md).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainer.parallel.strategy import Strategy

if TYPE_CHECKING:
    from trainer.launch.run import Run


def for_run(run: Run) -> Strategy:
    """The strategy the launch's accelerate config asks for."""
    if run.layout.sharded:
        from trainer.parallel.fsdp import FSDP2

        return FSDP2(run)
    from trainer.parallel.ddp import DDP

    return DDP(run)
