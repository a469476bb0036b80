"""Per-process data loaders with DistributedSampler semantics (its sharding tables).

Process k of K gets examples k, k+K, k+2K, ... of the (shuffled) epoch order; the tail is padded with the first
examples, or with ``drop_last`` only the M mod K trailing examples are dropped. Every rank draws the same
permutation from ``seed + epoch``, so one process at batch K*B sees the same global batches as K processes at B.

Why not let ``Accelerator.prepare`` shard: it splits whole batches between processes instead of examples, and a
loader that already has a DistributedSampler gets sharded a second time and loses examples. So each rank's loader
is built here with its own sampler, wrapped by accelerate's ``prepare_data_loader`` as a one-process loader (device
placement), and only then handed to ``Accelerator.prepare``.

An IterableDataset (a stream) is split per process instead (``trainer.data.streams``); a user's DataLoader is used as
is, its data already this process's part.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional

import torch
from accelerate import Accelerator, skip_first_batches
from accelerate.data_loader import get_sampler, prepare_data_loader
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset, Sampler

from trainer.config import TrainConfig
from trainer.data.columns import ready_columns
from trainer.data.streams import StreamShard
from trainer.errors import DataError
from trainer.telemetry.console import say


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


def data_loader(
    data: Any,
    model: torch.nn.Module,
    name: str,
    config: TrainConfig,
    accelerator: Accelerator,
    dp: Any,
    collate_fn: Optional[Callable],
    evaluation: bool = False,
) -> DataLoader:
    """This process's loader of ``data`` (``name``: how the user passed it), for training or ``evaluation``; an
    unformatted datasets.Dataset's model inputs first readied as tensors (``trainer.data.columns``), said once."""
    data, change = ready_columns(data, model, collate_fn is not None, name)
    if change:
        say(f"trainer | {change}")
    build = build_eval_loader if evaluation else build_train_loader
    return build(data, config, accelerator, dp, collate_fn)


def build_train_loader(
    data: Dataset | DataLoader, config: TrainConfig, accelerator: Accelerator, dp: Any, collate_fn: Optional[Callable]
) -> DataLoader:
    """This process's training loader, ready for ``Accelerator.prepare``; ``dp``: its data-parallel coordinates
    (``trainer.parallel.strategy.DataParallel``), which decide its share."""
    if isinstance(data, DataLoader):
        loader = _accept_user_loader(data, dp, "train_data")
        if isinstance(loader.dataset, IterableDataset):  # its stream's position noted for checkpoints
            stream = StreamShard(
                loader.dataset, dp.rank, dp.size, loader.batch_size or 1, read_ahead(config), split=False
            )
            loader = DataLoader(
                stream,
                batch_size=loader.batch_size,
                collate_fn=loader.collate_fn,
                num_workers=loader.num_workers,
                pin_memory=loader.pin_memory,
                drop_last=loader.drop_last,
                worker_init_fn=loader.worker_init_fn,
                persistent_workers=loader.persistent_workers,
                generator=loader.generator,
                prefetch_factor=loader.prefetch_factor,
                timeout=loader.timeout,
            )
    elif isinstance(data, IterableDataset):
        stream = StreamShard(data, dp.rank, dp.size, config.batch_size, read_ahead(config))
        loader = _loader(stream, None, config, accelerator, collate_fn)
    else:
        _check_size(data, dp, "train_data")
        sampler = ResumableSampler(
            data,
            num_replicas=dp.size,
            rank=dp.rank,
            shuffle=config.shuffle,
            seed=config.seed,
            drop_last=config.drop_last,
        )
        loader = _loader(data, sampler, config, accelerator, collate_fn)
    if batches_per_epoch(loader) == 0:  # None for a stream: its length is unknown
        raise DataError(
            f"train_data gives process {dp.rank} no batch per epoch "
            f"({len(loader.dataset)} examples, {dp.size} processes, drop_last={config.drop_last})"
        )
    if batches_per_epoch(loader) is None and config.max_steps is None:
        raise DataError("train_data has no length (an IterableDataset?): set max_steps to say when to stop")
    return _wrap(loader, accelerator)


def read_ahead(config: TrainConfig) -> int:
    """Batches a process reads before training them: accelerate's loader reads one ahead, and the trainer the next
    accumulation window (trainer.weighing)."""
    return 2 * config.gradient_accumulation_steps + 1


