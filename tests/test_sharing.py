"""Sharing Matters / MIC (dml_nb.methods.sharing): Algorithm 1's update budget (and the older alternation), the decorrelation
term and the regressor's optimiser settings, T^G grouping (the paper's and MIC's readings), MIC's group batches, the
unique-classes statistic, the architecture switches, Table 8 setups, exact resume of a killed run, and golden fixtures
from MIC's code (tests/fixtures/golden/sharing_*.json)."""

import re
import tempfile
import types

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from dml_nb.core.registry import METHODS, Registry
from dml_nb.data.datasets import load_dataset
from dml_nb.evaluation.clustering import cluster_statistics, match_clusters
from dml_nb.training.callbacks import Callback
from dml_nb.training.learner import Learner
from dml_nb.training.checkpoint import load_checkpoint
from dml_nb.blocks.miners import check_triplets
from dml_nb.blocks.models import build_backbone
from dml_nb.data.samplers import ClassBalancedBatchSampler
import dml_nb.methods.sharing as sharing_module
from dml_nb.methods.sharing import ARCHITECTURES, MIC, MIC_DEFAULTS, TG_PAPER_TEXT, SharingMatters, shared_miner
from dml_nb.methods.shared_batches import DISCRIMINATIVE, SHARED, GroupBatchSampler, SharingSampler
from dml_nb.methods.grouping import assign_to_centroids, group_samples, standardize_per_class
from golden import arr, load_golden

torch.set_num_threads(min(2, torch.get_num_threads()))


def backbone(seed=0, width=4):
    torch.manual_seed(seed)
    return build_backbone("small_cnn", width=width, feature_dim=4 * width)


Y = np.repeat(np.arange(6), 4)


def batch(seed=0, group=None):
    g = torch.Generator().manual_seed(seed)
    return {
        "x": torch.randn(24, 3, 32, 32, generator=g),
        "y": torch.as_tensor(Y),
        "index": torch.arange(24),
        "group": group,
    }


@pytest.fixture(scope="module")
def shapes():
    train = load_dataset("shapes", split="train", images_per_class=4)
    train_eval = load_dataset("shapes", split="train", images_per_class=4, augment=False)
    test = load_dataset("shapes", split="test", images_per_class=2)
    return train, train_eval, test


class Recording(SharingMatters):
    "Records (global step, active task names) and (group, images) of every training step."

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.seen, self.xs = [], []

    def training_step(self, b):
        self.seen.append((self._steps, [t.name for t in self.tasks_for_batch(b)], b["index"].tolist()))
        self.xs.append((b["group"], b["x"].detach().clone()))
        return super().training_step(b)


def run(shapes, run_dir=None, callbacks=(), epochs=2, cls=SharingMatters, **options):
    train, train_eval, test = shapes
    method = cls(backbone(), train.num_classes, train.labels, **{"embedding_dim": 8, "gamma": 50.0, **options})
    method.cluster_dataset = train_eval
    sampler = ClassBalancedBatchSampler(train.labels, batch_size=16, samples_per_class=4, seed=1, batches_per_epoch=5)
    return Learner(
        method,
        train,
        sampler,
        epochs=epochs,
        lr=1e-3,
        eval_sets={"test": test},
        metrics=("recall@1",),
        run_dir=run_dir,
        checkpoint_every_steps=2,
        callbacks=callbacks,
        progress=False,
        seed=2,
    )


# Algorithm 1's budget -----------------------------------------------------------------------------------------


def test_algorithm1_gives_phi_every_batch_of_the_run_and_a_shared_update_per_iteration(shapes):
    learn = run(shapes, cls=Recording, epochs=2)
    base = ClassBalancedBatchSampler(shapes[0].labels, batch_size=16, samples_per_class=4, seed=1, batches_per_epoch=5)
    hist = learn.fit()
    seen = learn.method.seen
    assert [names for _, names, _ in seen] == [["discriminative"], ["shared"]] * 10
    disc = [idx for _, names, idx in seen if names == ["discriminative"]]
    assert disc == base.batches(0) + base.batches(1)  # phi: the baseline's N/b batches
    shared = [idx for _, names, idx in seen if names == ["shared"]]
    assert not set(map(tuple, shared)) & set(map(tuple, disc))  # the shared update has its own batch
    assert [(r["updates/discriminative"], r["updates/shared"]) for r in hist] == [(5, 5), (5, 5)]
    assert int(learn.method.steps_done) == 20


def test_shared_probability_skips_shared_updates_only():
    y = np.repeat(np.arange(10), 8)
    base = ClassBalancedBatchSampler(y, batch_size=16, samples_per_class=4, seed=0, batches_per_epoch=400)
    second = ClassBalancedBatchSampler(y, batch_size=16, samples_per_class=4, seed=1, batches_per_epoch=400)
    tags = "".join("DS"[t] for t, _ in SharingSampler(base, second, shared_probability=0.8, seed=5).batches(0))
    assert re.fullmatch(r"(DS?)+", tags) and tags.count("D") == 400
    assert abs(tags.count("S") - 320) < 4 * (400 * 0.8 * 0.2) ** 0.5
    assert tags != "".join("DS"[t] for t, _ in SharingSampler(base, second, shared_probability=0.8, seed=5).batches(1))
    with pytest.raises(ValueError, match="shared_probability"):
        SharingSampler(base, second, shared_probability=1.5)


def test_alternation_picks_the_task_of_the_step_across_epochs(shapes):
    learn = run(shapes, cls=Recording, epochs=2, updates="alternate")  # 5 steps per epoch: the alternation crosses it
    learn.fit()
    seen = learn.method.seen
    assert [s for s, _, _ in seen] == list(range(10))
    assert [names for _, names, _ in seen] == [["discriminative"] if s % 2 == 0 else ["shared"] for s in range(10)]
    assert int(learn.method.steps_done) == 10


