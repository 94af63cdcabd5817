"""A training step that never waits for the device. Every recipe at its paper config (params/train/cub200_*.yaml, only
sizes shrunk; the JPEG path stood in by the embedded `shapes` set, the backbone by the small CNN, both on the CPU)
runs an ordinary step without one synchronising op outside dml_nb/data/batches.py (the JPEG path's own, which
benchmarks/step_census.py counts); the loss and gradient norm, read every few steps, still stop a run at a non-finite
value and name the steps read together (or the step itself under train.check_every_step); and every fixed-shape path
gives the same tuples, losses and states as the path it replaces."""

from __future__ import annotations
import copy
import traceback
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dml_nb.blocks.losses import MarginLoss, MultiSimilarityLoss
from dml_nb.blocks.miners import (
    DistanceWeightedMiner,
    DnCNearestMiner,
    IntraClassTripletMiner,
    MultiSimilarityMiner,
    SemiHardMiner,
    SharedRandomMiner,
    SharedTripletMiner,
)
from dml_nb.blocks.momentum import MemoryQueue, MomentumEncoder
from dml_nb.blocks.models import build_backbone
from dml_nb.core.config import config_to_dict, load_config, merge_layers
from dml_nb.data.samplers import ClassBalancedBatchSampler
from dml_nb.methods.base import BaselineMethod
from dml_nb.training.checkpoint import NonFiniteLossError
from dml_nb.training.learner import Learner

torch.set_num_threads(min(2, torch.get_num_threads()))
ROOT = Path(__file__).resolve().parents[1]
RECIPES = ("baseline", "diva", "sharing", "dnc", "bspml")
# the ops that make the host wait for the device when their input is there (on a GPU); on the CPU every tensor of
# the step is "there", so the count is of what would wait on a GPU
SYNC_OPS = {"_local_scalar_dense", "nonzero", "unique", "_unique", "_unique2", "unique_dim", "unique_consecutive"}
SYNC_OPS |= {"equal", "masked_select", "bincount"}
READS = ("tolist", "cpu", "numpy")  # device-to-host copies that do not dispatch an op on the CPU


def _site() -> str | None:
    """The innermost dml_nb frame of the caller (file:line), or None: outside dml_nb, in the JPEG path's module
    (data/batches.py: counted by benchmarks/step_census.py), or in torch.optim (Adam's and SGD's step counters are host
    tensors on a GPU too)."""
    stack = traceback.extract_stack()
    if any("/torch/optim/" in f.filename for f in stack):
        return None
    for f in reversed(stack):
        if "/dml_nb/" in f.filename:
            where = f.filename.split("/dml_nb/")[1]
            return None if where == "data/batches.py" else f"{where}:{f.lineno}"
    return None


class SyncCensus(TorchDispatchMode):
    "Counts the synchronising ops of the steps it is switched on for, by their dml_nb call site, and the kernels."

    def __init__(self):
        super().__init__()
        self.on, self.syncs, self.ops = False, Counter(), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if self.on:
            self.ops += 1
            masks = args[1] if name in ("index", "index_put", "index_put_") and len(args) > 1 else ()
            boolean = any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in masks or ())
            if name in SYNC_OPS or boolean or (name == "repeat_interleave" and not (kwargs or {}).get("output_size")):
                if (site := _site()) is not None:
                    self.syncs[f"{name} @ {site}"] += 1
        return func(*args, **(kwargs or {}))


@pytest.fixture
def census(monkeypatch):
    mode = SyncCensus()
    for name in READS:
        orig = getattr(torch.Tensor, name)

        def read(self, *a, _orig=orig, _name=name, **k):
            if mode.on and (site := _site()) is not None:
                mode.syncs[f"Tensor.{_name} @ {site}"] += 1
            return _orig(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, read)
    return mode


def paper_config(recipe: str, steps: int) -> dict:
    "params/train/cub200_<recipe>.yaml with only sizes shrunk (and the data and backbone the CPU stand-ins)."
    cfg = config_to_dict(load_config(ROOT / "params" / "train" / f"cub200_{recipe}.yaml"))
    k, opts = cfg["train"]["samples_per_class"], cfg["method"]["options"]
    small = {
        "data": {"name": "shapes", "images_per_class": 4, "size": 32, "decode": "pil", "root": None},
        "model": {"backbone": "small_cnn", "pretrained": None, "options": {"width": 4, "feature_dim": 16}},
        "train": {"epochs": 1, "batches_per_epoch": steps, "batch_size": 6 * k, "num_workers": 0, "device": "cpu"},
        "eval": {"every": 1, "metrics": ["recall@1"], "save_embeddings": False},
    }
    method = {key: 2 for key in ("queue_batches", "num_learners") if key in opts}  # DiVA's queue, D&C's K
    if method:
        small["method"] = {"options": method}
    return merge_layers(cfg, small)


