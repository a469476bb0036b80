"""Training sets mixed by weight: ``train_data={"web": web, "code": code}`` with ``data_weights: {web: 0.7,
code: 0.3}``, or weights that change at given steps (docs/project.md#several-training-sets).

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
    gives. ``phases``: ``[(first step, weights by name), ...]`` from step 0 on (None: each set's share of the
    examples, the sets simply joined); ``examples_per_step`` (the global batch) ties positions to steps."""

    def __init__(self, sets: Mapping[str, Any], phases: Optional[list[tuple[int, Mapping[str, float]]]]):
        super().__init__(list(sets.values()))
        self.names = list(sets)
        sizes = {name: len(part) for name, part in sets.items()}
        self.phases = [(step, self._shares(weights)) for step, weights in phases or [(0, sizes)]]
        self.examples_per_step, self.shuffle = 1, True
        self._sources: dict[int, torch.Tensor] = {}

    def _shares(self, weights: Mapping[str, float]) -> list[float]:
        shares = [float(weights[name]) for name in self.names]
        return [share / sum(shares) for share in shares]

    def sources(self, epoch: int) -> torch.Tensor:
        """Which set each position of epoch ``epoch`` draws from: every run of positions whose steps share a phase
        in that phase's shares (one run, the same every epoch, for weights that never change)."""
        if epoch not in self._sources:
            length, per_step = len(self), self.examples_per_step
            first = epoch * math.ceil(length / per_step)
            starts = [max(0, (step - first) * per_step) for step, _ in self.phases] + [length]
            runs = [
                stride_order(shares, min(end, length) - start)
                for (_, shares), start, end in zip(self.phases, starts, starts[1:], strict=False)
                if start < min(end, length)
            ]
            self._sources = {epoch: torch.cat(runs)}
        return self._sources[epoch]

    def order(self, seed: int, epoch: int) -> list[int]:
        """Epoch ``epoch``'s examples, as indices into the sets joined end to end."""
        sources = self.sources(epoch)
        order = torch.empty(len(sources), dtype=torch.int64)
        for number, size in enumerate(len(part) for part in self.datasets):
            where = (sources == number).nonzero().flatten()
            generator = torch.Generator().manual_seed((seed * 1_000_003 + epoch * 8_191 + number) & (2**63 - 1))
            # shuffle: false reads each set in its own order.
            passes = [
                torch.randperm(size, generator=generator) if self.shuffle else torch.arange(size)
                for _ in range(math.ceil(len(where) / size))
            ]
            offset = self.cumulative_sizes[number] - size
            order[where] = torch.cat(passes or [torch.empty(0, dtype=torch.int64)])[: len(where)] + offset
        return order.tolist()

    def counts(self, start: int, stop: int, *, per_epoch: int) -> dict[str, int]:
        """How many of the run's positions ``start`` to ``stop`` each set gave, its epochs ``per_epoch`` positions
        each end to end (a padded epoch's last positions repeat its first)."""
        found = torch.zeros(len(self.names), dtype=torch.int64)
        for begin in range(start - start % per_epoch, stop, per_epoch):
            sources = self.sources(begin // per_epoch)
            into = torch.arange(max(start - begin, 0), min(stop - begin, per_epoch)) % len(sources)
            found += torch.bincount(sources[into], minlength=len(self.names))
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
    ..., the tail padded with the first positions (``drop_last``: the trailing M mod K dropped).
    ``examples_per_step``: the global batch, which ties the mixture's positions to optimizer steps."""

    def __init__(self, dataset: Mixture, *, examples_per_step: int = 1, **kwargs: Any):
        super().__init__(dataset, **kwargs)
        dataset.examples_per_step, dataset.shuffle = examples_per_step, self.shuffle

    def __iter__(self):
        order = self.dataset.order(self.seed, self.epoch)
        if self.drop_last:
            order = order[: self.total_size]
        else:
            order = (order * math.ceil(self.total_size / len(order)))[: self.total_size]
        mine = order[self.rank : self.total_size : self.num_replicas][self._skip :]
        self._skip = 0
        return iter(mine)


def mixture_of(sets: Mapping[str, Any], weights: Mapping[str, Any], *, seed: int, given: type = dict) -> Any:
    """``train_data`` given as a dict of named sets: a Mixture of map-style sets, or datasets' interleaving of
    streams; the names and ``data_weights`` checked first. ``given``: the type the user passed."""
    if given.__name__ in ("DatasetDict", "IterableDatasetDict"):
        # Its splits (train, test, ...) are no sets to train on together.
        raise DataError(
            f"train_data is a {given.__name__} (splits {', '.join(sets)}): pass the split to train on, "
            f"train_data=data[{next(iter(sets), 'train')!r}] (a plain dict of sets mixes them)"
        )
    odd = [repr(name) for name in sets if not isinstance(name, str) or not name.isidentifier()]
    if odd or not sets:
        raise DataError(
            f"train_data is a dict, so it names training sets to mix, each under a name usable in a log "
            f"(data/<name>); got {', '.join(odd) or 'an empty dict'}"
        )
    phases = weight_phases(weights, sets)
    streams = [is_stream(part) for part in sets.values()]
    if all(streams):
        from datasets import interleave_datasets

        if len(phases or []) > 1:
            raise ConfigError(
                "data_weights that change at given steps mix map-style sets; streams take one weight each"
            )
        shares = [phases[0][1][name] / sum(phases[0][1].values()) for name in sets] if phases else None
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
    return Mixture(sets, phases)


def weight_phases(weights: Mapping[str, Any], sets: Mapping[str, Any]) -> Optional[list[tuple[int, dict]]]:
    """``data_weights`` as ``[(first step, {name: weight}), ...]``: one weight a set (``{web: 0.7, ...}``), or
    ``[step, weight]`` pairs a set, from step 0 (``{web: [[0, 0.7], [1000, 0.5]], ...}``); None for none."""
    if not weights:
        return None
    if set(weights) != set(sets):
        raise ConfigError(
            f"data_weights names {', '.join(sorted(weights))}, but train_data's sets are {', '.join(sorted(sets))}: "
            "give a weight for each set, and for no other"
        )
    number = lambda w: isinstance(w, (int, float)) and not isinstance(w, bool) and 0 <= w < math.inf  # noqa: E731
    pairs = {name: [(0, given)] if number(given) else given for name, given in weights.items()}
    for name, given in pairs.items():
        if not (
            isinstance(given, (list, tuple))
            and all(isinstance(pair, (list, tuple)) and len(pair) == 2 for pair in given)
            and all(type(step) is int and step >= 0 and number(w) for step, w in given)
            and sorted(step for step, _ in given) == [step for step, _ in given]
            and given[0][0] == 0
        ):
            raise ConfigError(
                f"data_weights[{name!r}] is {given!r}: a weight (a finite number, 0 or more), or [step, weight] "
                "pairs in step order from step 0, [[0, 0.7], [1000, 0.5]]"
            )
    steps = sorted({step for given in pairs.values() for step, _ in given})
    phases = [(step, {name: [w for s, w in given if s <= step][-1] for name, given in pairs.items()}) for step in steps]
    for step, shares in phases:
        if not sum(shares.values()) > 0:
            raise ConfigError(f"data_weights are all 0 from step {step}: give some set a weight")
        if not math.isfinite(sum(shares.values())):
            raise ConfigError(
                f"data_weights from step {step} sum to {sum(shares.values())} ({shares}): give weights whose sum is a "
                "finite number (they are shares: 0.7 and 0.3, or 7 and 3)"
            )
    return phases


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
