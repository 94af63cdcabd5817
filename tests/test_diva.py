"""Checks of dml_nb.methods.diva: task wiring, decorrelation, the DaNCE queue and momentum encoder through the learner,
exact resume, and one training run of every ablation / auxiliary task."""

import math
import tempfile
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from dml_nb.core.base import seed_everything
from dml_nb.data.datasets import load_dataset
from dml_nb.methods.diva import DeepClusterTask, DiVA, QueueTask, RotNetTask
from dml_nb.training.callbacks import Callback
from dml_nb.training.learner import Learner
from dml_nb.blocks.miners import check_triplets
from dml_nb.evaluation.clustering import kmeans
from dml_nb.blocks.models import build_backbone
from dml_nb.data.samplers import ClassBalancedBatchSampler

torch.set_num_threads(min(2, torch.get_num_threads()))

TRAIN = load_dataset("shapes", split="train", images_per_class=4)


def backbone(seed=0):
    seed_everything(seed)
    return build_backbone("small_cnn", width=4, feature_dim=16)


def batch(n=16, classes=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, 32, 32, generator=g)
    return {
        "x": x,
        "y": torch.arange(n) % classes,
        "index": torch.arange(n),
        "extra_views": [x + 0.1 * torch.randn(x.shape, generator=g)],
    }


def filled(method, seed=1):
    g = torch.Generator().manual_seed(seed)
    for t in method.queue_tasks():
        t.fill(method, (torch.randn(16, 3, 32, 32, generator=g) for _ in range(100)))
    return method


def learner(method, run_dir=None, epochs=1, steps=2, callbacks=(), **kw):
    sampler = ClassBalancedBatchSampler(
        TRAIN.labels, batch_size=16, samples_per_class=4, seed=1, batches_per_epoch=steps
    )
    return Learner(
        method,
        TRAIN,
        sampler,
        epochs=epochs,
        lr=1e-3,
        run_dir=run_dir,
        callbacks=callbacks,
        progress=False,
        seed=3,
        **kw,
    )


def diva(**kw):
    opts = dict(embedding_dim=32, rho=10.0, queue_size=48)
    opts.update(kw)
    return DiVA(backbone(), TRAIN.num_classes, TRAIN.labels, **opts)


def test_ranking_tasks_mine_the_right_triplets_on_the_right_heads():
    m = filled(diva(sharing="eq3", intra_distinct=True))  # the paper's readings: each triplet checkable on its own
    seen = {}
    for name in ("discriminative", "shared", "intra"):
        task = m.tasks[name]

        def record(e, y, _inner=task.miner, _name=name):
            t = _inner(e, y)
            seen[_name] = (t, y, e.shape[1])
            return t

        task.miner = record
    logs = m.training_step(batch())
    for name, relation in (("discriminative", "class"), ("shared", "shared"), ("intra", "intra")):
        tuples, y, dim = seen[name]
        assert len(tuples[0]) > 0 and check_triplets(tuples, y, relation), name
        assert dim == 8
        assert math.isfinite(float(logs[f"loss/{name}"]))
    assert m.model.head.dims == {"discriminative": 8, "shared": 8, "intra": 8, "dance": 8}
    code = filled(diva())  # the authors' intra draw: one class, images with replacement
    a, p, n = code.tasks["intra"].miner(torch.randn(16, 8), batch()["y"])
    y = batch()["y"]
    assert len(a) == 16 and bool(((y[a] == y[p]) & (y[a] == y[n])).all())


def test_decorrelation_gradients_reach_every_head():
    m = filled(diva(weights={"discriminative": 0.0, "shared": 0.0, "intra": 0.0, "dance": 0.0}))
    logs = m.training_step(batch())
    torch.testing.assert_close(logs["loss"], sum(logs[f"decorrelation/{k}"] for k in m.pairs))
    logs["loss"].backward()
    for h in ("discriminative", "shared", "intra", "dance"):
        g = m.model.head.heads[h].linear.weight.grad
        assert g is not None and g.abs().sum() > 0, h
    for k in m.pairs:
        assert m.decorrelations[k].psi[0].weight.grad.abs().sum() > 0
    assert set(m.pairs.values()) == {
        ("shared", "discriminative"),
        ("intra", "discriminative"),
        ("dance", "discriminative"),
    }


