"""The prepared GPU check: one run, at most 8 minutes, one table (printed and written to `--out`).

Sections, each with its own time limit (the whole run stops short of `--budget` seconds, 450 by default):
  environment                 GPU, driver-side CUDA, torch / torchvision / faiss / pytorch-metric-learning, nvJPEG
  gpu tests                   pytest -m gpu (the tests that need a CUDA device)
  ResNet50 and each method    img/s of the training steps of every params/train/cub200_*.yaml (fp32, batch 112, the
                              paper files' settings, the JPEG path on synthetic CUB-format JPEGs at 500 x 375) against
                              a bare torchvision ResNet50 loop in the same process; peak GPU memory per config
  data path                   the JPEG path's and the PIL path's img/s through the loader with 14 workers
  DiVA CUB200 projection      350 epochs x (5,864 images / DiVA's img/s + an evaluation of 5,924 images + its metrics)
  evaluation at SOP scale     dml_nb's torch back end against pytorch-metric-learning, and faiss-gpu where carried
  torchrun nccl               torchrun --nproc_per_node 1: a process group on nccl, dml_nb's collectives and DDP step
  resume                      a run killed mid-epoch on the device and resumed equals the uninterrupted run

    bash benchmarks/gpu_check.sh                         # on the GPU machine (PYTHONPATH=., no network)
    bash benchmarks/gpu_check.sh --device cpu --tiny     # the rehearsal: every section at toy size on the CPU
"""

from __future__ import annotations
import argparse
import datetime
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

METHODS = ("baseline", "diva", "dnc", "sharing", "bspml")
CUB_TRAIN, CUB_TEST, EPOCHS = 5864, 5924, 350  # CUB200's split; DiVA's sample runs train 350 epochs


class Check:
    "The table: rows (section, item, value, note), written to `out` after every section; the clock of the whole run."

    def __init__(self, out: Path, budget: float):
        self.out, self.budget, self.t0, self.rows = out, budget, time.perf_counter(), []

    def left(self) -> float:
        return self.budget - (time.perf_counter() - self.t0)

    def add(self, section, item, value, note=""):
        self.rows.append((section, item, value, note))
        print(f"  {section} | {item} | {value} | {note}", flush=True)

    def table(self) -> str:
        lines = ["| section | item | value | note |", "| --- | --- | --- | --- |"]
        lines += [f"| {s} | {i} | {v} | {n} |" for s, i, v, n in self.rows]
        return "\n".join(lines)

    def write(self):
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.out.write_text(
            f"# gpu_check {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, "
            f"{time.perf_counter() - self.t0:.0f} s\n\n{self.table()}\n"
        )

    def section(self, name: str, limit: float, fn, *args):
        "Run one section if `limit` seconds are left; a failure is a row, not the end of the check."
        if self.left() < limit:
            self.add(name, "skipped", "-", f"{self.left():.0f} s left of the budget, the section needs {limit:.0f}")
            return
        print(f"== {name} (limit {limit:.0f} s, {self.left():.0f} s left)", flush=True)
        t = time.perf_counter()
        try:
            fn(self, limit, *args)
        except Exception as e:
            self.add(name, "FAILED", type(e).__name__, str(e).replace("|", "/").replace("\n", " ")[:300])
            traceback.print_exc()
        self.add(name, "section time", f"{time.perf_counter() - t:.0f} s", "")
        self.write()


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ------------------------------------------------------------------------------------------------------ sections


def environment(c: Check, limit, device):
    import torchvision

    c.add("environment", "machine", platform.node(), f"{os.cpu_count()} cores, Python {platform.python_version()}")
    c.add(
        "environment",
        "torch / torchvision",
        f"{torch.__version__} / {torchvision.__version__}",
        f"CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}",
    )
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        c.add("environment", "device", p.name, f"{p.total_memory / 2**30:.0f} GiB, {torch.cuda.device_count()} GPU(s)")
    else:
        c.add("environment", "device", "cpu", "rehearsal")
    from dml_nb.data.batches import nvjpeg_available

    c.add(
        "environment",
        "nvJPEG decode",
        nvjpeg_available(device) if device.type == "cuda" else "n/a",
        "torchvision.io.decode_jpeg on the device",
    )
    try:
        import faiss
        from dml_nb.evaluation.faiss_backend import faiss_gpus

        c.add("environment", "faiss", faiss.__version__, f"{faiss_gpus()} GPU(s) for faiss")
    except ImportError:
        c.add(
            "environment", "faiss", "absent", "DiVA, D&C and Sharing cluster with faiss: carry a faiss wheel in .whl/"
        )
    try:
        import pytorch_metric_learning as pml

        c.add("environment", "pytorch-metric-learning", pml.__version__, "")
    except ImportError:
        c.add("environment", "pytorch-metric-learning", "absent", "the SOP comparison is skipped")


