"""Divide and Conquer (dml_nb.methods.dnc): cluster re-matching and k-means against the authors' code (golden fixture
`dnc_rematch`), cluster-restricted batches, slice-local gradients, the three phases, K = 1 = baseline, the Table 6
groupings, proxies merged for the finetune, degenerate settings refused, and exact resume of a killed run."""

import tempfile

import numpy as np
import pytest
import torch

from golden import load_golden, arr
from dml_nb.core.registry import METHODS, Registry
from dml_nb.evaluation.clustering import cluster_statistics, match_clusters
from dml_nb.methods.dnc import (
    ClusterError,
    DivideAndConquer,
    PhaseSampler,
    cluster_batch_sampler,
    label_grouping,
    random_partition,
)
from dml_nb.training.callbacks import Callback
from dml_nb.training.learner import Learner, NoTuplesError
from dml_nb.training.checkpoint import load_checkpoint
from dml_nb.methods.base import BaselineMethod
from dml_nb.evaluation.clustering import kmeans_assign
from dml_nb.blocks.models import build_backbone
from dml_nb.data.samplers import ClassBalancedBatchSampler, usable_members

torch.set_num_threads(min(2, torch.get_num_threads()))


def backbone(seed=0, width=4):
    torch.manual_seed(seed)
    return build_backbone("small_cnn", width=width, feature_dim=4 * width)


@pytest.fixture(scope="module")
def shapes(shapes4):
    return shapes4  # train, train with test transforms, test (conftest.py)


class Recording(DivideAndConquer):
    "Records (epoch, group, indices, assignments at that step, embedding width) of every training step."

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.seen = []

    def training_step(self, batch):
        out = super().training_step(batch)
        self.seen.append((batch["epoch"], batch["group"], batch["index"].tolist(), self.assignments.clone()))
        return out


def run(shapes, run_dir=None, callbacks=(), epochs=4, cls=DivideAndConquer, seed=0, **options):
    train, train_eval, test = shapes
    options = {"embedding_dim": 8, "num_learners": 2, "finetune_epochs": 1, **options}
    method = cls(backbone(), train.num_classes, train.labels, **options)
    method.cluster_dataset = train_eval
    sampler = ClassBalancedBatchSampler(train.labels, batch_size=16, samples_per_class=4, seed=1)
    return Learner(
        method,
        train,
        sampler,
        epochs=epochs,
        lr=1e-3,
        eval_sets={"test": test},
        metrics=("recall@1",),
        run_dir=run_dir,
        checkpoint_every_steps=3,
        callbacks=callbacks,
        progress=False,
        seed=seed,
    )


# clustering ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("k", [2, 3, 5, 8])
def test_hungarian_undoes_any_permutation(k):
    rng = np.random.default_rng(k)
    truth = rng.integers(0, k, 500)
    truth[:k] = np.arange(k)  # every cluster non-empty
    for _ in range(5):
        perm = rng.permutation(k)
        np.testing.assert_array_equal(match_clusters(truth, perm[truth], k), truth)
        noisy = perm[truth].copy()
        flip = rng.random(500) < 0.1
        noisy[flip] = rng.integers(0, k, flip.sum())
        matched = match_clusters(truth, noisy, k)
        assert (matched == truth).mean() >= 0.85  # identities kept through a noisy re-clustering
        # the matched ids are a pure renaming of the noisy ones
        assert len(np.unique(np.stack([matched, noisy]), axis=1).T) == len(np.unique(noisy))


def test_hungarian_maximises_overlap_against_brute_force():
    import itertools

    rng = np.random.default_rng(0)
    k = 4
    prev, cur = rng.integers(0, k, 200), rng.integers(0, k, 200)
    best = max(itertools.permutations(range(k)), key=lambda p: (np.array(p)[cur] == prev).sum())
    assert (match_clusters(prev, cur, k) == prev).sum() == (np.array(best)[cur] == prev).sum()


def test_kmeans_finds_separated_groups_and_is_seeded():
    g = torch.Generator().manual_seed(1)
    centres = torch.nn.functional.normalize(torch.randn(3, 16, generator=g), dim=1) * 4
    x = (centres[:, None] + 0.05 * torch.randn(3, 40, 16, generator=g)).reshape(-1, 16)
    truth = np.repeat(np.arange(3), 40)
    a = kmeans_assign(x, 3, seed=3)
    np.testing.assert_array_equal(match_clusters(truth, a, 3), truth)
    np.testing.assert_array_equal(kmeans_assign(x, 3, seed=3), a)
    with pytest.raises(ValueError, match="cannot cluster"):
        kmeans_assign(x[:2], 3)


