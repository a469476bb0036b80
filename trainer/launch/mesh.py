"""The device mesh of a launch, as accelerate's ``parallelism_config`` asks (replicas, shards of one replica,
context-parallel groups, tensor-parallel groups); processes are laid out row-major, tensor-parallel groups innermost,
then context-parallel groups, then shards, then replicas, so a shard group of one node's size stays on one node
(docs/internals.md#the-device-mesh).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any, Optional

from trainer.errors import ShardingError

# Accelerate's (and torchtitan's) names for the dimensions.
REPLICATE, SHARD, CP, TP = "dp_replicate", "dp_shard", "cp", "tp"
# What FSDP shards over under context parallelism: the shards and the context-parallel groups, flattened.
SHARD_CP = "dp_shard_cp"


@dataclass(frozen=True)
class Layout:
    """The sizes of the mesh's dimensions; ``sharded``: the launch's config asks for FSDP; ``cp``: processes that
    split each row's sequence (context parallelism, trainer.parallel.context)."""

    replicate: int = 1
    shard: int = 1
    tp: int = 1
    sharded: bool = False
    cp: int = 1
    # Processes each MoE layer's experts are split over (expert parallelism; trainer.parallel.experts): the shards
    # are (shard / ep) x ep for the experts, each expert sharded over shard / ep of them.
    ep: int = 1

    @property
    def data_parallel(self) -> int:
        """Processes that read different data: the replicas times the shards of each."""
        return self.replicate * self.shard

    @property
    def hybrid(self) -> bool:
        return self.sharded and self.replicate > 1

    def describe(self) -> str:
        """The banner's name for it: 'FSDP2 over 4 processes', 'HSDP 2 x 2 (replicate x shard)', 'TP 2 x FSDP 2',
        'CP 2 x FSDP2 over 4 processes' (FSDP shards over the shards and the context-parallel groups)."""
        if self.ep > 1:
            data = f"HSDP {self.replicate} x {self.shard}" if self.hybrid else f"FSDP2 over {self.shard} processes"
            return f"EP {self.ep} x {data} (each expert over {self.shard // self.ep})"
        if self.cp > 1:
            hybrid = f"HSDP {self.replicate} x {self.shard * self.cp} (replicate x shard)"
            return f"CP {self.cp} x " + (hybrid if self.hybrid else f"FSDP2 over {self.shard * self.cp} processes")
        if self.hybrid:
            data = f"HSDP {self.replicate} x {self.shard} (replicate x shard)"
        elif self.sharded and self.tp == 1:
            data = f"FSDP2 over {self.shard} processes"
        elif self.sharded:
            data = f"FSDP {self.shard}" if self.shard > 1 else ""
        else:
            data = f"DDP over {self.replicate} processes"
        return data if self.tp == 1 else f"TP {self.tp}" + (f" x {data}" if data else "")

    @property
    def kind(self) -> str:
        """A word or two for the launch line: FSDP2, HSDP, TP, TP x FSDP2, TP x HSDP."""
        data = "HSDP" if self.hybrid else "FSDP2" if self.shard > 1 or self.tp == 1 else ""
        if self.ep > 1:
            return f"EP x {data}"
        if self.cp > 1:
            return f"CP x {data}"
        return data if self.tp == 1 else "TP" + (f" x {data}" if data else "")

    def build(self, device_type: str) -> Any:
        """The device mesh, its dimensions named REPLICATE, SHARD, CP, TP (those of size 1 left out)."""
        from torch.distributed.device_mesh import init_device_mesh

        sizes = ((REPLICATE, self.replicate), (SHARD, self.shard), (CP, self.cp), (TP, self.tp))
        dims = [(name, size) for name, size in sizes if size > 1] or [(SHARD, 1)]
        names, sizes = zip(*dims, strict=True)
        return init_device_mesh(device_type, tuple(sizes), mesh_dim_names=tuple(names))


def requested_layout(world: int, sharded: bool, sizes: Optional[dict[str, int]] = None) -> Layout:
    """The layout the launch asks for (see the module docstring), checked against its ``world`` processes;
    ``sizes`` (``dp_replicate_size=2, ...``: a config file's section, read by the preflight) instead of the launch's."""
    default = Layout(shard=world, sharded=True) if sharded else Layout(replicate=world)
    if sizes is None and not _named_at_launch() or sizes == {}:
        return default
    from accelerate.parallelism_config import ParallelismConfig

    try:
        # Unset sizes: the PARALLELISM_CONFIG_* variables of the launch.
        asked = ParallelismConfig(**(sizes or {}))
    except (TypeError, ValueError) as err:
        raise ShardingError(f"parallelism_config: {err}") from None
    if asked.sp_size > 1:
        raise ShardingError(
            f"parallelism_config: sp_size {asked.sp_size} asks for DeepSpeed's sequence parallelism, which this "
            "trainer does not do: set cp_size instead (context parallelism over FSDP2), and sp_size to 1"
        )
    layout = Layout(asked.dp_replicate_size, asked.dp_shard_size, asked.tp_size, sharded, cp=asked.cp_size)
    product = layout.data_parallel * layout.tp * layout.cp
    # Every size left at 1: the launch's own mesh.
    if product == 1:
        return default
    if product != world:
        raise ShardingError(
            f"parallelism_config: dp_replicate_size {layout.replicate} x dp_shard_size {layout.shard} "
            f"x {f'cp_size {layout.cp} x ' if layout.cp > 1 else ''}tp_size {layout.tp} = {product} processes, but the "
            f"launch has {world}: make the "
            "product the number of processes"
        )
    if not sharded and (layout.shard > 1 or layout.tp > 1 or layout.cp > 1):
        asks = f"dp_shard_size {layout.shard} shards" if layout.shard > 1 else f"tp_size {layout.tp} splits"
        asks = f"cp_size {layout.cp} shards" if layout.cp > 1 else asks
        raise ShardingError(
            f"parallelism_config: {asks} the model, which needs an FSDP config (distributed_type: "
            "FSDP, fsdp_version: 2; accelerate_configs/hsdp.yaml): launch with one, or set only "
            "dp_replicate_size for DDP"
        )
    if layout.cp > 1 and layout.tp > 1:
        raise ShardingError(
            f"parallelism_config: cp_size {layout.cp} with tp_size {layout.tp} is not supported yet: split the "
            "sequence (cp_size) or the layers (tp_size)"
        )
    if sharded and layout.shard == 1 and layout.tp == 1 and layout.cp == 1:
        raise ShardingError(
            f"parallelism_config: dp_shard_size 1 leaves FSDP nothing to shard over "
            f"(dp_replicate_size {layout.replicate} alone is DDP): set dp_shard_size, or launch with "
            "a DDP config"
        )
    return layout


