"""The GPU code paths, exercised on the CPU where torch allows (and on a CUDA device by the tests marked `gpu`, which
benchmarks/gpu_check.sh runs): a bf16 autocast step against fp32, channels_last against the default layout, every view
of an on-device batch in the model's layout, the CUDA RNG state in checkpoints, and data-parallel training through
gloo with the JPEG path. (Already elsewhere: bf16 + channels_last runs, tests/test_learner.py; DDP against one process,
tests/test_distributed.py; the cache's and the JPEG path's device augmentation, tests/test_cache.py, test_jpeg_path.py.)"""

from __future__ import annotations
import csv
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from dml_nb.data.batches import JpegImages, to_device
from dml_nb.training.checkpoint import load_checkpoint, rng_state, set_rng_state
from dml_nb.core.base import seed_everything
from dml_nb.training.learner import Learner
from dml_nb.methods.base import BaselineMethod
from dml_nb.blocks.models import build_backbone
from dml_nb.data.samplers import ClassBalancedBatchSampler
from dml_nb.training.callbacks import Callback

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def sets(shapes4):
    return shapes4


def learner(sets, run_dir=None, epochs=2, steps=3, device="cpu", **kw):
    train, _, test = sets
    torch.manual_seed(0)
    bb = build_backbone("small_cnn", width=8, feature_dim=32)
    method = BaselineMethod(bb, train.num_classes, embedding_dim=16, loss="margin")
    sampler = ClassBalancedBatchSampler(
        train.labels, batch_size=16, samples_per_class=4, seed=0, batches_per_epoch=steps
    )
    kw = {"lr": 1e-3, "eval_sets": {"test": test}, "metrics": ("recall@1",), "progress": False, "seed": 3, **kw}
    return Learner(method, train, sampler, epochs=epochs, run_dir=run_dir, device=device, **kw)


def first_step(learn) -> tuple[float, torch.Tensor]:
    "The loss and the gradient of the learner's first training batch (the same batch and draws whatever its settings)."
    learn.prepare_fit()
    batches, _ = learn._epoch_batches(0)
    learn._batches.batches = [[(i, 100 + j) for j, i in enumerate(batches[0])]]
    batch = to_device(next(iter(learn._loader)), learn.device, learn.channels_last)
    seed_everything(5, cuda=learn.device.type == "cuda")
    with learn.autocast():
        loss = learn.method.training_step(batch)["loss"]
    learn.optimizer.zero_grad()
    loss.backward()
    return loss.item(), torch.cat(
        [p.grad.flatten().float().cpu() for p in learn.method.parameters() if p.grad is not None]
    )


def test_a_bf16_autocast_step_is_close_to_fp32(sets):
    """One step under bf16 autocast against float32, same batch and draws: measured here a relative loss difference of
    2.4e-4 and a gradient cosine of 0.995 (bf16 keeps 8 significant bits); the bounds leave 20x / 4x room."""
    l32, g32 = first_step(learner(sets, amp="none"))
    l16, g16 = first_step(learner(sets, amp="bf16"))
    assert l32 > 0 and abs(l16 - l32) / l32 < 5e-3
    assert torch.nn.functional.cosine_similarity(g32, g16, dim=0) > 0.98


def test_channels_last_trains_the_same_run(sets):
    """channels_last changes only the memory layout (and the convolution kernels): over 2 epochs the losses agreed to
    2.6e-8 and the weights to 3.8e-6 (relative) here; the bounds leave 100x room."""
    a, b = learner(sets, channels_last="off"), learner(sets, channels_last="on")
    ha, hb = a.fit(), b.fit()
    for ra, rb in zip(ha, hb):
        assert rb["loss"] == pytest.approx(ra["loss"], rel=1e-5)
    for (k, p), q in zip(a.method.named_parameters(), b.method.parameters()):
        torch.testing.assert_close(q, p, atol=1e-4, rtol=1e-4, msg=k)
    assert b.method.model.backbone.body[0].weight.is_contiguous(memory_format=torch.channels_last)