def gpu_tests(c: Check, limit, device):
    # the test files that hold a gpu mark: collecting all of tests/ would import papermill and the other dev
    # dependencies that a GPU machine's own Python may lack (only the package's dependencies are needed here)
    files = sorted(str(f.relative_to(ROOT)) for f in (ROOT / "tests").glob("test_*.py") if "mark.gpu" in f.read_text())
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", *files]
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    if device.type != "cuda":
        env["CUDA_VISIBLE_DEVICES"] = ""  # the rehearsal: they skip, the collection runs
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=limit, env=env)
    last = [l for l in r.stdout.strip().splitlines() if l.strip()][-1:] or ["(no output)"]
    c.add(
        "gpu tests", "pytest -m gpu", "passed" if r.returncode in (0, 5) else f"rc {r.returncode}", last[0].strip("= ")
    )
    if r.returncode not in (0, 5):
        print(r.stdout[-4000:], r.stderr[-2000:])


def write_cub(root: Path, classes: int, per_class: int) -> Path:
    "A CUB200-format tree (images.txt, image_class_labels.txt, classes.txt) of generated JPEGs of 500 x 375 (CUB's size)."
    from data import write_jpegs

    base = root / "CUB_200_2011"
    lines, labels, names, i = [], [], [], 0
    for c in range(1, classes + 1):
        folder = f"{c:03d}.Bird_{c}"
        names.append(f"{c} {folder}")
        for p in write_jpegs(base / "images" / folder, per_class, seed=c):
            i += 1
            lines.append(f"{i} {folder}/{p.name}")
            labels.append(f"{i} {c}")
    (base / "images.txt").write_text("\n".join(lines) + "\n")
    (base / "image_class_labels.txt").write_text("\n".join(labels) + "\n")
    (base / "classes.txt").write_text("\n".join(names) + "\n")
    return root


def paper_config(method: str, root: Path, device, tiny: bool, steps: int, extra=()):
    from dml_nb.core.config import load_config

    over = [
        f"data.root={root}",
        "model.pretrained=false",
        "train.epochs=1",
        f"train.batches_per_epoch={steps}",
        f"train.device={device.type}",
        "data.eval_train=false",
        f"train.num_workers={2 if tiny else 14}",
        *extra,
    ]
    if tiny:
        over += [
            "data.size=32",
            "train.batch_size=8",  # ResNet50 with random weights at 32 px;
            "train.stop_on_empty_tuples=false",
        ]  # toy batches may leave a task without tuples
    if tiny and method == "diva":
        over += ["method.queue_batches=2"]
    if tiny and method == "dnc":
        over += ["method.num_learners=2"]
    return load_config(ROOT / "params" / "train" / f"cub200_{method}.yaml", overrides=over)


def bare_rate(device, batch: int, size: int, steps: int, channels_last: bool, limit: float) -> float:
    "torchvision's ResNet50 + a 128-d linear layer, fp32, forward + backward + Adam on random input: img/s."
    import torchvision

    torch.manual_seed(0)
    net = torchvision.models.resnet50(num_classes=128).to(device)
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    net = net.to(memory_format=fmt)
    opt = torch.optim.Adam(net.parameters(), lr=1e-5)
    x = torch.randn(batch, 3, size, size, device=device).contiguous(memory_format=fmt)

    def step():
        loss = net(x).float().pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()

    for _ in range(3):
        step()
    sync(device)
    t, n = time.perf_counter(), 0
    while n < steps and time.perf_counter() - t < limit:
        step()
        n += 1
    sync(device)
    return batch * n / (time.perf_counter() - t)