def with_experts(layout: Layout, ep: int) -> Layout:
    """``layout`` with TrainConfig's ``ep_size`` (accelerate's parallelism_config has no key for it yet), checked."""
    if ep == 1:
        return layout
    if not layout.sharded:
        raise ShardingError(
            f"ep_size {ep} splits the experts over processes under FSDP2, which needs an FSDP config "
            "(distributed_type: FSDP, fsdp_version: 2; accelerate_configs/fsdp.yaml): launch with one, or set ep_size 1"
        )
    others = [f"{name} {size}" for name, size in (("tp_size", layout.tp), ("cp_size", layout.cp)) if size > 1]
    if others:
        raise ShardingError(
            f"ep_size {ep} with {', '.join(others)} is not supported yet: expert parallelism runs over FSDP2's "
            "or HSDP's shards (drop the parallelism_config's other sizes)"
        )
    if layout.shard % ep:
        fits = ", ".join(str(d) for d in range(2, layout.shard + 1) if layout.shard % d == 0) or "none"
        raise ShardingError(
            f"ep_size {ep} does not divide the {layout.shard} processes FSDP2 shards over: each expert group is a "
            f"whole number of processes (ep_size one of: {fits})"
        )
    return dataclasses.replace(layout, ep=ep)


def _named_at_launch() -> bool:
    """Whether the launch names a parallelism_config: accelerate's switch, or any size set by hand (torchrun)."""
    if os.environ.get("ACCELERATE_USE_PARALLELISM_CONFIG", "false").lower() == "true":
        return True
    return any(name.startswith("PARALLELISM_CONFIG_") and name.endswith("_SIZE") for name in os.environ)


def data_mesh(layout: Layout, mesh: Any) -> Any:
    """The part of ``mesh`` FSDP shards over: (replicate, shard) for HSDP, shard for FSDP (the shards and the
    context-parallel groups flattened, under context parallelism); None when tensor parallelism takes every process
    (nothing for FSDP to shard over)."""
    if layout.cp > 1:
        sharded = mesh[(SHARD, CP)]._flatten(SHARD_CP) if layout.shard > 1 else mesh[CP]
        if not layout.hybrid:
            return sharded
        return mesh[(REPLICATE, SHARD_CP if layout.shard > 1 else CP)]
    if layout.hybrid:
        return mesh[(REPLICATE, SHARD)]
    if layout.tp > 1 and layout.shard == 1:
        return None
    return mesh[SHARD]


def data_parallel_group(layout: Layout, mesh: Any) -> Any:
    """The process group of the processes that read different data: None when that is every process (no tensor or
    context parallelism) or only this one."""
    if layout.tp == 1 and layout.cp == 1 or layout.data_parallel == 1:
        return None
    if layout.replicate > 1 and layout.shard > 1:
        return mesh[(REPLICATE, SHARD)]._flatten("dp").get_group()
    return mesh[REPLICATE if layout.replicate > 1 else SHARD].get_group()


def mesh_lines(layout: Layout, per_machine: int, processes: int) -> list[str]:
    """What each process holds, and which replicas and groups each machine runs (the first few machines)."""
    if layout.data_parallel * layout.tp == processes and not layout.hybrid and layout.tp == 1:
        return [
            f"  model: sharded over the processes (FSDP2): each holds 1/{processes} of the weights, gradients "
            "and optimizer state"
        ]
    # Consecutive processes: one replica, sharded (and split) among them.
    replica = layout.shard * layout.cp * layout.tp
    lines = [
        f"  model: {layout.describe()}: each process holds 1/{replica} of the weights, gradients and optimizer state"
    ]
    for machine in range(min(processes // max(per_machine, 1), 4)):
        first, last = machine * per_machine, (machine + 1) * per_machine - 1
        replicas = sorted({rank // replica for rank in range(first, last + 1)})
        groups = f", tensor-parallel groups of {layout.tp}" if layout.tp > 1 else ""
        groups += f", context-parallel groups of {layout.cp}" if layout.cp > 1 else ""
        lines.append(f"  machine {machine}: ranks {first}-{last}: replica(s) {', '.join(map(str, replicas))}{groups}")
    if replica > per_machine:
        lines.append(
            f"  note: one replica's {replica} processes span {-(-replica // per_machine)} machines: its "
            "all-gathers and reduce-scatters cross the link between them (HSDP keeps a replica on one "
            "machine: dp_shard_size x cp_size x tp_size = processes per machine)"
        )
    return lines
