"""Census of one ordinary training step: aten kernels and host-device synchronisations, per recipe, on the CPU.

For the bare loop (torchvision's ResNet50 + a 128-d layer, forward, `pow(2).mean()`, `zero_grad()`, backward, Adam:
the loop of benchmarks/gpu_check.py) and for every recipe at its paper config (params/train/cub200_*.yaml as they
are; only sizes shrunk: ResNet50 with random weights, `--size` px crops, batch `--batch`, tiny CUB-format JPEGs on
the JPEG path, decoded in the main process as on a GPU), a `TorchDispatchMode` counts, per step after `--warmup`
steps (a step: from one `_train_step` call to the next, so the loop's own work between steps is in it):

* kernels: dispatched aten ops that are not views or allocations (`empty*`, `resize_`, `lift_fresh`) and that touch
  a tensor on the step's device: roughly one GPU launch each (a `_foreach_*` op counts once);
* syncs: the ops that make the host wait for the device when their input is on the device: `_local_scalar_dense`
  (`item()`, `int()`, `float()`, `bool()` of a tensor), `nonzero`, `unique` (all forms), `equal`, `masked_select`,
  `bincount`, `repeat_interleave` without `output_size`, indexing with a boolean mask (`index`, `index_put_`), a
  copy from the device to the host (`Tensor.cpu/.tolist/.numpy/.item`, `.to("cpu")`, `copy_` into a host
  tensor), and a blocking copy from the host to the device (`.to(device)` of a host tensor without
  `non_blocking=True`, `torch.tensor/as_tensor(..., device=device)`: CUDA waits for the stream there).

Which tensors are "on the device". On the CPU the step's device is the host, so the census tracks where each tensor
would be on a GPU: the method's parameters, buffers and gradients, the optimiser's state (except Adam's and SGD's
`step` counters, which torch keeps on the host unless the optimiser is fused or capturable) and the learner's
running sums are on the device; so is every tensor moved there (`Tensor.to(device)`), every tensor made by a
factory given `device=` (the step's device object or the string of its type), and every output of an op with an
input on the device. Anything else is a host tensor: the loader's batch before `to_device`, sampler indices, crop
boxes and flips, CPU generators' draws, tensors built without `device=`. Reading a host tensor is not a sync. Limits:
`.to(torch.device("cpu"))` of a device tensor counts as staying on the device (the string "cpu" counts as a copy to
the host); syncs inside C++ kernels (none known in torch 2.14 for the ops these recipes use) are not seen.

To mimic CUDA, optimisers take their foreach path (torch's default on CUDA; on the CPU it takes the per-parameter
loop), for the bare loop and the recipes alike, and channels_last is on. The counted steps are ordinary ones: after
the warm-up (the optimiser's state, a queue's first fill) and before any step that reads the logs back every N
steps. `syncs_per_step` is the most over the counted steps (a recipe may alternate kinds of batches, e.g. Sharing's
shared and own batches: count at least 2), `kernels_per_step` the median; the per-step lists and the sites are in the
JSON. `-v` prints every sync with its innermost dml_nb frame.

`jpeg_crops`: host (process CPU) time of the JPEG path's device part after the decode, for 112 decoded images of
24 x 32 px (and 32 x 24: tiny, so that the time is the host's work, not the pixels') cropped and resized to
`--jpeg-size` px, flipped and normalised: the per-image loop (torchvision's functions
per image and view, the JPEG path's loop before batching) against the library's `JpegDecode` in one batched pass,
one thread, timed in alternation (`--repeats` pairs, the order swapped every pair, so that a shared machine's load
falls on both alike): each one's median and best, and the speedup as the median of the pairs' ratios (with their
range) and as the ratio of the bests;
`jpeg_crops_2_views` the same for two views per image (DiVA's).

    python benchmarks/step_census.py [--tiny] [--json] [-v] [--batch 32 --size 32 --warmup 3 --steps 2] [--set K=V]
"""

from __future__ import annotations
import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "benchmarks") not in sys.path:
    sys.path.insert(0, str(ROOT / "benchmarks"))
from timing import cpu, paired  # noqa: E402  (process CPU time; shared with step.py)