def test_options_reach_the_losses():
    m = diva(include_positive=True, temperature=0.05, lower_cutoff=0.3, alpha=0.15)
    loss = m.tasks["dance"].loss
    assert (loss.include_positive, loss.temperature, loss.lower_cutoff) == (True, 0.05, 0.3)
    assert (loss.normalize, loss.upper_cutoff) == ("key", 1.4)  # the authors' DaNCE
    q = diva(normalize="query", dance_upper_cutoff=None).tasks["dance"].loss
    assert (q.normalize, q.upper_cutoff) == ("query", None)
    assert m.tasks["shared"].weight == 0.15 and m.tasks["discriminative"].weight == 1.0
    assert (
        diva().tasks["dance"].loss.include_positive is True
        and diva(include_positive=False).tasks["dance"].loss.include_positive is False
    )
    assert type(m.tasks["discriminative"].miner).__name__ == "DistanceWeightedMiner"
    assert m.tasks["discriminative"].loss.beta.shape == (TRAIN.num_classes,)
    assert {t.loss.pair_count for n, t in m.tasks.items() if n != "dance"} == {"triplets"}  # the DiVA code's count
    assert diva(loss_options={"pair_count": "terms"}).tasks["shared"].loss.pair_count == "terms"
    with pytest.raises(ValueError, match="weights"):
        diva(weights={"sharde": 1.0})
    with pytest.raises(ValueError, match="dims must give"):
        diva(dims={"discriminative": 8})
    assert diva(dims={"discriminative": 16, "shared": 4, "intra": 4, "dance": 8}).dims["discriminative"] == 16


class Probe(Callback):
    "Record the queue and the key encoder around every step."

    def __init__(self):
        self.rows = []

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
    assert not torch.equal(
        enc["head.heads.dance.linear.weight"], m.model.state_dict()["head.heads.dance.linear.weight"]
    )


def test_fill_from_learner_is_deterministic():
    a, b = diva(), diva()
    la, lb = learner(a), learner(b)
    la.prepare_fit()
    lb.prepare_fit()
    a.tasks["dance"].fill_from_learner(a, la.context)
    b.tasks["dance"].fill_from_learner(b, lb.context)
    assert torch.equal(a.tasks["dance"].queue.queue, b.tasks["dance"].queue.queue)
    assert a.tasks["dance"].queue.is_full


class KillAt(Callback):
    def __init__(self, epoch, step):
        self.at = (epoch, step)

    def after_step(self, learner, logs):
        if (learner.epoch, learner.step) == self.at:
            raise KeyboardInterrupt("killed")


@pytest.mark.parametrize(
    "tasks,queue",
    [
        (("discriminative", "shared", "intra", "dance"), {}),
        (("discriminative", "shared", "intra", "dance"), {"queue_size": None, "queue_batches": 3}),
        (("discriminative", "deepcluster"), {}),
    ],
)
def test_resume_is_exact(tasks, queue):
    run = lambda d, cbs=(): learner(
        diva(tasks=tasks, **queue), d, epochs=2, steps=3, callbacks=cbs, checkpoint_every_steps=1
    )
    ref = run(tempfile.mkdtemp())
    ref.fit()
    d = tempfile.mkdtemp()
    with pytest.raises(KeyboardInterrupt):
        run(d, [KillAt(1, 2)]).fit()
    res = run(d)
    res.fit()
    assert res.resumed
    ref_sd, res_sd = ref.method.state_dict(), res.method.state_dict()
    assert ref_sd.keys() == res_sd.keys()
    for k in ref_sd:
        torch.testing.assert_close(ref_sd[k], res_sd[k], rtol=0, atol=0, msg=k)
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
        assert len(bbs) == 4 and not {id(p) for p in bbs["dance"].parameters()} & {
            id(p) for p in bbs["shared"].parameters()
        }
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
        torch.testing.assert_close(
            t.key_encoder.encoder.state_dict()["head.heads.instance.linear.weight"],
            m.model.state_dict()["head.heads.instance.linear.weight"],
        )
    if name == "moco":
        assert m.tasks["moco"].momentum == 0.9 and m.tasks["moco"].loss.__class__.__name__ == "QueueNCELoss"
    if name == "rotnet":
        assert "accuracy/rotnet" in hist[-1]


