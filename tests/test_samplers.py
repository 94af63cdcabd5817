"""Batch samplers (dml_nb.data.samplers): the class-balanced sampler's extra length, the cluster schedules of Divide
and Conquer, and the code draws (`class_random`, `reshuffle`, `mic`), pinned against the authors' data loaders
(golden fixtures `dnc_round_robin`, `sampler_dnc`, `sampler_mic`)."""

import numpy as np
import pytest

from golden import load_golden, arr
from dml_nb.data.samplers import (
    CLUSTER_SCHEDULES,
    MIC_WORKERS,
    ClassBalancedBatchSampler,
    RoundRobinBatchSampler,
    mic_blocks,
    usable_members,
)


def golden_sampler(case, schedule="round_robin", seed=0):
    x = load_golden("dnc_round_robin")["inputs"][case]
    labels, assign = arr(x["labels"], np.int64), arr(x["assign"], np.int64)
    rr = RoundRobinBatchSampler.from_clusters(
        labels,
        assign,
        batch_size=x["batch_size"],
        samples_per_class=x["samples_per_class"],
        seed=seed,
        schedule=schedule,
    )
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
    for k, b in pairs:
        assert set(kept[b]) == {k}


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
    assert (counts.sum(1) == 28).all()  # the epoch passes over the data about once
    share = counts.sum(0) / counts.sum()
    np.testing.assert_allclose(share, 0.25, atol=0.02)  # every cluster equally likely, whatever its size
    assert len({tuple(c) for c in counts}) > 50  # a new draw every epoch
    assert rr.batches(7) == rr.batches(7)  # deterministic per epoch


def test_batches_per_sampler_and_ranks():
    rr, labels, _ = golden_sampler("shapes_sizes")
    rr2 = RoundRobinBatchSampler(rr.samplers, batches_per_sampler=5)
    assert len(rr2) == 20 and np.bincount([k for k, _ in rr2.batches(0)]).tolist() == [5] * 4
    # with 2 ranks every rank gets every cluster's share, and the ranks' batches are disjoint slices of one sequence
    x = load_golden("dnc_round_robin")["inputs"]["shapes_sizes"]
    ranks = [
        RoundRobinBatchSampler.from_clusters(labels, arr(x["assign"], np.int64), 32, 4, rank=r, world_size=2)
        for r in (0, 1)
    ]
    b0, b1 = ranks[0].batches(0), ranks[1].batches(0)
    assert [k for k, _ in b0] == [k for k, _ in b1]
    assert not any(a == b for (_, a), (_, b) in zip(b0, b1))


def test_class_balanced_num_batches_extends_the_same_sequence():
    y = np.repeat(np.arange(10), 7)
    s = ClassBalancedBatchSampler(y, 12, 3, seed=4)
    assert s.batches(2, num_batches=len(s) + 4)[: len(s)] == s.batches(2)
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
    labels = np.repeat(np.arange(100), 30)  # CUB-like: 100 training classes
    s = ClassBalancedBatchSampler(labels, 112, 2, draw="class_random", seed=3)
    batches = s.batches(0, num_batches=400)
    assert batches == s.batches(0, num_batches=400) and batches != s.batches(1, num_batches=400)
    assert all(len(b) == 112 for b in batches)
    slots = [labels[np.asarray(b)].reshape(56, 2) for b in batches]
    assert all((sl[:, 0] == sl[:, 1]).all() for sl in slots)  # each slot is one class
    distinct = np.mean([len(np.unique(sl[:, 0])) for sl in slots])
    assert abs(distinct - 100 * (1 - 0.99**56)) < 0.5  # 43.0 distinct classes of 56 slots on average
    same = np.mean([(np.asarray(b).reshape(56, 2)[:, 0] == np.asarray(b).reshape(56, 2)[:, 1]).mean() for b in batches])
    assert abs(same - 1 / 30) < 0.01  # a slot's two samples coincide 1 time in 30
    balanced = ClassBalancedBatchSampler(labels, 112, 2, seed=3).batches(0, num_batches=50)
    assert all(len(np.unique(labels[np.asarray(b)])) == 56 for b in balanced)
    two = [
        ClassBalancedBatchSampler(labels, 112, 2, draw="class_random", seed=3, rank=r, world_size=2).batches(0, 200)
        for r in (0, 1)
    ]
    assert sorted(map(tuple, two[0] + two[1])) == sorted(map(tuple, batches))  # two ranks split the same draws
    with pytest.raises(ValueError, match="sampler draw"):
        ClassBalancedBatchSampler(labels, 112, 2, draw="random")


