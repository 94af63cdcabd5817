"""Miners in dml_nb.blocks.miners: validity of every tuple, determinism, empty and NaN cases, and agreement with
pytorch-metric-learning (PML, a test-only reference) where the definitions coincide."""

import math

import pytest
import torch
import torch.nn.functional as F

from dml_nb.core.registry import MINERS
from dml_nb.blocks.distances import pairwise_distance
from dml_nb.blocks.miners import (
    DistanceWeightedMiner,
    MultiSimilarityMiner,
    SemiHardMiner,
    check_triplets,
    distance_weights,
)

pml_miners = pytest.importorskip("pytorch_metric_learning.miners")

RELATION = {
    "random": "class",
    "semihard": "class",
    "distance_weighted": "class",
    "shared": "shared",
    "intra": "intra",
    "grouping": "class",
    "dnc_nearest": "class",
    "shared_random": None,
}


def batch(n_classes=8, k=4, dim=32, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    labels = torch.arange(n_classes).repeat_interleave(k)
    emb = 0.8 * torch.randn(n_classes, dim, generator=g, dtype=dtype)[labels] + torch.randn(
        len(labels), dim, generator=g, dtype=dtype
    )
    return F.normalize(emb, dim=1), labels


def as_set(*tensors):
    return set(zip(*(t.tolist() for t in tensors)))


@pytest.mark.parametrize("name", sorted(RELATION))
@pytest.mark.parametrize("seed", [0, 1])
def test_triplet_miners_valid_and_deterministic(name, seed):
    emb, labels = batch(seed=seed)
    miner = MINERS.build(name)
    kw = {"groups": labels % 3} if name == "grouping" else {}
    ref = (labels % 3) if name == "grouping" else labels
    t1 = miner(emb, labels, generator=torch.Generator().manual_seed(seed), **kw)
    t2 = miner(emb, labels, generator=torch.Generator().manual_seed(seed), **kw)
    assert len(t1) == 3 and len(t1[0]) > 0
    assert all(u.dtype == torch.long and len(u) == len(t1[0]) for u in t1)
    if RELATION[name] is None:
        assert ((t1[0] != t1[1]) & (t1[0] != t1[2]) & (t1[1] != t1[2])).all()
    else:
        assert check_triplets(t1, ref, RELATION[name])
    assert all(torch.equal(u, v) for u, v in zip(t1, t2))


def test_unconstrained_distinct_and_ignores_labels():
    emb, labels = batch()
    a, p, n = MINERS.build("unconstrained")(emb, labels, generator=torch.Generator().manual_seed(0))
    assert ((a != p) & (a != n) & (p != n)).all() and len(a) == len(labels)
    assert (labels[a] == labels[p]).any()  # positives of the same class occur: no label constraint


@pytest.mark.parametrize(
    "name",
    ["random", "semihard", "distance_weighted", "shared", "intra", "unconstrained", "dnc_nearest", "shared_random"],
)
def test_empty_and_nan_cases(name):
    miner = MINERS.build(name)
    one = F.normalize(torch.randn(2, 8), dim=1)
    out = miner(one, torch.zeros(2, dtype=torch.long))  # two samples of one class: nothing valid
    assert len(out) == 3 and all(len(u) == 0 and u.dtype == torch.long for u in out)
    emb, labels = batch(n_classes=4, k=3, dim=8)
    emb = emb.clone()
    emb[0] = float("nan")
    out = miner(emb, labels, generator=torch.Generator().manual_seed(0))
    if RELATION.get(name, "class") is not None and name != "unconstrained":
        assert check_triplets(out, labels, RELATION.get(name, "class"))
    assert all(((u >= 0) & (u < len(labels))).all() for u in out)


def test_semihard_all_equals_pml():
    for seed in range(3):
        emb, labels = batch(seed=seed, dtype=torch.float64)
        ours = SemiHardMiner(margin=0.2, mode="all", positives="all")(emb, labels)  # PML: every pair
        theirs = pml_miners.TripletMarginMiner(margin=0.2, type_of_triplets="semihard")(emb, labels)
        assert len(theirs[0]) > 0 and as_set(*ours) == as_set(*theirs)


def test_semihard_sample_picks_semihard_when_available():
    emb, labels = batch(seed=4)
    a, p, n = SemiHardMiner(margin=0.2)(emb, labels, generator=torch.Generator().manual_seed(0))
    d = pairwise_distance(emb)
    allsemi = SemiHardMiner(margin=0.2, mode="all")(emb, labels)
    has = {(x, y) for x, y, _ in as_set(*allsemi)}
    picked_semi = [
        (d[i, k] > d[i, j]) & (d[i, k] <= d[i, j] + 0.2)
        for i, j, k in zip(a.tolist(), p.tolist(), n.tolist())
        if (i, j) in has
    ]
    assert len(picked_semi) > 0 and all(picked_semi)


def test_multi_similarity_equals_pml():
    for seed in range(3):
        emb, labels = batch(seed=seed, dtype=torch.float64)
        miner = MultiSimilarityMiner(epsilon=0.1)
        a1, p, a2, n = miner(emb, labels)
        t = pml_miners.MultiSimilarityMiner(epsilon=0.1)(emb, labels)
        assert as_set(a1, p) == as_set(t[0], t[1]) and as_set(a2, n) == as_set(t[2], t[3])
        assert len(a1) > 0 and len(a2) > 0
        informative = torch.zeros(len(labels), dtype=torch.bool)
        informative[torch.cat([t[0], t[2]])] = True
        assert torch.equal(miner.informative, informative)


def _reference_weights(dist, dim, allowed, cutoff=0.5, upper=1.4):
    d = dist.clamp_min(cutoff).double()
    logw = -(dim - 2) * d.log() - (dim - 3) / 2 * torch.log(1 - d**2 / 4)
    w = torch.zeros_like(d)
    for i in range(len(d)):
        ok = allowed[i] & (dist[i] < upper)
        if ok.any():
            wi = torch.exp(logw[i][ok] - logw[i][ok].max())
            w[i][ok] = wi / wi.sum()
    return w


@pytest.mark.parametrize("upper", [None, 1.4])
def test_distance_weights_match_formula_and_guard_rows(upper):
    emb, labels = batch(dim=16, seed=2)
    dist = pairwise_distance(emb)
    allowed = labels[:, None] != labels[None, :]
    allowed[0] = False  # a row with nothing allowed
    w = distance_weights(dist, 16, allowed, upper_cutoff=upper)
    torch.testing.assert_close(
        w.double(),
        _reference_weights(dist, 16, allowed, upper=math.inf if upper is None else upper),
        rtol=1e-4,
        atol=1e-6,
    )
    if upper is None:
        assert (w[1:] > 0).sum() == allowed[1:].sum()  # no cutoff: every negative can be drawn
    assert (w[0] == 0).all() and torch.isfinite(w).all()
    assert not w.requires_grad
    torch.testing.assert_close(w[1:].sum(1)[w[1:].sum(1) > 0], torch.ones(int((w[1:].sum(1) > 0).sum())))


def test_distance_weighted_draws_follow_weights():
    emb, labels = batch(n_classes=4, k=2, dim=8, seed=3)
    miner = DistanceWeightedMiner()
    counts = torch.zeros(len(labels), len(labels))
    g = torch.Generator().manual_seed(0)
    for _ in range(300):
        a, p, n = miner(emb, labels, generator=g)
        counts.index_put_((a, n), torch.ones(len(a)), accumulate=True)
    w = distance_weights(pairwise_distance(emb), 8, labels[:, None] != labels[None, :])
    freq = counts / counts.sum(1, keepdim=True)
    assert (freq[w == 0] == 0).all()
    assert (freq - w).abs().max() < 0.08


def test_distance_weighted_fallback_uniform_when_all_far():
    emb = F.normalize(torch.eye(6), dim=1)  # all distances sqrt(2) >= 1.4
    labels = torch.tensor([0, 0, 1, 1, 2, 2])
    a, p, n = DistanceWeightedMiner(upper_cutoff=1.4)(emb, labels, generator=torch.Generator().manual_seed(0))
    assert len(a) == 6 and check_triplets((a, p, n), labels)


def test_all_far_rows_zero_weights_but_pml_returns_nothing():
    # Every negative at distance >= 1.4: the weight rows are all zero (never NaN). PML's miner then returns no
    # triplet at all; ours falls back to uniform negatives (documented in the notebook).
    emb = F.normalize(torch.eye(6), dim=1)
    labels = torch.tensor([0, 0, 1, 1, 2, 2])
    w = distance_weights(pairwise_distance(emb), 6, labels[:, None] != labels[None, :], upper_cutoff=1.4)
    assert (w == 0).all()
    assert len(pml_miners.DistanceWeightedMiner()(emb, labels)[0]) == 0
    assert len(DistanceWeightedMiner(upper_cutoff=1.4, positives="all")(emb, labels)[0]) == 6


def test_shared_nearest_positive():
    emb, labels = batch(seed=5)
    a, p, n = MINERS.build("shared", positive="nearest")(emb, labels, generator=torch.Generator().manual_seed(0))
    d = pairwise_distance(emb).masked_fill(labels[:, None] == labels[None, :], math.inf)
    assert torch.equal(p, d.argmin(1)[a])


def test_intra_code_variant_and_strict():
    emb, labels = batch(n_classes=4, k=2)
    assert all(len(u) == 0 for u in MINERS.build("intra")(emb, labels))  # K=2: no three distinct samples
    a, p, n = MINERS.build("intra", distinct=False)(emb, labels, generator=torch.Generator().manual_seed(0))
    assert len(a) == len(labels) and ((labels[a] == labels[p]) & (labels[a] == labels[n])).all()


def test_bad_inputs_are_clear_errors():
    with pytest.raises(ValueError, match="one label per embedding row"):
        MINERS.build("random")(torch.randn(4, 3), torch.arange(3))
    with pytest.raises(ValueError, match="groups="):
        MINERS.build("grouping")(torch.randn(4, 3), torch.arange(4))
    with pytest.raises(TypeError, match="Did you mean 'margin'"):
        MINERS.build("semihard", margn=0.1)


# ---------------------------------------------------------------- options of issues 11 / 12


def test_positives_one_vs_all():
    emb, labels = batch(n_classes=6, k=4, seed=12)
    g = lambda: torch.Generator().manual_seed(0)
    for name in ("distance_weighted", "semihard", "shared_random"):
        a, p, n = MINERS.build(name)(emb, labels, generator=g())
        assert torch.equal(a, torch.arange(len(labels))), name  # one triplet per anchor (authors' code)
        a, p, n = MINERS.build(name, positives="all")(emb, labels, generator=g())
        assert len(a) == len(labels) * 3, name  # every anchor-positive pair
    with pytest.raises(ValueError, match="positives must be"):
        MINERS.build("distance_weighted", positives="each")


def test_one_positive_is_uniform():
    emb, labels = batch(n_classes=2, k=4, dim=8, seed=13)
    counts = torch.zeros(8, 8)
    miner, g = DistanceWeightedMiner(), torch.Generator().manual_seed(0)
    for _ in range(600):
        a, p, _ = miner(emb, labels, generator=g)
        counts.index_put_((a, p), torch.ones(len(a)), accumulate=True)
    freq = counts / 600
    same = (labels[:, None] == labels[None, :]) & ~torch.eye(8, dtype=torch.bool)
    assert (freq[~same] == 0).all() and (freq[same] - 1 / 3).abs().max() < 0.08


def test_random_batch_sampling_draws_distinct_triplets_uniformly():
    emb, labels = batch(n_classes=3, k=2, dim=4)
    miner, g = MINERS.build("random"), torch.Generator().manual_seed(0)
    assert miner.sampling == "batch"
    counts = {}
    for _ in range(2000):
        t = miner(emb, labels, generator=g)
        keys = list(zip(*(u.tolist() for u in t)))
        assert len(keys) == 6 and len(set(keys)) == 6 and check_triplets(t, labels)  # without replacement
        for k in keys:
            counts[k] = counts.get(k, 0) + 1
    assert len(counts) == 6 * 4  # all 24 triplets of the batch occur
    freq = torch.tensor(list(counts.values()), dtype=torch.float) / 2000
    assert (freq - 6 / 24).abs().max() < 0.04  # each with probability 6/24


def test_semihard_random_fallback_draws_any_negative():
    emb = F.normalize(torch.tensor([[1.0, 0], [1, 0.05], [0, 1], [-1, 0]]), dim=1)  # no semi-hard negative at all
    labels = torch.tensor([0, 0, 1, 2])
    seen = set()
    for s in range(40):
        a, p, n = SemiHardMiner(margin=0.01)(emb, labels, generator=torch.Generator().manual_seed(s))
        seen.add(int(n[a == 0]))
    assert seen == {2, 3}  # uniform over the negatives
    a, p, n = SemiHardMiner(margin=0.01, fallback="nearest")(emb, labels, generator=torch.Generator().manual_seed(0))
    assert int(n[a == 0]) == 2  # nearest farther negative


def test_shared_negative_first_only_changes_order_of_draws():
    emb, labels = batch(n_classes=5, k=2, dim=8, seed=14)
    a, p, n = MINERS.build("shared", first="negative", positive="random")(
        emb, labels, generator=torch.Generator().manual_seed(0)
    )
    assert check_triplets((a, p, n), labels, "shared")
    with pytest.raises(ValueError, match="needs the positive first"):
        MINERS.build("shared", first="negative", negative="semihard")


def test_cutoff_options_validated():
    for name in ("distance_weighted", "shared", "intra", "shared_random"):
        with pytest.raises(ValueError, match="upper_cutoff must be None"):
            MINERS.build(name, upper_cutoff=0.3)
        assert MINERS.build(name).upper_cutoff is None


def test_dnc_nearest_never_returns_masked_entries():
    emb, labels = batch(n_classes=4, k=3, dim=4, seed=15)
    for cutoff in (0.5, 1.0, 1.3):
        a, p, n = MINERS.build("dnc_nearest", cutoff=cutoff)(emb, labels)
        assert check_triplets((a, p, n), labels)
        assert (pairwise_distance(emb)[a, n] >= cutoff).all()
        assert (torch.bincount(a, minlength=len(labels)) <= 2).all()  # at most K - 1 per anchor


# ---------------------------------------------------------------- golden tests: the authors' miners on fixed inputs

import numpy as np
from golden import arr, load_golden

from dml_nb.blocks.miners import DnCNearestMiner, IntraClassTripletMiner, SharedRandomMiner, negative_mask


OUR_DRAWS, FREQ_TOL = (
    2000,
    0.06,
)  # vs their 4000 draws: the worst cell (p = 1/3) has sd 0.013; wrong readings differ > 0.25


def _golden_batch(name):
    g = load_golden(name)
    return g, torch.tensor(g["inputs"]["embeddings"], dtype=torch.float32), torch.tensor(g["inputs"]["labels"])


def _draw_frequencies(miner, emb, labels, draws, seed=0):
    "(a, p) and (a, n) counts over `draws` calls divided by `draws`, and the triplet counts per call."
    g = torch.Generator().manual_seed(seed)
    ap, an, per_call = torch.zeros(len(labels), len(labels)), torch.zeros(len(labels), len(labels)), set()
    for _ in range(draws):
        a, p, n = miner(emb, labels, generator=g)
        per_call.add(len(a))
        ap.index_put_((a, p), torch.ones(len(a)), accumulate=True)
        an.index_put_((a, n), torch.ones(len(a)), accumulate=True)
    return ap.numpy() / draws, an.numpy() / draws, per_call


def test_golden_distance_weights_without_cutoff():
    """DiVA's batchminer/distance.py (identical in Revisiting-DML and MIC): per-anchor probabilities on a fixed batch.
    The 1.4-cutoff reading moves 10-80% of each anchor's probability mass and fails."""
    g, emb, labels = _golden_batch("blocks_distance_weights")
    theirs = arr(g["outputs"]["probabilities"])
    dist, neg = pairwise_distance(emb), negative_mask(labels)
    ours = distance_weights(dist, emb.shape[1], neg).double().numpy()
    np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-6)
    wrong = distance_weights(dist, emb.shape[1], neg, upper_cutoff=1.4).double().numpy()
    assert np.abs(wrong - theirs).sum(1).min() > 0.1