def test_deepcluster_recluster_and_missing_labels():
    t = DeepClusterTask("dc", "dc", embedding_dim=4, num_samples=50, num_clusters=300)
    assert t.num_clusters == 5
    m = DiVA(
        backbone(),
        4,
        torch.zeros(50, dtype=torch.long).numpy(),
        tasks=("discriminative", "deepcluster"),
        embedding_dim=16,
    )
    with pytest.raises(ValueError, match="no pseudo-labels yet"):
        m.training_step(batch())
    g = torch.Generator().manual_seed(0)
    centers = torch.randn(5, 16, generator=g) * 5
    feats = centers.repeat_interleave(10, 0) + 0.01 * torch.randn(50, 16, generator=g)
    w0 = m.tasks["deepcluster"].classifier.weight.clone()
    labels = m.tasks["deepcluster"].recluster(feats, seed=7)
    ref, _, _ = kmeans(torch.nn.functional.normalize(feats, dim=1), 5, nredo=1, seed=7, backend="faiss")
    assert torch.equal(labels, ref) and int(labels.min()) >= 0 and int(labels.max()) < 5
    assert not torch.equal(w0, m.tasks["deepcluster"].classifier.weight)  # classifier re-initialised
    logs = m.training_step(batch())
    assert math.isfinite(float(logs["loss/deepcluster"]))
    with pytest.raises(ValueError, match="train_labels"):
        DiVA(backbone(), 4, None, tasks=("deepcluster",), embedding_dim=16)


class RecordingCE(torch.nn.CrossEntropyLoss):
    def forward(self, logits, target):
        self.target = target
        return super().forward(logits, target)


def test_rotnet_predicts_rotation_labels():
    from dml_nb.methods.base import MultiTaskMethod

    m = DiVA(backbone(), 4, tasks=("discriminative", "rotnet"), embedding_dim=16)
    t = m.tasks["rotnet"]
    t.loss = RecordingCE()
    inputs = []
    m.features = lambda x, model=None: (inputs.append(x), MultiTaskMethod.features(m, x, model))[1]
    b = batch()
    logs = m.training_step(b)
    assert len(inputs) == 2 and torch.equal(inputs[0], b["x"])  # the batch, then its rotated copy
    k = t.loss.target
    assert k.shape == (16,) and int(k.min()) >= 0 and int(k.max()) <= 3 and len(k.unique()) > 1
    for i in range(16):
        assert torch.equal(inputs[1][i], torch.rot90(b["x"][i], int(k[i]), (-2, -1)))
    assert abs(float(logs["loss/rotnet"]) - math.log(4)) < 1.0


def test_queue_task_needs_second_view():
    m = filled(diva())
    b = batch()
    del b["extra_views"]
    with pytest.raises(ValueError, match="second augmentation"):
        m.training_step(b)
    assert isinstance(m.tasks["dance"], QueueTask) and m.views == 2
    assert diva(tasks=("discriminative", "rotnet")).views == 1
    assert isinstance(diva(tasks=("discriminative", "rotnet")).tasks["rotnet"], RotNetTask)