RECIPES = ("baseline", "diva", "dnc", "sharing", "bspml")
FACTORIES = (
    "arange",
    "zeros",
    "ones",
    "full",
    "empty",
    "eye",
    "rand",
    "randn",
    "randint",
    "randperm",
    "linspace",
    "logspace",
    "scalar_tensor",
    "empty_strided",
)
ALLOC = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "resize_", "lift_fresh", "set_"}
SYNC_OPS = {
    "_local_scalar_dense",
    "nonzero",
    "unique",
    "_unique",
    "_unique2",
    "unique_dim",
    "unique_consecutive",
    "equal",
    "masked_select",
    "bincount",
}


def mark(t):
    "Mark a tensor as living on the step's device."
    if isinstance(t, torch.Tensor):
        try:
            t._census_dev = True
        except (AttributeError, RuntimeError):
            pass
    return t


def on_dev(t) -> bool:
    return isinstance(t, torch.Tensor) and getattr(t, "_census_dev", False)


class Census(TorchDispatchMode):
    """Counts kernels, host ops and syncs (with their innermost dml_nb frame) of the ops dispatched while active;
    the patched `Tensor` methods and factories (`patch`) record the copies that do not dispatch on the CPU."""

    def __init__(self, device: torch.device):
        super().__init__()
        self.device, self.quiet, self.factory_dev = device, 0, 0
        import dml_nb

        self.dml = str(Path(dml_nb.__file__).parent)
        self.reset()

    def reset(self):
        self.kernels, self.host_ops, self.syncs = 0, 0, []

    def site(self) -> str:
        "The innermost dml_nb frame of the caller (else the innermost frame outside this file and torch)."
        f, fallback = sys._getframe(1), None
        while f is not None:
            name = f.f_code.co_filename
            if name.startswith(self.dml):
                return f"dml_nb/{os.path.relpath(name, self.dml)}:{f.f_lineno}"
            if fallback is None and name != __file__ and "/torch/" not in name:
                fallback = f"{name}:{f.f_lineno}"
            f = f.f_back
        return fallback or "?"

    def sync(self, what: str):
        self.syncs.append((what, self.site()))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.quiet:
            return out
        ins = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        name = func.overloadpacket.__name__
        dev = self.factory_dev > 0 or any(on_dev(t) for t in ins)
        if name == "copy_" and not on_dev(args[0]) and on_dev(args[1]):
            self.sync("copy_ to a host tensor")  # a device-to-host copy; the destination stays on the host
            self.host_ops += 1
            return out
        if name == "copy_" and on_dev(args[0]) and not on_dev(args[1]) and not kwargs.get("non_blocking", False):
            self.sync("blocking copy_ from a host tensor")
        if dev:
            for t in tree_leaves(out):
                mark(t)
        if not dev:
            self.host_ops += 1
            return out
        if name in SYNC_OPS or (name == "repeat_interleave" and kwargs.get("output_size") is None and ins[0].dim()):
            self.sync(name)
        elif name in ("index", "index_put", "index_put_", "_index_put_impl_"):
            idx = args[1] if len(args) > 1 else kwargs.get("indices", [])
            if any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in idx):
                self.sync(f"{name} with a boolean mask")
        if name == "_local_scalar_dense":
            return out
        if not func.is_view and name not in ALLOC:
            self.kernels += 1
        return out