def test_every_view_of_an_on_device_batch_is_channels_last(tmp_path):
    "The JPEG path's device stage and the cache's BatchAugment give every view ('x', 'extra_views') in the model's layout."
    from PIL import Image
    from dml_nb.data.cache import cache_images
    from dml_nb.data.datasets import ImageListDataset, make_transform

    paths = []
    for k in range(4):
        paths.append(tmp_path / f"{k}.jpg")
        Image.fromarray((np.random.default_rng(k).random((90, 120, 3)) * 255).astype(np.uint8)).save(paths[-1])
    src = ImageListDataset(paths, [0, 0, 1, 1], make_transform("resnet50", train=True, size=64))
    ji = JpegImages(src, decode_on="device")
    items, collate = ji.loader_items(2, "cpu")
    b = to_device(collate([items[(k, k)] for k in range(4)]), "cpu", channels_last=True, transform=ji.batch_transform)
    cached = cache_images(src, cache_dir=tmp_path / "cache", progress=False)
    from dml_nb.data.cache import RawItems, pad_collate

    c = to_device(
        pad_collate([RawItems(cached)[(k, 0)] for k in range(4)]),
        "cpu",
        channels_last=True,
        transform=cached.batch_transform,
        views=2,
        generator=torch.Generator().manual_seed(0),
    )
    for batch in (b, c):
        for x in (batch["x"], *batch["extra_views"]):
            assert x.shape == (4, 3, 64, 64) and x.is_contiguous(memory_format=torch.channels_last)


class FakeCuda:
    "Two CUDA devices' RNG states, as torch.cuda keeps them, for a CPU-only machine."

    def __init__(self, n=2):
        self.n, self.states = n, [torch.randint(0, 255, (16,), dtype=torch.uint8) for _ in range(n)]
        self.restored = None

    def install(self, monkeypatch, n_here=None):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: self.n if n_here is None else n_here)
        monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: [s.clone() for s in self.states])
        monkeypatch.setattr(torch.cuda, "set_rng_state_all", lambda states: setattr(self, "restored", list(states)))


def test_checkpoints_keep_and_restore_the_cuda_rng_state_when_there_is_one(monkeypatch):
    "Guarded: restored where the device count matches, left alone on a machine without CUDA or with other devices."
    if not torch.cuda.is_available():
        assert rng_state()["cuda"] == []
    with monkeypatch.context() as m:
        fake = FakeCuda()
        fake.install(m)
        state = rng_state()
        after = torch.rand(3)
        assert len(state["cuda"]) == 2 and all(torch.equal(a, b) for a, b in zip(state["cuda"], fake.states))
        set_rng_state(state)
        assert fake.restored is not None and all(torch.equal(a, b) for a, b in zip(fake.restored, fake.states))
        fake.restored = None
        fake.install(m, n_here=1)  # resumed where there is one GPU: CUDA's states are not forced on it
        set_rng_state(state)
        assert fake.restored is None
    if not torch.cuda.is_available():  # a GPU checkpoint resumed on a CPU machine: the CPU states come back
        torch.manual_seed(1)
        set_rng_state(state)
        assert torch.equal(torch.rand(3), after)


def _torchrun():
    exe = Path(sys.executable).with_name("torchrun")
    return str(exe) if exe.exists() else shutil.which("torchrun")


def _dml_train():
    exe = Path(sys.executable).with_name("dml-train")
    return str(exe) if exe.exists() else shutil.which("dml-train")