def test_groupings_and_statistics():
    y = np.repeat(np.arange(10), 3)
    part = random_partition(30, 4, seed=0)
    assert sorted(np.bincount(part)) == [7, 7, 8, 8]
    groups = label_grouping(y, 4)
    for c in range(10):  # a class lies in exactly one group
        assert len(np.unique(groups[y == c])) == 1
    sizes, classes = cluster_statistics(groups, y, 4)
    assert sizes.sum() == 30 and classes.sum() == 10
    sizes, classes = cluster_statistics(part, y, 4)
    assert classes.sum() >= 10 and (classes <= 10).all()


# steps --------------------------------------------------------------------------------------------------------


def test_slice_gradient_touches_only_its_rows_and_its_own_loss():
    y = np.repeat(np.arange(8), 4)
    wu = {"class_specific_beta": True, "learn_beta": True}
    m = DivideAndConquer(backbone(), 8, y, embedding_dim=12, num_learners=3, loss_options=wu, miner="distance_weighted")
    x, yb = torch.randn(32, 3, 32, 32), torch.as_tensor(y)
    for k in range(3):
        m.zero_grad()
        m.training_step({"x": x, "y": yb, "group": k, "epoch": 0})["loss"].backward()
        rows = m.model.head.linear.weight.grad.abs().sum(1) > 0
        assert rows.tolist() == [k * 4 <= r < (k + 1) * 4 for r in range(12)]
        bias = m.model.head.linear.bias.grad != 0
        assert not bias[[r for r in range(12) if not k * 4 <= r < (k + 1) * 4]].any()
        for j, loss in enumerate(m.learner_losses):
            assert (loss.beta.grad is not None and loss.beta.grad.abs().sum() > 0) == (j == k)
        assert m.loss.beta.grad is None  # the finetune loss is untouched


def test_finetune_batch_and_nosplit_use_the_full_embedding():
    y = np.repeat(np.arange(8), 4)
    x, yb = torch.randn(32, 3, 32, 32), torch.as_tensor(y)
    for grouping, group in (("kmeans", None), ("kmeans_nosplit", 1)):
        m = DivideAndConquer(backbone(), 8, y, embedding_dim=12, num_learners=3, grouping=grouping, loss="triplet")
        m.zero_grad()
        m.training_step({"x": x, "y": yb, "group": group, "epoch": 0})["loss"].backward()
        assert (m.model.head.linear.weight.grad.abs().sum(1) > 0).all()
    # the official code's variant: cluster batches train the full embedding from full_embedding_epoch on
    m = DivideAndConquer(backbone(), 8, y, embedding_dim=12, num_learners=3, loss="triplet", full_embedding_epoch=2)
    for epoch, expect in ((1, 4), (2, 12)):
        m.zero_grad()
        m.training_step({"x": x, "y": yb, "group": 0, "epoch": epoch})["loss"].backward()
        assert int((m.model.head.linear.weight.grad.abs().sum(1) > 0).sum()) == expect


def test_proxy_losses_get_the_dimension_they_work_on():
    y = np.repeat(np.arange(8), 4)
    m = DivideAndConquer(backbone(), 8, y, embedding_dim=12, num_learners=3, loss="proxy_nca")
    assert m.miner is None
    assert m.loss.proxies.shape[1] == 12 and all(l.proxies.shape[1] == 4 for l in m.learner_losses)
    x, yb = torch.randn(32, 3, 32, 32), torch.as_tensor(y)
    assert torch.isfinite(m.training_step({"x": x, "y": yb, "group": 2, "epoch": 0})["loss"])


