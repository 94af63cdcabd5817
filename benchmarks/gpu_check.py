"""The prepared GPU check: one run, at most 5.5 minutes (two fit in 15 minutes of a GPU machine with its start), one
table (printed and written to `--out`) and `gpu_results.json` (machine-readable: `--results`).

Sections in order of priority, each with its own time limit (the whole run stops short of `--budget` seconds, 300 by
default; a section that no longer fits is a 'skipped' row):
  environment        GPU, driver-side CUDA, torch / torchvision / faiss / pytorch-metric-learning, nvJPEG
  training           img/s of the training steps of every params/train/cub200_*.yaml (batch 112, the paper files'
                     settings, the JPEG path on synthetic CUB-format JPEGs at 500 x 375), at the paper's precision
                     (fp32) and at bf16, against a bare torchvision ResNet50 loop in the same process, in three
                     variants: as it is; its BatchNorm frozen in eval mode (as the paper files' backbone); and also
                     zero_grad to zeros and Adam with weight decay 4e-4 (as the paper files). Rates are timed by CUDA
                     events over the steps after the warm-up: nothing synchronises the device inside the timed steps
  profile            a torch.profiler trace (CPU + CUDA) of 3 baseline and 3 DiVA steps, written beside `--out`, and
                     its summary: GPU-busy time against wall time per step, the blocking syncs per step, the longest
                     idle gaps of the GPU and what precedes them, the top kernels
  evaluation pass    the embedding pass of the evaluation at CUB's full test size (5,924 generated JPEGs in CUB's
                     format), in steady state after a warm-up pass, fp32 and bf16; the DiVA CUB200 projection: 200
                     epochs of training at bf16 and at fp32, and 350 epochs with an evaluation every epoch (fp32)
  data path          the JPEG path's and the PIL path's img/s through the loader with 14 workers
  gpu tests          pytest -m gpu (the tests that need a CUDA device)
  evaluation         at SOP scale: dml_nb's torch back end against pytorch-metric-learning, and faiss-gpu where carried
  torchrun           torchrun --nproc_per_node 1: a process group on nccl, dml_nb's collectives and DDP step
  resume             a run killed mid-epoch on the device and resumed equals the uninterrupted run

    bash benchmarks/gpu_check.sh                         # on the GPU machine (PYTHONPATH=., no network)
    bash benchmarks/gpu_check.sh --device cpu --tiny     # the rehearsal: every section at toy size on the CPU
"""

from __future__ import annotations
import argparse
import datetime
import gzip
import json
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
FUSED_METHODS = (
    "baseline",
    "diva",
)  # also timed at bf16 with train.fused_optimizer (torch's fused Adam; not bit-equal)
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