def step_clock(device):
    "A callback that records the time after every training step, the device synchronised."
    from dml_nb.training.callbacks import Callback

    class StepClock(Callback):
        def __init__(self):
            self.times = []

        def after_step(self, learner, logs):
            sync(device)
            self.times.append(time.perf_counter())

    return StepClock()


class StepParts:
    """Where a training step's time goes: the wait for the loader's batch, `to_device` (the copy, and on the JPEG path
    the decode and the crops on the device) and the rest of `_train_step` (forward, loss, backward, optimiser step).
    It wraps the learner's `_train_step` and its module's `to_device`, synchronising the device around the latter
    (the step already synchronises once, for its logs); benchmark instrumentation, undone by `close`."""

    def __init__(self, learn, device):
        import dml_nb.training.learner as L

        self.L, self.device, self.orig = L, device, L.to_device
        self.starts, self.ends, self.copies = [], [], []
        step = learn._train_step

        def to_device(*a, **k):
            sync(device)
            t = time.perf_counter()
            out = self.orig(*a, **k)
            sync(device)
            self.copies.append(time.perf_counter() - t)
            return out

        def train_step(batch):
            self.starts.append(time.perf_counter())
            out = step(batch)
            sync(device)
            self.ends.append(time.perf_counter())
            return out

        L.to_device, learn._train_step = to_device, train_step

    def close(self):
        self.L.to_device = self.orig

    def summary(self, warmup: int) -> str:
        "Milliseconds per step after `warmup`: loader wait, to_device, the rest."
        n = len(self.starts)
        idx = range(max(1, min(warmup, n - 2)), n)
        if not idx:
            return "too few steps to split"
        ms = lambda xs: 1e3 * sum(xs) / len(xs)
        wait = ms([self.starts[i] - self.ends[i - 1] for i in idx])
        copy = ms([self.copies[i] for i in idx])
        rest = ms([self.ends[i] - self.starts[i] - self.copies[i] for i in idx])
        return f"per step {wait:.0f} ms loader wait + {copy:.0f} ms to_device + {rest:.0f} ms model/loss/optimiser"


