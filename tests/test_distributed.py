"""Multi-process training on CPU (gloo, 2 processes): a tiny config through dml-train under torchrun, and
DistributedDataParallel with half the batch per process against one process with the whole batch."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

TINY = {
    "data": {"images_per_class": 6},
    "model": {"options": {"width": 8}},
    "method": {"name": "baseline", "embedding_dim": 16},
    "train": {"epochs": 1, "batch_size": 16, "samples_per_class": 4},
    "eval": {"metrics": ["recall@1"], "save_embeddings": False},
}


def _torchrun():
    exe = Path(sys.executable).with_name("torchrun")
    return str(exe) if exe.exists() else shutil.which("torchrun")


@pytest.mark.skipif(
    _torchrun() is None
    or shutil.which("dml-train") is None
    and not Path(sys.executable).with_name("dml-train").exists(),
    reason="torchrun / dml-train not installed",
)
def test_dml_train_under_torchrun_gloo(tmp_path):
    params = tmp_path / "tiny.yaml"
    params.write_text(yaml.safe_dump(TINY))
    dml_train = str(Path(sys.executable).with_name("dml-train"))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    res = subprocess.run(
        [
            _torchrun(),
            "--standalone",
            "--nproc_per_node",
            "2",
            "--no-python",
            dml_train,
            str(params),
            "-o",
            str(tmp_path / "run"),
            "--no-progress",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert 0 <= metrics["metrics"]["test/recall@1"] <= 1
    assert (tmp_path / "run" / "done").exists()
    # a finished run is not trained again
    again = subprocess.run(
        [dml_train, str(params), "-o", str(tmp_path / "run"), "--no-progress"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert again.returncode == 0 and "a stored result (not trained again)" in again.stdout


def test_dml_train_rejects_bad_params(tmp_path):
    params = tmp_path / "bad.yaml"
    params.write_text("train: {epochz: 1}\n")
    dml_train = str(Path(sys.executable).with_name("dml-train"))
    res = subprocess.run([dml_train, str(params)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "Did you mean 'epochs'" in res.stderr


# DistributedDataParallel: 2 processes with half the batch each = 1 process with the whole batch --------------------


class HalfBatches:
    "The same global batches in every process; rank r of w trains on the r-th of w equal slices of each."

    def __init__(self, labels, rank=0, world_size=1, batch_size=16, steps=3):
        import torch

        g = torch.Generator().manual_seed(0)
        self.rank, self.world_size, self.batch_size = rank, world_size, batch_size // world_size
        self.global_batches = [torch.randperm(len(labels), generator=g)[:batch_size].tolist() for _ in range(steps)]

    def set_epoch(self, epoch):
        pass

    def batches(self, epoch):
        n = self.batch_size
        return [b[self.rank * n : (self.rank + 1) * n] for b in self.global_batches]


def _half_batch_learner(rank=0, world_size=1):
    "Baseline + Proxy-NCA (a mean over samples, no mining) on the small CNN with frozen BatchNorm, SGD."
    import torch
    from dml_nb.data.datasets import load_dataset
    from dml_nb.training.learner import Learner
    from dml_nb.methods.base import BaselineMethod
    from dml_nb.blocks.models import build_backbone

    train = load_dataset("shapes", split="train", images_per_class=4, augment=False)  # no random transforms
    torch.manual_seed(0)
    bb = build_backbone("small_cnn", width=8, feature_dim=32, frozen_bn=True)
    method = BaselineMethod(bb, train.num_classes, embedding_dim=16, loss="proxy_nca")
    return Learner(
        method,
        train,
        HalfBatches(train.labels, rank, world_size),
        epochs=2,
        lr=0.05,
        optimizer="sgd",
        eval_sets={},
        progress=False,
        seed=3,
    )


def _half_batch_worker(rank, world_size, out):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{out}/store", rank=rank, world_size=world_size)
    try:
        learn = _half_batch_learner(rank, world_size)
        hist = learn.fit()
        if rank == 0:
            torch.save({"params": dict(learn.method.named_parameters()), "hist": hist}, f"{out}/ddp.pt")
    finally:
        dist.destroy_process_group()


def test_two_processes_with_half_batches_equal_one_process_with_the_whole_batch(tmp_path):
    """DDP averages the two halves' gradients; the single process differentiates the mean over the whole batch.
    Proxy-NCA is a mean over samples (no tuples across the halves) and BatchNorm is frozen (per-process batch
    statistics would differ), so the two are the same function and differ only in the order of float32 sums:
    after 6 SGD steps the weights agree to 1e-5 (absolute) + 1e-4 (relative), the losses to 1e-5 (relative).
    The two processes are forked from this one (they inherit its imports: the test stays fast)."""
    import torch
    import torch.multiprocessing as mp
    import dml_nb.training.learner
    import dml_nb.methods.base  # noqa: F401  (imported once, here: the forked processes inherit them)

    mp.start_processes(_half_batch_worker, args=(2, str(tmp_path)), nprocs=2, start_method="fork")
    two = torch.load(tmp_path / "ddp.pt", weights_only=True)
    one = _half_batch_learner()
    init = {k: p.detach().clone() for k, p in one.method.named_parameters()}
    hist = one.fit()
    assert [k for k, _ in one.method.named_parameters()] == list(two["params"])  # no DDP "module." prefix
    for k, p in one.method.named_parameters():
        assert not torch.allclose(init[k], p, atol=1e-4), f"{k} did not train: the comparison would be empty"
        torch.testing.assert_close(two["params"][k], p.detach(), atol=1e-5, rtol=1e-4, msg=k)
    for a, b in zip(hist, two["hist"]):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