def test_update_modes_and_single_task_architectures():
    m = SharingMatters(backbone(), 6, Y, embedding_dim=8, updates="joint")
    assert [t.name for t in m.tasks_for_batch(batch())] == ["discriminative", "shared"]
    m = SharingMatters(backbone(), 6, Y, embedding_dim=8)
    assert [t.name for t in m.tasks_for_batch(batch(group=SHARED))] == ["shared"]
    with pytest.raises(RuntimeError, match="batch\\['group'\\]"):
        m.tasks_for_batch(batch())
    for arch, name in (("discriminative", "discriminative"), ("shared", "shared")):
        m = SharingMatters(backbone(), 6, Y, embedding_dim=8, architecture=arch)
        assert (
            [t.name for t in m.tasks_for_batch(batch(group=0))]
            == [t.name for t in m.tasks_for_batch(batch(group=1))]
            == [name]
        )
    with pytest.raises(ValueError, match="updates='algorithm1'"):
        SharingMatters(backbone(), 6, Y, updates="alternate", shared_probability=0.5)


def test_active_task_alone_drives_its_head():
    m = SharingMatters(backbone(), 6, Y, embedding_dim=8, architecture="separate")  # no decorrelation coupling
    for tag, (trained, idle) in ((DISCRIMINATIVE, ("phi", "phi_star")), (SHARED, ("phi_star", "phi"))):
        m.zero_grad()
        m.training_step(batch(group=tag))["loss"].backward()
        heads = m.model.head.heads
        assert heads[trained].linear.weight.grad.abs().sum() > 0
        assert heads[idle].linear.weight.grad is None


# decorrelation ------------------------------------------------------------------------------------------------


def test_decorrelation_term_is_minus_gamma_r_of_phi_and_p_of_phi_star():
    m = SharingMatters(backbone(), 6, Y, embedding_dim=8, shared_dim=6, gamma=7.0)
    b = batch(group=DISCRIMINATIVE)
    logs = m.training_step(b)
    with torch.no_grad():
        emb = m.head_embeddings(m.features(b["x"]))
        p = m.decorrelations["phi_star_to_phi"].psi
        pred = F.normalize(p(F.normalize(emb["phi_star"], dim=1)), dim=1)
        r = (F.normalize(emb["phi"], dim=1) * pred).pow(2).mean()
    assert p[0].in_features == 6 and p[-1].out_features == 8  # p: phi_star (D*) -> phi (D)
    torch.testing.assert_close(logs["decorrelation/phi_star_to_phi"], -7.0 * r)
    # gradient reversal: the regressor ascends r, the embeddings descend it
    m.zero_grad()
    term = m.decorrelations["phi_star_to_phi"](emb["phi_star"].requires_grad_(), emb["phi"].requires_grad_())
    term.backward()
    lr = 1e-2
    with torch.no_grad():
        for q in p.parameters():
            q -= lr * q.grad
        new_r = (
            (F.normalize(emb["phi"], dim=1) * F.normalize(p(F.normalize(emb["phi_star"], dim=1)), dim=1)).pow(2).mean()
        )
    assert new_r > r
    for arch in ("separate", "one_head", "discriminative", "shared"):
        assert len(SharingMatters(backbone(), 6, Y, embedding_dim=8, architecture=arch).decorrelations) == 0


def test_regressor_optimiser_group():
    def group(m, lr):
        return {g["name"]: g for g in m.param_groups(lr, 4e-4)}["decorrelations.phi_star_to_phi"]

    for cls in (SharingMatters, MIC):
        g = group(cls(backbone(), 6, Y, embedding_dim=8), 3e-4)
        assert (g["lr"], g["weight_decay"]) == (3e-4, 1e-6)  # MIC code: the run's lr, wd 1e-6
    g = group(SharingMatters(backbone(), 6, Y, embedding_dim=8, regressor_lr=1e-5, regressor_weight_decay=0.0), 3e-4)
    assert (g["lr"], g["weight_decay"]) == (1e-5, 0.0)


# grouping -----------------------------------------------------------------------------------------------------


def test_standardisation_matches_hand_computation():
    g = torch.Generator().manual_seed(0)
    f, y = torch.randn(30, 5, generator=g) * 3 + 1, torch.arange(3).repeat(10)
    z, zm = standardize_per_class(f, y), standardize_per_class(f, y, scale=False)
    for c in range(3):
        fc = f[y == c]
        torch.testing.assert_close(z[y == c], (fc - fc.mean(0)) / fc.std(0, unbiased=False))
        torch.testing.assert_close(zm[y == c], fc - fc.mean(0))
    f[y == 2, 0] = 4.0  # a constant dimension: only centred
    assert torch.isfinite(standardize_per_class(f, y)).all()
    assert (standardize_per_class(f, y)[y == 2, 0] == 0).all()


def test_grouping_with_and_without_standardisation():
    g = torch.Generator().manual_seed(1)
    classes, shared = torch.arange(4).repeat_interleave(30), torch.arange(3).repeat(40)
    centres = torch.randn(4, 6, generator=g) * 10
    style = torch.randn(3, 6, generator=g)
    f = centres[classes] + style[shared] + 0.05 * torch.randn(120, 6, generator=g)
    plain = group_samples(f, classes, 4, standardize=False, seed=0)
    np.testing.assert_array_equal(match_clusters(classes.numpy(), plain, 4), classes.numpy())  # groups = classes
    assert cluster_statistics(plain, classes.numpy(), 4)[1].tolist() == [1, 1, 1, 1]
    for mode in (True, "mean_std", "mean"):
        std = group_samples(f, classes, 3, standardize=mode, seed=0)
        np.testing.assert_array_equal(match_clusters(shared.numpy(), std, 3), shared.numpy())  # groups = shared style
        assert cluster_statistics(std, classes.numpy(), 3)[1].tolist() == [4, 4, 4]