def test_options_are_validated():
    y = np.zeros(8, dtype=int)
    with pytest.raises(ValueError, match="Valid cluster_on values: embedding, features"):
        DivideAndConquer(backbone(), 2, y, cluster_on="penultimate")
    with pytest.raises(ValueError, match="not both"):
        DivideAndConquer(backbone(), 2, y, finetune_epoch=3, finetune_epochs=2)
    with pytest.raises(ValueError, match="Valid cluster_batches schedules: proportional, round_robin, uniform"):
        DivideAndConquer(backbone(), 2, y, cluster_batches="roundrobin")
    with pytest.raises(ValueError, match="Valid rematch rules: hungarian, official"):
        DivideAndConquer(backbone(), 2, y, rematch="inverse")
    with pytest.raises(ValueError, match="share of the run's epochs"):
        DivideAndConquer(backbone(), 2, y, finetune_fraction=1.5)
    with pytest.raises(ValueError, match="only used by grouping='labels'"):
        DivideAndConquer(backbone(), 2, y, num_learners=2, class_groups=[0, 1])
    assert METHODS._items["dnc"] is DivideAndConquer  # registered (METHODS.build imports every recipe module)
    reg = Registry("method")
    reg.register("dnc")(DivideAndConquer)
    with pytest.raises(TypeError, match="has no option 'k'"):
        reg.build("dnc", backbone=backbone(), num_classes=2, train_labels=y, k=4)
    assert isinstance(
        reg.build("dnc", backbone=backbone(), num_classes=2, train_labels=y, num_learners=2, embedding_dim=8),
        DivideAndConquer,
    )


# training runs ------------------------------------------------------------------------------------------------


def test_batches_stay_in_their_cluster_and_finetune_uses_all_data(shapes):
    learn = run(shapes, cls=Recording, epochs=4)
    hist = learn.fit()
    seen = learn.method.seen
    assert {e for e, *_ in seen} == {0, 1, 2, 3}
    assert [r["dnc/full_embedding"] for r in hist] == [0, 1, 1, 1]  # int(0.4 * 4) = 1
    for epoch, group, idx, assign in seen:
        if epoch < 3:
            assert group in (0, 1) and (assign[idx] == group).all()
        else:
            assert group is None
    finetune = [i for e, g, idx, _ in seen if e == 3 for i in idx]
    divide = [seen[i][3] for i in range(len(seen)) if seen[i][0] == 0][0]
    assert len(set(divide[finetune].tolist())) == 2  # finetune batches mix both clusters
    # both learners train in every divide epoch, round-robin
    for e in range(3):
        groups = [g for ep, g, *_ in seen if ep == e]
        assert set(groups) == {0, 1} and groups[:2] in ([0, 1], [1, 0])
    assert [r["dnc/reclustered"] for r in hist[:3]] == [1, 0, 1]
    assert "dnc/kept_fraction" in hist[2] and "dnc/cluster0/size" not in hist[3]


