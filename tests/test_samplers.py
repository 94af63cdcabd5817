"""Batch samplers (dml_nb.samplers): the class-balanced sampler's extra length, and the cluster schedules of Divide
and Conquer, pinned against the authors' data loaders (golden fixture `dnc_round_robin`)."""
import numpy as np
import pytest

from golden import load_golden, arr
from dml_nb.samplers import CLUSTER_SCHEDULES, ClassBalancedBatchSampler, RoundRobinBatchSampler, usable_members


def golden_sampler(case, schedule="round_robin", seed=0):
    x = load_golden("dnc_round_robin")["inputs"][case]
    labels, assign = arr(x["labels"], np.int64), arr(x["assign"], np.int64)
    rr = RoundRobinBatchSampler.from_clusters(labels, assign, batch_size=x["batch_size"],
                                              samples_per_class=x["samples_per_class"], seed=seed, schedule=schedule)
    return rr, labels, assign


@pytest.mark.parametrize("case", ["shapes_sizes", "singletons"])
def test_round_robin_matches_the_official_loaders(case):
    out = load_golden("dnc_round_robin")["outputs"][case]
    rr, labels, assign = golden_sampler(case)
    # the usable members of each cluster: the official singleton removal (cluster -1)
    kept = arr(out["cluster_after_singleton_removal"], np.int64)
    for k, s in enumerate(rr.samplers):
        np.testing.assert_array_equal(np.sort(s.indices), np.flatnonzero(kept == k))
    assert [len(s.indices) for s in rr.samplers] == out["usable_sizes"]
    assert [len(s) for s in rr.samplers] == out["own_batches"]
    pairs = rr.batches(0)
    assert [k for k, _ in pairs] == out["epoch_cluster_sequence"]
    assert np.bincount([k for k, _ in pairs]).tolist() == out["batches_per_learner"]
    for k, b in pairs: assert set(kept[b]) == {k}


def test_the_other_readings_differ_from_the_official_one():
    out = load_golden("dnc_round_robin")["outputs"]["shapes_sizes"]
    rr, *_ = golden_sampler("shapes_sizes", "proportional")
    counts = np.bincount([k for k, _ in rr.batches(0)]).tolist()
    assert counts == out["own_batches"] == [11, 8, 6, 3] and counts != out["batches_per_learner"]
    # counting the batches on every member (singletons included) would give cluster 0 a 12th batch
    x = load_golden("dnc_round_robin")["inputs"]["singletons"]
    assert (arr(x["assign"]) == 0).sum() // x["batch_size"] == 12
    assert load_golden("dnc_round_robin")["outputs"]["singletons"]["batches_per_learner"] == [11] * 4


def test_uniform_draws_clusters_uniformly():
    rr, *_ = golden_sampler("shapes_sizes", "uniform", seed=3)
    counts = np.array([np.bincount([k for k, _ in rr.batches(e)], minlength=4) for e in range(200)])
    assert (counts.sum(1) == 28).all()                          # the epoch passes over the data about once
    share = counts.sum(0) / counts.sum()
    np.testing.assert_allclose(share, 0.25, atol=0.02)         # every cluster equally likely, whatever its size
    assert len({tuple(c) for c in counts}) > 50                 # a new draw every epoch
    assert rr.batches(7) == rr.batches(7)                       # deterministic per epoch


def test_batches_per_sampler_and_ranks():
    rr, labels, _ = golden_sampler("shapes_sizes")
    rr2 = RoundRobinBatchSampler(rr.samplers, batches_per_sampler=5)
    assert len(rr2) == 20 and np.bincount([k for k, _ in rr2.batches(0)]).tolist() == [5] * 4
    # with 2 ranks every rank gets every cluster's share, and the ranks' batches are disjoint slices of one sequence
    x = load_golden("dnc_round_robin")["inputs"]["shapes_sizes"]
    ranks = [RoundRobinBatchSampler.from_clusters(labels, arr(x["assign"], np.int64), 32, 4, rank=r, world_size=2)
             for r in (0, 1)]
    b0, b1 = ranks[0].batches(0), ranks[1].batches(0)
    assert [k for k, _ in b0] == [k for k, _ in b1]
    assert not any(a == b for (_, a), (_, b) in zip(b0, b1))


def test_class_balanced_num_batches_extends_the_same_sequence():
    y = np.repeat(np.arange(10), 7)
    s = ClassBalancedBatchSampler(y, 12, 3, seed=4)
    assert s.batches(2, num_batches=len(s) + 4)[:len(s)] == s.batches(2)
    assert len(s.batches(2, num_batches=1)) == 1


def test_usable_members_and_bad_schedules():
    y = np.array([0, 0, 1, 2, 2, 2, 3])
    np.testing.assert_array_equal(usable_members(y, np.arange(7)), [0, 1, 3, 4, 5])
    rr, *_ = golden_sampler("shapes_sizes")
    with pytest.raises(ValueError, match="Valid schedules: round_robin, uniform, proportional"):
        RoundRobinBatchSampler(rr.samplers, schedule="roundrobin")
    assert CLUSTER_SCHEDULES[0] == "round_robin"


def test_class_random_draw_is_divas_sampler():
    "draw='class_random' (DiVA's class_random sampler): class slots and samples with replacement, reproducible per epoch."
    labels = np.repeat(np.arange(100), 30)                        # CUB-like: 100 training classes
    s = ClassBalancedBatchSampler(labels, 112, 2, draw="class_random", seed=3)
    batches = s.batches(0, num_batches=400)
    assert batches == s.batches(0, num_batches=400) and batches != s.batches(1, num_batches=400)
    assert all(len(b) == 112 for b in batches)
    slots = [labels[np.asarray(b)].reshape(56, 2) for b in batches]
    assert all((sl[:, 0] == sl[:, 1]).all() for sl in slots)      # each slot is one class
    distinct = np.mean([len(np.unique(sl[:, 0])) for sl in slots])
    assert abs(distinct - 100 * (1 - 0.99 ** 56)) < 0.5              # 43.0 distinct classes of 56 slots on average
    same = np.mean([(np.asarray(b).reshape(56, 2)[:, 0] == np.asarray(b).reshape(56, 2)[:, 1]).mean() for b in batches])
    assert abs(same - 1 / 30) < 0.01                                 # a slot's two samples coincide 1 time in 30
    balanced = ClassBalancedBatchSampler(labels, 112, 2, seed=3).batches(0, num_batches=50)
    assert all(len(np.unique(labels[np.asarray(b)])) == 56 for b in balanced)
    two = [ClassBalancedBatchSampler(labels, 112, 2, draw="class_random", seed=3, rank=r, world_size=2).batches(0, 200)
           for r in (0, 1)]
    assert sorted(map(tuple, two[0] + two[1])) == sorted(map(tuple, batches))   # two ranks split the same draws
    with pytest.raises(ValueError, match="sampler draw"):
        ClassBalancedBatchSampler(labels, 112, 2, draw="random")