def patch(census: Census):
    """Patch `Tensor.to/.cpu/.tolist/.numpy/.item` and the factories for the census (they do not dispatch, or
    dispatch the same, on the CPU); returns a function that undoes it."""
    T, saved = torch.Tensor, {}
    step_dev = census.device

    def is_step_device(d) -> bool:
        if d is None:
            return False
        if isinstance(d, str):
            return d == step_dev.type and step_dev.type != "cpu" or d == str(step_dev) and step_dev.type != "cpu"
        return torch.device(d) == step_dev

    def keep(name, fn):
        saved[(T, name)] = getattr(T, name)
        setattr(T, name, fn)

    orig_to, orig_cpu = T.to, T.cpu
    orig_tolist, orig_numpy, orig_item = T.tolist, T.numpy, T.item

    def quiet(fn, *a, **k):
        census.quiet += 1
        try:
            return fn(*a, **k)
        finally:
            census.quiet -= 1

    def to(self, *a, **k):
        if not census.enabled:
            return orig_to(self, *a, **k)
        target, _, non_blocking, _ = torch._C._nn._parse_to(*a, **k)
        literal_cpu = any(isinstance(v, str) and v.startswith("cpu") for v in (*a, *k.values()))
        out = orig_to(self, *a, **k)
        if target is None:
            return out  # a dtype or layout change: dispatched, or nothing to do
        if on_dev(self) and literal_cpu:
            census.sync('to("cpu")')
            return quiet(T.view_as, out, out) if out is self else out
        if on_dev(self) or target != step_dev:
            return out
        if not non_blocking:
            census.sync("blocking to(device) of a host tensor")
        # on a GPU the copy is a new tensor on the device: a view keeps the host original unmarked here
        return mark(quiet(T.view_as, out, out) if out is self else out)

    def cpu(self, *a, **k):
        if not census.enabled or not on_dev(self):
            return orig_cpu(self, *a, **k)
        census.sync("cpu()")
        out = orig_cpu(self, *a, **k)
        out = quiet(T.view_as, out, out) if out is self else out
        out._census_dev = False
        return out

    def reader(orig, what):
        def fn(self, *a, **k):
            if census.enabled and on_dev(self):
                census.sync(what)
                return quiet(orig, self, *a, **k)
            return orig(self, *a, **k)

        return fn

    keep("to", to)
    keep("cpu", cpu)
    keep("tolist", reader(orig_tolist, "tolist()"))
    keep("numpy", reader(orig_numpy, "numpy()"))
    keep("item", reader(orig_item, "item()"))

    def factory(orig, name):
        def fn(*a, **k):
            if not census.enabled or not is_step_device(k.get("device")):
                return orig(*a, **k)
            if name in ("tensor", "as_tensor") and not (a and on_dev(a[0])):
                census.sync(f"torch.{name}(..., device=) of host data")
            census.factory_dev += 1
            try:
                return mark(orig(*a, **k))
            finally:
                census.factory_dev -= 1

        return fn

    for name in (*FACTORIES, "tensor", "as_tensor"):
        saved[(torch, name)] = getattr(torch, name)
        setattr(torch, name, factory(getattr(torch, name), name))

    # foreach optimiser steps, as torch does by default on CUDA (on the CPU it loops over the parameters)
    import torch.optim.optimizer as O

    saved[(O, "_get_foreach_kernels_supported_devices")] = O._get_foreach_kernels_supported_devices
    O._get_foreach_kernels_supported_devices = lambda: ["cuda", "cpu"]

    def undo():
        for (owner, name), v in saved.items():
            setattr(owner, name, v)

    return undo


def mark_state(optimizer, *extra):
    """Mark what lives on the device between steps: the parameters, buffers and gradients of the modules in `extra`,
    the tensors of its dicts (running sums, a fixed batch), the optimiser's state (not a host-side `step`)."""
    modules = [m for m in extra if isinstance(m, torch.nn.Module)]
    for m in modules:
        for p in m.parameters():
            mark(p)
            mark(p.grad)
        for b in m.buffers():
            mark(b)
    if optimizer is not None:
        fused = any(g.get("fused") or g.get("capturable") for g in optimizer.param_groups)
        for st in optimizer.state.values():
            for k, v in st.items():
                if k != "step" or fused:
                    mark(v)
    for v in extra:
        if isinstance(v, dict):
            for t in tree_leaves(v):
                mark(t)


class Done(Exception):
    "Raised at the start of the step after the counted ones: the run stops there."


def count_steps(run_steps, census: Census, warmup: int, steps: int, mark_fn) -> list[tuple[int, int, list]]:
    """Run `run_steps(hook)`, which calls `hook(i)` at the start of every step i; count steps warmup .. warmup+steps-1
    (each from its start to the next step's start, where the run stops). Returns [(kernels, host ops, syncs)] per
    counted step."""
    rows = []
    state = {"on": False}

    def hook(i):
        if state["on"]:
            census.__exit__(None, None, None)
            state["on"] = False
            rows.append((census.kernels, census.host_ops, list(census.syncs)))
        if i == warmup + steps:
            raise Done
        if warmup <= i:
            mark_fn()
            census.reset()
            census.__enter__()
            state["on"] = True

    try:
        run_steps(hook)
    except Done:
        pass
    finally:
        if state["on"]:
            census.__exit__(None, None, None)
    return rows