@pytest.mark.skipif(_torchrun() is None or _dml_train() is None, reason="torchrun / dml-train not installed")
@pytest.mark.slow  # 35 s; one process: tests/test_jpeg_path.py trains identically on both paths, tests/test_learner.py two torchrun processes
def test_two_gloo_processes_train_the_same_on_the_jpeg_and_pil_paths(tmp_path):
    "dml-train under torchrun, 2 processes, gloo, on CUB-format JPEGs: the JPEG path's run equals the PIL path's."
    from dml_nb.data.checks import write_fake_dataset

    root = write_fake_dataset("cub200", tmp_path / "cub", n_classes=8, per_class=4, size=40)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    runs = {}
    for decode in ("pil", "jpeg_batch"):
        params = tmp_path / f"{decode}.yaml"
        params.write_text(
            yaml.safe_dump(
                {
                    "data": {"name": "cub200", "root": str(root), "size": 32, "decode": decode},
                    "model": {"backbone": "small_cnn", "options": {"width": 4, "feature_dim": 16}},
                    "method": {"name": "baseline", "embedding_dim": 8},
                    "train": {
                        "epochs": 1,
                        "batch_size": 16,
                        "samples_per_class": 4,
                        "batches_per_epoch": 2,
                        "device": "cpu",
                    },
                    "eval": {"metrics": ["recall@1"], "save_embeddings": False},
                }
            )
        )
        res = subprocess.run(
            [
                _torchrun(),
                "--standalone",
                "--nproc_per_node",
                "2",
                "--no-python",
                _dml_train(),
                str(params),
                "-o",
                str(tmp_path / decode),
                "--no-progress",
            ],
            capture_output=True,
            text=True,
            timeout=600,
            env=env,
        )
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
        hist = [
            {k: v for k, v in r.items() if k != "time"} for r in csv.DictReader(open(tmp_path / decode / "history.csv"))
        ]
        runs[decode] = (hist, json.loads((tmp_path / decode / "metrics.json").read_text())["metrics"])
    assert runs["pil"] == runs["jpeg_batch"]


# ---- on a CUDA device (pytest -m gpu; benchmarks/gpu_check.sh) ----


class KillAt(Callback):
    def __init__(self, epoch, step):
        self.at = (epoch, step)

    def after_step(self, learner, logs):
        if (learner.epoch, learner.step) == self.at:
            raise KeyboardInterrupt("killed")


@pytest.mark.gpu
def test_cuda_bf16_channels_last_step_and_rng_round_trip(sets):
    l32, g32 = first_step(learner(sets, device="cuda", amp="none", channels_last="off"))
    learn = learner(sets, device="cuda")  # auto: bf16 and channels_last on a GPU
    assert learn.amp == "bf16" and learn.channels_last
    l16, g16 = first_step(learn)
    assert abs(l16 - l32) / l32 < 5e-3 and torch.nn.functional.cosine_similarity(g32, g16, dim=0) > 0.98
    state = rng_state()
    assert len(state["cuda"]) == torch.cuda.device_count()
    a = torch.rand(4, device="cuda")
    set_rng_state(state)
    assert torch.equal(a, torch.rand(4, device="cuda"))


@pytest.mark.gpu
def test_cuda_kill_and_resume_equals_an_uninterrupted_run(sets, tmp_path):
    "A run killed mid-epoch on the GPU and resumed from its checkpoint ends with the uninterrupted run's weights."
    ref = learner(sets, tmp_path / "ref", device="cuda", epochs=2, steps=4, checkpoint_every_steps=2)
    ref_hist = ref.fit()
    killed = learner(
        sets, tmp_path / "run", device="cuda", epochs=2, steps=4, checkpoint_every_steps=2, callbacks=[KillAt(1, 3)]
    )
    with pytest.raises(KeyboardInterrupt):
        killed.fit()
    assert len(load_checkpoint(tmp_path / "run" / "checkpoint.pt")["rng"]["cuda"]) == torch.cuda.device_count()
    resumed = learner(sets, tmp_path / "run", device="cuda", epochs=2, steps=4, checkpoint_every_steps=2)
    hist = resumed.fit()
    assert resumed.resumed
    assert [r["loss"] for r in hist] == [r["loss"] for r in ref_hist]
    for (k, p), q in zip(ref.method.state_dict().items(), resumed.method.state_dict().values()):
        if isinstance(p, torch.Tensor):
            assert torch.equal(p, q), k
