"""Per-process data loaders with DistributedSampler semantics (docs/same-updates.md): process k of K gets examples
k, k+K, k+2K, ... of the epoch's order (the same permutation on every rank, from ``seed + epoch``), the tail padded
with the first examples (``drop_last``: only the M mod K trailing ones dropped).

Why not ``Accelerator.prepare``'s sharding: it splits whole batches between processes, and shards a loader that has a
DistributedSampler a second time (examples are lost). So each rank's loader is built here with its own sampler, made
a one-process accelerate loader (device placement), then handed to ``Accelerator.prepare``. A stream is split per
process (``trainer.data.streams``); a user's DataLoader is used as is, its data already this process's part.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch
from accelerate import skip_first_batches
from accelerate.data_loader import get_sampler, prepare_data_loader
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset

from trainer.console import say
from trainer.data.columns import ready_columns
from trainer.data.mixing import Mixture, MixtureSampler, mixture_of
from trainer.data.samplers import ResumableSampler, ShardSampler
from trainer.data.streams import StreamShard
from trainer.errors import ConfigError, DataError

if TYPE_CHECKING:
    from trainer.launch.run import Run


class Loaders:
    """This process's loaders of the Trainer's data: ``train`` (None: a Trainer for ``evaluate`` and ``predict``
    alone), each eval set's (``eval``, by name; '' for one unnamed set), and ``of(data)`` for data given later."""

    def __init__(
        self,
        run: Run,
        *,
        model: torch.nn.Module,
        train_data: Any,
        eval_data: Any,
        collate_fn: Optional[Callable] = None,
    ):
        self.run, self.model, self.collate_fn = run, model, collate_fn
        prepare = run.accelerator.prepare
        self.train = None if train_data is None else prepare(self.of(train_data, name="train_data", evaluation=False))
        self.eval = {
            name: prepare(self.of(part, name=f"eval_data[{name!r}]" if name else "eval_data"))
            for name, part in named_sets(eval_data).items()
        }
        stream = getattr(self.train, "dataset", None)
        # The training data as a stream, whose position checkpoints hold (trainer.data.streams).
        self.stream = stream if isinstance(stream, StreamShard) else None
        # The training sets' sizes, which an epoch's order depends on (a checkpoint records them), or None.
        self.sizes = train_sizes(self.train)

    def require_train(self) -> None:
        if self.train is None:
            raise ConfigError("fit(): this Trainer was built with train_data=None, for evaluate() and predict() alone")

    def of(self, data: Any, *, name: str, evaluation: bool = True) -> DataLoader:
        """This process's loader of ``data`` (``name``: how the user passed it), for training or ``evaluation``; an
        unformatted datasets.Dataset's model inputs first readied as tensors (``trainer.data.columns``), said once."""
        if isinstance(data, Mapping) and not evaluation:
            ready = {part: self.ready(data[part], name=f"{name}[{part!r}]") for part in data}
            data = mixture_of(ready, self.run.config.data_weights, seed=self.run.config.seed, given=type(data))
        elif self.run.config.data_weights and not evaluation:
            raise ConfigError(
                f"data_weights weighs named training sets, but train_data is a {type(data).__name__}: pass "
                "train_data={name: data set, ...} to mix them, or leave data_weights out"
            )
        data = self.ready(data, name=name)
        build = build_eval_loader if evaluation else build_train_loader
        return build(data, self.run, collate_fn=self.collate_fn)

    def ready(self, data: Any, *, name: str) -> Any:
        data, change = ready_columns(data, self.model, collate=self.collate_fn is not None, name=name)
        if change:
            say(f"trainer | {change}")
        return data


def train_sizes(loader: Optional[DataLoader]) -> Optional[dict[str, int]]:
    """The examples of each training set the trainer's sampler deals (``{"train_data": n}`` for one set, each
    set's by name for a mixture); None for a stream or a user's DataLoader, whose order is theirs."""
    sampler = getattr(getattr(loader, "batch_sampler", None), "sampler", None)
    if isinstance(sampler, MixtureSampler):
        return {name: len(part) for name, part in zip(sampler.dataset.names, sampler.dataset.datasets, strict=True)}
    return {"train_data": len(sampler.dataset)} if isinstance(sampler, ResumableSampler) else None


