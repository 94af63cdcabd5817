"""Checks of dml_nb.methods.base: task wiring, the weighted sum, decorrelation gradients, separate backbones,
the baseline's regularisers, and an exact resume through the learner."""

import tempfile

import pytest
import torch
import torch.nn as nn

from dml_nb.core.base import seed_everything
from dml_nb.training.callbacks import Callback
from dml_nb.training.learner import Learner
from dml_nb.methods.base import BaselineMethod, MultiTaskMethod, Task, build_loss
from dml_nb.blocks.miners import check_triplets
from dml_nb.blocks.models import build_backbone
from dml_nb.data.samplers import ClassBalancedBatchSampler

torch.set_num_threads(min(2, torch.get_num_threads()))


def tiny_backbone(seed=0):
    seed_everything(seed)
    return build_backbone("small_cnn", width=4, feature_dim=16)


class Recorder(nn.Module):
    "A loss that records what it was called with and returns mean(embeddings) * scale."

    default_miner = None

    def __init__(self, scale=1.0):
        super().__init__()
        self.scale, self.calls = scale, []

    def forward(self, emb, labels, tuples=None):
        self.calls.append((emb.detach().clone(), labels.clone(), tuples))
        return emb.mean() * self.scale


def batch(n=16, classes=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(n, 3, 32, 32, generator=g), "y": torch.arange(n) % classes, "index": torch.arange(n)}


def test_tasks_get_their_own_head_and_weights_sum():
    a, b = Recorder(2.0), Recorder(3.0)
    m = MultiTaskMethod(
        tiny_backbone(),
        {"h1": 8, "h2": 4},
        [Task("t1", "h1", a, miner=None, weight=0.5), Task("t2", "h2", b, miner=None, weight=0.25)],
    )
    bt = batch()
    logs = m.training_step(bt)
    embs = m.head_embeddings(m.features(bt["x"]))
    assert a.calls[0][0].shape == (16, 8) and b.calls[0][0].shape == (16, 4)
    torch.testing.assert_close(a.calls[0][0], embs["h1"].detach())
    torch.testing.assert_close(b.calls[0][0], embs["h2"].detach())
    expected = 0.5 * 2.0 * embs["h1"].mean() + 0.25 * 3.0 * embs["h2"].mean()
    torch.testing.assert_close(logs["loss"], expected)
    torch.testing.assert_close(logs["loss/t1"], 2.0 * embs["h1"].mean().detach())


def test_shared_task_triplets_have_three_distinct_classes():
    seen = []
    task = Task("shared", "shared", "margin", miner="shared", num_classes=4)
    inner = task.miner
    task.miner = lambda e, y: seen.append((inner(e, y), y)) or seen[-1][0]
    m = MultiTaskMethod(
        tiny_backbone(),
        {"discriminative": 8, "shared": 8},
        [Task("discriminative", "discriminative", "margin", num_classes=4), task],
    )
    m.training_step(batch())
    ((tuples, y),) = seen
    assert len(tuples[0]) == 16 and check_triplets(tuples, y, "shared")


def test_decorrelation_gradient_is_reversed_and_reaches_both_heads():
    m = MultiTaskMethod(
        tiny_backbone(), {"d": 8, "s": 4}, [Task("t", "d", Recorder(0.0), miner=None)], [("s", "d", 7.0)]
    )
    bt = batch()
    dec = m.decorrelations["s_to_d"]
    f = m.features(bt["x"]).detach()
    heads = m.model.head.heads

    def grads(loss):
        m.zero_grad(set_to_none=True)
        loss.backward()
        return [p.grad.clone() for p in (heads["d"].linear.weight, heads["s"].linear.weight, dec.psi[0].weight)]

    e = m.head_embeddings(f)
    g_rev = grads(dec(e["s"], e["d"]))
    e = m.head_embeddings(f)
    g_plain = grads(-7.0 * dec.correlation(e["s"], e["d"]))
    assert all(g.abs().sum() > 0 for g in g_rev)
    torch.testing.assert_close(g_rev[0], -g_plain[0])
    torch.testing.assert_close(g_rev[1], -g_plain[1])
    torch.testing.assert_close(g_rev[2], g_plain[2])  # psi itself is not reversed: it maximises c
    logs = m.training_step(bt)
    torch.testing.assert_close(logs["loss"], logs["decorrelation/s_to_d"] + 0 * logs["loss/t"])


