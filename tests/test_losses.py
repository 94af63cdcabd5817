"""Losses in dml_nb.blocks.losses against pytorch-metric-learning (PML, a test-only reference), gradchecks and edge cases.

Intended differences from PML, also written in nbs/22_losses.ipynb:
* NPair / FastAP / MS / triplet / contrastive / SNR: none for `tuples=None` (and for tuples given as PML indices).
* Margin loss: identical with per-class beta; with a single shared beta PML adds nu*beta unnormalised, we add
  nu * sum over triplets of beta / (number of non-zero terms) (Wu et al.'s form), so that case is tested with nu=0.
* FastAP with a miner's tuples: PML turns tuples into per-sample weights, we restrict the pairs; compared only with
  tuples=None.
"""

import pytest
import torch
import torch.nn.functional as F

pml_losses = pytest.importorskip("pytorch_metric_learning.losses")
pml_miners = pytest.importorskip("pytorch_metric_learning.miners")

from dml_nb.core.registry import LOSSES
from dml_nb.blocks.losses import (
    ContrastiveLoss,
    FastAPLoss,
    MarginLoss,
    MultiSimilarityLoss,
    NPairLoss,
    RDMLLoss,
    SNRContrastiveLoss,
    SoftTripletLoss,
    TripletLoss,
    WeightedMultiSimilarityLoss,
)
from dml_nb.blocks.miners import MultiSimilarityMiner, SemiHardMiner


def batch(n_classes=8, k=4, dim=16, seed=0, dtype=torch.float64, spread=1.0):
    g = torch.Generator().manual_seed(seed)
    labels = torch.arange(n_classes).repeat_interleave(k)
    centres = torch.randn(n_classes, dim, generator=g, dtype=dtype)
    emb = spread * centres[labels] + torch.randn(n_classes * k, dim, generator=g, dtype=dtype)
    return emb, labels


def value_and_grad(fn, emb, *args, **kw):
    e = emb.detach().clone().requires_grad_()
    v = fn(e, *args, **kw)
    v.backward()
    return v.detach(), e.grad