def build_train_loader(data: Dataset | DataLoader, run: Run, *, collate_fn: Optional[Callable]) -> DataLoader:
    """This process's training loader, ready for ``Accelerator.prepare``; its share decided by ``run.dp``, its
    data-parallel coordinates."""
    config, dp = run.config, run.dp
    if isinstance(data, DataLoader):
        loader = _accept_user_loader(data, dp, "train_data")
        # Its stream's position noted for checkpoints.
        if isinstance(loader.dataset, IterableDataset):
            size, ahead = loader.batch_size or 1, read_ahead(config)
            stream = StreamShard(loader.dataset, dp.rank, dp.size, batch_size=size, read_ahead=ahead, split=False)
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
        stream = StreamShard(data, dp.rank, dp.size, batch_size=config.batch_size, read_ahead=read_ahead(config))
        loader = _loader(stream, None, run, collate_fn=collate_fn)
    else:
        _check_size(data, dp, "train_data")
        # A mixture of sets deals its own order (trainer.data.mixing), its phases in steps of the global batch.
        mixed = {"examples_per_step": config.batch_size * dp.size * config.gradient_accumulation_steps}
        sampler = (MixtureSampler if isinstance(data, Mixture) else ResumableSampler)(
            data,
            num_replicas=dp.size,
            rank=dp.rank,
            shuffle=config.shuffle,
            seed=config.seed,
            drop_last=config.drop_last,
            **(mixed if isinstance(data, Mixture) else {}),
        )
        loader = _loader(data, sampler, run, collate_fn=collate_fn)
    # None for a stream: its length is unknown.
    if batches_per_epoch(loader) == 0:
        raise DataError(
            f"train_data gives process {dp.rank} no batch per epoch "
            f"({len(loader.dataset)} examples, {dp.size} processes, drop_last={config.drop_last})"
        )
    if batches_per_epoch(loader) is None and config.max_steps is None:
        raise DataError("train_data has no length (an IterableDataset?): set max_steps to say when to stop")
    return _wrap(loader, run.accelerator)


def build_eval_loader(data: Dataset | DataLoader, run: Run, *, collate_fn: Optional[Callable]) -> DataLoader:
    """This process's evaluation loader: its share of the examples, each example on exactly one process."""
    dp = run.dp
    if isinstance(data, DataLoader):
        loader = _accept_user_loader(data, dp, "eval_data")
    elif isinstance(data, IterableDataset):
        # Each process its own part of the stream, read to its end.
        loader = _loader(
            StreamShard(data, dp.rank, dp.size, batch_size=run.config.batch_size), None, run, collate_fn=collate_fn
        )
    else:
        # Refused now, not after all of training when evaluate() would divide by zero.
        if len(data) == 0:
            raise DataError("eval_data has no examples: pass a data set with at least one, or none", job_wide=True)
        loader = _loader(data, ShardSampler(len(data), dp.size, dp.rank), run, collate_fn=collate_fn)
    return _wrap(loader, run.accelerator)


def read_ahead(config: Any) -> int:
    """Batches a process reads before training them: accelerate's loader reads one ahead, and the trainer the next
    accumulation window (``trainer.loop.weighing``)."""
    return 2 * config.gradient_accumulation_steps + 1


def start_epoch(loader: DataLoader, epoch: int, *, skip_batches: int, seed: int) -> DataLoader:
    """Ready ``loader`` for ``epoch`` (a new shuffle, the same on every rank), starting after its first
    ``skip_batches`` batches (a resumed run). The trainer's own loaders reseed their generator from ``seed + epoch``
    and skip by slicing indices; a user's DataLoader skips through accelerate's ``skip_first_batches``, which walks
    the batch sampler's indices without loading data; a stream continues from where it was given."""
    loader.set_epoch(epoch)
    if isinstance(loader.dataset, StreamShard):
        return loader
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


def _loader(data: Any, sampler: Any, run: Run, *, collate_fn: Optional[Callable]) -> DataLoader:
    config = run.config
    return DataLoader(
        data,
        batch_size=config.batch_size,
        sampler=sampler,
        collate_fn=collate_fn,
        num_workers=config.num_workers,
        pin_memory=run.device.type == "cuda",
        persistent_workers=config.num_workers > 0,
        # Its own generator, so starting an epoch's iterator (which draws worker seeds) leaves the global torch
        # RNG, and with it every later dropout mask, untouched.
        generator=torch.Generator().manual_seed(config.seed),
    )


def _wrap(loader: DataLoader, accelerator: Any) -> DataLoader:
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
        # Its IterableDataset yields this process its own part (say datasets' split_dataset_by_node)
        return loader
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


def named_sets(data: Any) -> dict[str, Any]:
    """``eval_data`` as ``{name: data set}``: a dict of named data sets (a datasets.DatasetDict too) as it is, one
    data set as ``{"": it}``, none as ``{}``. A dict whose values are not data sets is refused, naming them."""
    if data is None:
        return {}
    if not isinstance(data, Mapping):
        return {"": data}
    odd = {
        name: type(part).__name__
        for name, part in data.items()
        if not isinstance(name, str) or not name.isidentifier() or not _is_data_set(part)
    }
    if odd or not data:
        got = ", ".join(f"{name!r}: {kind}" for name, kind in odd.items()) or "an empty dict"
        raise DataError(
            f"eval_data is a dict, so each entry must be a named data set (a Dataset, a DataLoader or an "
            f"IterableDataset, under a name usable in eval_<name>_loss); got {got}"
        )
    return dict(data)


def _is_data_set(part: Any) -> bool:
    # A column of a batch is no data set.
    return isinstance(part, (DataLoader, torch.utils.data.IterableDataset)) or (
        hasattr(part, "__len__")
        and hasattr(part, "__getitem__")
        and not isinstance(part, (str, bytes, Mapping, torch.Tensor))
    )