def test_golden_distance_weighted_miner_draws():
    """Many draws of the whole miner against many draws of theirs: one positive per anchor, uniform; negatives with
    the probabilities above. The 'all' positives or the 1.4 cutoff fail."""
    g, emb, labels = _golden_batch("blocks_distance_weights")
    ap, an, per_call = _draw_frequencies(DistanceWeightedMiner(), emb, labels, OUR_DRAWS)
    assert per_call == {g["outputs"]["triplets_per_call"]}
    assert np.abs(ap - arr(g["outputs"]["anchor_positive_frequency"])).max() < FREQ_TOL
    assert np.abs(an - arr(g["outputs"]["anchor_negative_frequency"])).max() < FREQ_TOL
    _, an_cut, _ = _draw_frequencies(DistanceWeightedMiner(upper_cutoff=1.4), emb, labels, 500)
    assert np.abs(an_cut - arr(g["outputs"]["anchor_negative_frequency"])).max() > 0.1
    _, _, per_call_all = _draw_frequencies(DistanceWeightedMiner(positives="all"), emb, labels, 1)
    assert per_call_all != per_call


def test_golden_shared_random_candidates():
    """DiVA's batchminer/random_distance.py for one recorded permutation: the same anchors, candidate positives and
    negative probabilities (those of the class miner on the permuted labels)."""
    g, emb, labels = _golden_batch("blocks_shared_random")
    out = g["outputs"]
    perm = torch.tensor(out["permutation"])
    assert labels[perm].tolist() == out["permuted_labels"]
    miner, seen = SharedRandomMiner(), {}
    for s in range(40):
        a, p, n = miner(emb, labels, generator=torch.Generator().manual_seed(s), permutation=perm)
        assert a.tolist() == out["anchors"]
        for i, j in zip(a.tolist(), p.tolist()):
            seen.setdefault(i, set()).add(j)
    assert [sorted(seen[i]) for i in out["anchors"]] == [sorted(c) for c in out["positive_candidates"]]
    w = distance_weights(pairwise_distance(emb), emb.shape[1], negative_mask(labels[perm]))
    np.testing.assert_allclose(
        w[out["anchors"]].double().numpy(), arr(out["negative_probabilities"]), rtol=1e-4, atol=1e-6
    )