def test_each_projector_has_its_own_group():
    m = MultiTaskMethod(
        tiny_backbone(),
        {"d": 8, "a": 4, "b": 4},
        [Task("t", "d", num_classes=4)],
        [("a", "d", 1.0), ("b", "d", 1.0)],
        decorrelation_lr=3e-5,
    )
    groups = {g["name"]: g for g in m.param_groups(1e-3, 4e-4)}
    for key in ("decorrelations.a_to_d", "decorrelations.b_to_d"):
        assert groups[key]["lr"] == 3e-5 and groups[key]["weight_decay"] == 0.0
        assert len(groups[key]["params"]) == 4
    assert {"backbone", "heads", "tasks.t.loss"} <= set(groups)
    m = MultiTaskMethod(
        tiny_backbone(),
        {"d": 8, "a": 4},
        [Task("t", "d", num_classes=4)],
        [("a", "d", 1.0)],
        decorrelation_lr=2e-4,
        decorrelation_weight_decay=1e-6,
    )  # MIC's settings at lr 2e-4
    g = {g["name"]: g for g in m.param_groups(1e-3, 4e-4)}["decorrelations.a_to_d"]
    assert (g["lr"], g["weight_decay"]) == (2e-4, 1e-6)


class Tagged(MultiTaskMethod):
    "Trains the task named by the batch's tag, as a sampler yielding (tag, indices) sets it."

    def tasks_for_batch(self, batch):
        return [list(self.tasks.values())[batch["group"]]]


def test_tasks_for_batch_drives_a_learner_with_tagged_batches():
    class TwoTasks:
        "Yields every batch of `base` twice: tagged 0, then 1."

        def __init__(self, base):
            self.base, self.epoch = base, 0

        def set_epoch(self, e):
            self.epoch = e
            self.base.set_epoch(e)

        def batches(self, epoch=None):
            return [(t, b) for b in self.base.batches(epoch) for t in (0, 1)]

    seen = []

    class Spy(Callback):
        def after_step(self, learner, logs):
            seen.append(sorted(k for k in logs if k.startswith("loss/")))

    y = torch.arange(48) % 6
    data = torch.utils.data.TensorDataset(torch.randn(48, 3, 32, 32), y)
    data.labels = y.numpy()
    m = Tagged(
        tiny_backbone(),
        {"d": 8, "s": 4},
        [Task("disc", "d", num_classes=6), Task("shared", "s", miner="shared", num_classes=6)],
    )
    base = ClassBalancedBatchSampler(data.labels, batch_size=12, samples_per_class=4, seed=0, batches_per_epoch=3)
    Learner(m, data, TwoTasks(base), epochs=1, lr=1e-3, progress=False, callbacks=[Spy()]).fit()
    assert seen == [["loss/disc"], ["loss/shared"]] * 3
    assert int(m.steps_done) == 6


def test_separate_backbones_share_nothing():
    m = MultiTaskMethod(
        tiny_backbone(),
        {"h1": 8, "h2": 8},
        [Task("t1", "h1", Recorder(), miner=None), Task("t2", "h2", Recorder(0.0), miner=None)],
        separate=True,
    )
    ids1 = {id(p) for p in m.model.backbone.backbones["h1"].parameters()}
    ids2 = {id(p) for p in m.model.backbone.backbones["h2"].parameters()}
    assert not ids1 & ids2
    m.training_step(batch())["loss"].backward()
    assert all(
        p.grad is not None and p.grad.abs().sum() > 0
        for p in m.model.backbone.backbones["h1"].parameters()
        if p.requires_grad and p.dim() > 1
    )
    assert all(p.grad is None or p.grad.abs().sum() == 0 for p in m.model.backbone.backbones["h2"].parameters())
    m.eval()
    e = m.embed(batch()["x"])
    assert list(e) == ["concat", "h1", "h2"]


