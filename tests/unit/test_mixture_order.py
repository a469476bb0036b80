"""A mixture's order (trainer.data.mixing), without processes: the shares at every prefix, each set's examples in
a seeded order per epoch, the dealing of a padded epoch, and the refusals that name the culprit."""

from __future__ import annotations

import pytest
import torch

from trainer.data.mixing import Mixture, MixtureSampler, mixture_of, stride_order
from trainer.errors import ConfigError, DataError


def test_every_prefix_holds_each_sets_share_to_within_one():
    sources = stride_order([0.7, 0.2, 0.1], 1000)
    counts = torch.zeros(3)
    for position, source in enumerate(sources.tolist(), start=1):
        counts[source] += 1
        assert (counts - torch.tensor([0.7, 0.2, 0.1]) * position).abs().max() <= 1


def test_a_small_set_repeats_a_large_one_is_sampled_in_a_new_seeded_order_each_epoch():
    mixture = Mixture({"a": list(range(30)), "b": list(range(100, 110))}, {"a": 0.5, "b": 0.5})
    first, again, second = mixture.order(0, 0), mixture.order(0, 0), mixture.order(0, 1)
    assert first == again != second and len(first) == 40
    for order in (first, second):
        drawn_a, drawn_b = [i for i in order if i < 30], [i for i in order if i >= 30]
        assert len(drawn_a) == 20 and len(set(drawn_a)) == 20  # sampled, none twice
        assert sorted(drawn_b) == sorted(list(range(30, 40)) * 2)  # each of b's 10 twice
    assert mixture.counts(0, 80, per_epoch=40) == {"a": 40, "b": 40}


def test_no_weights_joins_the_sets_in_their_sizes_and_a_padded_epoch_repeats_its_first_positions():
    mixture = Mixture({"a": list(range(3)), "b": list(range(2))}, None)
    assert sorted(mixture.order(0, 0)) == [0, 1, 2, 3, 4]
    dealt = [list(MixtureSampler(mixture, num_replicas=3, rank=rank, seed=0)) for rank in range(3)]
    order = mixture.order(0, 0)
    assert [i for row in zip(*dealt, strict=True) for i in row] == order + order[:1]


def test_weights_that_do_not_name_the_sets_or_a_set_with_no_examples_are_refused_by_name():
    with pytest.raises(ConfigError, match="data_weights names a, c, but train_data's sets are a, b"):
        mixture_of({"a": [1], "b": [2]}, {"a": 1.0, "c": 1.0}, seed=0)
    with pytest.raises(ConfigError, match="each a number, 0 or more, and not all 0"):
        mixture_of({"a": [1], "b": [2]}, {"a": 0, "b": 0}, seed=0)
    with pytest.raises(DataError, match="train_data's set 'b' has no examples"):
        mixture_of({"a": [1], "b": []}, {}, seed=0)
    with pytest.raises(DataError, match="each under a name usable in a log"):
        mixture_of({"my set": [1]}, {}, seed=0)