@pytest.mark.parametrize("reading", ["code", "paper"])
def test_grouping_run_records_unique_classes_and_feeds_group_labels(shapes, reading):
    train = shapes[0]
    options = {"regroup_every": 1} if reading == "code" else dict(TG_PAPER_TEXT)
    for sampling, standardize in (("tg_std", {"code": "mean", "paper": "mean_std"}[reading]), ("tg_nostd", "none")):
        if sampling == "tg_nostd":
            options = {**options, "standardize": "none", "regroup_standardize": "none"}
        learn = run(shapes, epochs=2, shared_sampling=sampling, num_groups=5, **options)
        hist = learn.fit()
        m = learn.method
        assert m.standardize == standardize
        assert m.shared_batches == {"code": "groups", "paper": "class_balanced"}[reading]
        groups = m.groups.numpy()
        assert groups.min() >= 0 and groups.max() < 5
        sizes, classes = cluster_statistics(groups, train.labels, 5)
        expect = classes[sizes > 0].mean()
        assert hist[-1]["sharing/unique_classes_per_group"] == pytest.approx(expect)
        assert [r["sharing/regrouped"] for r in hist] == [1, 1]
        assert 0 <= hist[-1]["positives/shared"] <= 1
        if reading == "code":
            assert hist[-1]["positives/shared"] == 1.0
        # the shared task sees group ids as labels and mines triplets by group
        b = {**batch(), "index": torch.arange(24) * 7}
        b = {**b, "shared_group": m.groups[b["index"]]}
        task = m.tasks["shared"]
        emb = torch.nn.functional.normalize(torch.randn(24, 8), dim=1)
        tuples = task.mine(emb, task.targets(b), b)
        assert check_triplets(tuples, b["shared_group"], "class")
    with pytest.raises(RuntimeError, match="groups are not computed yet"):
        SharingMatters(backbone(), 6, Y, embedding_dim=8, shared_sampling="tg_std").training_step(batch(group=SHARED))


def test_regroup_every(shapes):
    learn = run(shapes, epochs=3, shared_sampling="tg_std", num_groups=4, regroup_every=2)
    hist = learn.fit()
    assert [r["sharing/regrouped"] for r in hist] == [1, 0, 1]


class Spy(SharingMatters):
    "Records what each regrouping clustered (its feature dimension) and with which standardisation."

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.clustered = []

    def grouping_features(self, learner, on):
        out = super().grouping_features(learner, on)
        self.clustered.append((learner.epoch, on, out.shape[1]))
        return out


def test_mic_reading_of_the_grouping(shapes):
    options = {k: v for k, v in MIC_DEFAULTS.items() if k not in ("gamma", "num_groups")}
    learn = run(shapes, epochs=5, cls=Spy, num_groups=4, **options)
    hist = learn.fit()
    m = learn.method
    # the first grouping on early features (16 x 16 map of width 4, pooled to 4 x 4), then phi* every 4 epochs
    assert m.clustered == [(0, "early", 4 * 16), (4, "phi_star", 8)]
    assert [r["sharing/regrouped"] for r in hist] == [1, 0, 0, 0, 1]
    # group batches: every shared anchor has a positive; phi is the headline embedding
    assert all(r["positives/shared"] == 1.0 for r in hist)
    assert "test/concat/recall@1" in hist[-1] and "test/phi_star/recall@1" in hist[-1]
    assert all(r["updates/discriminative"] == 5 and r["updates/shared"] <= 5 for r in hist)


def test_group_batches_split_across_ranks_and_label_their_items():
    groups = np.random.default_rng(0).integers(0, 6, size=300)
    whole = GroupBatchSampler(groups, 24, 4, 0.2, seed=3).batches(2)
    parts = [GroupBatchSampler(groups, 24, 4, 0.2, seed=3, rank=r, world_size=2).batches(2) for r in (0, 1)]
    assert [b for pair in zip(*parts) for b in pair] == whole[: 2 * len(parts[0])]
    idx, lab = np.array([b for b, _ in whole]), np.array([l for _, l in whole])
    assert ((groups[idx] == lab).mean()) > 0.75
    assert (
        GroupBatchSampler(groups, 24, 4, 0.0, seed=3).batches(0)[0][1]
        == groups[GroupBatchSampler(groups, 24, 4, 0.0, seed=3).batches(0)[0][0]].tolist()
    )  # no swaps: own group


@pytest.mark.parametrize("arch", ["shared", "one_head", "discriminative"])
def test_grouping_with_each_single_or_shared_head_architecture(shapes, arch):
    hist = run(shapes, epochs=1, architecture=arch, shared_sampling="tg_std", num_groups=5).fit()
    want = {"shared": (None, 5), "one_head": (5, 5), "discriminative": (5, None)}[arch]
    assert (hist[0].get("updates/discriminative"), hist[0].get("updates/shared")) == want
    assert ("sharing/regrouped" in hist[0]) == (arch != "discriminative")  # no shared task: nothing to group