def method_rate(cfg, device, warmup: int) -> tuple[float, float | None, object, str]:
    """(img/s of the steps after `warmup`, peak GPU memory GiB, learner, where the time went) of one short epoch of
    `cfg` (no evaluation). An epoch shorter than `warmup + 2` steps (D&C's own sampler ignores batches_per_epoch) keeps
    fewer warm-up steps."""
    from dml_nb.reproduction.experiment import build_learner

    learn = build_learner(cfg, run_dir=None, progress=False)
    learn.eval_sets = {}  # steps only: no evaluation at the epoch's end
    clock = step_clock(device)
    learn.callbacks.append(clock)
    parts = StepParts(learn, device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    try:
        learn.fit()
    finally:
        parts.close()
    warmup = min(warmup, max(len(clock.times) - 2, 0))  # at least two clock times, one timed step
    t = clock.times[warmup:]
    rate = cfg.train.batch_size * (len(t) - 1) / (t[-1] - t[0]) if len(t) > 1 else float("nan")
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    return rate, peak, learn, f"{len(t) - 1} steps timed; {parts.summary(warmup)}"


def training(c: Check, limit, device, tiny, root: Path, results: dict):
    cuda = device.type == "cuda"
    batch, size = (8, 32) if tiny else (112, 224)
    steps, warmup = (2, 0) if tiny else (14, 4)
    per = limit / (len(METHODS) + 2)
    bare = bare_rate(device, batch, size, 4 if tiny else 30, cuda, per)
    c.add(
        "training",
        f"bare torchvision ResNet50, fp32, batch {batch}, {size} px{', channels_last' if cuda else ''}",
        f"{bare:.1f} img/s",
        "random input, forward + backward + Adam",
    )
    results["bare"] = bare
    c.add("training", "bare step", f"{1e3 * batch / bare:.0f} ms", "the same, per step")
    for m in METHODS:
        if c.left() < per:
            c.add("training", m, "skipped", "time")
            continue
        t = time.perf_counter()
        try:
            rate, peak, learn, split = method_rate(paper_config(m, root, device, tiny, warmup + steps), device, warmup)
        except Exception as e:
            c.add("training", m, "FAILED", f"{type(e).__name__}: {str(e)[:200]}".replace("|", "/").replace("\n", " "))
            continue
        results[m] = rate
        target = {"baseline": 0.15, "diva": 0.45}.get(m)
        c.add(
            "training",
            f"{m} (params/train/cub200_{m}.yaml)",
            f"{rate:.1f} img/s",
            f"overhead {bare / rate - 1:+.0%} vs bare{'' if target is None else f' (target <= {target:.0%})'}; "
            f"amp {learn.amp or 'fp32'}, channels_last {learn.channels_last}, "
            f"peak GPU memory {'-' if peak is None else f'{peak:.1f} GiB'}; {split}; {time.perf_counter() - t:.0f} s",
        )
        if m == "diva":
            results["diva_learner"] = learn


def loader_rate(items, collate, n: int, batch: int, workers: int, consume=None, passes: int = 3) -> tuple[float, float]:
    """(img/s from the loader's start, img/s from its first batch on) of `passes` passes over the n items (index,
    seed) through a DataLoader, then `consume`: the second leaves out the workers' start-up."""
    keys = [(i % n, i) for i in range(n * passes)]
    batches = [keys[a : a + batch] for a in range(0, len(keys), batch)]
    t0 = time.perf_counter()
    loader = torch.utils.data.DataLoader(items, batch_sampler=batches, num_workers=workers, collate_fn=collate)
    done, first, t1 = 0, 0, None
    for b in loader:
        if consume is not None:
            consume(b)
        done += len(b["y"])
        if t1 is None:
            t1, first = time.perf_counter(), done
    t = time.perf_counter()
    del loader
    return done / (t - t0), (done - first) / max(t - t1, 1e-9)


def data_path(c: Check, limit, device, tiny, root: Path):
    from dml_nb.data.batches import JpegImages, SeededViews, to_device
    from dml_nb.data.datasets import load_dataset

    workers, batch = (2, 8) if tiny else (14, 112)
    src = load_dataset("cub200", root=root, split="train", size=32 if tiny else None)
    ji = JpegImages(src, decode_on="device")  # on a CPU (the rehearsal): decoded in the main process
    items, collate = ji.loader_items(1, device)
    consume = (lambda b: (to_device(b, device, transform=ji.batch_transform), sync(device))) if collate else None
    where = "nvJPEG on the device" if device.type == "cuda" else "torchvision on the CPU in the main process"
    wall, steady = loader_rate(items, collate, len(src), batch, workers, consume)
    c.add(
        "data path",
        f"JPEG path, {workers} workers, batch {batch}",
        f"{steady:.0f} img/s",
        f"3 passes over {len(src)} images of 500 x 375, decoded by {where}; {wall:.0f} img/s with the workers' start-up",
    )
    if collate:  # the two halves: the workers' part (bytes, header, boxes), the device's part (decode, crops)
        _, steady = loader_rate(items, collate, len(src), batch, workers)
        c.add("data path", f"the workers' part only, {workers} workers", f"{steady:.0f} img/s", "read, header, boxes")
        from dml_nb.data.batches import unpack_jpeg

        b = collate([items[(i % len(src), i)] for i in range(batch)])
        jt, images = ji.batch_transform, unpack_jpeg(b["jpeg"], b["jpeg_shapes"])

        def timed(fn, reps=5):
            fn()
            sync(device)
            t = time.perf_counter()
            for _ in range(reps):
                fn()
            sync(device)
            return (time.perf_counter() - t) / reps

        t_dec = timed(lambda: jt.decode(images, device))
        t_all = timed(lambda: to_device(dict(b), device, transform=jt))
        c.add(
            "data path",
            f"the device's part, batch {batch}",
            f"{batch / t_all:.0f} img/s",
            f"{1e3 * t_dec:.0f} ms {'nvJPEG ' if device.type == 'cuda' else ''}decode + {1e3 * (t_all - t_dec):.0f} ms crops, resize, normalise per batch",
        )
        from torchvision.io import decode_jpeg

        cpu = [decode_jpeg(d) for d in images if d.dim() == 1]
        gpu = [x.cpu() for d, x in zip(images, jt.decode(images, device)) if d.dim() == 1]
        d = torch.cat([(x.float() - y.float()).abs().flatten() for x, y in zip(cpu, gpu)])
        c.add(
            "data path",
            f"{'nvJPEG' if device.type == 'cuda' else 'the CPU decode'} against libjpeg-turbo, same files",
            f"mean {d.mean():.2f}, max {d.max():.0f} levels",
            f"8-bit levels over {batch} decodes; {(d > 8).float().mean():.2%} of values differ by more than 8",
        )
    if c.left() > limit / 2:
        _, steady = loader_rate(SeededViews(src), None, len(src), batch, workers)
        c.add("data path", f"PIL path, {workers} workers, batch {batch}", f"{steady:.0f} img/s", "for comparison")


def projection(c: Check, limit, device, tiny, root: Path, results: dict):
    from dml_nb.data.datasets import load_dataset
    from dml_nb.data.batches import JpegImages
    from dml_nb.evaluation.metrics import evaluate
    from eval import synthetic

    learn = results.get("diva_learner")
    if learn is None or "diva" not in results:
        c.add("projection", "DiVA CUB200, 350 epochs", "-", "needs the DiVA row above")
        return
    test = JpegImages(load_dataset("cub200", root=root, split="test", size=32 if tiny else None))
    t = time.perf_counter()
    learn.embed(test)
    sync(device)
    embed_rate = len(test) / (time.perf_counter() - t)
    n, classes = (600, 10) if tiny else (CUB_TEST, 100)
    emb, labels = synthetic(n, classes, noise=0.15)
    emb, labels = emb.to(device), labels.to(device)
    kw = dict(learn.evaluator.readings)
    t = time.perf_counter()
    evaluate(emb, labels, learn.evaluator.metrics, **kw)
    sync(device)
    metrics_s = (time.perf_counter() - t) * (CUB_TEST / n)
    train_s, eval_s = CUB_TRAIN / results["diva"], CUB_TEST / embed_rate + metrics_s
    total = EPOCHS * (train_s + eval_s)
    c.add(
        "projection",
        "DiVA CUB200, 350 epochs, evaluation every epoch",
        f"{total / 3600:.2f} h",
        f"per epoch: training {train_s:.0f} s ({results['diva']:.0f} img/s), evaluation {eval_s:.1f} s "
        f"(embedding {embed_rate:.0f} img/s, metrics {metrics_s:.1f} s{' scaled from a toy set' if tiny else ''})",
    )


def sop_eval(c: Check, limit, device, tiny, pml: bool = True):
    from eval import RETRIEVAL, SCALES, synthetic
    from dml_nb.evaluation.metrics import evaluate
    from dml_nb.evaluation.faiss_backend import faiss_gpus
    from dml_nb.evaluation.neighbours import knn

    scale = dict(n=3000, classes=560, noise=0.1, min_size=2) if tiny else SCALES["sop"]
    emb, labels = synthetic(**scale)
    emb, labels = emb.to(device), labels.to(device)
    what = f"{len(emb):,} x 512, {len(labels.unique()):,} classes"

    def timed(fn):
        sync(device)
        t = time.perf_counter()
        out = fn()
        sync(device)
        return out, time.perf_counter() - t

    ours, t_r = timed(lambda: evaluate(emb, labels, metrics=RETRIEVAL))
    _, t_n = timed(lambda: evaluate(emb, labels, metrics=("nmi",)))
    c.add(
        "evaluation",
        f"dml_nb torch back end ({what})",
        f"{t_r + t_n:.1f} s",
        f"retrieval {t_r:.1f} s (R@1 {ours['recall@1']:.3f}), NMI {t_n:.1f} s",
    )
    if not pml:
        c.add("evaluation", "pytorch-metric-learning", "skipped", "--skip pml")
        return
    try:
        import faiss  # noqa: F401
        from pytorch_metric_learning.utils.accuracy_calculator import AccuracyCalculator
    except ImportError as e:
        c.add("evaluation", "pytorch-metric-learning", "skipped", f"{e} (carry its wheel and faiss's in .whl/)")
        return
    import logging

    logging.getLogger("PML").setLevel(logging.ERROR)
    calc = AccuracyCalculator(
        include=("precision_at_1", "mean_average_precision_at_r", "r_precision", "NMI"),
        k="max_bin_count",
        device=device,
    )
    pml, t_p = timed(lambda: calc.get_accuracy(emb, labels))
    c.add(
        "evaluation",
        "pytorch-metric-learning (faiss inside)",
        f"{t_p:.1f} s",
        f"ours / PML = {(t_r + t_n) / t_p:.2f} (target <= 0.5 at SOP scale); PML P@1 {pml['precision_at_1']:.3f}",
    )
    if faiss_gpus() > 0 and device.type == "cuda":
        _, t_f = timed(lambda: knn(emb, emb, 8, exclude_self=True, backend="faiss_gpu"))
        _, t_t = timed(lambda: knn(emb, emb, 8, exclude_self=True, backend="torch"))
        c.add(
            "evaluation",
            "k-NN, k = 8: faiss-gpu / torch",
            f"{t_f:.2f} s / {t_t:.2f} s",
            "exact flat search, same neighbours",
        )
    else:
        c.add("evaluation", "faiss-gpu", "not carried", "faiss has no GPU here")


NCCL_CHILD = """
import os, sys, torch, torch.distributed as dist
sys.path.insert(0, os.environ["DML_ROOT"])
dev = torch.device(sys.argv[1])
backend = "nccl" if dev.type == "cuda" else "gloo"
if dev.type == "cuda": torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
dist.init_process_group(backend)
from dml_nb.core.base import gather_rows
from dml_nb.training.distributed import all_reduce_logs, data_parallel, mean_over_processes
from dml_nb.methods.base import BaselineMethod
from dml_nb.blocks.models import build_backbone
x = torch.arange(6.0, device=dev).view(3, 2)
assert torch.equal(gather_rows(x, 3, 3), x) and mean_over_processes(torch.tensor([2.0, 4.0], device=dev)).tolist() == [2.0, 4.0]
sums, counts = all_reduce_logs({"loss": torch.tensor(3.0, device=dev)}, {"loss": 1}, dev)
torch.manual_seed(0)
method = BaselineMethod(build_backbone("small_cnn", width=8, feature_dim=32), 4, embedding_dim=16).to(dev)
step = data_parallel(method)
batch = {"x": torch.randn(16, 3, 32, 32, device=dev), "y": torch.arange(4, device=dev).repeat_interleave(4),
         "index": torch.arange(16, device=dev)}
loss = step(batch)["loss"]; loss.backward()
print("OK", dist.get_backend(), dist.get_world_size(), float(loss))
dist.destroy_process_group()
"""


def torchrun(c: Check, limit, device):
    import shutil

    exe = Path(sys.executable).with_name("torchrun")
    exe = str(exe) if exe.exists() else shutil.which("torchrun")
    if exe is None:
        c.add("torchrun", "torchrun", "absent", "not on PATH beside python")
        return
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "child.py"
        script.write_text(NCCL_CHILD)
        env = {**os.environ, "DML_ROOT": str(ROOT), "OMP_NUM_THREADS": "1"}
        r = subprocess.run(
            [exe, "--standalone", "--nproc_per_node", "1", str(script), device.type],
            capture_output=True,
            text=True,
            timeout=limit,
            env=env,
        )
    ok = [l for l in r.stdout.splitlines() if l.startswith("OK")]
    c.add(
        "torchrun",
        "torchrun --nproc_per_node 1",
        ok[0] if ok and r.returncode == 0 else f"rc {r.returncode}",
        "process group, dml_nb's collectives, a DDP step"
        if ok
        else (r.stderr.strip().splitlines() or ["no output"])[-1][:200],
    )


def resume(c: Check, limit, device, tiny):
    "A small run (shapes, small CNN) on the device, killed at epoch 2 step 3 and resumed, against the uninterrupted run."
    from dml_nb.training.callbacks import Callback
    from dml_nb.data.datasets import load_dataset
    from dml_nb.training.learner import Learner
    from dml_nb.methods.base import BaselineMethod
    from dml_nb.blocks.models import build_backbone
    from dml_nb.data.samplers import ClassBalancedBatchSampler

    train = load_dataset("shapes", split="train", images_per_class=4)

    class Kill(Callback):
        def after_step(self, learner, logs):
            if (learner.epoch, learner.step) == (1, 3):
                raise KeyboardInterrupt("killed")

    def learner(run_dir, callbacks=()):
        torch.manual_seed(0)
        w = 8 if tiny else 32
        m = BaselineMethod(build_backbone("small_cnn", width=w, feature_dim=4 * w), train.num_classes, embedding_dim=16)
        s = ClassBalancedBatchSampler(
            train.labels, batch_size=16 if tiny else 64, samples_per_class=4, seed=0, batches_per_epoch=5
        )
        return Learner(
            m,
            train,
            s,
            epochs=2,
            lr=1e-3,
            run_dir=run_dir,
            device=str(device),
            eval_sets={},
            progress=False,
            seed=3,
            checkpoint_every_steps=2,
            callbacks=list(callbacks),
        )

    with tempfile.TemporaryDirectory() as tmp:
        ref = learner(Path(tmp) / "ref")
        ref.fit()
        try:
            learner(Path(tmp) / "run", [Kill()]).fit()
        except KeyboardInterrupt:
            pass
        res = learner(Path(tmp) / "run")
        res.fit()
        same = all(
            torch.equal(a, b)
            for a, b in zip(ref.method.state_dict().values(), res.method.state_dict().values())
            if isinstance(a, torch.Tensor)
        )
        diff = max(
            (
                (a.float() - b.float()).abs().max().item()
                for a, b in zip(ref.method.state_dict().values(), res.method.state_dict().values())
                if isinstance(a, torch.Tensor) and a.is_floating_point()
            ),
            default=0.0,
        )
    c.add(
        "resume",
        f"killed at epoch 2, step 3, resumed, on {device.type}",
        "equal" if same and res.resumed else "DIFFERENT",
        f"largest weight difference {diff:.2e}; amp {res.amp or 'fp32'}, channels_last {res.channels_last}",
    )


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="toy sizes (the CPU rehearsal)")
    ap.add_argument(
        "--budget",
        type=float,
        default=450.0,
        help="seconds for the whole check (gpu_check.sh stops it at $GPU_CHECK_TIMEOUT, 480 s by default)",
    )
    ap.add_argument("--out", default=str(ROOT / "runs" / "gpu_check.md"))
    ap.add_argument(
        "--skip",
        default="",
        help="comma-separated sections to leave out (gpu_tests, training, data_path, projection, evaluation, torchrun, "
        "resume) and 'pml' (the pytorch-metric-learning comparison: minutes of faiss k-means on the CPU)",
    )
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        ap.error("no CUDA device here: run the rehearsal with --device cpu --tiny")
    torch.set_num_threads(min(4, os.cpu_count() or 1) if args.tiny else (os.cpu_count() or 1))
    c = Check(Path(args.out), args.budget)
    skip = set(filter(None, args.skip.split(",")))
    if bad := skip - {"gpu_tests", "training", "data_path", "projection", "evaluation", "torchrun", "resume", "pml"}:
        ap.error(f"--skip: unknown section(s) {sorted(bad)}")
    tiny = args.tiny
    lim = lambda full, small: small if tiny else full
    results: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = write_cub(Path(tmp) / "cub", *((32, 3) if tiny else (200, 6)))  # CUB: classes 1-100 train, 101-200 test
        c.section("environment", 10, environment, device)
        sections = [
            ("gpu tests", lim(75, 60), gpu_tests, (device,)),
            ("training", lim(170, 60), training, (device, tiny, root, results)),
            ("data path", lim(40, 20), data_path, (device, tiny, root)),
            ("projection", lim(25, 15), projection, (device, tiny, root, results)),
            ("evaluation", lim(60, 20), sop_eval, (device, tiny, "pml" not in skip)),
            ("torchrun", lim(50, 90), torchrun, (device,)),  # its start-up alone took > 40 s at a load of 20-30
            ("resume", lim(25, 30), resume, (device, tiny)),
        ]
        for name, limit, fn, fargs in sections:
            if name.replace(" ", "_") in skip:
                c.add(name, "skipped", "-", "--skip")
            else:
                c.section(name, limit, fn, *fargs)
    c.write()
    print(f"\n{c.table()}\n\nwritten to {c.out} ({time.perf_counter() - c.t0:.0f} s)")
    failed = [r for r in c.rows if r[1] == "FAILED" or r[2] in ("DIFFERENT",) or str(r[2]).startswith("rc ")]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