def test_discriminative_only_diva_is_the_baseline():
    from dml_nb.methods.base import BaselineMethod

    seed_everything(0)
    base = BaselineMethod(backbone(), TRAIN.num_classes, embedding_dim=16, loss_options={"pair_count": "triplets"})
    seed_everything(0)
    only = DiVA(backbone(), TRAIN.num_classes, tasks=("discriminative",), embedding_dim=16)
    learner(base, steps=3).fit()
    learner(only, steps=3).fit()
    a, b = base.model.state_dict(), only.model.state_dict()
    assert len(a) == len(b)
    for (ka, va), (kb, vb) in zip(a.items(), b.items()):
        assert ka.replace("embedding", "discriminative") == kb
        torch.testing.assert_close(va, vb, rtol=0, atol=0)


# ---------------------------------------------------------------- golden tests against the authors' code
from golden import arr, load_golden  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from dml_nb.methods.diva import combine_heads, embed_weight_list  # noqa: E402
from dml_nb.evaluation.metrics import recall_at_k  # noqa: E402

AUTHORS_HEAD = {"discriminative": "discriminative", "selfsimilarity": "dance", "shared": "shared", "intra": "intra"}


def _golden_heads(fx):
    "The fixture's head embeddings under dml_nb's head names, in dml_nb's head order."
    heads = {
        AUTHORS_HEAD[h]: torch.tensor(arr(fx["inputs"]["heads"][h]), dtype=torch.float32)
        for h in fx["inputs"]["heads_order"]
    }
    return {h: heads[h] for h in ("discriminative", "shared", "intra", "dance")}


def _in_dml_nb_order(features, authors_order, dim):
    "Columns of the authors' concatenation (their head order) rearranged into dml_nb's head order."
    blocks = {AUTHORS_HEAD[h]: features[:, i * dim : (i + 1) * dim] for i, h in enumerate(authors_order)}
    return torch.cat([blocks[h] for h in ("discriminative", "shared", "intra", "dance")], dim=1)


@pytest.mark.parametrize("reading", ["code", "equal"])
def test_golden_test_embedding_is_the_authors_weighted_concatenation(reading):
    fx = load_golden("diva_test_embedding")
    heads, y = _golden_heads(fx), torch.tensor(fx["inputs"]["labels"])
    for combo in fx["outputs"]["combinations"]:
        weights = {AUTHORS_HEAD[h]: w for h, w in zip(combo["heads"], combo["weights"])}
        ref = _in_dml_nb_order(torch.tensor(arr(combo["features"]), dtype=torch.float32), combo["heads"], 8)
        ours = combine_heads(heads, weights if reading == "code" else None)
        close = torch.allclose(ours, ref, atol=1e-6)
        if reading == "equal" and combo["weights"] != [1.0] * 4:
            assert not close, combo["evaltype"]  # equal weights are not what the code evaluates here
            continue
        assert close, combo["evaltype"]
        assert recall_at_k(ours, y, ks=(1,))[1] == pytest.approx(combo["recall@1"]), combo["evaltype"]


def test_golden_diva_embed_reports_every_weighting_of_the_authors_code():
    fx = load_golden("diva_test_embedding")
    heads = _golden_heads(fx)
    cub = [c for c in fx["outputs"]["combinations"] if "cub200" in c["datasets"]]
    assert len(cub) == 3 and all(c["weights"][0] < c["weights"][1] for c in cub)  # never equal weights on CUB200
    m = diva(embed_weights=[{AUTHORS_HEAD[h]: w for h, w in zip(c["heads"], c["weights"])} for c in cub])
    m.head_embeddings = lambda f, names=None, model=None, regularise=True: heads
    m.features = lambda x, model=None: x
    out = m.embed(torch.zeros(24, 1))
    assert list(out)[:3] == ["concat", "concat2", "concat3"]
    for key, c in zip(("concat", "concat2", "concat3"), cub):
        ref = _in_dml_nb_order(torch.tensor(arr(c["features"]), dtype=torch.float32), c["heads"], 8)
        torch.testing.assert_close(out[key], ref, atol=1e-6, rtol=0)