# architectures and setups -------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_each_architecture_trains_a_step(arch):
    m = SharingMatters(backbone(), 6, Y, embedding_dim=8, architecture=arch, updates="joint")
    params = {n: p.detach().clone() for n, p in m.named_parameters()}
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    logs = m.training_step(batch())
    logs["loss"].backward()
    opt.step()
    changed = {n for n, p in m.named_parameters() if not torch.equal(p, params[n])}
    heads = list(m.dims)
    for h in heads:
        assert f"model.head.heads.{h}.linear.weight" in changed
    assert any(n.startswith("model.backbone") for n in changed)
    assert any(n.startswith("decorrelations") for n in changed) == (arch == "separate_decorrelated")
    expected_tasks = {"discriminative": ["discriminative"], "shared": ["shared"]}.get(
        arch, ["discriminative", "shared"]
    )
    assert sorted(k for k in logs if k.startswith("loss/")) == [f"loss/{t}" for t in expected_tasks]


@pytest.mark.parametrize(
    "sampling,sampler,relation",
    [
        ("tstar", "distance", "shared"),
        ("tstar", "random", "shared"),
        ("tstar", "semihard", "shared"),
        ("min_dap", "distance", "shared"),
        ("no_constraint", "random", None),
    ],
)
def test_table8_setups_give_the_right_triplets(sampling, sampler, relation):
    miner = shared_miner(sampling, sampler)
    x = F.normalize(torch.randn(24, 8), dim=1)
    a, p, n = miner(x, torch.as_tensor(Y))
    assert len(a) == 24
    if relation:
        assert check_triplets((a, p, n), torch.as_tensor(Y), relation)
    else:
        assert bool(((a != p) & (a != n) & (p != n)).all())
    if sampling == "min_dap":
        d = torch.cdist(x, x)
        torch.testing.assert_close(
            d[a, p], d.masked_fill(torch.as_tensor(Y)[:, None] == torch.as_tensor(Y)[None], 9).min(1).values
        )


def test_proxy_loss_trains_phi_star_with_semihard_triplets():
    m = SharingMatters(backbone(), 6, Y, embedding_dim=8, loss="proxy_nca", updates="joint")
    assert type(m.tasks["shared"].loss).__name__ == "TripletLoss"
    assert (
        type(m.tasks["shared"].miner).__name__ == "SharedTripletMiner"
        and m.tasks["shared"].miner.negative == "semihard"
    )
    assert m.tasks["discriminative"].miner is None
    assert torch.isfinite(m.training_step(batch())["loss"])


def test_embed_option_orders_the_headline():
    x = torch.randn(3, 3, 32, 32)
    for name, order in (
        ("concat", ["concat", "phi", "phi_star"]),
        ("phi_star", ["phi_star", "concat", "phi"]),
        ("phi", ["phi", "concat", "phi_star"]),
    ):
        m = SharingMatters(backbone(), 6, Y, embedding_dim=8, embed=name).eval()
        assert list(m.embed(x)) == order
    assert list(MIC(backbone(), 6, Y, embedding_dim=8).eval().embed(x)) == ["phi", "concat", "phi_star"]


def test_registry_and_validation():
    assert METHODS._items["sharing"] is SharingMatters and METHODS._items["mic"] is MIC
    assert METHODS.options("mic") == METHODS.options("sharing")
    reg = Registry("method")
    reg.register("sharing")(SharingMatters)
    reg.register("mic")(MIC)
    for name in ("sharing", "mic"):
        with pytest.raises(TypeError, match="has no option 'rho'"):
            reg.build(name, backbone=backbone(), num_classes=6, rho=3.0)
    with pytest.raises(ValueError, match="Valid shared_samplers: distance, random, semihard"):
        SharingMatters(backbone(), 6, Y, shared_sampler="hard")
    with pytest.raises(ValueError, match="pass train_labels"):
        SharingMatters(backbone(), 6, None, shared_sampling="tg_std")
    with pytest.raises(ValueError, match="gamma"):
        SharingMatters(backbone(), 6, Y, gamma=-1.0)
    with pytest.raises(ValueError, match="needs shared_sampling"):
        SharingMatters(backbone(), 6, Y, shared_batches="groups")
    with pytest.raises(ValueError, match="Valid updates values"):
        SharingMatters(backbone(), 6, Y, updates="alternating")


# per-task logs and resume -------------------------------------------------------------------------------------


def test_task_losses_are_averaged_over_their_own_steps(shapes):
    class Logs(Callback):
        def __init__(self):
            self.rows = []

        def after_step(self, learner, logs):
            self.rows.append({k: float(v) for k, v in logs.items()})

    spy = Logs()
    hist = run(shapes, callbacks=[spy], epochs=1).fit()
    disc = [r["loss/discriminative"] for r in spy.rows if "loss/discriminative" in r]
    assert len(disc) == 5 and hist[0]["loss/discriminative"] == pytest.approx(np.mean(disc))


class KillAt(Callback):
    def __init__(self, epoch, step):
        self.at = (epoch, step)

    def after_step(self, learner, logs):
        if (learner.epoch, learner.step) == self.at:
            raise KeyboardInterrupt("killed")


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"shared_probability": 0.6},
        {"updates": "alternate"},
        {"shared_sampling": "tg_std", "num_groups": 4},
        {"cls": MIC, "num_groups": 4, "regroup_every": 1},
    ],
)
def test_resume_is_exact(shapes, options):
    ref = run(shapes, tempfile.mkdtemp(), epochs=2, **options)
    ref_hist = ref.fit()
    d = tempfile.mkdtemp()
    with pytest.raises(KeyboardInterrupt):
        run(shapes, d, [KillAt(1, 3)], epochs=2, **options).fit()
    ck = load_checkpoint(f"{d}/checkpoint.pt")
    assert (ck["epoch"], ck["step"]) == (1, 2)
    if options.get("updates") == "alternate":
        assert int(ck["method"]["steps_done"]) == 7  # odd: next step is shared
    res = run(shapes, d, [KillAt(-1, -1)], epochs=2, **options)  # same callbacks as the killed process (never fires)
    res_hist = res.fit()
    assert res.resumed
    drop = lambda h: [{k: v for k, v in r.items() if k != "time"} for r in h]
    assert drop(res_hist) == drop(ref_hist)
    for (k, a), b in zip(ref.method.state_dict().items(), res.method.state_dict().values()):
        assert torch.equal(a, b), k