def test_golden_mic_draw_replays_mics_class_stream():
    """mic_blocks against MIC's BaseTripletDataset read by a real DataLoader (3 and 8 workers, 3 epochs; the main
    process for its first epoch): every batch's labels and images equal, in order."""
    g = load_golden("sampler_mic")
    x = g["inputs"]
    labels = arr(x["labels"], np.int64)
    pools = [np.flatnonzero(labels == c) for c in np.unique(labels)]
    checked = 0
    for workers, epochs in g["outputs"]["batches"].items():
        for e, (order, want) in enumerate(zip(x["orders"], epochs)):
            if workers == "0" and e > 0:
                continue  # the main process carries its chain over epochs; MIC runs 8 workers
            got = mic_blocks(
                order,
                pools,
                x["samples_per_class"],
                x["batch_size"],
                workers=max(1, int(workers)),
                first_visited=x["initial_class"],
            )
            assert [[[int(labels[i]), i] for i in b] for b in got] == want, (workers, e)
            checked += 1
    assert checked == 7 and MIC_WORKERS == 8
    with pytest.raises(ValueError, match="at least 1"):
        mic_blocks(x["orders"][0], pools, 4, 16, workers=0)


def test_mic_draw_in_the_sampler():
    "draw='mic': MIC's blocks from the sampler's own shuffled positions; one class per block, classes may repeat."
    labels = np.repeat(np.arange(100), 59)  # CUB-like
    s = ClassBalancedBatchSampler(labels, 112, 4, draw="mic", seed=3)
    b = s.batches(0)
    assert b == ClassBalancedBatchSampler(labels, 112, 4, draw="mic", seed=3).batches(0) and b != s.batches(1)
    assert len(b) == len(labels) // 112 and all(len(x) == 112 for x in b)
    blocks = labels[np.asarray(b)].reshape(len(b), 28, 4)
    assert (blocks == blocks[..., :1]).all()  # a block is one class
    distinct = np.mean([len(np.unique(x)) for x in blocks[..., 0]])
    assert 24 < distinct < 27  # 28 blocks, classes repeat (25.1 measured)
    long = s.batches(0, num_batches=3 * len(b))  # longer than a pass over the data: more permutations
    assert long[: len(b)] == b and len(long) == 3 * len(b)
    two = [
        ClassBalancedBatchSampler(labels, 112, 4, draw="mic", seed=3, rank=r, world_size=2).batches(0, 20)
        for r in (0, 1)
    ]
    assert two[0] + two[1] != [] and sorted(map(tuple, two[0] + two[1])) == sorted(map(tuple, s.batches(0, 40)))
    one = ClassBalancedBatchSampler(labels, 112, 1, draw="mic", seed=3).batches(
        0
    )  # ProxyNCA: the images at the positions
    assert len({i for x in one for i in x}) == 112 * len(one)
    with pytest.raises(ValueError, match="at least 1"):
        ClassBalancedBatchSampler(labels, 112, 4, draw="mic", workers=0)
    with pytest.raises(ValueError, match="at least 3 classes"):
        ClassBalancedBatchSampler(np.repeat([0, 1], 8), 8, 4, draw="mic")


def _block_statistics(labels, blocks):
    "D&C fixture statistics of a sequence of blocks (each the K indices of one class, in drawing order)."
    size = np.bincount(labels)
    cls = labels[blocks[:, 0]]
    out = {"repeat": {}, "consecutive": {}, "share": {}}
    for n in np.unique(size[cls]):
        mine = size[cls] == n
        out["repeat"][int(n)] = float(np.mean([len(set(b)) < blocks.shape[1] for b in blocks[mine].tolist()]))
        pairs, shares = [], []
        for c in np.flatnonzero(size == n):
            bc = blocks[cls == c]
            pairs += [len(set(a) | set(b)) for a, b in zip(bc[:-1].tolist(), bc[1:].tolist())]
            use = np.bincount(bc.ravel(), minlength=labels.size)[labels == c]
            shares.append(use.max() / use.min())
        out["consecutive"][int(n)], out["share"][int(n)] = float(np.mean(pairs)), float(np.mean(shares))
    return out