def assert_same(ours, theirs, emb, labels, tuples=None, ours_tuples="same", rtol=1e-6, atol=1e-9):
    ours_t = tuples if ours_tuples == "same" else ours_tuples
    v1, g1 = value_and_grad(lambda e: ours(e, labels, ours_t), emb)
    v2, g2 = value_and_grad(lambda e: theirs(e, labels, tuples), emb)
    assert v1.item() != 0.0, "test batch gives a zero loss; choose a harder batch"
    torch.testing.assert_close(v1, v2, rtol=rtol, atol=atol)
    torch.testing.assert_close(g1, g2, rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("seed", [0, 1])
def test_contrastive_matches_pml(seed):
    emb, labels = batch(seed=seed)
    assert_same(ContrastiveLoss(0.0, 0.5), pml_losses.ContrastiveLoss(pos_margin=0, neg_margin=0.5), emb, labels)
    assert_same(ContrastiveLoss(0.2, 1.0), pml_losses.ContrastiveLoss(pos_margin=0.2, neg_margin=1.0), emb, labels)


@pytest.mark.parametrize("seed", [0, 1])
def test_triplet_matches_pml(seed):
    emb, labels = batch(seed=seed)
    assert_same(TripletLoss(margin=0.2), pml_losses.TripletMarginLoss(margin=0.2), emb, labels)
    tuples = SemiHardMiner(margin=0.2, mode="all")(emb, labels)
    assert len(tuples[0]) > 0
    assert_same(TripletLoss(margin=0.2), pml_losses.TripletMarginLoss(margin=0.2), emb, labels, tuples)


def test_soft_triplet_matches_pml_smooth():
    emb, labels = batch()
    assert_same(SoftTripletLoss(), pml_losses.TripletMarginLoss(margin=0.0, smooth_loss=True), emb, labels)


def test_margin_matches_pml_per_class_beta_and_nu():
    emb, labels = batch(seed=3)
    ours = MarginLoss(margin=0.2, beta=1.2, num_classes=8, nu=0.1)
    theirs = pml_losses.MarginLoss(margin=0.2, beta=1.2, num_classes=8, learn_beta=True, nu=0.1).double()
    with torch.no_grad():
        ours.beta.copy_(torch.linspace(0.9, 1.4, 8, dtype=torch.float32))
        theirs.beta.copy_(torch.linspace(0.9, 1.4, 8, dtype=torch.float64))
    ours.double()
    assert_same(ours, theirs, emb, labels)
    assert ours.beta.grad is not None and theirs.beta.grad is not None
    torch.testing.assert_close(ours.beta.grad, theirs.beta.grad)


def test_margin_matches_pml_shared_beta():
    emb, labels = batch(seed=4)
    ours = MarginLoss(num_classes=None, nu=0.0).double()
    theirs = pml_losses.MarginLoss(margin=0.2, beta=1.2, learn_beta=True, nu=0.0).double()
    assert_same(ours, theirs, emb, labels)
    torch.testing.assert_close(ours.beta.grad, theirs.beta.grad)


@pytest.mark.parametrize("seed", [0, 5])
def test_multi_similarity_matches_pml(seed):
    emb, labels = batch(seed=seed)
    ours, theirs = MultiSimilarityLoss(2, 50, 0.5), pml_losses.MultiSimilarityLoss(alpha=2, beta=50, base=0.5)
    assert_same(ours, theirs, emb, labels)  # all pairs
    pml_tuples = pml_miners.MultiSimilarityMiner(epsilon=0.1)(emb, labels)
    our_tuples = MultiSimilarityMiner(epsilon=0.1)(emb, labels)
    assert_same(ours, theirs, emb, labels, pml_tuples, ours_tuples=our_tuples)  # each with its own miner
    # weights all one: BSPML eq. 7 is the plain loss
    v1, _ = value_and_grad(lambda e: ours(e, labels, our_tuples), emb)
    v2, _ = value_and_grad(lambda e: ours(e, labels, our_tuples, weights=torch.ones(len(labels))), emb)
    torch.testing.assert_close(v1, v2)


def test_npair_matches_pml():
    emb, labels = batch(seed=2)
    assert_same(NPairLoss(), pml_losses.NPairsLoss(), emb, labels)
    # with a miner's pairs (PML keeps the first pair per class in label order; so do we)
    tuples = MultiSimilarityMiner()(emb, labels)
    assert_same(NPairLoss(), pml_losses.NPairsLoss(), emb, labels, tuples)


@pytest.mark.parametrize("bins", [10, 4])
def test_fastap_matches_pml(bins):
    emb, labels = batch(seed=6, spread=0.6)
    assert_same(FastAPLoss(num_bins=bins), pml_losses.FastAPLoss(num_bins=bins), emb, labels)


def test_snr_matches_pml():
    emb, labels = batch(seed=7)
    assert_same(
        SNRContrastiveLoss(0.0, 1.0),
        pml_losses.SignalToNoiseRatioContrastiveLoss(pos_margin=0, neg_margin=1),
        emb,
        labels,
    )


def _gradcheck(fn, emb):
    e = emb.detach().clone().requires_grad_()
    assert torch.autograd.gradcheck(fn, (e,), eps=1e-6, atol=1e-5)


def test_gradcheck_soft_triplet_weighted_ms_rdml():
    emb, labels = batch(n_classes=4, k=3, dim=6, seed=8)
    _gradcheck(lambda e: SoftTripletLoss()(e, labels), emb)
    _gradcheck(lambda e: RDMLLoss(eta=2.0)(e, labels), emb)
    _gradcheck(lambda e: RDMLLoss(eta=0.5, balance=False)(e, labels), emb)
    tuples = MultiSimilarityMiner()(emb, labels)
    w = torch.rand(len(labels), generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    wms = WeightedMultiSimilarityLoss(alpha=2, beta=10, base=0.5)  # beta 10 keeps finite differences accurate
    _gradcheck(lambda e: wms(e, labels, tuples, weights=w), emb)
    _gradcheck(lambda e: wms(e, labels, None, weights=w), emb)


def test_weighted_ms_follows_eq7():
    emb, labels = batch(n_classes=5, k=4, dim=8, seed=9)
    loss = WeightedMultiSimilarityLoss()
    tuples = MultiSimilarityMiner()(emb, labels)
    w = torch.rand(len(labels), generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    x = F.normalize(emb, dim=1)
    s = x @ x.T
    a1, p, a2, n = tuples
    total = 0.0
    for i in range(len(labels)):
        P, N = p[a1 == i], n[a2 == i]
        if len(P):
            total += w[i] * w[P].mean() / 2 * torch.log1p(torch.exp(-2 * (s[i, P] - 1)).sum())
        if len(N):
            total += w[i] * w[N].mean() / 50 * torch.log1p(torch.exp(50 * (s[i, N] - 1)).sum())
    torch.testing.assert_close(loss(emb, labels, tuples, weights=w), total / len(labels))
    # zero weight on a sample removes it as anchor and as partner
    w0 = w.clone()
    w0[0] = 0
    assert loss(emb, labels, tuples, weights=w0) < loss(emb, labels, tuples, weights=w)
    assert loss(emb, labels, tuples, weights=torch.zeros_like(w)).item() == 0.0


def test_per_sample_terms_match_batch_terms():
    emb, labels = batch(n_classes=6, k=5, dim=8, seed=10)
    loss = MultiSimilarityLoss()
    xp, xn = loss.per_sample_terms(emb, labels, chunk_size=7)
    # eq. 3 with all pairs: the loss over all pairs is the mean of xi+ + xi-
    torch.testing.assert_close((xp + xn).mean(), loss(emb, labels))
    assert xp.requires_grad is False and (xp >= 0).all() and (xn >= 0).all()


@pytest.mark.parametrize(
    "name",
    sorted(
        n
        for n in LOSSES
        if n
        in {
            "contrastive",
            "fastap",
            "margin",
            "multi_similarity",
            "npair",
            "rdml",
            "snr",
            "soft_triplet",
            "triplet",
            "weighted_multi_similarity",
        }
    ),
)
def test_edge_cases(name):
    loss = LOSSES.build(name, num_classes=3) if name == "margin" else LOSSES.build(name)
    emb, labels = batch(n_classes=3, k=2, dim=8, seed=11, dtype=torch.float32)
    kind = 3 if name in ("triplet", "soft_triplet", "margin") else 4
    empty = (torch.empty(0, dtype=torch.long),) * kind
    for e, l, t in [
        (emb, labels, empty),  # miner found nothing
        (emb[:1], labels[:1], None),  # a single sample
        (emb[:4], torch.zeros(4, dtype=torch.long), None),  # one class
        (emb[:3], torch.arange(3), None),
    ]:  # singletons
        x = e.detach().clone().requires_grad_()
        v = loss(x, l, t)
        assert v.dim() == 0 and torch.isfinite(v)
        v.backward()
        assert x.grad is not None and torch.isfinite(x.grad).all()
        if t is not None or (kind == 3 and len(l.unique()) == 1) or len(l) == 1:
            assert v.item() == 0.0


def test_all_weights_zero_and_bad_weights():
    emb, labels = batch(n_classes=3, k=2, dim=8, dtype=torch.float32)
    loss = WeightedMultiSimilarityLoss()
    x = emb.clone().requires_grad_()
    v = loss(x, labels, weights=torch.zeros(6))
    v.backward()
    assert v.item() == 0.0 and torch.isfinite(x.grad).all()
    with pytest.raises(ValueError, match="one weight per batch sample"):
        loss(emb, labels, weights=torch.ones(5))


def test_margin_label_range_error_and_param_lr():
    emb, labels = batch(n_classes=3, k=2, dim=8, dtype=torch.float32)
    with pytest.raises(ValueError, match="num_classes"):
        MarginLoss(num_classes=2)(emb, labels)
    m = LOSSES.build("margin", num_classes=3)
    assert m.param_lr == 5e-4 and [n for n, _ in m.named_parameters()] == ["beta"]
    assert LOSSES.get("margin").default_miner == "distance_weighted"
    assert LOSSES.get("triplet").default_miner == "semihard"


# ---------------------------------------------------------------- options of issues 11 / 12


def test_contrastive_cosine_reading_matches_pml_cosine_similarity():
    from pytorch_metric_learning.distances import CosineSimilarity

    emb, labels = batch(seed=12)
    theirs = pml_losses.ContrastiveLoss(pos_margin=1, neg_margin=0, distance=CosineSimilarity())
    assert_same(ContrastiveLoss(metric="cosine"), theirs, emb, labels)
    assert (ContrastiveLoss(metric="cosine").pos_margin, ContrastiveLoss(metric="cosine").neg_margin) == (1.0, 0.0)
    with pytest.raises(ValueError, match="metric must be one of"):
        ContrastiveLoss(metric="dot")


def test_margin_beta_readings():
    emb, labels = batch(n_classes=3, k=2, dim=8, dtype=torch.float32)
    fixed = LOSSES.build("margin", num_classes=3, class_specific_beta=False, learn_beta=False)  # official D&C
    assert list(fixed.parameters()) == [] and fixed.beta.shape == (1,) and fixed.param_lr == 5e-4
    per_class = LOSSES.build("margin", num_classes=3)  # DiVA / MIC
    assert [n for n, _ in per_class.named_parameters()] == ["beta"] and per_class.beta.shape == (3,)
    scalar_learned = LOSSES.build("margin", num_classes=3, class_specific_beta=False)
    assert scalar_learned.beta.shape == (1,) and scalar_learned.beta.requires_grad
    # a fixed scalar beta equals a per-class beta with all entries 1.2 that is never updated
    torch.testing.assert_close(fixed(emb, labels), per_class(emb, labels))


def test_fixed_beta_never_reaches_an_optimiser():
    from dml_nb.training.context import Method

    class Tiny(Method):
        def __init__(self, **loss_options):
            super().__init__()
            self.head = torch.nn.Linear(8, 4)
            self.loss = MarginLoss(num_classes=3, **loss_options)

        def training_step(self, b):
            return {"loss": self.loss(self.head(b["x"]), b["y"])}

    emb, labels = batch(n_classes=3, k=4, dim=8, dtype=torch.float32)
    m = Tiny(class_specific_beta=False, learn_beta=False)
    groups = m.param_groups(lr=1e-3, weight_decay=0.0)
    assert all(p is not m.loss.beta for g in groups for p in g["params"])
    assert [g["name"] for g in groups] == ["other"]  # no group of its own: nothing to train
    opt = torch.optim.Adam(groups)
    for _ in range(5):
        opt.zero_grad()
        m.training_step({"x": emb, "y": labels})["loss"].backward()
        opt.step()
    assert torch.equal(m.loss.beta, torch.tensor([1.2]))
    learned = Tiny()
    groups = learned.param_groups(lr=1e-3, weight_decay=4e-4)
    beta_group = [g for g in groups if any(p is learned.loss.beta for p in g["params"])]
    assert len(beta_group) == 1 and beta_group[0]["lr"] == 5e-4 and beta_group[0]["weight_decay"] == 0.0
    assert "beta" in dict(m.loss.state_dict())  # the fixed beta is still checkpointed


def test_margin_distance_has_the_authors_epsilon():
    emb, labels = batch(n_classes=2, k=2, dim=4, dtype=torch.float64)
    loss = MarginLoss(num_classes=2).double()
    same = (torch.tensor([0]), torch.tensor([0]), torch.tensor([0]))  # a = p = n: d = sqrt(1e-8) = 1e-4
    torch.testing.assert_close(loss(emb, labels, same), torch.tensor(1.2 - 1e-4 + 0.2, dtype=torch.float64))


# ---------------------------------------------------------------- golden tests: the authors' margin losses

import numpy as np
from golden import arr, load_golden

from dml_nb.blocks.miners import DnCNearestMiner


def test_golden_margin_diva_per_class_beta():
    """DiVA's criteria/margin.py (per-class beta, learned; PyTorch >= 1.2, so its pair count is the number of triplets
    with a non-zero term) on fixed triplets with repeated indices: value, gradient wrt the embeddings and wrt beta.
    One shared beta, or counting terms, fails."""
    g = load_golden("blocks_margin_diva")
    inp, out = g["inputs"], g["outputs"]
    emb, labels = torch.tensor(inp["embeddings"], dtype=torch.float32), torch.tensor(inp["labels"])
    tuples = tuple(torch.tensor(t) for t in zip(*inp["triplets"]))
    loss = MarginLoss(num_classes=4, pair_count="triplets")
    with torch.no_grad():
        loss.beta.copy_(torch.tensor(inp["beta"]))
    e = emb.clone().requires_grad_()
    v = loss(e, labels, tuples)
    v.backward()
    assert abs(v.item() - out["loss"]) < 1e-6
    np.testing.assert_allclose(e.grad.numpy(), arr(out["gradient"]), atol=1e-6)
    np.testing.assert_allclose(loss.beta.grad.numpy(), arr(out["beta_gradient"]), atol=1e-6)
    shared = MarginLoss(num_classes=4, class_specific_beta=False, pair_count="triplets")
    with torch.no_grad():
        shared.beta.fill_(float(np.mean(inp["beta"])))
    assert abs(shared(emb, labels, tuples).item() - out["loss"]) > 1e-3
    terms = MarginLoss(num_classes=4)
    with torch.no_grad():
        terms.beta.copy_(torch.tensor(inp["beta"]))
    assert abs(terms(emb, labels, tuples).item() - out["loss"]) > 1e-2


@pytest.mark.parametrize("case", ["balanced", "uneven"])
@pytest.mark.parametrize("torch_version,pair_count", [("pytorch_1_0", "terms"), ("pytorch_2", "triplets")])
def test_golden_dnc_margin_fixed_beta(case, torch_version, pair_count):
    """The official D&C margin loss (lib/loss/margin_loss.py with its own sampler, one scalar beta never given to
    the optimiser): the gradient at the first step and the loss over 4 Adam steps of the embeddings, as their code
    computed it on the PyTorch of its release (non-zero terms counted) and as it runs today (triplets counted). A
    learned beta (in its own group at 5e-4, as DiVA's) moves and the later losses fail; so does the other count."""
    g = load_golden("blocks_dnc_nearest")
    inp, out = g["inputs"][case], g["outputs"][case][torch_version]
    labels = torch.tensor(inp["labels"])

    def run(**options):
        loss, miner = MarginLoss(num_classes=int(labels.max()) + 1, **options), DnCNearestMiner()
        e = torch.nn.Parameter(torch.tensor(inp["embeddings"], dtype=torch.float32))
        groups = [{"params": [e], "lr": 0.01}]
        if list(loss.parameters()):
            groups.append({"params": list(loss.parameters()), "lr": loss.param_lr})
        opt, values, grad0 = torch.optim.Adam(groups), [], None
        for _ in range(4):
            opt.zero_grad()
            v = loss(e, labels, miner(e, labels))
            v.backward()
            values.append(v.item())
            grad0 = e.grad.clone() if grad0 is None else grad0
            opt.step()
        return values, grad0, loss.beta

    values, grad0, beta = run(class_specific_beta=False, learn_beta=False, pair_count=pair_count)
    np.testing.assert_allclose(values, out["loss_per_step"], rtol=1e-5)
    np.testing.assert_allclose(grad0.numpy(), arr(out["gradient_step0"]), atol=1e-6)
    assert beta.item() == out["beta_after"] == pytest.approx(1.2)
    learned, _, _ = run(class_specific_beta=False, learn_beta=True, pair_count=pair_count)
    assert abs(learned[-1] - out["loss_per_step"][-1]) > 2e-5  # beyond the rtol 1e-5 above
    other, _, _ = run(
        class_specific_beta=False, learn_beta=False, pair_count={"terms": "triplets"}.get(pair_count, "terms")
    )
    assert abs(other[0] - out["loss_per_step"][0]) > 1e-2


# ---------------------------------------------------------------- distance objects (issue 16)


def test_losses_take_pml_distances():
    "A loss given a distance matches PML's loss given PML's same distance; the default is the loss's own."
    from pytorch_metric_learning import distances as pml_d
    from dml_nb.blocks.distances import CosineSimilarity, DotProductSimilarity, EuclideanDistance

    emb, labels = batch(seed=21, spread=0.5)
    for ours_d, theirs_d in [
        (CosineSimilarity(), pml_d.CosineSimilarity()),
        (EuclideanDistance(squared=True), pml_d.LpDistance(power=2)),
    ]:
        assert_same(
            TripletLoss(margin=0.1, distance=ours_d),
            pml_losses.TripletMarginLoss(margin=0.1, distance=theirs_d),
            emb,
            labels,
        )
    assert_same(
        ContrastiveLoss(pos_margin=0.9, neg_margin=0.2, distance=DotProductSimilarity(normalize=True)),
        pml_losses.ContrastiveLoss(pos_margin=0.9, neg_margin=0.2, distance=pml_d.DotProductSimilarity()),
        emb,
        labels,
    )
    assert_same(
        MultiSimilarityLoss(alpha=2, beta=5, distance=DotProductSimilarity()),
        pml_losses.MultiSimilarityLoss(
            alpha=2, beta=5, base=0.5, distance=pml_d.DotProductSimilarity(normalize_embeddings=False)
        ),
        emb / 4,
        labels,
    )
    with pytest.raises(ValueError, match="similarity threshold"):
        MultiSimilarityLoss(distance="euclidean")
    e32, l32 = emb.float(), labels
    assert torch.equal(TripletLoss()(e32, l32), TripletLoss(distance="euclidean")(e32, l32))
    assert torch.equal(MultiSimilarityLoss()(e32, l32), MultiSimilarityLoss(distance="cosine")(e32, l32))
    with pytest.raises(ValueError, match="Valid distances: cosine"):
        TripletLoss(distance="manhatan")