def bare(census: Census, batch: int, size: int, warmup: int, steps: int):
    "torchvision's ResNet50 + 128-d layer: forward, pow(2).mean(), zero_grad, backward, Adam (channels_last)."
    import torchvision

    torch.manual_seed(0)
    net = torchvision.models.resnet50(num_classes=128).to(memory_format=torch.channels_last)
    opt = torch.optim.Adam(net.parameters(), lr=1e-5)
    x = torch.randn(batch, 3, size, size).contiguous(memory_format=torch.channels_last)

    def run_steps(hook):
        for i in range(warmup + steps + 1):
            hook(i)
            loss = net(x).float().pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()

    return count_steps(run_steps, census, warmup, steps, lambda: mark_state(opt, net, {"x": x}))


def recipe_config(recipe: str, root: Path, batch: int, size: int, steps: int, extra: Sequence[str] = ()):
    """The paper file as it is, with only the sizes shrunk (and the run's place, device and loader workers set);
    `extra`: more `section.key=value` overrides, last (`--set`)."""
    from dml_nb.core.config import load_config

    over = [
        f"data.root={root}",
        f"data.size={size}",
        "data.eval_train=false",
        "model.pretrained=false",
        "train.epochs=1",
        f"train.batches_per_epoch={steps}",
        f"train.batch_size={batch}",
        "train.device=cpu",
        "train.num_workers=0",
        "train.channels_last=on",  # as on CUDA, where it is on by default
        "train.stop_on_empty_tuples=false",  # toy batches may leave a task without tuples
    ]
    if recipe == "diva":
        over += ["method.queue_batches=2"]
    if recipe == "dnc":
        over += ["method.num_learners=2"]
    return load_config(ROOT / "params" / "train" / f"cub200_{recipe}.yaml", overrides=[*over, *extra])


def recipe(
    census: Census, name: str, root: Path, batch: int, size: int, warmup: int, steps: int, extra: Sequence[str] = ()
):
    from dml_nb.training.build import build_learner
    from dml_nb.data.batches import JpegImages

    cfg = recipe_config(name, root, batch, size, warmup + steps + 1, extra)
    torch.manual_seed(0)
    learn = build_learner(cfg, run_dir=None, progress=False)
    learn.eval_sets = {}
    if isinstance(learn.train_ds, JpegImages):
        learn.train_ds.decode_on = "device"  # decoded in the main process, in batches, as on a GPU
    step, calls, hooks = learn._train_step, [0], []

    def train_step(batch):
        hooks[0](calls[0])
        calls[0] += 1
        return step(batch)

    learn._train_step = train_step

    def marks():
        state = getattr(learn, "state", None)
        sums = [getattr(state, k, None) for k in ("sums", "counts")] if state is not None else []
        mark_state(learn.optimizer, learn.method, *[s for s in sums if isinstance(s, dict)])

    def run_steps(h):
        hooks.append(h)
        learn.fit()

    rows = count_steps(run_steps, census, warmup, steps, marks)
    if len(rows) < steps:
        raise RuntimeError(f"{name}: the epoch ran {calls[0]} steps, fewer than {warmup + steps + 1}")
    return rows


