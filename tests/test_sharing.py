"""Sharing Matters / MIC (dml_nb.sharing): Algorithm 1's alternation, the decorrelation term, T^G grouping with and
without per-class standardisation, the unique-classes statistic, the architecture switches, Table 8 setups, and exact
resume of a killed run."""
import tempfile

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from dml_nb.core import METHODS, Registry
from dml_nb.data import load_dataset
from dml_nb.dnc import cluster_statistics, match_clusters
from dml_nb.learner import Callback, Learner, load_checkpoint
from dml_nb.miners import check_triplets
from dml_nb.models import build_backbone
from dml_nb.samplers import ClassBalancedBatchSampler
from dml_nb.sharing import (ARCHITECTURES, SharingMatters, group_samples, shared_miner, standardize_per_class)

torch.set_num_threads(min(2, torch.get_num_threads()))


def backbone(seed=0, width=4):
    torch.manual_seed(seed)
    return build_backbone("small_cnn", width=width, feature_dim=4 * width)


Y = np.repeat(np.arange(6), 4)


def batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(24, 3, 32, 32, generator=g), "y": torch.as_tensor(Y), "index": torch.arange(24)}


@pytest.fixture(scope="module")
def shapes():
    train = load_dataset("shapes", split="train", images_per_class=4)
    train_eval = load_dataset("shapes", split="train", images_per_class=4, augment=False)
    test = load_dataset("shapes", split="test", images_per_class=2)
    return train, train_eval, test


class Recording(SharingMatters):
    "Records (global step, active task names) of every training step."
    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.seen = []

    def training_step(self, b):
        self.seen.append((self._steps, [t.name for t in self.tasks_for_step(self._steps)]))
        return super().training_step(b)


def run(shapes, run_dir=None, callbacks=(), epochs=2, cls=SharingMatters, **options):
    train, train_eval, test = shapes
    method = cls(backbone(), train.num_classes, train.labels, **{"embedding_dim": 8, "gamma": 50.0, **options})
    method.cluster_dataset = train_eval
    sampler = ClassBalancedBatchSampler(train.labels, batch_size=16, samples_per_class=4, seed=1, batches_per_epoch=5)
    return Learner(method, train, sampler, epochs=epochs, lr=1e-3, eval_sets={"test": test}, metrics=("recall@1",),
                   run_dir=run_dir, checkpoint_every_steps=2, callbacks=callbacks, progress=False, seed=2)


# alternation --------------------------------------------------------------------------------------------------

def test_alternation_picks_the_task_of_the_step_across_epochs(shapes):
    learn = run(shapes, cls=Recording, epochs=2)          # 5 steps per epoch: the alternation crosses the epoch
    learn.fit()
    seen = learn.method.seen
    assert [s for s, _ in seen] == list(range(10))
    assert [names for _, names in seen] == [["discriminative"] if s % 2 == 0 else ["shared"] for s in range(10)]
    assert int(learn.method.steps_done) == 10


def test_alternation_switches_and_single_task_architectures():
    m = SharingMatters(backbone(), 6, Y, embedding_dim=8, alternate=False)
    assert [t.name for t in m.tasks_for_step(1)] == ["discriminative", "shared"]
    for arch, name in (("discriminative", "discriminative"), ("shared", "shared")):
        m = SharingMatters(backbone(), 6, Y, embedding_dim=8, architecture=arch)
        assert [t.name for t in m.tasks_for_step(0)] == [t.name for t in m.tasks_for_step(1)] == [name]


def test_active_task_alone_drives_its_head():
    m = SharingMatters(backbone(), 6, Y, embedding_dim=8, architecture="separate")   # no decorrelation coupling
    for step, (trained, idle) in enumerate([("phi", "phi_star"), ("phi_star", "phi")]):
        m.zero_grad()
        m._steps = step
        m.training_step(batch())["loss"].backward()
        heads = m.model.head.heads
        assert heads[trained].linear.weight.grad.abs().sum() > 0
        assert heads[idle].linear.weight.grad is None


# decorrelation ------------------------------------------------------------------------------------------------

def test_decorrelation_term_is_minus_gamma_r_of_phi_and_p_of_phi_star():
    m = SharingMatters(backbone(), 6, Y, embedding_dim=8, shared_dim=6, gamma=7.0)
    b = batch()
    logs = m.training_step(b)
    with torch.no_grad():
        emb = m.head_embeddings(m.features(b["x"]))
        p = m.decorrelations["phi_star_to_phi"].psi
        pred = F.normalize(p(F.normalize(emb["phi_star"], dim=1)), dim=1)
        r = (F.normalize(emb["phi"], dim=1) * pred).pow(2).mean()
    assert p[0].in_features == 6 and p[-1].out_features == 8      # p: phi_star (D*) -> phi (D)
    torch.testing.assert_close(logs["decorrelation/phi_star_to_phi"], -7.0 * r)
    # gradient reversal: the regressor ascends r, the embeddings descend it
    m.zero_grad()
    term = m.decorrelations["phi_star_to_phi"](emb["phi_star"].requires_grad_(), emb["phi"].requires_grad_())
    term.backward()
    lr = 1e-2
    with torch.no_grad():
        for q in p.parameters(): q -= lr * q.grad
        new_r = (F.normalize(emb["phi"], dim=1) * F.normalize(p(F.normalize(emb["phi_star"], dim=1)), dim=1)).pow(2).mean()
    assert new_r > r
    for arch in ("separate", "one_head", "discriminative", "shared"):
        assert len(SharingMatters(backbone(), 6, Y, embedding_dim=8, architecture=arch).decorrelations) == 0


