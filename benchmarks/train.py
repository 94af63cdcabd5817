"""Training throughput (images/s) of each method recipe beside the bare backbone's forward + backward + Adam step at
the same batch size; the ratio is the method's overhead (loss, mining, extra heads, key encoder, data pipeline,
per-epoch work such as D&C re-clustering or BSPML's weight update).

CPU (default): the recipes of params/train/shapes_<method>.yaml (small CNN, embedded `shapes`, batch 60), built by
dml_nb.training.build.build_learner, once with the per-item augmentation (PIL/v2 path) and once with the image cache
(`data.cache: true`: augmentation in batches). GPU (`--variant resnet50 --device cuda`): the recipes of
params/train/cub200_<method>.yaml (ResNet50 with frozen BN, batch 112, bf16, channels_last) on generated 256 x 256
uint8 images through the cache path (real data are not needed); `--compile` adds torch.compile.

Each method runs `--epochs` epochs; the first (warm-up: DiVA's queue fill, first re-clustering) is not counted and the
fastest of the others is reported (the machine may be shared: the least disturbed epoch). The bare backbone is timed
right before and right after each method, in the same process, best of 3 bursts each; the mean of the two is used.

    python benchmarks/train.py [--methods baseline diva dnc sharing bspml] [--cache off on] [--epochs 3] [--threads 2]
    python benchmarks/train.py --variant resnet50 --device cuda [--steps 30] [--compile]
"""

from __future__ import annotations
import argparse
import datetime
import os
import platform
import time
from pathlib import Path

import numpy as np
import torch

import dml_nb.experiments.experiment as X
from dml_nb.core.config import load_config
from dml_nb.data.datasets import ArrayDataset, make_transform
from dml_nb.training.callbacks import Callback
from dml_nb.blocks.models import build_backbone

PARAMS = Path(__file__).resolve().parent.parent / "params" / "train"
METHODS = ("baseline", "diva", "dnc", "sharing", "bspml")


class EpochClock(Callback):
    "Wall-clock time stamps: before the first epoch and after every epoch (after everything else of that epoch)."

    order = 10**9

    def __init__(self):
        self.stamps = []

    def before_fit(self, learner):
        self.stamps.append(time.perf_counter())

    def after_epoch(self, learner):
        self.stamps.append(time.perf_counter())


def bare_rate(cfg, device, batch: int, size: int, steps: int, bursts: int = 3) -> float:
    "Images/s of the bare backbone (forward, sum of the features as the loss, backward, Adam step) at `batch`: best of `bursts`."
    torch.manual_seed(0)
    bb = build_backbone(cfg.model.backbone, pretrained=None, **cfg.model.options).to(device)
    cuda = device.type == "cuda"
    if cuda:
        bb = bb.to(memory_format=torch.channels_last)
    if cfg.train.compile:
        bb.compile()
    opt = torch.optim.Adam([p for p in bb.parameters() if p.requires_grad], lr=1e-5)
    x = torch.randn(batch, 3, size, size, device=device)
    if cuda:
        x = x.contiguous(memory_format=torch.channels_last)

    def step():
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
            loss = bb(x).float().sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    for _ in range(3):
        step()
    best = 0.0
    for _ in range(bursts):  # the machine may be shared: the least disturbed burst counts
        if cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(steps):
            step()
        if cuda:
            torch.cuda.synchronize()
        best = max(best, batch * steps / (time.perf_counter() - t))
    return best


def generated_sets(n_classes: int, per_class: int, size: int = 224, side: int = 256, seed: int = 0):
    "Random smooth uint8 images (side x side), class-labelled, with the ResNet50 train / test transforms at crop `size`."
    g = torch.Generator().manual_seed(seed)
    low = torch.rand(n_classes * per_class, 3, 9, 9, generator=g)
    imgs = (torch.nn.functional.interpolate(low, size=(side, side), mode="bilinear") * 255).to(torch.uint8)
    arr = np.ascontiguousarray(imgs.permute(0, 2, 3, 1).numpy())
    labels = np.repeat(np.arange(n_classes), per_class)
    train = ArrayDataset(
        arr, labels, make_transform("resnet50", train=True, size=size), name="generated", split="train"
    )
    test = ArrayDataset(arr, labels, make_transform("resnet50", train=False, size=size), name="generated", split="test")
    return train, test