def jpeg_crops(images: int, out_size: int, repeats: int, views: int = 1) -> dict:
    "Host time of the crops, resize, flips and normalisation of `images` decoded images: per-image loop vs batched."
    from torchvision.transforms.v2 import functional as TF
    from dml_nb.data.batches import JpegDecode
    from dml_nb.data.datasets import make_transform

    jd = JpegDecode.from_transform(make_transform("resnet50", train=True, size=out_size))
    g = torch.Generator().manual_seed(0)
    shapes = [(3, 24, 32) if i % 3 else (3, 32, 24) for i in range(images)]  # tiny, in CUB's two orientations
    ims = [torch.randint(0, 256, sh, dtype=torch.uint8, generator=g) for sh in shapes]
    torch.manual_seed(0)
    draws = [jd.draw(im.shape[1], im.shape[2], views) for im in ims]
    boxes, flips = torch.stack([b for b, _ in draws]), torch.stack([f for _, f in draws])
    s = jd.spec

    def per_image():  # the JPEG path's loop before batching: torchvision's functions per image and view
        out = []
        for v in range(views):
            xs = []
            for i, im in enumerate(ims):
                top, left, h, w = (int(u) for u in boxes[i, v])
                x = TF.to_dtype(im[:, top : top + h, left : left + w], torch.float32, scale=True)
                x = TF.resize(x, [s.size, s.size], antialias=True)
                xs.append(TF.horizontal_flip(x) if bool(flips[i, v]) else x)
            x = TF.normalize(torch.stack(xs), list(s.mean), list(s.std))
            out.append(x.flip(-3) if s.bgr else x)
        return out

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    out = {"images": images, "views": views, "size": out_size, "repeats": repeats}
    try:
        if getattr(JpegDecode, "batched", False):
            t = paired(per_image, lambda: jd(ims, boxes, flips, "cpu"), repeats)
            out.update(per_image_s=t["a_s"], batched_s=t["b_s"], speedup=t["ratio"], speedup_range=t["ratio_range"])
            out.update(per_image_best_s=t["a_best_s"], batched_best_s=t["b_best_s"])
            out["speedup_of_bests"] = t["a_best_s"] / t["b_best_s"]
            ref, got = per_image(), jd(ims, boxes, flips, "cpu")
            out["max_abs_diff"] = max(float((a - b).abs().max()) for a, b in zip(ref, got))
        else:  # this version of the library crops image by image only
            out.update(per_image_s=cpu(per_image, repeats, warm=True), batched_s=None)
    finally:
        torch.set_num_threads(threads)
    return out