# golden fixtures from MIC's code --------------------------------------------------------------------------------


def test_golden_grouping_preprocessing_and_assignment():
    "MIC's initcluster / deepcluster on fixed features: the preprocessing, the assignment to their centroids, k-means."
    g = load_golden("sharing_grouping")
    f, y = torch.tensor(g["inputs"]["features"]), torch.tensor(g["inputs"]["labels"])
    phi_star, k, out = torch.tensor(g["inputs"]["phi_star"]), g["inputs"]["k"], g["outputs"]
    mic = MIC(backbone(), 6, y.numpy(), embedding_dim=8)  # sharing with T^G has the same grouping defaults
    mode = lambda standardize: {"mean_std": True, "mean": False}.get(standardize)
    first = standardize_per_class(f, y, scale=mode(mic.standardize))  # MIC: the class mean only
    np.testing.assert_allclose(first, arr(out["mean"]["preprocessed"]), atol=1e-6)
    np.testing.assert_allclose(first, arr(out["no_norm"]["preprocessed"]), atol=1e-6)  # 'no_norm' subtracts it too
    np.testing.assert_allclose(
        standardize_per_class(f, y), arr(out["mstd"]["preprocessed"]), atol=1e-5
    )  # 'mstd' = paper
    assert np.abs(standardize_per_class(f, y).numpy() - arr(out["mean"]["preprocessed"])).max() > 0.1
    assert mic.regroup_standardize == "none"  # deepcluster clusters phi* as it is
    np.testing.assert_allclose(phi_star, arr(out["deepcluster"]["preprocessed"]), atol=0)
    for name, z in (("mean", first), ("mstd", standardize_per_class(f, y)), ("deepcluster", phi_star)):
        np.testing.assert_array_equal(assign_to_centroids(z, arr(out[name]["centroids"])), out[name]["assignment"])
    # the whole grouping under MIC's reading equals theirs (faiss k-means, one run, seed 1234); on these 36 points
    # 20 iterations (what run_kmeans asks for, fixture 'inputs') and 25 (what faiss ran) give the same ids
    km = dict(seed=g["inputs"]["kmeans"]["seed"], niter=mic.kmeans_iterations, nredo=mic.kmeans_redo)
    assert (km["niter"], km["nredo"]) == (g["inputs"]["kmeans"]["niter"], g["inputs"]["kmeans"]["nredo"])
    for niter, most in ((25, 256), (25, None)):
        np.testing.assert_array_equal(
            group_samples(
                f, y, k, mic.standardize, seed=km["seed"], niter=niter, nredo=1, max_points_per_centroid=most
            ),
            out["mean"]["assignment"],
        )
    np.testing.assert_array_equal(group_samples(f, y, k, mic.standardize, **km), out["mean"]["assignment"])
    np.testing.assert_array_equal(
        group_samples(phi_star, y, k, mic.regroup_standardize, **km), out["deepcluster"]["assignment"]
    )
    paper = group_samples(f, y, k, TG_PAPER_TEXT["standardize"], **km)
    np.testing.assert_array_equal(paper, out["mstd"]["assignment"])
    assert not np.array_equal(paper, out["mean"]["assignment"])  # the readings group differently here


def group_batch_statistics(groups, batches, samples_per_group):
    "The statistics the fixture holds, for (indices, labels) batches drawn in order."
    lab = np.array([l for _, l in batches])
    img = np.array([b for b, _ in batches])
    chain = lab[:, ::samples_per_group].reshape(-1)
    counts = np.concatenate([np.unique(b, return_counts=True)[1] for b in lab])
    K = int(groups.max()) + 1
    true = groups[img]
    return {
        "label_constant_per_block": bool(
            (lab.reshape(len(lab), -1, samples_per_group) == lab[:, ::samples_per_group, None]).all()
        ),
        "swap_rate": float((true != lab).mean()),
        "lag1_repeat": float((chain[1:] == chain[:-1]).mean()),
        "lag2_repeat": float((chain[2:] == chain[:-2]).mean()),
        "lag3_repeat": float((chain[3:] == chain[:-3]).mean()),
        "mean_distinct_labels_per_batch": float(np.mean([len(np.unique(b)) for b in lab])),
        "images_per_label_in_batch": {str(int(c)): float((counts == c).mean()) for c in np.unique(counts)},
        "block_label_frequency": np.bincount(chain, minlength=K) / len(chain),
        "swapped_image_cluster_frequency": np.bincount(true[true != lab], minlength=K) / max(1, (true != lab).sum()),
        "anchors_with_positive": float(np.mean([(np.bincount(b)[b] > 1).mean() for b in lab])),
    }