def write_cub(root: Path, classes: int, per_class: int, test_images: int, unique: int) -> Path:
    """The one CUB200-format tree (images.txt, image_class_labels.txt, classes.txt) of generated JPEGs of 500 x 375
    (CUB's size) that every section reads: `classes` training classes (of 1-100) of `per_class` distinct files, and a
    test split (classes 101-200) of `test_images` files (CUB's: 5,924) of which `unique` are distinct, hard-linked
    (else copied) to the other names: each decodes as a photo does."""
    import shutil
    from data import write_jpegs

    base = root / "CUB_200_2011"
    pool = write_jpegs(root / "pool", unique, seed=7)
    per_test = [test_images // 100 + (k < test_images % 100) for k in range(100)]
    lines, labels, names, i = [], [], [], 0
    for c in range(1, 201):
        folder = f"{c:03d}.Bird_{c}"
        names.append(f"{c} {folder}")
        if c <= 100:  # training classes: their own files
            files = write_jpegs(base / "images" / folder, per_class, seed=c) if c <= classes else []
        else:  # test classes: links to the pool
            (base / "images" / folder).mkdir(parents=True, exist_ok=True)
            files = []
            for k in range(per_test[c - 101]):
                dst = base / "images" / folder / f"{k:05d}.jpg"
                try:
                    os.link(pool[(i + k) % unique], dst)
                except OSError:
                    shutil.copy(pool[(i + k) % unique], dst)
                files.append(dst)
        for f in files:
            i += 1
            lines.append(f"{i} {folder}/{f.name}")
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


BARE_VARIANTS = {
    "as is": {},
    "BatchNorm frozen (eval mode)": {"eval_bn": True},
    "BatchNorm frozen, zero_grad to zeros, Adam weight decay 4e-4": {"eval_bn": True, "zeros": True, "wd": 4e-4},
}


def bare_rate(
    device,
    batch: int,
    size: int,
    steps: int,
    channels_last: bool,
    limit: float,
    eval_bn=False,
    zeros=False,
    wd=0.0,
    bf16=False,
    warm: int = 3,
) -> float:
    """torchvision's ResNet50 + a 128-d linear layer, forward + backward + Adam on random input: img/s over `steps`
    steps after `warm`, timed by CUDA events (the loop never synchronises). `eval_bn`: every BatchNorm in eval mode (the
    paper files' frozen BatchNorm); `zeros`: zero_grad(set_to_none=False); `wd`: Adam's weight decay; `bf16`: autocast."""
    import torchvision

    torch.manual_seed(0)
    net = torchvision.models.resnet50(num_classes=128).to(device)
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    net = net.to(memory_format=fmt)
    if eval_bn:
        for m in net.modules():
            if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
                m.eval()
    opt = torch.optim.Adam(net.parameters(), lr=1e-5, weight_decay=wd)
    x = torch.randn(batch, 3, size, size, device=device).contiguous(memory_format=fmt)

    def step():
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            loss = net(x).float().pow(2).mean()
        opt.zero_grad(set_to_none=not zeros)
        loss.backward()
        opt.step()

    for _ in range(warm):
        step()
    clock = Clock(device)
    clock.mark()
    t, n = time.perf_counter(), 0
    while n < steps and time.perf_counter() - t < limit:
        step()
        clock.mark()
        n += 1
    return clock.rate(batch, 0)


class Clock:
    """Times on the device's own clock: a CUDA event recorded after each step (nothing waits for it), read once at
    the end; on a CPU, the host's clock."""

    def __init__(self, device):
        self.cuda, self.marks = device.type == "cuda", []

    def mark(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            self.marks.append(e)
        else:
            self.marks.append(time.perf_counter())

    def rate(self, batch: int, warmup: int) -> float:
        "img/s over the marks after `warmup` (one synchronisation, here, after the run)."
        marks = self.marks[warmup:]
        if len(marks) < 2:
            return float("nan")
        if self.cuda:
            marks[-1].synchronize()
            secs = marks[0].elapsed_time(marks[-1]) / 1e3
        else:
            secs = marks[-1] - marks[0]
        return batch * (len(marks) - 1) / secs


def step_clock(device):
    "A callback that marks the `Clock` after every training step, without synchronising the device."
    from dml_nb.training.callbacks import Callback

    class StepClock(Callback):
        def __init__(self):
            self.clock = Clock(device)

        def after_step(self, learner, logs):
            self.clock.mark()

    return StepClock()


def method_rate(cfg, device, warmup: int) -> tuple[float, float | None, object, str]:
    """(img/s of the steps after `warmup`, timed by CUDA events, peak GPU memory GiB, learner, a note) of one short
    epoch of `cfg` (no evaluation). An epoch shorter than `warmup + 2` steps (D&C's own sampler ignores
    batches_per_epoch) keeps fewer warm-up steps."""
    from dml_nb.training.build import build_learner

    learn = build_learner(cfg, run_dir=None, progress=False)
    learn.eval_sets = {}  # steps only: no evaluation at the epoch's end
    clock = step_clock(device)
    learn.callbacks.append(clock)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    learn.fit()
    marks = clock.clock.marks
    warmup = min(warmup, max(len(marks) - 2, 0))  # at least two marks, one timed step
    rate = clock.clock.rate(cfg.train.batch_size, warmup)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    return rate, peak, learn, f"{len(marks) - warmup - 1} steps timed by events"


def training(c: Check, limit, device, tiny, root: Path, results: dict):
    cuda = device.type == "cuda"
    batch, size = (8, 32) if tiny else (112, 224)
    steps, warmup = (2, 1) if tiny else (12, 4)
    per = limit / (2 * len(METHODS) + len(FUSED_METHODS) + len(BARE_VARIANTS) + 1)
    for name, kw in BARE_VARIANTS.items():
        bare = bare_rate(device, batch, size, 2 if tiny else 30, cuda, per, warm=1 if tiny else 3, **kw)
        key = {"as is": "bare", "BatchNorm frozen (eval mode)": "bare_eval_bn"}.get(name, "bare_eval_bn_zeros_wd")
        results[f"{key}_img_s"] = bare
        c.add(
            "training",
            f"bare torchvision ResNet50, fp32, {name}",
            f"{bare:.1f} img/s",
            f"batch {batch}, {size} px{', channels_last' if cuda else ''}; {1e3 * batch / bare:.0f} ms per step",
        )
    bare_bf16 = bare_rate(device, batch, size, 2 if tiny else 30, cuda, per, bf16=True, warm=1 if tiny else 3)
    results["bare_bf16_img_s"] = bare_bf16
    c.add("training", "bare torchvision ResNet50, bf16, as is", f"{bare_bf16:.1f} img/s", "autocast bf16")
    for amp in ("paper", "bf16", "bf16_fused"):
        ref = results["bare_img_s"] if amp == "paper" else bare_bf16
        for m in METHODS if amp != "bf16_fused" else FUSED_METHODS:
            if c.left() < per:
                c.add("training", f"{m} ({amp})", "skipped", "time")
                continue
            t = time.perf_counter()
            extra = {"paper": (), "bf16": ("train.amp=bf16",)}.get(
                amp, ("train.amp=bf16", "train.fused_optimizer=true")
            )
            try:
                rate, peak, learn, note = method_rate(
                    paper_config(m, root, device, tiny, warmup + steps, extra), device, warmup
                )
            except Exception as e:
                c.add("training", f"{m} ({amp})", "FAILED", f"{type(e).__name__}: {str(e)[:200]}".replace("|", "/"))
                continue
            results[f"{m}_img_s" if amp == "paper" else f"{m}_{amp}_img_s"] = rate
            target = {"baseline": 0.15, "diva": 0.45}.get(m)
            c.add(
                "training",
                f"{m} (params/train/cub200_{m}.yaml, {amp})",
                f"{rate:.1f} img/s",
                f"overhead {ref / rate - 1:+.0%} vs bare at the same precision"
                f"{'' if target is None else f' (target <= {target:.0%})'}; amp {learn.amp or 'fp32'}, "
                f"channels_last {learn.channels_last}, peak GPU memory {'-' if peak is None else f'{peak:.1f} GiB'}; "
                f"{note}; {time.perf_counter() - t:.0f} s",
            )
            if m == "diva" and amp != "bf16_fused":
                results["diva_learner" if amp == "paper" else "diva_learner_bf16"] = learn


def trace_summary(path: Path, cuda: bool) -> dict:
    """The summary of a chrome trace of the profiled steps: wall and busy time per step (busy: the union of the GPU's
    kernels and copies; on a CPU, of the top-level CPU ops), blocking syncs per step, the longest idle gaps with the
    work before and after them and the host op that launched the next one, the top kernels by time."""
    events = json.loads(gzip.open(path, "rt").read())["traceEvents"]
    steps = sorted(
        (e["ts"], e["ts"] + e["dur"])
        for e in events
        if str(e.get("name", "")).startswith("ProfilerStep#") and "dur" in e
    )
    busy_cats = ("kernel", "gpu_memcpy", "gpu_memset") if cuda else ("cpu_op",)
    dev = sorted(
        (e["ts"], e["ts"] + e["dur"], e["name"], e.get("args", {}).get("correlation"))
        for e in events
        if e.get("cat") in busy_cats and "dur" in e
    )
    if not steps or not dev:
        return {"steps": len(steps), "note": "no step or no device events in the trace"}
    t0, t1 = steps[0][0], max(steps[-1][1], dev[-1][1])
    dev = [d for d in dev if d[1] > t0]
    merged = []
    for a, b, name, corr in dev:
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
            merged[-1][3] = name
        else:
            merged.append([max(a, t0), b, name, name, corr])
    busy = sum(b - a for a, b, *_ in merged)
    runtime = [e for e in events if e.get("cat") == "cuda_runtime" and "dur" in e]
    launch_at = {e.get("args", {}).get("correlation"): e["ts"] for e in runtime}
    ops = sorted((e["ts"], e["ts"] + e["dur"], e["name"]) for e in events if e.get("cat") == "cpu_op" and "dur" in e)

    def host_op(ts):
        "The innermost CPU op running at `ts` (the one that launched a kernel then)."
        inner = None
        for a, b, name in ops:
            if a > ts:
                break
            if b >= ts:
                inner = name
        return inner or "-"

    syncing = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")
    syncs = [e for e in runtime if e["name"] in syncing and t0 <= e["ts"] <= t1]
    gaps = []
    for (a0, b0, _, last0, _), (a1, _, first1, _, corr1) in zip(merged, merged[1:]):
        inside = sorted({e["name"] for e in syncs if b0 <= e["ts"] + e["dur"] and e["ts"] <= a1})
        launched = host_op(launch_at[corr1]) if cuda and corr1 in launch_at else host_op(a1)
        gaps.append((a1 - b0, last0, first1, launched, inside))
    gaps.sort(key=lambda g: -g[0])
    kernels: dict = {}
    for a, b, name, _ in dev:
        k = kernels.setdefault(name, [0.0, 0])
        k[0], k[1] = k[0] + (b - a), k[1] + 1
    n = len(steps)
    return {
        "steps": n,
        "wall_ms_per_step": (t1 - t0) / 1e3 / n,
        "busy_ms_per_step": busy / 1e3 / n,
        "busy_fraction": busy / (t1 - t0),
        "blocking_syncs_per_step": len(syncs) / n,
        "idle_ms_per_step": sum(g[0] for g in gaps) / 1e3 / n,
        "longest_gaps": [
            {"ms": g[0] / 1e3, "after": g[1][:80], "before": g[2][:80], "launched_by": g[3][:80], "syncs": g[4]}
            for g in gaps[:5]
        ],
        "top_kernels": [
            {"name": k[:80], "ms_per_step": v[0] / 1e3 / n, "calls_per_step": v[1] / n}
            for k, v in sorted(kernels.items(), key=lambda kv: -kv[1][0])[:8]
        ],
    }


def profile(c: Check, limit, device, tiny, root: Path, results: dict, out_dir: Path):
    "torch.profiler traces of 3 steps of the baseline and of DiVA (after a warm-up), and their summaries."
    from torch.profiler import ProfilerActivity, profile as torch_profile
    from dml_nb.training.build import build_learner
    from dml_nb.training.callbacks import Callback

    cuda = device.type == "cuda"
    warmup, n = (1, 3) if tiny else (3, 3)
    out_dir.mkdir(parents=True, exist_ok=True)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    for m in ("baseline", "diva"):
        prof = torch_profile(activities=activities)

        class Profiled(Callback):
            "Profiles the steps warmup + 1 .. warmup + n, each in a 'ProfilerStep#k' range of the trace."

            done, rec = 0, None

            def after_step(self, learner, logs):
                self.done += 1  # steps so far
                if self.rec is not None:
                    self.rec.__exit__(None, None, None)
                    self.rec = None
                if self.done == warmup:
                    prof.start()
                if self.done == warmup + n:
                    prof.stop()
                elif warmup <= self.done < warmup + n:
                    self.rec = torch.profiler.record_function(f"ProfilerStep#{self.done - warmup + 1}")
                    self.rec.__enter__()

        learn = build_learner(paper_config(m, root, device, tiny, warmup + n + 1), run_dir=None, progress=False)
        learn.eval_sets = {}
        learn.callbacks.append(Profiled())
        learn.fit()
        path = out_dir / f"trace_{m}.json.gz"
        prof.export_chrome_trace(str(path))
        summary = trace_summary(path, cuda)
        results.setdefault("profile", {})[m] = summary
        if "wall_ms_per_step" not in summary:
            c.add("profile", m, "-", summary.get("note", ""))
            continue
        what = "GPU" if cuda else "CPU (rehearsal: top-level CPU ops)"
        c.add(
            "profile",
            f"{m}: {what} busy / wall per step",
            f"{summary['busy_ms_per_step']:.1f} / {summary['wall_ms_per_step']:.1f} ms",
            f"{summary['busy_fraction']:.0%} busy; {summary['blocking_syncs_per_step']:.1f} blocking syncs per step; "
            f"idle {summary['idle_ms_per_step']:.1f} ms per step; trace {path.name}",
        )
        for g in summary["longest_gaps"][:3]:
            c.add(
                "profile",
                f"{m}: idle gap",
                f"{g['ms']:.2f} ms",
                f"after {g['after']}, before {g['before']} (launched by {g['launched_by']})"
                + (f"; syncs in it: {', '.join(g['syncs'])}" if g["syncs"] else ""),
            )
        top = "; ".join(f"{k['name'][:50]} {k['ms_per_step']:.2f} ms" for k in summary["top_kernels"][:4])
        c.add("profile", f"{m}: top {'kernels' if cuda else 'ops'} per step", "-", top.replace("|", "/"))


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


def embed_rate(learn, test, device, batch_size=None) -> float:
    """img/s of the embedding pass over `test` in steady state: from its first batch on (the loader's start left out),
    after a whole warm-up pass; a pass of one batch is timed whole."""
    learn.embed(
        test, batch_size=batch_size
    )  # warm-up: cuDNN's choices, the loader's first start, the decoder's buffers
    times, first = [], []

    def fn(x):
        if not times:
            sync(device)
            times.append(time.perf_counter())
            first.append(len(x))
        return learn.method.embed(x)

    t = time.perf_counter()
    learn.embed(test, fn=fn, batch_size=batch_size)
    sync(device)
    end = time.perf_counter()
    rest = len(test) - first[0]
    return rest / (end - times[0]) if rest > 0 else len(test) / (end - t)


def evaluation_pass(c: Check, limit, device, tiny, root: Path, results: dict):
    """The evaluation's embedding pass at CUB's test size in steady state (fp32 and bf16), and the DiVA CUB200
    projection: 200 epochs of training (bf16, the target's precision, and fp32), and 350 epochs with an evaluation
    every epoch (the paper files' fp32)."""
    from dml_nb.data.datasets import load_dataset
    from dml_nb.data.batches import JpegImages
    from dml_nb.evaluation.metrics import evaluate
    from eval import synthetic

    learn = results.get("diva_learner")
    if learn is None or "diva_img_s" not in results:
        c.add("evaluation pass", "DiVA's embedding pass", "-", "needs the DiVA row of the training section")
        return
    test = JpegImages(load_dataset("cub200", root=root, split="test", size=32 if tiny else None))  # main's tree
    rates = {}
    for amp, lrn in (("fp32", learn), ("bf16", results.get("diva_learner_bf16"))):
        if lrn is None:
            continue
        was = lrn.amp
        lrn.amp = None if amp == "fp32" else "bf16"
        try:
            rates[amp] = embed_rate(lrn, test, device, batch_size=16 if tiny else None)
        finally:
            lrn.amp = was
        results["eval_embed_img_s" if amp == "fp32" else "eval_embed_bf16_img_s"] = rates[amp]
        train = results["diva_img_s" if amp == "fp32" else "diva_bf16_img_s"]
        c.add(
            "evaluation pass",
            f"DiVA's embedding pass, {len(test):,} CUB-format JPEGs, {amp}",
            f"{rates[amp]:.0f} img/s",
            f"steady state after a warm-up pass; {rates[amp] / train:.1f}x DiVA's training rate (target >= 2x)",
        )
    m, classes = (600, 10) if tiny else (CUB_TEST, 100)
    emb, labels = synthetic(m, classes, noise=0.15)
    emb, labels = emb.to(device), labels.to(device)
    t = time.perf_counter()
    evaluate(emb, labels, learn.evaluator.metrics, **dict(learn.evaluator.readings))
    sync(device)
    metrics_s = (time.perf_counter() - t) * (CUB_TEST / m)
    for amp in ("bf16", "fp32"):
        rate = results.get("diva_img_s" if amp == "fp32" else "diva_bf16_img_s")
        if rate:
            minutes = 200 * CUB_TRAIN / rate / 60
            results["diva_cub200_200_epochs_min" if amp == "bf16" else "diva_cub200_200_epochs_fp32_min"] = minutes
            c.add(
                "evaluation pass",
                f"DiVA CUB200, 200 epochs of training, {amp}",
                f"{minutes:.1f} min",
                f"{CUB_TRAIN} images an epoch at {rate:.0f} img/s{' (target <= 10 min)' if amp == 'bf16' else ''}",
            )
    if "fp32" in rates:
        train_s, eval_s = CUB_TRAIN / results["diva_img_s"], CUB_TEST / rates["fp32"] + metrics_s
        results["diva_cub200_350_epochs_eval_h"] = EPOCHS * (train_s + eval_s) / 3600
        c.add(
            "evaluation pass",
            "DiVA CUB200, 350 epochs, evaluation every epoch, fp32",
            f"{results['diva_cub200_350_epochs_eval_h']:.2f} h",
            f"per epoch: training {train_s:.0f} s, evaluation {eval_s:.1f} s (embedding {rates['fp32']:.0f} img/s, "
            f"metrics {metrics_s:.1f} s{' scaled from a toy set' if tiny else ''})",
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


def write_results(path: Path, results: dict, device, c: Check) -> None:
    "gpu_results.json: the card, date and versions, every rate and projection of the run (absent: the section did not run)."
    import torchvision

    card = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (rehearsal)"
    out = {
        "card": card,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "torch": torch.__version__,
        "torchvision": torchvision.__version__,
        "device": device.type,
        "seconds": round(time.perf_counter() - c.t0),
        "precision": {
            "paper": "fp32 (the paper files' amp: none)",
            "bf16": "autocast bf16 (train.amp=bf16)",
            "bf16_fused": "autocast bf16 with torch's fused Adam (train.amp=bf16, train.fused_optimizer=true)",
        },
    }
    keys = ["bare", "bare_eval_bn", "bare_eval_bn_zeros_wd", *METHODS]
    for k in keys:
        for suffix in ("_img_s", "_bf16_img_s", "_bf16_fused_img_s"):
            if f"{k}{suffix}" in results:
                out[f"{k}{suffix}"] = round(results[f"{k}{suffix}"], 2)
    for k in (
        "eval_embed_img_s",
        "eval_embed_bf16_img_s",
        "diva_cub200_200_epochs_min",
        "diva_cub200_200_epochs_fp32_min",
        "diva_cub200_350_epochs_eval_h",
    ):
        if k in results:
            out[k] = round(results[k], 3)
    for m in METHODS:
        for amp, ref in (("", "bare_img_s"), ("_bf16", "bare_bf16_img_s"), ("_bf16_fused", "bare_bf16_img_s")):
            if f"{m}{amp}_img_s" in out and ref in out:
                out[f"{m}{amp}_overhead"] = round(out[ref] / out[f"{m}{amp}_img_s"] - 1, 4)
    if "profile" in results:
        out["profile"] = results["profile"]
    out["failed_rows"] = [list(r) for r in c.rows if r[1] == "FAILED"]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(f"results written to {path}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="toy sizes (the CPU rehearsal)")
    ap.add_argument(
        "--budget",
        type=float,
        default=300.0,
        help="seconds for the whole check (gpu_check.sh stops it at $GPU_CHECK_TIMEOUT, 330 s by default)",
    )
    ap.add_argument("--out", default=str(ROOT / "runs" / "gpu_check.md"), help="the table; traces go beside it")
    ap.add_argument(
        "--results",
        default=None,
        help="the machine-readable results (default benchmarks/gpu_results.json on a GPU, beside --out on a CPU)",
    )
    ap.add_argument(
        "--skip",
        default="",
        help="comma-separated sections to leave out (training, profile, evaluation_pass, data_path, gpu_tests, "
        "evaluation, torchrun, resume) and 'pml' (the pytorch-metric-learning comparison: minutes of faiss k-means on "
        "the CPU)",
    )
    args = ap.parse_args(argv)
    try:
        device = torch.device(args.device)
    except RuntimeError:
        ap.error(f"--device {args.device[:200]!r}: not a torch device; use cuda (the check) or cpu (the rehearsal)")
    if device.type == "cuda" and not torch.cuda.is_available():
        ap.error("no CUDA device here: run the rehearsal with --device cpu --tiny")
    results_path = (
        Path(args.results)
        if args.results
        else (
            ROOT / "benchmarks" / "gpu_results.json"
            if device.type == "cuda"
            else Path(args.out).parent / "gpu_results.json"
        )
    )
    if device.type != "cuda" and results_path.resolve().parent == (ROOT / "benchmarks").resolve():
        ap.error(
            f"--results {str(results_path)[:200]}: benchmarks/gpu_results.json holds a GPU's figures, not a "
            f"{device.type} rehearsal's: give a path outside benchmarks/ (the default is beside --out)"
        )
    torch.set_num_threads(min(4, os.cpu_count() or 1) if args.tiny else (os.cpu_count() or 1))
    c = Check(Path(args.out), args.budget)
    skip = set(filter(None, args.skip.split(",")))
    known = {"training", "profile", "evaluation_pass", "data_path", "gpu_tests", "evaluation", "torchrun", "resume"}
    if bad := skip - known - {"pml"}:
        ap.error(f"--skip: unknown section(s) {sorted(bad)}")
    tiny = args.tiny
    lim = lambda full, small: small if tiny else full
    results: dict = {}
    out_dir = Path(args.out).parent / "gpu_check_traces"
    with tempfile.TemporaryDirectory() as tmp:
        # the one CUB-format tree of every section: classes 1-100 train, 101-200 test (CUB's test size on a GPU)
        root = write_cub(Path(tmp) / "cub", *((32, 3, 120, 20) if tiny else (100, 6, CUB_TEST, 240)))
        c.section("environment", 10, environment, device)
        sections = [  # in order of priority: a section that no longer fits the budget is skipped
            ("training", lim(130, 150), training, (device, tiny, root, results)),
            ("profile", lim(30, 40), profile, (device, tiny, root, results, out_dir)),
            ("evaluation pass", lim(45, 40), evaluation_pass, (device, tiny, root, results)),
            ("data path", lim(20, 20), data_path, (device, tiny, root)),
            ("gpu tests", lim(40, 60), gpu_tests, (device,)),
            ("evaluation", lim(30, 20), sop_eval, (device, tiny, "pml" not in skip)),
            ("torchrun", lim(25, 90), torchrun, (device,)),  # its start-up alone took > 40 s at a load of 20-30
            ("resume", lim(15, 30), resume, (device, tiny)),
        ]
        for name, limit, fn, fargs in sections:
            if name.replace(" ", "_") in skip:
                c.add(name, "skipped", "-", "--skip")
            else:
                c.section(name, limit, fn, *fargs)
    c.write()
    write_results(results_path, results, device, c)
    print(f"\n{c.table()}\n\nwritten to {c.out} ({time.perf_counter() - c.t0:.0f} s)")
    failed = [r for r in c.rows if r[1] == "FAILED" or r[2] in ("DIFFERENT",) or str(r[2]).startswith("rc ")]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
