"""Checks of dml_nb.diva: task wiring, decorrelation, the DaNCE queue and momentum encoder through the learner,
exact resume, and one training run of every ablation / auxiliary task."""
import math
import tempfile

import pytest
import torch

from dml_nb.core import seed_everything
from dml_nb.data import load_dataset
from dml_nb.diva import DeepClusterTask, DiVA, QueueTask, RotNetTask
from dml_nb.learner import Callback, Learner
from dml_nb.miners import check_triplets
from dml_nb.metrics import kmeans
from dml_nb.models import build_backbone
from dml_nb.samplers import ClassBalancedBatchSampler

torch.set_num_threads(min(2, torch.get_num_threads()))

TRAIN = load_dataset("shapes", split="train", images_per_class=4)


def backbone(seed=0):
    seed_everything(seed)
    return build_backbone("small_cnn", width=4, feature_dim=16)


def batch(n=16, classes=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, 32, 32, generator=g)
    return {"x": x, "y": torch.arange(n) % classes, "index": torch.arange(n),
            "extra_views": [x + 0.1 * torch.randn(x.shape, generator=g)]}


def filled(method, seed=1):
    g = torch.Generator().manual_seed(seed)
    for t in method.queue_tasks(): t.fill(method, (torch.randn(16, 3, 32, 32, generator=g) for _ in range(100)))
    return method


def learner(method, run_dir=None, epochs=1, steps=2, callbacks=(), **kw):
    sampler = ClassBalancedBatchSampler(TRAIN.labels, batch_size=16, samples_per_class=4, seed=1, batches_per_epoch=steps)
    return Learner(method, TRAIN, sampler, epochs=epochs, lr=1e-3, run_dir=run_dir, callbacks=callbacks,
                   progress=False, seed=3, **kw)


def diva(**kw):
    opts = dict(embedding_dim=32, rho=10.0, queue_size=48)
    opts.update(kw)
    return DiVA(backbone(), TRAIN.num_classes, TRAIN.labels, **opts)


def test_ranking_tasks_mine_the_right_triplets_on_the_right_heads():
    m = filled(diva())
    seen = {}
    for name in ("discriminative", "shared", "intra"):
        task = m.tasks[name]
        def record(e, y, _inner=task.miner, _name=name):
            t = _inner(e, y); seen[_name] = (t, y, e.shape[1]); return t
        task.miner = record
    logs = m.training_step(batch())
    for name, relation in (("discriminative", "class"), ("shared", "shared"), ("intra", "intra")):
        tuples, y, dim = seen[name]
        assert len(tuples[0]) > 0 and check_triplets(tuples, y, relation), name
        assert dim == 8
        assert math.isfinite(float(logs[f"loss/{name}"]))
    assert m.model.head.dims == {"discriminative": 8, "shared": 8, "intra": 8, "dance": 8}


def test_decorrelation_gradients_reach_every_head():
    m = filled(diva(weights={"discriminative": 0.0, "shared": 0.0, "intra": 0.0, "dance": 0.0}))
    logs = m.training_step(batch())
    torch.testing.assert_close(logs["loss"], sum(logs[f"decorrelation/{k}"] for k in m.pairs))
    logs["loss"].backward()
    for h in ("discriminative", "shared", "intra", "dance"):
        g = m.model.head.heads[h].linear.weight.grad
        assert g is not None and g.abs().sum() > 0, h
    for k in m.pairs: assert m.decorrelations[k].psi[0].weight.grad.abs().sum() > 0
    assert set(m.pairs.values()) == {("shared", "discriminative"), ("intra", "discriminative"), ("dance", "discriminative")}


def test_options_reach_the_losses():
    m = diva(include_positive=True, temperature=0.05, lower_cutoff=0.3, alpha=0.15)
    loss = m.tasks["dance"].loss
    assert (loss.include_positive, loss.temperature, loss.lower_cutoff) == (True, 0.05, 0.3)
    assert m.tasks["shared"].weight == 0.15 and m.tasks["discriminative"].weight == 1.0
    assert diva().tasks["dance"].loss.include_positive is True and diva(include_positive=False).tasks["dance"].loss.include_positive is False
    assert type(m.tasks["discriminative"].miner).__name__ == "DistanceWeightedMiner"
    assert m.tasks["discriminative"].loss.beta.shape == (TRAIN.num_classes,)
    with pytest.raises(ValueError, match="weights"): diva(weights={"sharde": 1.0})
    with pytest.raises(ValueError, match="dims must give"): diva(dims={"discriminative": 8})
    assert diva(dims={"discriminative": 16, "shared": 4, "intra": 4, "dance": 8}).dims["discriminative"] == 16