def test_k1_is_the_baseline(shapes):
    train, _, test = shapes
    sampler = lambda: ClassBalancedBatchSampler(train.labels, batch_size=16, samples_per_class=4, seed=1)
    kw = dict(epochs=2, lr=1e-3, eval_sets={"test": test}, metrics=("recall@1",), progress=False, seed=0)
    # K = 1 with torch's Linear init and Wu et al.'s margin reading is the plain baseline, step for step
    dnc = DivideAndConquer(
        backbone(),
        train.num_classes,
        train.labels,
        embedding_dim=8,
        num_learners=1,
        init="default",
        loss_options={"class_specific_beta": True, "learn_beta": True},
        miner="distance_weighted",
    )
    h1 = Learner(dnc, train, sampler(), **kw).fit()
    base = BaselineMethod(backbone(), train.num_classes, embedding_dim=8, loss="margin")
    h2 = Learner(base, train, sampler(), **kw).fit()
    assert [r["test/recall@1"] for r in h1] == [r["test/recall@1"] for r in h2]
    assert [r["loss"] for r in h1] == [r["loss"] for r in h2]
    for a, b in zip(dnc.model.parameters(), base.model.parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("grouping", ["random", "labels", "kmeans_nosplit"])
def test_other_groupings_train(shapes, grouping):
    learn = run(shapes, cls=Recording, epochs=2, grouping=grouping, finetune_epochs=0)
    hist = learn.fit()
    first = learn.method.seen[0][3]
    if grouping == "labels":
        y = shapes[0].labels
        assert all(len(np.unique(first.numpy()[y == c])) == 1 for c in np.unique(y))
    if grouping in ("random", "labels"):  # fixed: never re-drawn
        assert all(torch.equal(s[3], first) for s in learn.method.seen)
    assert all(np.isfinite(r["loss"]) for r in hist)


def test_cluster_on_features(shapes):
    learn = run(shapes, epochs=1, cluster_on="features")
    vec = learn.method.cluster_vectors(learn.context)
    assert vec.shape == (len(shapes[0]), learn.method.model.backbone.feature_dim)
    torch.testing.assert_close(vec.norm(dim=1), torch.ones(len(vec)))
    learn.method.cluster_on = "embedding"
    assert learn.method.cluster_vectors(learn.context).shape == (len(shapes[0]), 8)


class KillAt(Callback):
    def __init__(self, epoch, step):
        self.at = (epoch, step)

    def after_step(self, learner, logs):
        if (learner.epoch, learner.step) == self.at:
            raise KeyboardInterrupt("killed")


@pytest.mark.parametrize("kill", [(1, 4), (2, 4)])
def test_resume_is_exact(shapes, kill):
    ref = run(shapes, tempfile.mkdtemp(), epochs=4)
    ref_hist = ref.fit()
    d = tempfile.mkdtemp()
    with pytest.raises(KeyboardInterrupt):
        run(shapes, d, [KillAt(*kill)], epochs=4).fit()
    ck = load_checkpoint(f"{d}/checkpoint.pt")
    assert (ck["epoch"], ck["step"]) == (kill[0], 3)
    assert (ck["method"]["assignments"] >= 0).all()
    res = run(shapes, d, epochs=4)
    res_hist = res.fit()
    assert res.resumed
    drop = lambda h: [{k: v for k, v in r.items() if k != "time"} for r in h]
    assert drop(res_hist) == drop(ref_hist)
    for (k, a), b in zip(ref.method.state_dict().items(), res.method.state_dict().values()):
        assert torch.equal(a, b), k


# against the authors' code (golden fixture dnc_rematch) -------------------------------------------------------------


@pytest.mark.parametrize("case", ["three_cycle_K3", "cycle_K4", "swaps_K4", "random_K8", "identity_K5"])
def test_official_rematch_matches_the_code(case):
    g = load_golden("dnc_rematch")
    x, out = g["inputs"][case], g["outputs"][case]
    prev, cur, k = arr(x["previous"], np.int64), arr(x["current"], np.int64), x["K"]
    np.testing.assert_array_equal(match_clusters(prev, cur, k, rule="official"), out["official"])
    # the code's L1 costs between membership vectors = |new| + |old| - 2 overlap: the same optimum as max overlap
    overlap = np.bincount(cur * k + prev, minlength=k * k).reshape(k, k)
    l1 = np.bincount(cur, minlength=k)[:, None] + np.bincount(prev, minlength=k)[None, :] - 2 * overlap
    np.testing.assert_allclose(l1, arr(out["costs_L1"]))
    intended = match_clusters(prev, cur, k)  # rule="hungarian"
    same = np.array_equal(intended, out["official"])
    perm = np.array([np.bincount(intended[cur == i], minlength=k).argmax() for i in range(k)])  # new id -> old id
    assert same == np.array_equal(perm[perm], np.arange(k))  # they agree exactly when the permutation is an involution
    assert (intended == prev).mean() >= (np.asarray(out["official"]) == prev).mean()


def test_hungarian_reading_fails_the_official_fixture():
    g = load_golden("dnc_rematch")
    x, out = g["inputs"]["three_cycle_K3"], g["outputs"]["three_cycle_K3"]
    prev, cur = arr(x["previous"], np.int64), arr(x["current"], np.int64)
    assert not np.array_equal(match_clusters(prev, cur, 3), out["official"])
    assert (np.asarray(out["official"]) == prev).mean() < 0.1 < 0.9 < (match_clusters(prev, cur, 3) == prev).mean()


@pytest.mark.parametrize("k", [3, 5])
def test_kmeans_matches_the_code(k):
    g = load_golden("dnc_rematch")
    x = arr(g["inputs"]["kmeans"]["features"], np.float32)
    want = np.asarray(g["outputs"]["kmeans"]["labels"][str(k)])
    np.testing.assert_array_equal(kmeans_assign(x, k), want)  # seed 1234, 100 iterations, 1 run, every point
    assert not np.array_equal(kmeans_assign(x, k, seed=0), want)  # another seed numbers (and draws) them differently


# phases, losses, proxies, degenerate settings -------------------------------------------------------------------


def test_phase_defaults_follow_the_official_split():
    y = np.repeat(np.arange(8), 4)
    m = DivideAndConquer(backbone(), 8, y, embedding_dim=8, num_learners=2, loss="triplet")
    assert (m.full_embedding_start(200), m.finetune_start(200)) == (80, 190)
    assert (m.full_embedding_start(150), m.finetune_start(150)) == (60, 142)
    lit = DivideAndConquer(
        backbone(), 8, y, embedding_dim=8, num_learners=2, loss="triplet", full_embedding_epoch=80, finetune_epoch=190
    )
    assert (lit.full_embedding_start(80), lit.finetune_start(80)) == (80, 190)  # --nb-epochs=80: slices throughout


def test_official_margin_is_the_default_and_its_beta_is_not_optimised():
    y = np.repeat(np.arange(8), 4)
    m = DivideAndConquer(backbone(), 8, y, embedding_dim=12, num_learners=3)
    assert type(m.miner).__name__ == "DnCNearestMiner"
    for loss in [m.loss, *m.learner_losses]:
        assert loss.beta.numel() == 1 and not loss.beta.requires_grad and float(loss.beta) == pytest.approx(1.2)
    assert [g["name"] for g in m.param_groups(1e-5, 1e-4)] == ["backbone", "heads"]
    wu = DivideAndConquer(
        backbone(),
        8,
        y,
        embedding_dim=12,
        num_learners=3,
        miner="distance_weighted",
        loss_options={"class_specific_beta": True, "learn_beta": True},
    )
    assert wu.loss.beta.numel() == 8 and wu.loss.beta.requires_grad
    trip = DivideAndConquer(backbone(), 8, y, embedding_dim=12, num_learners=3, loss="triplet")
    assert type(trip.miner).__name__ != "DnCNearestMiner"  # other losses keep their own default miner


def test_proxies_are_merged_once_for_the_full_embedding(shapes):
    learn = run(shapes, epochs=3, loss="proxy_nca", full_embedding_epoch=2, finetune_epochs=0)
    m = learn.method
    before = [l.proxies.detach().clone() for l in m.learner_losses]
    assert not bool(m.proxies_merged)
    learn.fit()
    assert bool(m.proxies_merged)
    # merged at the start of epoch 2 from the learners' proxies as they were then; check the construction directly
    fresh = DivideAndConquer(
        backbone(), shapes[0].num_classes, shapes[0].labels, embedding_dim=8, num_learners=2, loss="proxy_nca"
    )
    assert fresh.merge_proxies() and not fresh.merge_proxies()  # once
    joined = torch.cat([torch.nn.functional.normalize(l.proxies, dim=1) for l in fresh.learner_losses], 1) / 2**0.5
    torch.testing.assert_close(fresh.loss.proxies.detach(), joined)
    off = DivideAndConquer(
        backbone(),
        shapes[0].num_classes,
        shapes[0].labels,
        embedding_dim=8,
        num_learners=2,
        loss="proxy_nca",
        finetune_proxies="fresh",
    )
    p0 = off.loss.proxies.detach().clone()
    lf = run(shapes, epochs=2, loss="proxy_nca", finetune_proxies="fresh", finetune_epochs=1)
    lf.fit()
    assert not bool(lf.method.proxies_merged)
    assert before[0].shape == (shapes[0].num_classes, 4) and p0.shape == (shapes[0].num_classes, 8)


def test_more_learners_than_classes_is_refused():
    y = np.repeat(np.arange(6), 4)
    with pytest.raises(ValueError, match="training set has 6 classes"):
        DivideAndConquer(backbone(), 6, y, embedding_dim=16, num_learners=8)


def test_a_cluster_that_cannot_form_a_batch_stops_the_run(shapes):
    train = shapes[0]
    assign = np.zeros(len(train), dtype=int)
    assign[train.labels == 0] = 1  # learner 1 gets a single class: no negatives
    with pytest.raises(ClusterError, match=r"learner 1 \(cluster of 4 images, 1 class"):
        cluster_batch_sampler(train.labels, assign, 2, 16, 4)

    class OneClassCluster(DivideAndConquer):
        def recluster(self, learner):
            self.assignments.copy_(torch.as_tensor(assign))
            self.clustered_epoch.fill_(learner.epoch)

    learn = run(shapes, epochs=2, cls=OneClassCluster)
    with pytest.raises(ClusterError, match="Use fewer learners"):
        learn.fit()
    assert learn.global_step == 0  # refused before any step


def test_uniform_schedule_missing_a_learner_is_an_error(shapes):
    learn = run(shapes, epochs=1, num_learners=4, embedding_dim=8, cluster_batches="uniform", finetune_epochs=0)
    learn.sampler = PhaseSampler(learn.sampler)
    m = learn.method
    m.before_fit(learn.context)
    rr = m._sampler
    # find an epoch in which the uniform draws skip a learner (few steps per epoch make it likely) and check the stop
    m.recluster(learn.context)
    m._use_clusters(learn.context)
    epochs = [e for e in range(400) if 0 in rr.clusters.counts(e)]
    if not epochs:
        pytest.skip("no epoch without a learner among the first 400")
    learn.epoch = epochs[0]
    m.clustered_epoch.fill_(epochs[0])
    with pytest.raises(ClusterError, match="get no batch in epoch"):
        m.before_epoch(learn.context)


def test_every_learner_gets_the_same_updates_and_logs_its_tuples(shapes8):
    learn = run(shapes8, cls=Recording, epochs=3, num_learners=4, embedding_dim=8, finetune_epochs=0)
    hist = learn.fit()
    for e, row in enumerate(hist):
        groups = [g for ep, g, *_ in learn.method.seen if ep == e]
        counts = np.bincount(groups, minlength=4)
        assert len(set(counts)) == 1 and counts[0] == row["dnc/learner0/batches"]
        assign = next(a for ep, g, idx, a in learn.method.seen if ep == e).numpy()
        usable = [len(usable_members(shapes8[0].labels, np.flatnonzero(assign == k))) for k in range(4)]
        assert counts[0] == max(1, max(usable) // 16)  # the largest cluster's batches, for every learner
        assert all(row[f"tuples/learner{k}"] > 0 for k in range(4))


def test_a_learner_without_tuples_stops_the_run(shapes):
    class NoTuples(DivideAndConquer):
        def training_step(self, batch):
            out = super().training_step(batch)
            if batch.get("group") == 1:
                out["tuples/learner1"] = 0.0
            return out

    learn = run(shapes, epochs=2, cls=NoTuples, loss="triplet", finetune_epochs=0)
    with pytest.raises(NoTuplesError, match="tuples/learner1"):
        learn.fit()


def test_k3_trains_with_ceil_slices(shapes):
    learn = run(shapes, epochs=2, num_learners=3, embedding_dim=8, loss="triplet", finetune_epochs=0)
    hist = learn.fit()
    assert learn.method.model.head.slice_dims == [3, 3, 2]
    assert all(np.isfinite(r["loss"]) for r in hist)
    assert {r["dnc/learner0/batches"] for r in hist} == {r["dnc/learner2/batches"] for r in hist}


def test_feature_dropout_drops_in_training_only_and_is_off_by_default():
    "D&C's Dropout(0.01) on the pooled features (lib/model.py:79, :124): an option, identity in eval mode, no new state."
    labels = np.repeat(np.arange(8), 4)
    plain = DivideAndConquer(backbone(), 8, labels, embedding_dim=8, num_learners=2)
    dropped = DivideAndConquer(backbone(), 8, labels, embedding_dim=8, num_learners=2, feature_dropout=0.3)
    assert plain.feature_dropout == 0.0 and not hasattr(plain.model, "feature_dropout")
    dropped.model.load_state_dict(plain.model.state_dict())  # same keys: the option adds no state
    x = torch.randn(5, 3, 32, 32)
    plain.model.eval()
    dropped.model.eval()
    torch.testing.assert_close(dropped.model(x), plain.model(x))
    inputs = []
    hook = dropped.model.head.linear.register_forward_hook(lambda m, i, o: inputs.append(i[0]))
    dropped.model.feature_dropout.train()
    torch.manual_seed(0)
    dropped.model(x, slice=1)
    hook.remove()
    features = dropped.model.backbone(x)
    zeroed = inputs[0] == 0
    assert 0.15 < zeroed.float().mean().item() < 0.45  # about 0.3 of the entries
    torch.testing.assert_close(inputs[0][~zeroed], (features / 0.7)[~zeroed])
    with pytest.raises(ValueError, match="feature_dropout"):
        DivideAndConquer(backbone(), 8, labels, feature_dropout=-0.1)