_DATA: dict = {}


@pytest.mark.parametrize("recipe", RECIPES)
def test_an_ordinary_step_of_every_paper_recipe_waits_for_the_device_nowhere(recipe, census, monkeypatch):
    import dml_nb.training.build as E

    def build_data(cfg, progress=True):  # the sets once per label noise (BSPML's): they are what takes the time
        key = cfg.data.label_noise
        if key not in _DATA:
            _DATA[key] = build(cfg, progress=progress)
        return _DATA[key]

    build = E.build_data
    monkeypatch.setattr(E, "build_data", build_data)
    steps, counted = 4, (1, 2)  # the first and last step of an epoch read the loss (one sync each)
    learner = E.build_learner(paper_config(recipe, steps), progress=False)
    learner.eval_sets = {}  # no evaluation: the steps are what is counted
    step, seen = learner._train_step, []

    def counting(batch):
        census.on = batch["step"] in counted
        seen.append(batch["step"])
        with census:
            out = step(batch)
        census.on = False
        return out

    learner._train_step = counting
    history = learner.fit()
    assert set(counted) <= set(seen) and census.ops > 0
    assert not census.syncs, f"{recipe}: synchronising ops per ordinary step: {dict(census.syncs)}"
    tuples = [v for k, v in history[-1].items() if k == "tuples" or k.startswith("tuples/")]
    assert tuples and all(v > 0 for v in tuples), history[-1]  # the miners ran and found tuples


# the deferred finite check ----------------------------------------------------------------------------------------


class NaNAt(BaselineMethod):
    "The baseline, whose loss turns NaN at one step."

    def __init__(self, *a, at: int = 2, **kw):
        super().__init__(*a, **kw)
        self.at = at

    def training_step(self, batch):
        out = super().training_step(batch)
        if batch["step"] == self.at:
            out["loss"] = out["loss"] * float("nan")
        return out


def nan_learner(shapes4, tmp_path, at: int, steps: int = 8, **settings) -> Learner:
    train, _, _ = shapes4
    torch.manual_seed(0)
    bb = build_backbone("small_cnn", width=4, feature_dim=16)
    method = NaNAt(bb, train.num_classes, embedding_dim=8, at=at)
    sampler = ClassBalancedBatchSampler(train.labels, 16, 4, seed=0, batches_per_epoch=steps)
    kw = {"lr": 1e-3, "eval_sets": {}, "progress": False, "epochs": 2, "run_dir": tmp_path}
    return Learner(method, train, sampler, **kw, **settings)


def test_a_nonfinite_loss_is_caught_at_the_next_read_naming_the_steps_read_with_it(shapes4, tmp_path):
    learn = nan_learner(shapes4, tmp_path, at=2, log_every=4)  # reads: step 0 (the first), 3, 7 (the last)
    with pytest.raises(NonFiniteLossError) as e:
        learn.fit()
    msg = str(e.value)
    assert "the loss is nan at epoch 0 (0-based), step 2, the first non-finite one of steps 1-3, read together" in msg
    assert "The optimiser step of step 2 was taken, not that of step 3" in msg
    assert "train.check_every_step: true" in msg and "there is no checkpoint (none was written yet)" in msg
    assert learn.step == 3 and not (tmp_path / "checkpoint.pt").exists()  # stopped inside step 3, nothing written


def test_with_check_every_step_the_error_names_the_step_before_its_optimiser_step(shapes4, tmp_path):
    learn = nan_learner(shapes4, tmp_path, at=2, check_every_step=True)
    with pytest.raises(NonFiniteLossError) as e:
        learn.fit()
    msg = str(e.value)
    assert "the loss is nan at epoch 0 (0-based), step 2. The optimiser step was not taken" in msg
    assert "read together" not in msg
    assert all(torch.isfinite(p).all() for p in learn.method.parameters())  # no step with the NaN was taken


def test_a_nonfinite_loss_at_the_last_step_of_an_epoch_stops_before_the_epochs_checkpoint(shapes4, tmp_path):
    learn = nan_learner(shapes4, tmp_path, at=7, steps=8, log_every=100)  # reads at the first and last steps
    with pytest.raises(NonFiniteLossError, match="step 7, the first non-finite one of steps 1-7, read together.*"
                       "The optimiser step was not taken"):  # fmt: skip
        learn.fit()
    assert not (tmp_path / "checkpoint.pt").exists()