# grouping -----------------------------------------------------------------------------------------------------

def test_standardisation_matches_hand_computation():
    g = torch.Generator().manual_seed(0)
    f, y = torch.randn(30, 5, generator=g) * 3 + 1, torch.arange(3).repeat(10)
    z = standardize_per_class(f, y)
    for c in range(3):
        fc = f[y == c]
        torch.testing.assert_close(z[y == c], (fc - fc.mean(0)) / fc.std(0, unbiased=False))
    f[y == 2, 0] = 4.0                                             # a constant dimension: only centred
    assert torch.isfinite(standardize_per_class(f, y)).all()
    assert (standardize_per_class(f, y)[y == 2, 0] == 0).all()


def test_grouping_with_and_without_standardisation():
    g = torch.Generator().manual_seed(1)
    classes, shared = torch.arange(4).repeat_interleave(30), torch.arange(3).repeat(40)
    centres = torch.randn(4, 6, generator=g) * 10
    style = torch.randn(3, 6, generator=g)
    f = centres[classes] + style[shared] + 0.05 * torch.randn(120, 6, generator=g)
    plain = group_samples(f, classes, 4, standardize=False, seed=0)
    std = group_samples(f, classes, 3, standardize=True, seed=0)
    np.testing.assert_array_equal(match_clusters(classes.numpy(), plain, 4), classes.numpy())   # groups = classes
    np.testing.assert_array_equal(match_clusters(shared.numpy(), std, 3), shared.numpy())       # groups = shared style
    assert cluster_statistics(plain, classes.numpy(), 4)[1].tolist() == [1, 1, 1, 1]
    assert cluster_statistics(std, classes.numpy(), 3)[1].tolist() == [4, 4, 4]


def test_grouping_run_records_unique_classes_and_feeds_group_labels(shapes):
    train = shapes[0]
    for sampling, standardize in (("tg_std", True), ("tg_nostd", False)):
        learn = run(shapes, epochs=2, shared_sampling=sampling, num_groups=5, regroup_every=1)
        hist = learn.fit()
        m = learn.method
        assert m.standardize is standardize
        groups = m.groups.numpy()
        assert groups.min() >= 0 and groups.max() < 5
        sizes, classes = cluster_statistics(groups, train.labels, 5)
        expect = classes[sizes > 0].mean()
        assert hist[-1]["sharing/unique_classes_per_group"] == pytest.approx(expect)
        assert [r["sharing/regrouped"] for r in hist] == [1, 1]
        # the shared task sees group ids as labels and mines triplets by group
        b = {**batch(), "index": torch.arange(24) * 7}
        b = {**b, "shared_group": m.groups[b["index"]]}
        task = m.tasks["shared"]
        emb = torch.nn.functional.normalize(torch.randn(24, 8), dim=1)
        tuples = task.mine(emb, task.targets(b), b)
        assert check_triplets(tuples, b["shared_group"], "class")
    with pytest.raises(RuntimeError, match="groups are not computed yet"):
        SharingMatters(backbone(), 6, Y, embedding_dim=8, shared_sampling="tg_std").training_step(batch())


def test_regroup_every(shapes):
    learn = run(shapes, epochs=3, shared_sampling="tg_std", num_groups=4, regroup_every=2)
    hist = learn.fit()
    assert [r["sharing/regrouped"] for r in hist] == [1, 0, 1]


# architectures and setups -------------------------------------------------------------------------------------

@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_each_architecture_trains_a_step(arch):
    m = SharingMatters(backbone(), 6, Y, embedding_dim=8, architecture=arch, alternate=False)
    params = {n: p.detach().clone() for n, p in m.named_parameters()}
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    logs = m.training_step(batch())
    logs["loss"].backward(); opt.step()
    changed = {n for n, p in m.named_parameters() if not torch.equal(p, params[n])}
    heads = list(m.dims)
    for h in heads: assert f"model.head.heads.{h}.linear.weight" in changed
    assert any(n.startswith("model.backbone") for n in changed)
    assert any(n.startswith("decorrelations") for n in changed) == (arch == "separate_decorrelated")
    expected_tasks = {"discriminative": ["discriminative"], "shared": ["shared"]}.get(arch, ["discriminative", "shared"])
    assert sorted(k for k in logs if k.startswith("loss/")) == [f"loss/{t}" for t in expected_tasks]