def method_rate(cfg, epochs: int, sets=None) -> tuple[float, float, int]:
    "(images/s of the best of epochs 2.. (whole epoch), of the best of their step loops, batch) of one recipe, built as dml-train builds it."
    if sets is not None:  # the generated-image variant: the same builder, with these datasets
        from dml_nb.data.cache import cache_images

        train, test = sets
        X.build_datasets = lambda cfg, progress=True: (cache_images(train), {"test": cache_images(test)})
    learner = X.build_learner(cfg, run_dir=None, progress=False)
    learner.eval_sets = {}  # time training only; D&C and Sharing still embed the training set themselves
    clock = EpochClock()
    learner.callbacks.append(clock)
    learner.fit()
    walls = np.diff(clock.stamps)[1:]
    images = learner.steps_in_epoch * cfg.train.batch_size
    steps_only = [images / r["time"] for r in learner.history[1:]]
    return float(images / np.min(walls)), float(max(steps_only)), cfg.train.batch_size


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--variant", choices=("shapes", "resnet50"), default="shapes")
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    ap.add_argument("--cache", nargs="+", default=["off", "on"], choices=("off", "on"))
    ap.add_argument("--epochs", type=int, default=3, help="epochs per method (the first is not counted)")
    ap.add_argument(
        "--steps", type=int, default=None, help="steps per epoch (default: the whole set, shapes; 30, resnet50)"
    )
    ap.add_argument("--bare-steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=None, help="override the recipe's batch size (smoke runs)")
    ap.add_argument("--size", type=int, default=224, help="crop size of the resnet50 variant")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    print(
        f"# {datetime.date.today()} {platform.node()} {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} cores, torch {torch.__version__}, device {device}"
        f"{' (' + torch.cuda.get_device_name(device) + ')' if device.type == 'cuda' else ''}, threads {args.threads}"
    )
    rows = []
    for m in args.methods:
        for cache in args.cache if args.variant == "shapes" else ["on"]:
            over = [
                f"train.epochs={args.epochs}",
                f"train.device={args.device}",
                "eval.save_embeddings=false",
                f"train.compile={'true' if args.compile else 'false'}",
            ]
            if args.variant == "shapes":
                over.append(f"data.cache={'true' if cache == 'on' else 'false'}")
                cfg = load_config(PARAMS / f"shapes_{m}.yaml", overrides=over)
            else:
                cfg = load_config(
                    PARAMS / f"cub200_{m}.yaml", overrides=over + ["model.pretrained=null", "data.name=shapes"]
                )
            if args.batch:
                cfg.train.batch_size = args.batch
            steps = args.steps or (None if args.variant == "shapes" else 30)
            if steps:
                cfg.train.batches_per_epoch = steps
            sets = None
            if args.variant == "resnet50":
                per = cfg.train.samples_per_class * 2
                sets = generated_sets(max(cfg.train.batch_size // cfg.train.samples_per_class * 2, 8), per, args.size)
            size = args.size if args.variant == "resnet50" else (cfg.data.size or 32)
            load0 = os.getloadavg()[0]
            before = bare_rate(cfg, device, cfg.train.batch_size, size, args.bare_steps)
            rate, steps_rate, batch = method_rate(cfg, args.epochs, sets)
            after = bare_rate(cfg, device, cfg.train.batch_size, size, args.bare_steps)
            bare = (before + after) / 2
            load1 = os.getloadavg()[0]
            rows.append((m, cache, batch, rate, steps_rate, bare, bare / rate - 1, f"{load0:.1f}-{load1:.1f}"))
            print(
                f"{m:9s} cache={cache:3s} batch {batch}: {rate:7.1f} img/s (steps only {steps_rate:7.1f}), bare "
                f"{before:7.1f} / {after:7.1f} img/s, overhead {100 * (bare / rate - 1):+.0f}%, load {rows[-1][-1]}",
                flush=True,
            )
    print(
        "\n| method | cache | batch | method img/s (epoch) | steps only img/s | bare backbone img/s | overhead | load avg |"
    )
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | --- |")
    for m, cache, batch, rate, steps_rate, bare, over, load in rows:
        print(f"| {m} | {cache} | {batch} | {rate:.1f} | {steps_rate:.1f} | {bare:.1f} | {100 * over:+.0f}% | {load} |")


if __name__ == "__main__":
    main()