def test_golden_reshuffle_draw_matches_dncs_sampler():
    """draw='reshuffle' against D&C's ClassBalancedSampler (20,000 batches of their code): no image twice in a block
    of a class of at least K, the same overlap of a class's consecutive blocks, the same even use of its images.
    One long epoch here: every dml_nb epoch starts from new pools, their sampler carries them over (16_samplers)."""
    g = load_golden("sampler_dnc")
    x, ref = g["inputs"], g["outputs"]
    labels, K = arr(x["labels"], np.int64), x["samples_per_class"]
    s = ClassBalancedBatchSampler(
        labels, x["batch_size"], K, draw="reshuffle", seed=0, batches_per_epoch=ref["batches"]
    )
    batches = np.asarray(s.batches(0))
    assert {len(np.unique(labels[b])) for b in batches} == set(ref["classes_per_batch"]) == {x["batch_size"] // K}
    ours = _block_statistics(labels, batches.reshape(-1, K))
    for n, want in ref["block_repeat_rate_by_size"].items():
        assert ours["repeat"][int(n)] == want, n  # 1 below K (drawn with replacement), else 0
    for n, want in ref["distinct_in_consecutive_blocks_by_size"].items():
        assert ours["consecutive"][int(n)] == pytest.approx(want, abs=0.03), n
    for n, want in ref["image_share_by_size"].items():  # max / min use of a class's images: binomial noise of 1-2%
        assert ours["share"][int(n)] == pytest.approx(want, abs=0.05), n
    assert ours["share"][4] < 1.001 and ours["share"][8] < 1.001  # whole passes: every image equally often
    assert len(ClassBalancedBatchSampler(labels, x["batch_size"], K, draw="reshuffle")) == ref["len"]
    balanced = _block_statistics(
        labels,
        np.asarray(
            ClassBalancedBatchSampler(labels, x["batch_size"], K, seed=0, batches_per_epoch=ref["batches"]).batches(0)
        ).reshape(-1, K),
    )
    assert balanced["repeat"][5] > 0.3 and ref["block_repeat_rate_by_size"]["5"] == 0  # what the option changes


def test_golden_class_random_draw_matches_divas_sampler():
    """draw='class_random' against DiVA's class_random Sampler run unchanged (20,000 batches of 28 slots x 2): the
    distinct classes per batch, how often a slot's two images coincide by class size, each class's share of slots."""
    g = load_golden("sampler_diva")
    x, ref = g["inputs"], g["outputs"]
    labels, K = arr(x["labels"], np.int64), x["samples_per_class"]
    s = ClassBalancedBatchSampler(
        labels, x["batch_size"], K, draw="class_random", seed=0, batches_per_epoch=ref["batches"]
    )
    slots = np.asarray(s.batches(0)).reshape(ref["batches"], -1, K)
    cls = labels[slots[..., 0]]
    assert (labels[slots] == cls[..., None]).all()  # a slot is one class
    assert len(ClassBalancedBatchSampler(labels, x["batch_size"], K, draw="class_random")) == ref["len"]
    distinct = np.mean([len(np.unique(r)) for r in cls])
    assert distinct == pytest.approx(ref["mean_distinct_classes_per_batch"], abs=0.1)  # 20.3 of 28 slots
    size, same = np.bincount(labels), slots[..., 0] == slots[..., 1]
    for n, want in ref["slot_same_image_rate_by_size"].items():  # 1 / n
        assert same[size[cls] == int(n)].mean() == pytest.approx(want, abs=0.01), n
    share = np.bincount(cls.ravel(), minlength=len(size)) / cls.size
    np.testing.assert_allclose(share, ref["class_slot_share"], atol=0.0015)  # uniform over classes
    use = np.bincount(slots.ravel(), minlength=len(labels))
    for n, want in ref["image_share_by_size"].items():  # max / min use of a class's images: binomial noise, 1-7%
        ratios = [use[labels == c].max() / use[labels == c].min() for c in np.flatnonzero(size == int(n))]
        assert np.mean(ratios) == pytest.approx(want, abs=0.04), n


def test_reshuffle_draw_fills_a_batch_from_fewer_classes_as_dncs_sampler():
    """D&C's sampler draws the classes with replacement when there are fewer than a batch needs (a small cluster):
    draw='reshuffle' keeps the full batch; 'balanced' refuses, and D&C's cluster batches shrink under it instead."""
    from dml_nb.methods.dnc import cluster_batch_sampler

    labels = np.repeat(np.arange(6), 9)
    s = ClassBalancedBatchSampler(labels[:27], 32, 4, draw="reshuffle", batches_per_epoch=50)  # 3 classes, 8 blocks
    blocks = np.asarray(s.batches(0)).reshape(50, 8, 4)
    assert (labels[blocks] == labels[blocks[..., :1]]).all()  # a block is one class
    assert all(len(set(b)) == 4 for b in blocks.reshape(-1, 4).tolist())  # never an image twice in a block
    assert {len(np.unique(labels[b[:, 0]])) for b in blocks} <= {1, 2, 3}
    with pytest.raises(ValueError, match="needs 8 classes"):
        ClassBalancedBatchSampler(labels[:27], 32, 4)
    assign = np.repeat([0, 1], 27)  # two clusters of 3 classes
    _, _, full = cluster_batch_sampler(labels, assign, 2, 32, 4, draw="reshuffle")
    _, _, small = cluster_batch_sampler(labels, assign, 2, 32, 4)
    assert full == [32, 32] and small == [12, 12]
