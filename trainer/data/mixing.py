"""Training sets mixed by weight: ``train_data={"web": web, "code": code}`` with ``data_weights: {web: 0.7,
code: 0.3}`` (docs/project.md#several-training-sets).

An epoch of a mixture is as many examples as its sets hold together. Each position of it goes to the set furthest
behind its share (stride scheduling, as Megatron blends data sets: no draw, the shares hold to one example at every
step), and each set gives its examples in an order drawn from ``seed``, the epoch and the set, a new one each time
it runs out: a small set repeats, a large one is sampled. The order is the same on every process and at any process
count; the sampler deals it out as DistributedSampler deals an unshuffled epoch, so a resume slices it as any
epoch. Streams (datasets' IterableDatasets) are interleaved by datasets' ``interleave_datasets`` with the weights as
probabilities and ``seed``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Optional

import torch
from torch.utils.data import ConcatDataset, IterableDataset

from trainer.data.samplers import ResumableSampler
from trainer.errors import ConfigError, DataError
from trainer.hf import is_stream


class Mixture(ConcatDataset):
    """The sets of ``sets`` (map-style, by name) one after another, drawn from in the order ``order(seed, epoch)``
    gives; ``weights`` by name (None: each set's share of the examples, the sets simply joined)."""

    def __init__(self, sets: Mapping[str, Any], weights: Optional[Mapping[str, float]]):
        super().__init__(list(sets.values()))
        self.names = list(sets)
        sizes = [len(part) for part in sets.values()]
        shares = [float(weights[name]) for name in self.names] if weights else sizes
        self.weights = [share / sum(shares) for share in shares]
        # Which set each position of an epoch draws from: the same every epoch.
        self.sources = stride_order(self.weights, len(self))

    def order(self, seed: int, epoch: int) -> list[int]:
        """Epoch ``epoch``'s examples, as indices into the sets joined end to end."""
        order = torch.empty(len(self.sources), dtype=torch.int64)
        for number, size in enumerate(len(part) for part in self.datasets):
            where = (self.sources == number).nonzero().flatten()
            generator = torch.Generator().manual_seed((seed * 1_000_003 + epoch * 8_191 + number) & (2**63 - 1))
            passes = [torch.randperm(size, generator=generator) for _ in range(math.ceil(len(where) / size))]
            offset = self.cumulative_sizes[number] - size
            order[where] = torch.cat(passes or [torch.empty(0, dtype=torch.int64)])[: len(where)] + offset
        return order.tolist()

    def counts(self, start: int, stop: int, *, per_epoch: int) -> dict[str, int]:
        """How many of the run's positions ``start`` to ``stop`` each set gave, its epochs ``per_epoch`` positions
        each end to end (a padded epoch's last positions repeat its first)."""
        found = torch.zeros(len(self.names), dtype=torch.int64)
        for begin in range(start - start % per_epoch, stop, per_epoch):
            into = torch.arange(max(start - begin, 0), min(stop - begin, per_epoch)) % len(self.sources)
            found += torch.bincount(self.sources[into], minlength=len(self.names))
        return dict(zip(self.names, found.tolist(), strict=True))


def stride_order(weights: list[float], length: int) -> torch.Tensor:
    """Which set each of ``length`` positions draws from: set ``i``'s k-th example at time (k + 0.5) / weight,
    all sets' times merged (ties to the first set), so every prefix holds each set's share to within one."""
    times, sets = [], []
    for number, weight in enumerate(weights):
        if weight > 0:
            count = math.ceil(weight * length) + 1
            times.append((torch.arange(count, dtype=torch.float64) + 0.5) / weight)
            sets.append(torch.full((count,), number, dtype=torch.int64))
    merged = torch.cat(times).argsort(stable=True)[:length]
    return torch.cat(sets)[merged]


class MixtureSampler(ResumableSampler):
    """DistributedSampler's dealing of a Mixture's own order for the epoch: process k of K gets positions k, k+K,
    ..., the tail padded with the first positions (``drop_last``: the trailing M mod K dropped)."""

    def __iter__(self):
        order = self.dataset.order(self.seed, self.epoch)
        if self.drop_last:
            order = order[: self.total_size]
        else:
            order = (order * math.ceil(self.total_size / len(order)))[: self.total_size]
        mine = order[self.rank : self.total_size : self.num_replicas][self._skip :]
        self._skip = 0
        return iter(mine)


def mixture_of(sets: Mapping[str, Any], weights: Mapping[str, float], *, seed: int) -> Any:
    """``train_data`` given as a dict of named sets: a Mixture of map-style sets, or datasets' interleaving of
    streams; the names and ``data_weights`` checked first."""
    odd = [repr(name) for name in sets if not isinstance(name, str) or not name.isidentifier()]
    if odd or not sets:
        raise DataError(
            f"train_data is a dict, so it names training sets to mix, each under a name usable in a log "
            f"(data/<name>); got {', '.join(odd) or 'an empty dict'}"
        )
    if weights and set(weights) != set(sets):
        raise ConfigError(
            f"data_weights names {', '.join(sorted(weights))}, but train_data's sets are {', '.join(sorted(sets))}: "
            "give a weight for each set, and for no other"
        )
    if any(not isinstance(w, (int, float)) or isinstance(w, bool) or w < 0 for w in weights.values()) or (
        weights and not sum(weights.values()) > 0
    ):
        raise ConfigError(f"data_weights are {dict(weights)}: each a number, 0 or more, and not all 0")
    streams = [is_stream(part) for part in sets.values()]
    if all(streams):
        from datasets import interleave_datasets

        shares = [weights[name] / sum(weights.values()) for name in sets] if weights else None
        parts = list(sets.values())
        mixed = interleave_datasets(parts, probabilities=shares, seed=seed, stopping_strategy="all_exhausted")
        # interleave_datasets drops the sets' format (with_format("torch")); a format they share is kept.
        kinds = {getattr(getattr(part, "_formatting", None), "format_type", None) for part in parts}
        return mixed.with_format(kinds.pop()) if len(kinds) == 1 and None not in kinds else mixed
    if any(streams) or any(isinstance(part, IterableDataset) for part in sets.values()):
        raise DataError(
            "train_data mixes streams only when every set is a datasets IterableDataset (interleave_datasets), and "
            "map-style sets only with map-style sets; got "
            + ", ".join(f"{name!r}: {type(part).__name__}" for name, part in sets.items())
        )
    empty = [repr(name) for name, part in sets.items() if len(part) == 0]
    if empty:
        raise DataError(f"train_data's set {', '.join(empty)} has no examples: give it some, or leave it out")
    return Mixture(sets, weights or None)


class MixtureShares:
    """A callback: each log's ``data/<name>``, the share of each set among the examples trained since the last."""

    def __init__(self, mixture: Mixture, *, examples_per_batch: int, per_epoch: int):
        self.mixture, self.examples_per_batch, self.per_epoch = mixture, examples_per_batch, per_epoch
        self.last = 0

    @classmethod
    def for_loader(cls, loader: Any, processes: int) -> list["MixtureShares"]:
        """The callback for the training loader ``loader`` (read by ``processes`` processes alike), or none."""
        sampler = getattr(getattr(loader, "batch_sampler", None), "sampler", None)
        if not isinstance(sampler, MixtureSampler):
            return []
        batch = loader.batch_sampler.batch_size * processes
        return [cls(sampler.dataset, examples_per_batch=batch, per_epoch=sampler.total_size)]

    def _trained(self, trainer: Any) -> int:
        state = trainer.state
        return state.epoch * self.per_epoch + min(state.batches_into_epoch * self.examples_per_batch, self.per_epoch)

    def on_train_begin(self, trainer: Any) -> None:
        self.last = self._trained(trainer)

    def on_log(self, trainer: Any, metrics: dict[str, Any]) -> None:
        now = self._trained(trainer)
        counts = self.mixture.counts(self.last, now, per_epoch=self.per_epoch)
        self.last = now
        total = sum(counts.values())
        if total:
            metrics.update({f"data/{name}": count / total for name, count in counts.items()})