@pytest.mark.parametrize("sampling,sampler,relation", [("tstar", "distance", "shared"), ("tstar", "random", "shared"),
                                                       ("tstar", "semihard", "shared"), ("min_dap", "distance", "shared"),
                                                       ("no_constraint", "random", None)])
def test_table8_setups_give_the_right_triplets(sampling, sampler, relation):
    miner = shared_miner(sampling, sampler)
    x = F.normalize(torch.randn(24, 8), dim=1)
    a, p, n = miner(x, torch.as_tensor(Y))
    assert len(a) == 24
    if relation: assert check_triplets((a, p, n), torch.as_tensor(Y), relation)
    else: assert bool(((a != p) & (a != n) & (p != n)).all())
    if sampling == "min_dap":
        d = torch.cdist(x, x)
        torch.testing.assert_close(d[a, p], d.masked_fill(torch.as_tensor(Y)[:, None] == torch.as_tensor(Y)[None], 9).min(1).values)


def test_proxy_loss_trains_phi_star_with_semihard_triplets():
    m = SharingMatters(backbone(), 6, Y, embedding_dim=8, loss="proxy_nca", alternate=False)
    assert type(m.tasks["shared"].loss).__name__ == "TripletLoss"
    assert type(m.tasks["shared"].miner).__name__ == "SharedTripletMiner" and m.tasks["shared"].miner.negative == "semihard"
    assert m.tasks["discriminative"].miner is None
    assert torch.isfinite(m.training_step(batch())["loss"])


def test_embed_option_orders_the_headline():
    x = torch.randn(3, 3, 32, 32)
    for name, order in (("concat", ["concat", "phi", "phi_star"]), ("phi_star", ["phi_star", "concat", "phi"]),
                        ("phi", ["phi", "concat", "phi_star"])):
        m = SharingMatters(backbone(), 6, Y, embedding_dim=8, embed=name).eval()
        assert list(m.embed(x)) == order


def test_registry_and_validation():
    assert METHODS._items["sharing"] is SharingMatters
    reg = Registry("method"); reg.register("sharing")(SharingMatters)
    with pytest.raises(TypeError, match="has no option 'rho'"):
        reg.build("sharing", backbone=backbone(), num_classes=6, rho=3.0)
    with pytest.raises(ValueError, match="Valid shared_samplers: distance, random, semihard"):
        SharingMatters(backbone(), 6, Y, shared_sampler="hard")
    with pytest.raises(ValueError, match="pass train_labels"):
        SharingMatters(backbone(), 6, None, shared_sampling="tg_std")
    with pytest.raises(ValueError, match="gamma"):
        SharingMatters(backbone(), 6, Y, gamma=-1.0)


# per-task logs and resume -------------------------------------------------------------------------------------

def test_task_losses_are_averaged_over_their_own_steps(shapes):
    class Logs(Callback):
        def __init__(self): self.rows = []
        def after_step(self, learner, logs): self.rows.append({k: float(v) for k, v in logs.items()})
    spy = Logs()
    hist = run(shapes, callbacks=[spy], epochs=1).fit()
    disc = [r["loss/discriminative"] for r in spy.rows if "loss/discriminative" in r]
    assert len(disc) == 3 and hist[0]["loss/discriminative"] == pytest.approx(np.mean(disc))


class KillAt(Callback):
    def __init__(self, epoch, step): self.at = (epoch, step)
    def after_step(self, learner, logs):
        if (learner.epoch, learner.step) == self.at: raise KeyboardInterrupt("killed")


@pytest.mark.parametrize("options", [{}, {"shared_sampling": "tg_std", "num_groups": 4}])
def test_resume_is_exact(shapes, options):
    ref = run(shapes, tempfile.mkdtemp(), epochs=2, **options)
    ref_hist = ref.fit()
    d = tempfile.mkdtemp()
    with pytest.raises(KeyboardInterrupt):
        run(shapes, d, [KillAt(1, 3)], epochs=2, **options).fit()
    ck = load_checkpoint(f"{d}/checkpoint.pt")
    assert (ck["epoch"], ck["step"]) == (1, 2) and int(ck["method"]["steps_done"]) == 7   # odd: next step is shared
    res = run(shapes, d, [KillAt(-1, -1)], epochs=2, **options)   # same callbacks as the killed process (never fires)
    res_hist = res.fit()
    assert res.resumed
    drop = lambda h: [{k: v for k, v in r.items() if k != "time"} for r in h]
    assert drop(res_hist) == drop(ref_hist)
    for (k, a), b in zip(ref.method.state_dict().items(), res.method.state_dict().values()):
        assert torch.equal(a, b), k