class Probe(Callback):
    "Record the queue and the key encoder around every step."
    def __init__(self): self.rows = []
    def before_fit(self, learner):
        t = learner.method.tasks["dance"]
        self.rows.append(("fit", len(t.queue), int(t.queue.ptr), int(t.key_encoder.num_updates)))
    def after_step(self, learner, logs):
        t = learner.method.tasks["dance"]
        self.rows.append(("step", len(t.queue), int(t.queue.ptr), int(t.key_encoder.num_updates)))


def test_queue_filled_before_training_then_fifo_and_momentum_updates():
    m = diva()
    init = {k: v.clone() for k, v in m.tasks["dance"].key_encoder.encoder.state_dict().items()}
    probe = Probe()
    learner(m, callbacks=[probe], steps=3).fit()
    assert probe.rows == [("fit", 48, 0, 0), ("step", 48, 16, 1), ("step", 48, 32, 2), ("step", 48, 0, 3)]
    enc = m.tasks["dance"].key_encoder.encoder.state_dict()
    assert any(not torch.equal(init[k], enc[k]) for k in init if init[k].is_floating_point())
    # the key encoder is the EMA of the model, not the model
    assert not torch.equal(enc["head.heads.dance.linear.weight"], m.model.state_dict()["head.heads.dance.linear.weight"])


def test_fill_from_learner_is_deterministic():
    a, b = diva(), diva()
    la, lb = learner(a), learner(b)
    la._setup(); lb._setup()
    a.tasks["dance"].fill_from_learner(a, la); b.tasks["dance"].fill_from_learner(b, lb)
    assert torch.equal(a.tasks["dance"].queue.queue, b.tasks["dance"].queue.queue)
    assert a.tasks["dance"].queue.is_full


class KillAt(Callback):
    def __init__(self, epoch, step): self.at = (epoch, step)
    def after_step(self, learner, logs):
        if (learner.epoch, learner.step) == self.at: raise KeyboardInterrupt("killed")


@pytest.mark.parametrize("tasks", [("discriminative", "shared", "intra", "dance"), ("discriminative", "deepcluster")])
def test_resume_is_exact(tasks):
    run = lambda d, cbs=(): learner(diva(tasks=tasks), d, epochs=2, steps=3, callbacks=cbs, checkpoint_every_steps=1)
    ref = run(tempfile.mkdtemp()); ref.fit()
    d = tempfile.mkdtemp()
    with pytest.raises(KeyboardInterrupt): run(d, [KillAt(1, 2)]).fit()
    res = run(d); res.fit()
    assert res.resumed
    ref_sd, res_sd = ref.method.state_dict(), res.method.state_dict()
    assert ref_sd.keys() == res_sd.keys()
    for k in ref_sd: torch.testing.assert_close(ref_sd[k], res_sd[k], rtol=0, atol=0, msg=k)
    if "dance" in tasks:
        assert "tasks.dance.queue.queue" in ref_sd and int(ref_sd["tasks.dance.queue.ptr"]) == (48 + 6 * 16) % 48 == 0


ABLATIONS = {
    "no_decorrelation": dict(decorrelation=False),
    "separate": dict(separate=True, decorrelation=False),
    "ensemble": dict(tasks=("discriminative",), discriminative_heads=4),
    "deepcluster": dict(tasks=("discriminative", "deepcluster"), num_clusters=300),
    "rotnet": dict(tasks=("discriminative", "rotnet")),
    "instance": dict(tasks=("discriminative", "instance")),
    "moco": dict(tasks=("discriminative", "moco")),
}


@pytest.mark.parametrize("name", list(ABLATIONS))
def test_each_ablation_trains(name):
    m = diva(**ABLATIONS[name])
    before = {k: v.clone() for k, v in m.model.state_dict().items()}
    hist = learner(m, steps=2).fit()
    assert math.isfinite(hist[-1]["loss"])
    after = m.model.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before if before[k].is_floating_point())
    m.eval()
    emb = m.embed(TRAIN[0][0][None])
    assert next(iter(emb)) == "concat" and emb["concat"].shape == (1, 32)
    if name == "separate":
        bbs = m.model.backbone.backbones
        assert len(bbs) == 4 and not {id(p) for p in bbs["dance"].parameters()} & {id(p) for p in bbs["shared"].parameters()}
        assert m.pairs == {}
    if name == "ensemble":
        assert list(m.dims) == ["discriminative", "discriminative2", "discriminative3", "discriminative4"]
        assert set(m.pairs) == {f"discriminative{i}_to_discriminative" for i in (2, 3, 4)}
        assert all(t.weight == 1.0 for t in m.tasks.values())
    if name == "deepcluster":
        t = m.tasks["deepcluster"]
        assert t.num_clusters == len(TRAIN) // 10 and int(t.assignments.min()) >= 0
        assert len(t.assignments.unique()) > 1 and "clusters/deepcluster" in hist[-1]
    if name == "instance":
        t = m.tasks["instance"]
        assert t.momentum == 0.0 and t.loss.__class__.__name__ == "QueueNCELoss"
        torch.testing.assert_close(t.key_encoder.encoder.state_dict()["head.heads.instance.linear.weight"],
                                   m.model.state_dict()["head.heads.instance.linear.weight"])
    if name == "moco":
        assert m.tasks["moco"].momentum == 0.9 and m.tasks["moco"].loss.__class__.__name__ == "QueueNCELoss"
    if name == "rotnet": assert "accuracy/rotnet" in hist[-1]