def test_paper_files_use_the_codes_head_weightings():
    "Every four-task DiVA section of a paper-scale file lists the weightings the authors' code evaluates on its dataset."
    import yaml
    from pathlib import Path

    fx = load_golden("diva_test_embedding")
    heads = ["discriminative", "shared", "intra", "dance"]
    unit = lambda w: torch.nn.functional.normalize(torch.tensor([float(w[h]) for h in heads]), dim=0)
    code = {}
    for c in fx["outputs"]["combinations"]:
        for ds in c["datasets"]:
            code.setdefault(ds, []).append(unit({AUTHORS_HEAD[h]: w for h, w in zip(c["heads"], c["weights"])}))
    code["sop"] = code.pop("online_products")
    root = Path(__file__).parents[1] / "params"
    sections = [
        ("cub200", yaml.safe_load((root / "train" / "cub200_diva.yaml").read_text())["method"]),
        ("cub200", yaml.safe_load((root / "repro_diva_fig4_left" / "cub200.yaml").read_text())["diva"]),
        ("cub200", yaml.safe_load((root / "repro_diva_fig5" / "cub200.yaml").read_text())["diva"]["method"]),
    ]
    sections += [
        (ds, yaml.safe_load((root / "repro_diva_table4" / f"{ds}.yaml").read_text())["diva"])
        for ds in ("cub200", "cars196")
    ]
    for ds, sec in sections:
        assert sec["tasks"] == heads
        ours = [unit(w) for w in embed_weight_list(sec["embed_weights"], heads)]
        assert len(ours) == len(code[ds]) and all(torch.allclose(a, b, atol=1e-6) for a, b in zip(ours, code[ds])), ds


class _Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.backbone = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.BatchNorm1d(5), torch.nn.ReLU())
        self.head = torch.nn.Linear(5, 4)


class _Stub:
    "The two calls QueueTask makes on its recipe, for a model with one backbone and one head."

    def __init__(self, model):
        self.model = model

    def features(self, x, model=None):
        return (model or self.model).backbone(x)

    def head_embeddings(self, f, names, model=None, regularise=True):
        return {names[0]: F.normalize((model or self.model).head(f), dim=-1)}


def _load(module, state):
    with torch.no_grad():
        for k, v in module.state_dict().items():
            if k in state:
                v.copy_(torch.tensor(arr(state[k]), dtype=v.dtype))


@pytest.mark.parametrize("reading", ["code", "ema_buffers", "momentum_0.999"])
def test_golden_key_encoder_and_queue(reading):
    fx = load_golden("diva_key_encoder_queue")
    inp, out = fx["inputs"], fx["outputs"]
    model = _Tiny()
    _load(model, inp["initial_model"])
    stub = _Stub(model)
    task = QueueTask(
        "dance",
        "head",
        "dance",
        None,
        1.0,
        embedding_dim=4,
        queue_batches=inp["n_key_batches"],
        momentum={"momentum_0.999": 0.999}.get(reading, inp["momentum"]),
        key_buffers="ema" if reading == "ema_buffers" else "initial",
    )
    task.setup(stub)
    x = torch.tensor(arr(inp["fill_inputs"]), dtype=torch.float32)
    bs = inp["batch_size"]
    assert task.fill(stub, (x[i : i + bs] for i in range(0, len(x), bs))) == inp["n_key_batches"] * bs
    torch.testing.assert_close(
        task.queue.ordered_keys(), torch.tensor(arr(out["queue_after_fill"]), dtype=torch.float32)
    )
    matches = []
    for step, ref in zip(inp["steps"], out["steps"]):
        _load(model, step["model"])  # the query model after an optimiser step
        task._pending = torch.tensor(arr(step["keys"]), dtype=torch.float32)
        task.after_optimizer_step(SimpleNamespace(method=stub))  # a task's hooks read the recipe from the context
        enc = task.key_encoder.encoder.state_dict()
        matches.append(
            all(
                torch.allclose(enc[k], torch.tensor(arr(v), dtype=torch.float32), atol=1e-6)
                for k, v in ref["key_model"].items()
            )
        )
        torch.testing.assert_close(
            task.queue.ordered_keys(), torch.tensor(arr(ref["queue"]), dtype=torch.float32)
        )  # FIFO
    assert all(matches) if reading == "code" else not any(matches)