def test_the_epochs_loss_is_the_mean_of_every_step_read_in_windows(shapes4, tmp_path):
    "Read every 3 steps or every step: the same row, bit for bit (the sums add the same floats in the same order)."
    rows = []
    for settings in ({"log_every": 3}, {"check_every_step": True}):
        learn = nan_learner(shapes4, None, at=-1, steps=7, **settings)
        rows.append([{k: v for k, v in r.items() if k != "time"} for r in learn.fit()])
    assert rows[0] == rows[1]
    logs = [k for k in rows[0][0] if k != "epoch" and not k.startswith("lr/")]
    assert logs[:2] == ["loss", "grad_norm"]  # the columns' order: loss and grad_norm first, as before


# the fixed-shape paths give what the paths they replace give ---------------------------------------------------------


def pk_batch(p=6, k=2, dim=8, seed=0, shuffle=True):
    from dml_nb.blocks.miners import LabelLayout

    g = torch.Generator().manual_seed(seed)
    labels = torch.arange(p).repeat_interleave(k) * 3 + 5  # not 0..p-1: ranks and labels differ
    if shuffle:
        labels = labels[torch.randperm(len(labels), generator=g)]
    x = torch.nn.functional.normalize(torch.randn(len(labels), dim, generator=g), dim=1)
    return x, labels, LabelLayout.of(labels.numpy())


def same_draws(miner, x, labels, layout, **kw):
    a = miner(x, labels, generator=torch.Generator().manual_seed(1), **kw)
    b = miner(x, labels, generator=torch.Generator().manual_seed(1), layout=layout, **kw)
    assert len(a) == len(b) and all(torch.equal(u, v) for u, v in zip(a, b)), (a, b)
    return b


@pytest.mark.parametrize("k", [2, 4])
def test_the_miners_with_a_layout_draw_the_same_tuples(k):
    from dml_nb.blocks.miners import LabelLayout

    x, labels, layout = pk_batch(k=k)
    assert layout == LabelLayout(6, k, k, 6 * k * (k - 1)) and layout.every_anchor and layout.equal
    for miner in (
        DistanceWeightedMiner(),
        DistanceWeightedMiner(positives="all"),
        SemiHardMiner(),
        SharedTripletMiner(),
        SharedRandomMiner(),
        IntraClassTripletMiner(distinct=False),
        DnCNearestMiner(),
    ):
        same_draws(miner, x, labels, layout)
    same_draws(SharedRandomMiner(), x, labels, layout, permutation=torch.randperm(len(labels)))


def test_an_unbalanced_batch_keeps_the_reading_path():
    from dml_nb.blocks.miners import LabelLayout

    x, labels, _ = pk_batch(k=3)
    labels = labels.clone()
    labels[0] = 99  # a class of one: that anchor has no positive
    layout = LabelLayout.of(labels.numpy())
    assert not layout.every_anchor and not layout.equal
    for miner in (
        DistanceWeightedMiner(),
        SharedTripletMiner(),
        IntraClassTripletMiner(distinct=False),
        DnCNearestMiner(),
    ):
        out = same_draws(miner, x, labels, layout)
        assert 0 not in out[0].tolist() or isinstance(miner, (SharedTripletMiner, IntraClassTripletMiner))


def test_the_multi_similarity_loss_takes_the_miners_masks_as_its_tuples():
    x, labels, _ = pk_batch(k=4, dim=16)
    x.requires_grad_(True)
    miner, loss = MultiSimilarityMiner(epsilon=0.1), MultiSimilarityLoss(base=0.5)
    w = torch.rand(len(labels), generator=torch.Generator().manual_seed(2))
    by_index = loss(x, labels, miner(x, labels), weights=w)
    by_mask = loss(x, labels, miner.masks(x, labels), weights=w)
    assert torch.equal(by_index, by_mask)
    (g1,) = torch.autograd.grad(by_index, x)
    (g2,) = torch.autograd.grad(by_mask, x)
    assert torch.equal(g1, g2)
    none = torch.zeros(len(labels), len(labels), dtype=torch.bool)  # no informative pair: a zero loss, zero gradients
    empty = loss(x, labels, (none, none), weights=w)
    assert empty.item() == 0 and not torch.autograd.grad(empty, x)[0].any()


def test_the_margin_loss_checks_its_labels_once_up_front():
    x, labels, _ = pk_batch()
    loss = MarginLoss(num_classes=10)
    with pytest.raises(ValueError, match=r"one beta per class for 10 classes but got labels in \[5, 20\]"):
        loss.check_labels(labels.numpy())
    assert not loss.labels_checked
    loss.check_labels(np.arange(10))
    assert loss.labels_checked


