"""Divide and Conquer (dml_nb.dnc): cluster re-matching, cluster-restricted batches, slice-local gradients, the
finetune phase, K = 1 = baseline, the Table 6 groupings, and exact resume of a killed run."""
import tempfile

import numpy as np
import pytest
import torch

from dml_nb.core import METHODS, Registry
from dml_nb.data import load_dataset
from dml_nb.dnc import (DivideAndConquer, PhaseSampler, cluster_statistics, kmeans_assign, label_grouping,
                        match_clusters, random_partition)
from dml_nb.learner import Baseline, Callback, Learner, load_checkpoint
from dml_nb.models import EmbeddingHead, EmbeddingModel, build_backbone
from dml_nb.samplers import ClassBalancedBatchSampler

torch.set_num_threads(min(2, torch.get_num_threads()))


def backbone(seed=0, width=4):
    torch.manual_seed(seed)
    return build_backbone("small_cnn", width=width, feature_dim=4 * width)


@pytest.fixture(scope="module")
def shapes():
    train = load_dataset("shapes", split="train", images_per_class=4)
    train_eval = load_dataset("shapes", split="train", images_per_class=4, augment=False)
    test = load_dataset("shapes", split="test", images_per_class=4)
    return train, train_eval, test


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
    return Learner(method, train, sampler, epochs=epochs, lr=1e-3, eval_sets={"test": test}, metrics=("recall@1",),
                   run_dir=run_dir, checkpoint_every_steps=3, callbacks=callbacks, progress=False, seed=seed)


# clustering ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("k", [2, 3, 5, 8])
def test_hungarian_undoes_any_permutation(k):
    rng = np.random.default_rng(k)
    truth = rng.integers(0, k, 500)
    truth[:k] = np.arange(k)                                       # every cluster non-empty
    for _ in range(5):
        perm = rng.permutation(k)
        np.testing.assert_array_equal(match_clusters(truth, perm[truth], k), truth)
        noisy = perm[truth].copy()
        flip = rng.random(500) < 0.1
        noisy[flip] = rng.integers(0, k, flip.sum())
        matched = match_clusters(truth, noisy, k)
        assert (matched == truth).mean() >= 0.85                   # identities kept through a noisy re-clustering
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
    for c in range(10):                                            # a class lies in exactly one group
        assert len(np.unique(groups[y == c])) == 1
    sizes, classes = cluster_statistics(groups, y, 4)
    assert sizes.sum() == 30 and classes.sum() == 10
    sizes, classes = cluster_statistics(part, y, 4)
    assert classes.sum() >= 10 and (classes <= 10).all()


# steps --------------------------------------------------------------------------------------------------------

def test_slice_gradient_touches_only_its_rows_and_its_own_loss():
    y = np.repeat(np.arange(8), 4)
    m = DivideAndConquer(backbone(), 8, y, embedding_dim=12, num_learners=3)   # margin: per-learner betas
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
        assert m.loss.beta.grad is None                            # the finetune loss is untouched


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
    with pytest.raises(ValueError, match="only used by grouping='labels'"):
        DivideAndConquer(backbone(), 2, y, class_groups=[0, 1])
    assert METHODS._items["dnc"] is DivideAndConquer          # registered (METHODS.build imports every recipe module)
    reg = Registry("method"); reg.register("dnc")(DivideAndConquer)
    with pytest.raises(TypeError, match="has no option 'k'"):
        reg.build("dnc", backbone=backbone(), num_classes=2, train_labels=y, k=4)
    assert isinstance(reg.build("dnc", backbone=backbone(), num_classes=2, train_labels=y, num_learners=2,
                                embedding_dim=8), DivideAndConquer)


# training runs ------------------------------------------------------------------------------------------------

def test_batches_stay_in_their_cluster_and_finetune_uses_all_data(shapes):
    learn = run(shapes, cls=Recording, epochs=4)
    hist = learn.fit()
    seen = learn.method.seen
    assert {e for e, *_ in seen} == {0, 1, 2, 3}
    for epoch, group, idx, assign in seen:
        if epoch < 3:
            assert group in (0, 1) and (assign[idx] == group).all()
        else:
            assert group is None
    finetune = [i for e, g, idx, _ in seen if e == 3 for i in idx]
    divide = [seen[i][3] for i in range(len(seen)) if seen[i][0] == 0][0]
    assert len(set(divide[finetune].tolist())) == 2                # finetune batches mix both clusters
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
    dnc = DivideAndConquer(backbone(), train.num_classes, train.labels, embedding_dim=8, num_learners=1)
    h1 = Learner(dnc, train, sampler(), **kw).fit()
    bb = backbone()
    base = Baseline(EmbeddingModel(bb, EmbeddingHead(bb.feature_dim, 8)), "margin",
                    loss_options={"num_classes": train.num_classes})
    h2 = Learner(base, train, sampler(), **kw).fit()
    assert [r["test/recall@1"] for r in h1] == [r["test/recall@1"] for r in h2]
    assert [r["loss"] for r in h1] == [r["loss"] for r in h2]
    for a, b in zip(dnc.model.parameters(), base.model.parameters()): assert torch.equal(a, b)


@pytest.mark.parametrize("grouping", ["random", "labels", "kmeans_nosplit"])
def test_other_groupings_train(shapes, grouping):
    learn = run(shapes, cls=Recording, epochs=2, grouping=grouping, finetune_epochs=0)
    hist = learn.fit()
    first = learn.method.seen[0][3]
    if grouping == "labels":
        y = shapes[0].labels
        assert all(len(np.unique(first.numpy()[y == c])) == 1 for c in np.unique(y))
    if grouping in ("random", "labels"):                             # fixed: never re-drawn
        assert all(torch.equal(s[3], first) for s in learn.method.seen)
    assert all(np.isfinite(r["loss"]) for r in hist)


def test_cluster_on_features(shapes):
    learn = run(shapes, epochs=1, cluster_on="features")
    vec = learn.method.cluster_vectors(learn)
    assert vec.shape == (len(shapes[0]), learn.method.model.backbone.feature_dim)
    torch.testing.assert_close(vec.norm(dim=1), torch.ones(len(vec)))
    learn.method.cluster_on = "embedding"
    assert learn.method.cluster_vectors(learn).shape == (len(shapes[0]), 8)


class KillAt(Callback):
    def __init__(self, epoch, step): self.at = (epoch, step)
    def after_step(self, learner, logs):
        if (learner.epoch, learner.step) == self.at: raise KeyboardInterrupt("killed")


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