def test_baseline_regularisers():
    bt = batch()
    plain = BaselineMethod(tiny_backbone(), 4, embedding_dim=8)
    noisy_in = BaselineMethod(tiny_backbone(), 4, embedding_dim=8, input_noise=1.0)
    noisy_in.load_state_dict(plain.state_dict())
    seed_everything(1)
    l1 = plain.training_step(bt)["loss"]
    seed_everything(1)
    l2 = noisy_in.training_step(bt)["loss"]
    assert not torch.allclose(l1, l2)
    out_noise = BaselineMethod(tiny_backbone(), 4, embedding_dim=8, output_noise=0.3)
    out_noise.load_state_dict(plain.state_dict())
    f = plain.features(bt["x"]).detach()
    z_plain, z_noise = plain.head_embeddings(f)["embedding"], out_noise.head_embeddings(f)["embedding"]
    assert not torch.allclose(z_plain, z_noise)
    out_noise.eval()
    torch.testing.assert_close(out_noise.head_embeddings(f)["embedding"], z_plain)
    drop = BaselineMethod(tiny_backbone(), 4, embedding_dim=8, dropout=0.5)
    assert drop.model.head.heads["embedding"].dropout.p == 0.5
    with pytest.raises(ValueError, match="standard deviations"):
        BaselineMethod(tiny_backbone(), 4, input_noise=-1)


def test_build_loss_fills_context():
    assert build_loss("margin", num_classes=9).beta.shape == (9,)
    assert build_loss("proxy_anchor", num_classes=3, embedding_dim=5).proxies.shape == (3, 5)
    with pytest.raises(ValueError, match="loss_options only apply"):
        build_loss(Recorder(), {"a": 1})


class KillAt(Callback):
    def __init__(self, epoch, step):
        self.at = (epoch, step)

    def after_step(self, learner, logs):
        if (learner.epoch, learner.step) == self.at:
            raise KeyboardInterrupt("killed")


def _run(run_dir, callbacks=()):
    from dml_nb.data.datasets import load_dataset

    train = load_dataset("shapes", split="train", images_per_class=4)
    sampler = ClassBalancedBatchSampler(train.labels, batch_size=16, samples_per_class=4, seed=1, batches_per_epoch=3)
    m = MultiTaskMethod(
        tiny_backbone(2),
        {"d": 8, "s": 8},
        [
            Task("d", "d", "margin", num_classes=train.num_classes),
            Task("s", "s", "margin", miner="shared", weight=0.3, num_classes=train.num_classes),
        ],
        [("s", "d", 50.0)],
        dropout=0.1,
        output_noise=0.05,
        input_noise=0.05,
    )
    return Learner(
        m,
        train,
        sampler,
        epochs=2,
        lr=1e-3,
        run_dir=run_dir,
        checkpoint_every_steps=1,
        callbacks=callbacks,
        progress=False,
        seed=3,
    )


def test_resume_is_exact():
    ref = _run(tempfile.mkdtemp())
    ref.fit()
    d = tempfile.mkdtemp()
    with pytest.raises(KeyboardInterrupt):
        _run(d, [KillAt(1, 1)]).fit()
    res = _run(d)
    res.fit()
    assert res.resumed
    for (k, a), b in zip(ref.method.state_dict().items(), res.method.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=k)
    assert int(res.method.steps_done) == 6


def test_registered_and_built_by_name():
    from dml_nb.core.registry import METHODS

    m = METHODS.build(
        "baseline", backbone=tiny_backbone(), num_classes=4, train_labels=None, embedding_dim=8, dropout=0.1
    )
    assert isinstance(m, BaselineMethod) and m.dims == {"embedding": 8}
    with pytest.raises(TypeError, match="Did you mean 'dropout'"):
        METHODS.build("baseline", backbone=tiny_backbone(), num_classes=4, dropuot=0.1)
    d = METHODS.build("diva", backbone=tiny_backbone(), num_classes=4, embedding_dim=16, queue_size=32)
    assert list(d.dims) == ["discriminative", "shared", "intra", "dance"]
