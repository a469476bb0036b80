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
    mixture = Mixture({"a": list(range(30)), "b": list(range(100, 110))}, [(0, {"a": 0.5, "b": 0.5})])
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
    with pytest.raises(ConfigError, match="data_weights are all 0 from step 0"):
        mixture_of({"a": [1], "b": [2]}, {"a": 0, "b": 0}, seed=0)
    with pytest.raises(ConfigError, match=r"data_weights\['b'\] is \[\[5, 0.5\]\]: a weight .* from step 0"):
        mixture_of({"a": [1], "b": [2]}, {"a": 1, "b": [[5, 0.5]]}, seed=0)
    with pytest.raises(DataError, match="train_data's set 'b' has no examples"):
        mixture_of({"a": [1], "b": []}, {}, seed=0)
    with pytest.raises(DataError, match="each under a name usable in a log"):
        mixture_of({"my set": [1]}, {}, seed=0)


def test_weights_that_change_at_given_steps_hold_from_those_steps_whatever_the_split():
    """a alone for steps 0-1, then b alone from step 2, then half and half from step 4: with a global batch of 4,
    positions 0-7 are a's, 8-15 b's, the rest half each; the mixture's own order does not depend on the split."""
    sets = {"a": list(range(20)), "b": list(range(100, 120))}
    phases = mixture_of(sets, {"a": [[0, 1.0], [2, 0.0], [4, 0.5]], "b": [[0, 0.0], [2, 1.0], [4, 0.5]]}, seed=0)
    assert phases.phases == [(0, [1.0, 0.0]), (2, [0.0, 1.0]), (4, [0.5, 0.5])]
    orders = []
    for processes in (1, 2, 4):
        dealt = [
            list(MixtureSampler(phases, num_replicas=processes, rank=rank, seed=0, examples_per_step=4))
            for rank in range(processes)
        ]
        orders.append([i for row in zip(*dealt, strict=True) for i in row])
    assert orders[0] == orders[1] == orders[2]
    sources = ["a" if i < 20 else "b" for i in orders[0]]
    assert sources[:8] == ["a"] * 8 and sources[8:16] == ["b"] * 8 and sorted(sources[16:]) == ["a"] * 12 + ["b"] * 12
    # The next epoch (40 positions = 10 steps a epoch) is all past step 4: half and half throughout.
    assert phases.counts(40, 80, per_epoch=40) == {"a": 20, "b": 20}
    assert phases.counts(0, 40, per_epoch=40) == {"a": 20, "b": 20}


def test_a_datasetdicts_splits_are_not_mixed_and_weights_without_sets_are_not_ignored(tmp_path):
    """``train_data=data`` where ``data["train"]`` was meant would train on the test split too: refused. And
    ``data_weights`` with a single training set would weigh nothing: refused, not ignored."""
    datasets = pytest.importorskip("datasets")
    Dataset, DatasetDict = datasets.Dataset, datasets.DatasetDict

    from trainer import TrainConfig
    from trainer.data.loaders import Loaders
    from trainer.launch.run import Run

    splits = DatasetDict({"train": Dataset.from_dict({"x": [1.0, 2.0]}), "test": Dataset.from_dict({"x": [3.0]})})
    with pytest.raises(DataError, match=r"train_data is a DatasetDict \(splits train, test\): .*data\['train'\]"):
        mixture_of(dict(splits), {}, seed=0, given=type(splits))
    run = Run.join(TrainConfig(output_dir=str(tmp_path), batch_size=1, data_weights={"a": 1.0}))
    with pytest.raises(ConfigError, match="data_weights weighs named training sets, but train_data is a list"):
        Loaders(run, model=torch.nn.Linear(1, 1), train_data=[{"x": torch.ones(1)}] * 4, eval_data=None)