def summarise(rows) -> dict:
    syncs = [len(s) for _, _, s in rows]
    sites = Counter(f"{site} {what}" for _, _, ss in rows for what, site in ss)
    return {
        "syncs_per_step": max(syncs),
        "kernels_per_step": int(statistics.median(k for k, _, _ in rows)),
        "host_ops_per_step": int(statistics.median(h for _, h, _ in rows)),
        "syncs_each_step": syncs,
        "kernels_each_step": [k for k, _, _ in rows],
        "sync_sites": dict(sorted(sites.items())),
    }


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true", help="the smallest sizes: batch 8, 32 px, 1 warm-up step, 2 counted")
    ap.add_argument("--batch", type=int, default=None, help="batch size (default 32; --tiny 8)")
    ap.add_argument("--size", type=int, default=None, help="crop size in px (default 32)")
    ap.add_argument("--warmup", type=int, default=None, help="steps before the counted ones (default 3; --tiny 1)")
    ap.add_argument("--steps", type=int, default=None, help="counted steps (default 2)")
    ap.add_argument("--recipes", default=",".join(RECIPES), help=f"comma-separated, of {', '.join(RECIPES)}")
    ap.add_argument("--jpeg-images", type=int, default=112)
    ap.add_argument("--jpeg-size", type=int, default=16, help="output px of the jpeg_crops timing")
    ap.add_argument("--repeats", type=int, default=30, help="pairs of jpeg_crops timings (medians are kept)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an override of every recipe's paper file, as dml-train's --set (e.g. train.fused_optimizer=true); "
        "repeatable. The bare loop stays as it is",
    )
    ap.add_argument("--json", action="store_true", help="print one JSON object on the last line")
    ap.add_argument("-v", "--verbose", action="store_true", help="print every sync with its site, per step")
    args = ap.parse_args(argv)
    batch = args.batch or (8 if args.tiny else 32)
    size = args.size or 32
    warmup = args.warmup if args.warmup is not None else (1 if args.tiny else 3)
    steps = args.steps or 2
    recipes = [r for r in args.recipes.split(",") if r]
    sizes = (("--batch", batch, 4), ("--size", size, 16), ("--steps", steps, 1), ("--warmup", warmup, 0))
    for name, v, lo in (*sizes, ("--repeats", args.repeats, 1), ("--jpeg-images", args.jpeg_images, 1)):
        if v < lo:
            ap.error(f"{name} {v}: needs at least {lo}")
    if bad := [r for r in recipes if r not in RECIPES]:
        ap.error(f"--recipes: unknown {', '.join(bad)[:200]}; choose from {', '.join(RECIPES)}")
    for r in recipes if args.overrides else ():  # a bad --set stops here, in one line, before anything is counted
        try:
            recipe_config(r, ROOT, batch, size, warmup + steps + 1, args.overrides)
        except (ValueError, KeyError, TypeError) as e:
            text = " ".join(str(e).split())[:400]
            ap.error(text if text.startswith("--set") else f"--set: {text}")
    torch.set_num_threads(args.threads)
    from dml_nb.data.checks import write_fake_dataset

    census = Census(torch.device("cpu"))
    census.enabled = False
    undo = patch(census)
    result: dict = {}
    log = (lambda *a: print(*a, file=sys.stderr, flush=True)) if args.json else print
    try:
        census.enabled = True
        result["bare"] = summarise(bare(census, batch, size, warmup, steps))
        result["bare"].pop("syncs_each_step")
        log(f"bare: {result['bare']['kernels_per_step']} kernels per step")
        with tempfile.TemporaryDirectory() as tmp:
            root = write_fake_dataset("cub200", Path(tmp) / "cub", n_classes=16, per_class=8, size=size + 8)
            for r in recipes:
                t = time.perf_counter()
                rows = recipe(census, r, root, batch, size, warmup, steps, args.overrides)
                result[r] = summarise(rows)
                log(
                    f"{r}: {result[r]['syncs_per_step']} syncs, {result[r]['kernels_per_step']} kernels per step "
                    f"({time.perf_counter() - t:.0f} s)"
                )
                if args.verbose:
                    for i, (_, _, syncs) in enumerate(rows):
                        for what, site in syncs:
                            log(f"    step {warmup + i}: {site}  {what}")
        census.enabled = False
        result["jpeg_crops"] = jpeg_crops(args.jpeg_images, args.jpeg_size, args.repeats)
        result["jpeg_crops_2_views"] = jpeg_crops(args.jpeg_images, args.jpeg_size, args.repeats, views=2)
    finally:
        census.enabled = False
        undo()
    result["settings"] = {
        "batch": batch,
        "size": size,
        "warmup": warmup,
        "steps": steps,
        "torch": torch.__version__,
        "threads": args.threads,
        "overrides": list(args.overrides),
    }
    bare_k = result["bare"]["kernels_per_step"]
    lines = [
        f"# step census: batch {batch}, {size} px, {warmup} warm-up step(s), {steps} counted, torch {torch.__version__}"
        + (f"; paper files with {', '.join(args.overrides)}" if args.overrides else ""),
        "",
        "| run | syncs per ordinary step | kernels per step | vs bare | host ops per step | sync sites (all counted steps) |",
        "| --- | ---: | ---: | ---: | ---: | --- |",
        f"| bare | - | {bare_k} | 1.00 | {result['bare']['host_ops_per_step']} | |",
    ]
    for r in recipes:
        d = result[r]
        sites = "; ".join(f"{k} x{v}" for k, v in d["sync_sites"].items())
        lines.append(
            f"| {r} | {d['syncs_per_step']} | {d['kernels_per_step']} | {d['kernels_per_step'] / bare_k:.2f} | "
            f"{d['host_ops_per_step']} | {sites} |"
        )
    lines.append("")
    for key in ("jpeg_crops", "jpeg_crops_2_views"):
        j = result[key]
        batched = "n/a" if j["batched_s"] is None else f"{1e3 * j['batched_s']:.1f} ms"
        lines.append(
            f"{key} ({j['images']} images x {j['views']} view(s) to {j['size']} px, host time): per image "
            f"{1e3 * j['per_image_s']:.1f} ms, batched {batched}"
            + (
                f" (medians of {j['repeats']} alternated pairs; speedup {j['speedup']:.1f}x, the median of the pairs' "
                f"ratios, range {j['speedup_range'][0]:.1f}-{j['speedup_range'][1]:.1f}x; bests "
                f"{1e3 * j['per_image_best_s']:.1f} and {1e3 * j['batched_best_s']:.1f} ms: "
                f"{j['speedup_of_bests']:.1f}x)"
                if j.get("speedup")
                else ""
            )
        )
    log("\n".join(lines))
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