def test_the_queue_mirrors_its_count_on_the_host_across_a_state_dict():
    q = MemoryQueue(5, 2)
    for n in (2, 2, 3):
        q.enqueue(torch.randn(n, 2))
    assert len(q) == int(q.count) == 5 and q.is_full
    r = MemoryQueue(5, 2)
    q.reset()
    q.enqueue(torch.randn(3, 2))
    r.load_state_dict(q.state_dict())
    assert len(r) == 3 and not r.is_full and torch.equal(r.keys, q.keys)


def test_the_key_encoder_left_its_buffers_is_the_round_trip_it_replaces():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    model.train()
    model(torch.randn(8, 3))  # the query model's statistics move away from the key's
    old, new = MomentumEncoder(model, 0.9), MomentumEncoder(model, 0.9)
    model(torch.randn(8, 3))
    with torch.no_grad():
        model[0].weight.add_(1.0)
    kept = [b.clone() for b in old.encoder.buffers()]  # the former key_buffers='initial': update, then restore
    old.update(model)
    for b, k in zip(old.encoder.buffers(), kept):
        b.copy_(k)
    new.update(model, with_buffers=False)
    for (n, a), b in zip(old.state_dict().items(), new.state_dict().values()):
        assert torch.equal(a, b), n


def test_zeroing_the_gradients_drops_them_and_fills_zeros_after_the_backward():
    from dml_nb.training.learner import fill_zero_grads, zero_grads

    params = [
        torch.nn.Parameter(torch.randn(3)),
        torch.nn.Parameter(torch.randn(2, 2)),
        torch.nn.Parameter(torch.ones(1)),
    ]
    opt = torch.optim.Adam(params)
    sum(p.sum() for p in params[:2]).backward()
    had = zero_grads(opt, set_to_none=False)
    assert had == params[:2] and all(p.grad is None for p in params)  # dropped: the backward takes its buffers
    fill_zero_grads(had)  # no gradient came: zeros for those that had one, as zero_grad(set_to_none=False)
    assert all(p.grad is not None and not p.grad.any() for p in params[:2]) and params[2].grad is None
    assert zero_grads(opt, set_to_none=True) == [] and all(p.grad is None for p in params)


class KernelNames(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def test_zero_grads_zeros_gives_a_parameter_without_gradient_zeros_and_an_adam_step_without_adds():
    from dml_nb.training.learner import fill_zero_grads, zero_grads

    torch.manual_seed(0)
    init = [torch.randn(3), torch.randn(4), torch.randn(2)]
    w = [torch.randn(3), torch.randn(4)]  # linear losses: their backward is a mul per parameter, no add

    def run(ours: bool):
        params = [torch.nn.Parameter(t.clone()) for t in init]
        opt = torch.optim.Adam(params, lr=0.1, weight_decay=0.01)
        names = []
        for step in range(3):
            # the last parameter gets a gradient in the first step only
            loss = sum((p * c).sum() for p, c in zip(params, w)) + (params[2].sum() if step == 0 else 0)
            count = KernelNames()
            with count:
                if ours:
                    had = zero_grads(opt, set_to_none=False)
                    loss.backward()
                    fill_zero_grads(had)
                else:
                    opt.zero_grad(set_to_none=False)
                    loss.backward()
            names.append(count.names)
            if step > 0:
                assert params[2].grad is not None and not params[2].grad.any()
            opt.step()
        return params, opt, names

    ours, opt, names = run(True)
    ref, ref_opt, ref_names = run(False)
    assert not torch.equal(ours[2].detach(), init[2])  # Adam still moved it by its momentum and weight decay
    for a, b in zip(ours, ref):  # the same values as zero_grad(set_to_none=False)
        assert torch.equal(a, b) and torch.equal(a.grad, b.grad)
    for s, r in zip(opt.state.values(), ref_opt.state.values()):
        assert all(torch.equal(s[k], r[k]) for k in ("exp_avg", "exp_avg_sq"))
    assert sum(ref_names[-1][k] for k in ("add", "add_")) >= 2  # the zeros path of torch: one add per parameter
    for n in names[1:]:  # ours: no add, one fill (zeros) for the parameter without gradient
        assert n["add"] + n["add_"] == 0, n
        assert n["zero_"] + n["fill_"] + n["zeros_like"] == 1, n


def test_a_deep_copy_of_a_queue_keeps_its_count():
    q = MemoryQueue(4, 2)
    q.enqueue(torch.randn(3, 2))
    assert len(copy.deepcopy(q)) == 3