def test_tuple_options_reach_the_miners():
    code = diva()
    assert type(code.tasks["shared"].miner).__name__ == "SharedRandomMiner"  # the published runs
    assert code.tasks["intra"].miner.distinct is False
    assert (code.tasks["discriminative"].miner.upper_cutoff, code.tasks["discriminative"].miner.positives) == (
        None,
        "one",
    )
    assert (code.tasks["shared"].miner.upper_cutoff, code.tasks["shared"].miner.positives) == (None, "one")
    paper = diva(sharing="eq3", intra_distinct=True, upper_cutoff=1.4, positives="all")
    assert (
        type(paper.tasks["shared"].miner).__name__ == "SharedTripletMiner"
        and paper.tasks["shared"].miner.upper_cutoff == 1.4
    )
    assert paper.tasks["intra"].miner.distinct is True
    assert (paper.tasks["discriminative"].miner.upper_cutoff, paper.tasks["discriminative"].miner.positives) == (
        1.4,
        "all",
    )
    ms = diva(loss="multi_similarity")  # a loss whose miner takes no distance options
    assert type(ms.tasks["discriminative"].miner).__name__ != "DistanceWeightedMiner"
    for bad, match in (
        (dict(sharing="full"), "sharing"),
        (dict(normalize="batch"), "normalize"),
        (dict(positives="two"), "positives"),
        (dict(key_buffers="frozen"), "key_buffers"),
        (dict(queue_batches=30), "not both"),
        (dict(embed_weights={"dnace": 1.0}), "Did you mean"),
    ):
        with pytest.raises((ValueError, KeyError), match=match):
            diva(**bad)


def test_queue_is_sized_in_batches_of_the_learner():
    m = diva(queue_size=None)  # default: 30 batches
    lrn = learner(m, steps=1)
    lrn.prepare_fit()
    m.before_fit(lrn.context)
    assert m.tasks["dance"].queue.size == 30 * 16 and m.tasks["dance"].queue.is_full
    assert diva(queue_size=None, queue_batches=2).tasks["dance"].fill(m, [torch.randn(8, 3, 32, 32)] * 5) == 16


class PerStep(Callback):
    def __init__(self):
        self.rows = []

    def after_step(self, learner, logs):
        self.rows.append({k: float(v) for k, v in logs.items()})


def test_short_shapes_run_gives_every_task_a_signal():
    """K = 2 (the paper's batches): the intra task gets triplets in every batch (three distinct images of a class would
    give none), and DaNCE logs the share of query-negative pairs with a non-zero weight. DaNCE's loss is non-zero while
    the DaNCE head's embeddings are spread; on `shapes` they concentrate within the lambda = 0.5 clamp after a few
    steps and the loss becomes 0 in float32, in the authors' code as well (nbs/51_diva.ipynb, point 14)."""
    seed_everything(0)
    m = DiVA(
        build_backbone("small_cnn", width=4, feature_dim=16),
        TRAIN.num_classes,
        TRAIN.labels,
        embedding_dim=32,
        rho=10.0,
    )
    sampler = ClassBalancedBatchSampler(TRAIN.labels, batch_size=16, samples_per_class=2, seed=1, batches_per_epoch=3)
    probe = PerStep()
    hist = Learner(m, TRAIN, sampler, epochs=2, lr=1e-3, callbacks=[probe], progress=False, seed=3).fit()
    assert len(probe.rows) == 6 and all(r["tuples/intra"] == 16 for r in probe.rows)
    assert all(r["tuples/shared"] > 0 and r["tuples/discriminative"] > 0 for r in probe.rows)
    assert all(0 < h["nonzero_weights/dance"] <= 1 for h in hist)
    assert hist[0]["loss/dance"] > 0 and all(-1 <= h["positive_similarity/dance"] <= 1 for h in hist)
    paper = DiVA(
        build_backbone("small_cnn", width=4, feature_dim=16),
        TRAIN.num_classes,
        TRAIN.labels,
        embedding_dim=32,
        rho=10.0,
        intra_distinct=True,
    )
    filled(paper)
    b = batch(classes=8)  # 16 images, 2 per class
    assert paper.training_step(b)["tuples/intra"] == 0  # the paper's reading at K = 2: no intra-class triplets