def test_golden_shared_random_draws():
    """Many draws with fresh permutations: the (a, p) / (a, n) frequencies and the class statistics of theirs. The
    paper's T* miner ('shared') and the plain class miner fail."""
    g, emb, labels = _golden_batch("blocks_shared_random")
    out = g["outputs"]
    ap, an, per_call = _draw_frequencies(SharedRandomMiner(), emb, labels, OUR_DRAWS)
    assert per_call == {int(out["statistics"]["triplets_per_call"])}
    assert np.abs(ap - arr(out["anchor_positive_frequency"])).max() < FREQ_TOL
    assert np.abs(an - arr(out["anchor_negative_frequency"])).max() < FREQ_TOL
    for wrong in (MINERS.build("shared"), DistanceWeightedMiner()):
        ap_w, an_w, _ = _draw_frequencies(wrong, emb, labels, 300)
        assert (
            max(
                np.abs(ap_w - arr(out["anchor_positive_frequency"])).max(),
                np.abs(an_w - arr(out["anchor_negative_frequency"])).max(),
            )
            > 0.2
        )


def test_golden_intra_with_replacement():
    """DiVA's batchminer/intra_random.py: the class of each triplet uniform over the batch's classes, a, p, n with
    replacement inside it. distinct=True (no repeats) and a class drawn per sample both fail."""
    g = load_golden("blocks_intra_random")
    labels, draws = torch.tensor(g["inputs"]["labels"]), 1500  # theirs: 3000 calls
    emb = F.normalize(torch.randn(len(labels), 4, generator=torch.Generator().manual_seed(0)), dim=1)

    def frequencies(miner):
        gen, counts = torch.Generator().manual_seed(1), {}
        for _ in range(draws):
            t = miner(emb, labels, generator=gen)
            for k in zip(*(u.tolist() for u in t)):
                counts[k] = counts.get(k, 0) + 1
        total = sum(counts.values())
        return {k: c / total for k, c in counts.items()}, total

    theirs = {tuple(r[:3]): r[3] for r in g["outputs"]["frequencies"]}
    ours, total = frequencies(IntraClassTripletMiner(distinct=False))
    assert total == draws * g["outputs"]["triplets_per_call"]
    assert set(ours) == set(theirs)  # the same support: 107 (a, p, n)
    assert max(abs(ours[k] - theirs[k]) for k in theirs) < 0.008  # largest cell 1/32, sd 0.0017
    cls = (
        np.bincount([int(labels[k[0]]) for k, f in ours.items() for _ in range(round(f * total))], minlength=4) / total
    )
    np.testing.assert_allclose(cls, arr(g["outputs"]["class_frequency"]), atol=0.01)
    repeats = sum(f for k, f in ours.items() if len(set(k)) < 3)
    assert abs(repeats - g["outputs"]["statistics"]["any_repeat"]) < 0.01
    strict, _ = frequencies(IntraClassTripletMiner(distinct=True))
    assert set(strict) != set(theirs)


@pytest.mark.parametrize("case", ["balanced", "uneven"])
def test_golden_dnc_nearest_exact_triplets(case):
    """The official D&C sampler (lib/loss/sampler.py): exactly its triplets, in its order. Pairing the positives with
    the negatives in distance order instead of index order fails."""
    g = load_golden("blocks_dnc_nearest")
    inp, out = g["inputs"][case], g["outputs"][case]
    emb, labels = torch.tensor(inp["embeddings"], dtype=torch.float32), torch.tensor(inp["labels"])
    a, p, n = DnCNearestMiner()(emb, labels)
    assert (a.tolist(), p.tolist(), n.tolist()) == (out["anchors"], out["positives"], out["negatives"])
    d = pairwise_distance(F.normalize(emb, dim=1))
    by_distance = torch.cat(
        [n[a == i][d[i, n[a == i]].argsort()] for i in a.unique()]
    )  # same negatives, distance order
    assert by_distance.tolist() != out["negatives"]