def test_golden_group_batches_match_mic_cluster_dataset():
    "MIC's ClusterDataset batches vs GroupBatchSampler with the mic recipe's settings: statistics of many draws."
    g = load_golden("sharing_group_batches")
    groups, ref = np.asarray(g["inputs"]["groups"]), g["outputs"]
    mic = MIC(backbone(), 6, Y, embedding_dim=8)
    assert (mic.shared_batches, mic.group_swap_probability) == ("groups", g["inputs"]["swap_probability"])
    sampler = GroupBatchSampler(
        groups,
        g["inputs"]["batch_size"],
        g["inputs"]["samples_per_group"],
        mic.group_swap_probability,
        batches_per_epoch=300,
        seed=0,
    )
    ours = group_batch_statistics(
        groups, [b for e in range(5) for b in sampler.batches(e)], g["inputs"]["samples_per_group"]
    )
    assert ours["label_constant_per_block"] and ref["label_constant_per_block"]
    assert ours["anchors_with_positive"] == ref["anchors_with_positive"] == 1.0
    assert ours["lag1_repeat"] == ref["lag1_repeat"] == 0 and ours["lag2_repeat"] == ref["lag2_repeat"] == 0
    assert ours["lag3_repeat"] == pytest.approx(ref["lag3_repeat"], abs=0.02)
    assert ours["swap_rate"] == pytest.approx(ref["swap_rate"], abs=0.01)
    assert ours["mean_distinct_labels_per_batch"] == pytest.approx(ref["mean_distinct_labels_per_batch"], abs=0.15)
    n = sum(ref["images_per_label_in_batch_hist"].values())
    for c, count in ref["images_per_label_in_batch_hist"].items():
        assert ours["images_per_label_in_batch"].get(c, 0.0) == pytest.approx(count / n, abs=0.02), c
    np.testing.assert_allclose(
        ours["block_label_frequency"], ref["block_label_frequency"], atol=0.01
    )  # uniform, not by size
    np.testing.assert_allclose(
        ours["swapped_image_cluster_frequency"], ref["swapped_image_cluster_frequency"], atol=0.015
    )


class VectorSet(torch.utils.data.Dataset):
    def __init__(self, x, y):
        self.x, self.labels, self.num_classes = x, np.asarray(y), int(max(y)) + 1

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], int(self.labels[i])


class LinearFeatures(nn.Module):
    feature_dim = 6

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 6)

    def forward(self, x):
        return self.linear(x)


class Fixed:
    "A sampler that yields the given batches every epoch."

    def __init__(self, batches):
        self.batches_, self.epoch = batches, 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def batches(self, epoch=None):
        return [list(b) for b in self.batches_]

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass


class Replay:
    "A miner that returns the triplets MIC's sampler drew."

    def __init__(self, triplets):
        self.t = torch.tensor(triplets).T

    def __call__(self, embeddings, labels, groups=None):
        return tuple(self.t)


class StepLogs(Callback):
    def __init__(self):
        self.rows = []

    def after_step(self, learner, logs):
        self.rows.append({k: float(v) for k, v in logs.items()})


def step_order_learner(g, **options):
    "The mic recipe on MIC's tiny harness model, their weights and triplets copied in, both updates of one iteration."
    i, o = g["inputs"], g["inputs"]["options"]
    x = torch.tensor(i["x0"] + i["x1"])
    y = i["y0"] + i["y1"]  # class labels of the first batch; the second is grouped
    m = MIC(
        LinearFeatures(),
        o["num_classes"],
        y,
        embedding_dim=4,
        gamma=o["adv_weight"],
        num_groups=o["num_groups"],
        regressor_hidden_dim=o["adv_dim"],
        shared_batches="class_balanced",
        shared_probability=1.0,
        **options,
    )
    init = {k: torch.tensor(v) for k, v in i["init"].items()}
    with torch.no_grad():
        m.model.backbone.linear.weight.copy_(init["model.f.weight"])
        m.model.backbone.linear.bias.copy_(init["model.f.bias"])
        for head, task in (("phi", "Class"), ("phi_star", "Shared")):
            m.model.head.heads[head].linear.weight.copy_(init[f"model.last_linear.{task}.weight"])
            m.model.head.heads[head].linear.bias.copy_(init[f"model.last_linear.{task}.bias"])
        psi = m.decorrelations["phi_star_to_phi"].psi
        for j in (0, 2):
            psi[j].weight.copy_(init[f"regressor.{j}.weight"])
            psi[j].bias.copy_(init[f"regressor.{j}.bias"])
    m.groups.copy_(torch.tensor(i["y0"] + i["y1"]))
    m.grouped_epoch.fill_(0)  # items 12..23 carry their groups
    m.tasks["discriminative"].miner = Replay(i["triplets"]["Class"])
    m.tasks["shared"].miner = Replay(i["triplets"]["Shared"])
    sampler = SharingSampler(Fixed([range(12)]), Fixed([range(12, 24)]), shared_probability=1.0)
    logs = StepLogs()
    learn = Learner(
        m,
        VectorSet(x, y),
        sampler,
        epochs=1,
        lr=o["lr"],
        weight_decay=o["weight_decay"],
        callbacks=[logs],
        progress=False,
        device="cpu",
        seed=0,
        metrics=("recall@1",),
    )
    learn.fit()
    return m, learn, logs.rows