class _FillContext:
    "Just what QueueTask.fill_from_learner reads of a run; each image's key is its index (so the queue shows the images)."

    def __init__(self, labels, batch_size, samples_per_class, dim):
        self.batch_size, self.world_size, self.dim = batch_size, 1, dim
        self.train_dataset = type("Set", (), {"labels": np.asarray(labels), "__len__": lambda s: len(labels)})()
        self.sampler = self.run_sampler = ClassBalancedBatchSampler(
            labels, batch_size, samples_per_class, draw="class_random"
        )
        self.samples_per_class = samples_per_class  # the context's batch shape

    def rng(self, name, *keys):
        return torch.Generator().manual_seed(hash((name, keys)) % 2**31)

    def seed(self, name, *keys):
        return hash((name, keys)) % 2**31

    def embed(self, dataset, fn, indices, seeds, batch_size):
        return {"keys": torch.tensor(indices, dtype=torch.float32)[:, None].repeat(1, self.dim)}, None


def test_golden_queue_fill_class_random():
    """DiVA fills its queue from 30 class-random batches (criteria/fast_moco.py create_memory_queue over the training
    loader), so images repeat: 2,520-2,576 distinct of 3,360 at CUB's size in their code (10 seeds)."""
    g = load_golden("diva_queue_fill")
    inp, out = g["inputs"], g["outputs"]
    labels = np.repeat(np.arange(len(inp["class_sizes"])), inp["class_sizes"])
    n_keys = inp["queue_batches"] * inp["batch_size"]
    assert out["keys"] == [n_keys] * len(inp["seeds"])
    theirs = np.asarray(out["queue_seed0"])
    assert len(np.unique(theirs)) == out["distinct"][0]
    assert (labels[theirs[0::2]] == labels[theirs[1::2]]).all()  # their blocks: 2 images of one class
    ours = []
    for seed in inp["seeds"]:
        task = QueueTask(
            "dance", "dance", embedding_dim=4, queue_batches=inp["queue_batches"], queue_fill="class_random"
        )
        ctx = _FillContext(labels, inp["batch_size"], inp["samples_per_class"], 4)
        ctx.seed = lambda name, *keys, s=seed: s
        assert task.fill_from_learner(None, ctx) == n_keys
        filled = task.queue.keys[:, 0].long().numpy()
        assert (labels[filled[0::2]] == labels[filled[1::2]]).all()  # the same block structure
        ours.append(len(np.unique(filled)))
    lo, hi = min(out["distinct"]), max(out["distinct"])
    spread = np.std(out["distinct"])
    assert lo - 3 * spread <= np.mean(ours) <= hi + 3 * spread, (ours, out["distinct"])
    assert abs(np.mean(ours) - np.mean(out["distinct"])) < 4 * spread / np.sqrt(len(ours)) + 10
    distinct = QueueTask("dance", "dance", embedding_dim=4, queue_batches=inp["queue_batches"])  # dml_nb's default
    assert distinct.queue_fill == "distinct"
    distinct.fill_from_learner(None, _FillContext(labels, inp["batch_size"], inp["samples_per_class"], 4))
    assert len(np.unique(distinct.queue.keys[:, 0].long().numpy())) == n_keys
    with pytest.raises(ValueError, match="queue_fill"):
        QueueTask("dance", "dance", embedding_dim=4, queue_fill="loader")