def start_epoch(loader: DataLoader, epoch: int, skip_batches: int, seed: int) -> DataLoader:
    """Ready ``loader`` for ``epoch``, starting after its first ``skip_batches`` batches (a resumed run).

    The trainer's own loaders reseed their generator from ``seed + epoch`` (worker seeds then do not depend on
    how many epochs this process has run) and skip by slicing indices; a user's DataLoader skips through
    accelerate's ``skip_first_batches``, which walks the batch sampler's indices without loading data.
    """
    loader.set_epoch(epoch)  # a new shuffle, the same on every rank
    if isinstance(loader.dataset, StreamShard):
        return loader  # a stream continues from the position it was given (StreamShard.resume_at)
    sampler = get_sampler(loader)
    if not isinstance(sampler, ResumableSampler):
        return skip_first_batches(loader, skip_batches) if skip_batches else loader
    loader.generator.manual_seed(seed + epoch)
    sampler.skip_next(skip_batches * loader.batch_sampler.batch_size)
    return loader


def batches_per_epoch(loader: DataLoader) -> Optional[int]:
    """Batches this process reads per epoch, or None when the data has no length (an IterableDataset)."""
    try:
        return len(loader)
    except TypeError:
        return None


def examples_per_process(loader: DataLoader) -> Optional[int]:
    """The examples this process reads per epoch (its sampler's share), or None when unknown (a stream)."""
    try:
        return len(get_sampler(loader))
    except TypeError:
        return None


def build_eval_loader(
    data: Dataset | DataLoader, config: TrainConfig, accelerator: Accelerator, dp: Any, collate_fn: Optional[Callable]
) -> DataLoader:
    """This process's evaluation loader: its share of the examples, each example on exactly one process."""
    if isinstance(data, DataLoader):
        loader = _accept_user_loader(data, dp, "eval_data")
    elif isinstance(data, IterableDataset):  # each process its own part of the stream, read to its end
        stream = StreamShard(data, dp.rank, dp.size, config.batch_size)
        loader = _loader(stream, None, config, accelerator, collate_fn)
    else:
        if len(data) == 0:  # refused now, not after all of training when evaluate() would divide by zero
            raise DataError("eval_data has no examples: pass a data set with at least one, or none", job_wide=True)
        sampler = ShardSampler(len(data), dp.size, dp.rank)
        loader = _loader(data, sampler, config, accelerator, collate_fn)
    return _wrap(loader, accelerator)


def _loader(data, sampler, config: TrainConfig, accelerator: Accelerator, collate_fn) -> DataLoader:
    return DataLoader(
        data,
        batch_size=config.batch_size,
        sampler=sampler,
        collate_fn=collate_fn,
        num_workers=config.num_workers,
        pin_memory=accelerator.device.type == "cuda",
        persistent_workers=config.num_workers > 0,
        # Its own generator, so starting an epoch's iterator (which draws worker seeds) leaves the global torch
        # RNG, and with it every later dropout mask, untouched.
        generator=torch.Generator().manual_seed(config.seed),
    )


def _wrap(loader: DataLoader, accelerator: Accelerator) -> DataLoader:
    """Wrap as a one-process accelerate loader and mark it prepared, so ``Accelerator.prepare`` registers it
    without sharding it again (accelerate skips objects it marked ``_is_accelerate_prepared`` itself). Never a
    dispatcher, which accelerate picks for an IterableDataset: process 0 would read for all, from its own part."""
    wrapped = prepare_data_loader(
        loader,
        device=accelerator.device,
        num_processes=1,
        process_index=0,
        put_on_device=accelerator.device_placement,
        non_blocking=accelerator.dataloader_config.non_blocking,
        dispatch_batches=False,
    )
    wrapped._is_accelerate_prepared = True
    return wrapped


def _accept_user_loader(loader: DataLoader, dp: Any, name: str) -> DataLoader:
    """A user's DataLoader is used as is, never sharded a second time; refused if it would feed every process
    the same data."""
    world, rank = dp.size, dp.rank
    if world == 1 or isinstance(loader.dataset, IterableDataset):
        return loader  # its IterableDataset yields this process its own part (say datasets' split_dataset_by_node)
    sampler = get_sampler(loader)
    if isinstance(sampler, DistributedSampler):
        if (sampler.num_replicas, sampler.rank) != (world, rank):
            raise DataError(
                f"{name}: its DistributedSampler has num_replicas={sampler.num_replicas}, rank={sampler.rank}, "
                f"but this is process {rank} of {world}"
            )
        return loader
    raise DataError(
        f"{name} is a DataLoader with a {type(sampler).__name__}, which would give all {world} processes the same "
        f"examples. Pass the Dataset itself as {name} (the Trainer shards it like DistributedSampler), or give "
        f"the DataLoader sampler=DistributedSampler(dataset, num_replicas={world}, rank=<process index>)."
    )


def _check_size(data: Dataset, dp: Any, name: str) -> None:
    try:
        size = len(data)
    except TypeError:
        raise DataError(
            f"{name} has no len(): pass a map-style Dataset, an IterableDataset or a DataLoader", job_wide=True
        ) from None
    if size < dp.size:
        raise DataError(
            f"{name} has {size} examples, fewer than the {dp.size} processes: every process needs at least one example",
            job_wide=True,
        )