def test_golden_algorithm1_step_order_matches_mic_train_one_epoch():
    "One iteration of MIC's train_one_epoch vs the mic recipe under the Learner: losses of each update, parameters after."
    g = load_golden("sharing_step_order")
    m, learn, rows = step_order_learner(g)
    (d, s), want = rows, g["outputs"]["updates"]
    assert (
        "loss/discriminative" in d and "loss/shared" not in d and "loss/shared" in s and "loss/discriminative" not in s
    )
    assert d["loss/discriminative"] == pytest.approx(want[0]["loss"], abs=1e-6)
    assert s["loss/shared"] == pytest.approx(want[1]["loss"], abs=1e-6)
    w = g["inputs"]["options"]["adv_weight"]
    assert d["decorrelation/phi_star_to_phi"] == pytest.approx(w * want[0]["decorrelation"], abs=1e-5)
    assert s["decorrelation/phi_star_to_phi"] == pytest.approx(w * want[1]["decorrelation"], abs=1e-5)
    after = {k: arr(v) for k, v in g["outputs"]["after"].items()}
    ours = {
        "model.f.weight": m.model.backbone.linear.weight,
        "model.f.bias": m.model.backbone.linear.bias,
        "model.last_linear.Class.weight": m.model.head.heads["phi"].linear.weight,
        "model.last_linear.Class.bias": m.model.head.heads["phi"].linear.bias,
        "model.last_linear.Shared.weight": m.model.head.heads["phi_star"].linear.weight,
        "model.last_linear.Shared.bias": m.model.head.heads["phi_star"].linear.bias,
        "beta.Class": m.tasks["discriminative"].loss.beta,
        "beta.Shared": m.tasks["shared"].loss.beta,
        **{
            f"regressor.{j}.{p}": getattr(m.decorrelations["phi_star_to_phi"].psi[j], p)
            for j in (0, 2)
            for p in ("weight", "bias")
        },
    }
    assert set(ours) == set(after)
    for k, v in ours.items():
        np.testing.assert_allclose(v.detach().numpy(), after[k], atol=2e-7, rtol=0, err_msg=k)
    # the optimiser settings of every parameter (by shape) are theirs: network, margin betas, regressor
    ours_groups = sorted(
        (gr["lr"], gr["weight_decay"], sorted(list(p.shape) for p in gr["params"]))
        for gr in learn.optimizer.param_groups
    )
    theirs = sorted((gr["lr"], gr["weight_decay"], sorted(gr["sizes"])) for gr in g["outputs"]["optimizer_groups"])
    merged = lambda gs: sorted((lr, wd, size) for lr, wd, sizes in gs for size in sizes)
    assert merged(ours_groups) == merged(theirs)


def test_golden_step_order_fails_on_the_other_readings():
    "The fixture tells the readings apart: the regressor at 1e-5 (dml_nb's earlier setting), or both losses in each step."
    g = load_golden("sharing_step_order")
    after = arr(g["outputs"]["after"]["regressor.0.weight"])
    m, _, _ = step_order_learner(g, regressor_lr=1e-5)
    assert np.abs(m.decorrelations["phi_star_to_phi"].psi[0].weight.detach().numpy() - after).max() > 1e-4
    m, _, rows = step_order_learner(g, updates="joint")
    assert (
        "loss/shared" in rows[0]
        and np.abs(m.model.backbone.linear.weight.detach().numpy() - arr(g["outputs"]["after"]["model.f.weight"])).max()
        > 1e-4
    )


def test_golden_shared_update_probability_matches_mic_schedule():
    "task_p = [1, 0.8]: every iteration's discriminative update, then the shared one with probability 0.8."
    g = load_golden("sharing_step_order")
    theirs = g["outputs"]["schedule_sequence"]
    n, p = g["inputs"]["schedule"]["iterations"], g["inputs"]["schedule"]["task_p"][1]
    assert re.fullmatch(r"(CS?)+", theirs) and theirs.count("C") == n
    y = np.repeat(np.arange(10), 8)
    base = ClassBalancedBatchSampler(y, batch_size=16, samples_per_class=4, seed=0, batches_per_epoch=n)
    second = ClassBalancedBatchSampler(y, batch_size=16, samples_per_class=4, seed=1, batches_per_epoch=n)
    mic = MIC(backbone(), 6, Y)
    ours = "".join("CS"[t] for t, _ in SharingSampler(base, second, mic.shared_probability, seed=0).batches(0))
    assert mic.shared_probability == p
    assert re.fullmatch(r"(CS?)+", ours) and ours.count("C") == n
    sd = 4 * (n * p * (1 - p)) ** 0.5
    assert abs(ours.count("S") - n * p) < sd and abs(theirs.count("S") - n * p) < sd


# Unflipped shared batches (MIC's ClusterDataset: RandomResizedCrop without a flip, datasets.py:407) ------------------


def test_shared_flip_false_trains_the_shared_batches_unflipped(shapes):
    """shared_flip=False: the shared updates' items are loaded as (index, seed, False), i.e. with the training
    transform minus its flip (the same crop); the discriminative batches keep their flips."""
    from dml_nb.data.batches import SeededViews, without_flips
    from dml_nb.data.datasets import make_transform

    train = shapes[0]
    learn = run(shapes, cls=Recording, epochs=1, shared_flip=False)
    learn.fit()
    keys = learn._batches.batches
    assert [g for g, _ in learn.method.xs] == [DISCRIMINATIVE, SHARED] * 5
    views = SeededViews(train)
    mirrored = 0
    for (g, x), k in zip(learn.method.xs, keys):
        assert all(len(key) == (3 if g == SHARED else 2) for key in k)
        want = torch.stack([views[key]["x"] for key in k])
        assert torch.equal(x, want)  # the images the step trained on
        if g == SHARED:
            flipped = torch.stack([views[key[:2]]["x"] for key in k])  # the same items with the flip
            same = (flipped == x).flatten(1).all(1)
            assert ((flipped.flip(-1) == x).flatten(1).all(1) | same).all()
            mirrored += int((~same).sum())
    assert mirrored > 0  # some would have been flipped
    plain = make_transform("small_cnn", train=True, size=32, flip=False)
    assert [type(t).__name__ for t in without_flips(train).transform.transforms] == [
        type(t).__name__ for t in plain.transforms
    ]
    with pytest.raises(ValueError, match="updates='algorithm1'"):
        SharingMatters(backbone(), 6, Y, embedding_dim=8, updates="alternate", shared_flip=False)
    with pytest.raises(TypeError, match="shared_flip is true or false"):
        SharingMatters(backbone(), 6, Y, embedding_dim=8, shared_flip="false")
    with pytest.raises(TypeError, match="torchvision Compose"):
        without_flips(torch.utils.data.TensorDataset(torch.zeros(2, 3)))