def test_deepcluster_recluster_and_missing_labels():
    t = DeepClusterTask("dc", "dc", embedding_dim=4, num_samples=50, num_clusters=300)
    assert t.num_clusters == 5
    m = DiVA(backbone(), 4, torch.zeros(50, dtype=torch.long).numpy(), tasks=("discriminative", "deepcluster"), embedding_dim=16)
    with pytest.raises(ValueError, match="no pseudo-labels yet"): m.training_step(batch())
    g = torch.Generator().manual_seed(0)
    centers = torch.randn(5, 16, generator=g) * 5
    feats = centers.repeat_interleave(10, 0) + 0.01 * torch.randn(50, 16, generator=g)
    w0 = m.tasks["deepcluster"].classifier.weight.clone()
    labels = m.tasks["deepcluster"].recluster(feats, seed=7)
    ref, _, _ = kmeans(torch.nn.functional.normalize(feats, dim=1), 5, nredo=1, seed=7, backend="faiss")
    assert torch.equal(labels, ref) and int(labels.min()) >= 0 and int(labels.max()) < 5
    assert not torch.equal(w0, m.tasks["deepcluster"].classifier.weight)     # classifier re-initialised
    logs = m.training_step(batch())
    assert math.isfinite(float(logs["loss/deepcluster"]))
    with pytest.raises(ValueError, match="train_labels"): DiVA(backbone(), 4, None, tasks=("deepcluster",), embedding_dim=16)


class RecordingCE(torch.nn.CrossEntropyLoss):
    def forward(self, logits, target):
        self.target = target
        return super().forward(logits, target)


def test_rotnet_predicts_rotation_labels():
    from dml_nb.methods import MultiTaskMethod
    m = DiVA(backbone(), 4, tasks=("discriminative", "rotnet"), embedding_dim=16)
    t = m.tasks["rotnet"]
    t.loss = RecordingCE()
    inputs = []
    m.features = lambda x, model=None: (inputs.append(x), MultiTaskMethod.features(m, x, model))[1]
    b = batch()
    logs = m.training_step(b)
    assert len(inputs) == 2 and torch.equal(inputs[0], b["x"])      # the batch, then its rotated copy
    k = t.loss.target
    assert k.shape == (16,) and int(k.min()) >= 0 and int(k.max()) <= 3 and len(k.unique()) > 1
    for i in range(16): assert torch.equal(inputs[1][i], torch.rot90(b["x"][i], int(k[i]), (-2, -1)))
    assert abs(float(logs["loss/rotnet"]) - math.log(4)) < 1.0


def test_queue_task_needs_second_view():
    m = filled(diva())
    b = batch(); del b["extra_views"]
    with pytest.raises(ValueError, match="second augmentation"): m.training_step(b)
    assert isinstance(m.tasks["dance"], QueueTask) and m.views == 2
    assert diva(tasks=("discriminative", "rotnet")).views == 1
    assert isinstance(diva(tasks=("discriminative", "rotnet")).tasks["rotnet"], RotNetTask)


def test_discriminative_only_diva_is_the_baseline():
    from dml_nb.methods import BaselineMethod
    seed_everything(0); base = BaselineMethod(backbone(), TRAIN.num_classes, embedding_dim=16)
    seed_everything(0); only = DiVA(backbone(), TRAIN.num_classes, tasks=("discriminative",), embedding_dim=16)
    learner(base, steps=3).fit(); learner(only, steps=3).fit()
    a, b = base.model.state_dict(), only.model.state_dict()
    assert len(a) == len(b)
    for (ka, va), (kb, vb) in zip(a.items(), b.items()):
        assert ka.replace("embedding", "discriminative") == kb
        torch.testing.assert_close(va, vb, rtol=0, atol=0)