def test_batch_augment_without_flips_keeps_the_crops():
    "BatchAugment(flip=False): the boxes of the flipped call, no image mirrored."
    from dml_nb.data.cache import BatchAugment

    aug = BatchAugment(16, train=True, flip=0.5)
    imgs = torch.randint(0, 256, (12, 3, 24, 30), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    a = aug(imgs, None, torch.Generator().manual_seed(5))
    b = aug(imgs, None, torch.Generator().manual_seed(5), flip=False)
    _, flips = aug.boxes(torch.tensor([[24, 30]] * 12), torch.Generator().manual_seed(5))
    assert 0 < int(flips.sum()) < 12
    assert torch.allclose(a[~flips], b[~flips]) and torch.allclose(a[flips], b[flips].flip(-1), atol=1e-5)


def test_golden_kmeans_as_faiss_ran_it_for_mic(monkeypatch):
    """MIC's run_kmeans sets n_iter / max_points_per_centroid as attributes faiss.Kmeans never reads: faiss ran 25
    iterations on a subsample of at most 256 points per centroid. 2,400 points, k = 8 tell the readings apart."""
    g = load_golden("sharing_kmeans_subsample")
    x, k, out = torch.tensor(g["inputs"]["features"]), g["inputs"]["k"], g["outputs"]
    assert out["faiss_parameters"] == {"niter": 25, "max_points_per_centroid": 256, "seed": 1234}
    labels = np.zeros(len(x), dtype=np.int64)
    ids = lambda **kw: group_samples(x, labels, k, "none", seed=1234, nredo=1, **kw)
    theirs = np.asarray(out["assignment"])
    np.testing.assert_array_equal(ids(niter=25, max_points_per_centroid=256), theirs)
    for name, kw in (
        ("20/256", dict(niter=20, max_points_per_centroid=256)),
        ("25/2400", dict(niter=25)),
        ("20/2400", dict(niter=20)),
    ):
        assert (ids(**kw) != theirs).sum() == out["differ"][name] > 0  # each other reading groups differently
    np.testing.assert_array_equal(assign_to_centroids(x, arr(out["centroids"])), theirs)  # their centroids, their ids
    # the paper files select it; the recipe passes it to the grouping
    mic = MIC(
        backbone(),
        6,
        np.repeat(np.arange(6), 4),
        embedding_dim=8,
        kmeans_iterations=25,
        kmeans_max_points_per_centroid=256,
    )
    seen = {}
    monkeypatch.setattr(
        sharing_module, "group_samples", lambda *a, **kw: seen.update(kw) or np.zeros(24, dtype=np.int64)
    )
    monkeypatch.setattr(mic, "grouping_features", lambda ctx, on: torch.zeros(24, 4))
    mic.regroup(types.SimpleNamespace(seed=lambda *a: 0, epoch=0))
    assert (seen["niter"], seen["max_points_per_centroid"]) == (25, 256)
    assert MIC(backbone(), 6, np.repeat(np.arange(6), 4), embedding_dim=8).kmeans_max_points_per_centroid is None
    with pytest.raises(ValueError, match="kmeans_max_points_per_centroid"):
        MIC(backbone(), 6, np.repeat(np.arange(6), 4), embedding_dim=8, kmeans_max_points_per_centroid=0)


def test_golden_group_batches_of_mic_workers():
    """MIC's ClusterDataset read by 8 DataLoader workers: under PyTorch 1.0.1 (numpy not reseeded) the batches at the
    same worker position carry the same labels; `workers=8` replays that, the default draws every batch anew."""
    g = load_golden("sharing_worker_batches")
    inp, out = g["inputs"], g["outputs"]
    kw = dict(
        batch_size=inp["batch_size"],
        samples_per_group=inp["samples_per_group"],
        swap_probability=inp["swap_probability"],
        seed=0,
    )

    def partition(batches):
        first = {}
        return [first.setdefault(tuple(l), len(first)) for _, l in batches]

    emulated, reseeded = (GroupBatchSampler(inp["groups"], workers=w, **kw) for w in (inp["workers"], None))
    for epoch in range(inp["epochs"]):
        theirs_1_0, theirs_now = out["pytorch_1_0"][epoch], out["reseeded"][epoch]
        assert len(emulated.batches(epoch)) == theirs_1_0["batches"] == 25
        assert partition(emulated.batches(epoch)) == theirs_1_0["sequence_id"]  # 4 distinct, by worker position
        assert partition(reseeded.batches(epoch)) == theirs_now["sequence_id"] == list(range(25))
        assert len({tuple(i) for i, _ in emulated.batches(epoch)}) == theirs_1_0["distinct_index_lists"] == 25
    assert [e["distinct_label_sequences"] for e in out["pytorch_1_0"]] == [4, 4, 4]
    mic = MIC(backbone(), 6, np.repeat(np.arange(6), 4), embedding_dim=8, group_batch_workers=8)
    assert (
        mic.group_batch_workers == 8
        and MIC(backbone(), 6, np.repeat(np.arange(6), 4), embedding_dim=8).group_batch_workers is None
    )
    with pytest.raises(ValueError, match="group_batch_workers"):
        SharingMatters(
            backbone(), 6, np.repeat(np.arange(6), 4), embedding_dim=8, group_batch_workers=8
        )  # T*: no group batches
