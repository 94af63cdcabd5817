"""Data-loading throughput (decoded, augmented images/s) of the training pipeline, against the rate at which the
model consumes images.

Pipelines, on a set of generated JPEGs of CUB's typical size (500 x 375, quality 90; `--root` for a folder of your
own JPEGs): (1) the PIL path: decode + RandomResizedCrop(224) + flip + normalise per item in DataLoader workers;
(2) building the image cache once (decode + resize to shorter side 256); (3) the cache path: uint8 bytes out of the
memory map and padded into a batch by the workers (4) + `BatchAugment` on `--device` for the batch. The model's
consumption: the bare ResNet50 forward + backward + Adam step at 224 px on `--device`. Each loader figure is per
worker count, so the per-core rate can be scaled to a larger machine.

    python benchmarks/data.py [--images 240] [--workers 0 1 2] [--device cpu] [--threads 2] [--batch 16]
"""

from __future__ import annotations
import argparse
import datetime
import os
import platform
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from dml_nb.data.cache import RawItems, cache_images, pad_collate
from dml_nb.data.datasets import ImageListDataset, make_transform
from dml_nb.data.batches import SeededViews


def write_jpegs(folder: Path, n: int, seed: int = 0) -> list[Path]:
    "n JPEGs of 500 x 375 (or 375 x 500): smooth colour fields plus texture noise, so that decoding costs what a photo costs."
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(n):
        h, w = (375, 500) if i % 3 else (500, 375)
        low = torch.from_numpy(rng.random((1, 3, 8, 8), dtype=np.float32))
        x = torch.nn.functional.interpolate(low, size=(h, w), mode="bicubic", align_corners=False)[0] * 200
        x = x + torch.from_numpy(rng.normal(0, 18, (3, h, w)).astype(np.float32))
        p = folder / f"{i:05d}.jpg"
        Image.fromarray(x.clamp(0, 255).to(torch.uint8).permute(1, 2, 0).numpy()).save(p, quality=90)
        paths.append(p)
    return paths


def loader_rate(dataset, batch: int, workers: int, collate=None, consume=None) -> float:
    "Images/s through a DataLoader over the whole set, one pass, worker start-up included (a conservative figure)."
    n = len(dataset)
    batches = [[(i, i) for i in range(a, min(a + batch, n))] for a in range(0, n, batch)]
    t = time.perf_counter()
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=batches, num_workers=workers, collate_fn=collate)
    done = 0
    for b in loader:
        if consume:
            consume(b)
        done += len(b["y"])
    return done / (time.perf_counter() - t)


def model_rate(device, batch: int, steps: int) -> float:
    "Bare ResNet50 forward + backward + Adam at 224 px (bf16 + channels_last on CUDA)."
    from dml_nb.blocks.models import build_backbone

    torch.manual_seed(0)
    bb = build_backbone("resnet50", frozen_bn=True).to(device)
    cuda = device.type == "cuda"
    if cuda:
        bb = bb.to(memory_format=torch.channels_last)
    opt = torch.optim.Adam(bb.parameters(), lr=1e-5)
    x = torch.randn(batch, 3, 224, 224, device=device)

    def step():
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
            loss = bb(x).float().sum()
        opt.zero_grad()
        loss.backward()
        opt.step()

    step()
    if cuda:
        torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(steps):
        step()
    if cuda:
        torch.cuda.synchronize()
    return batch * steps / (time.perf_counter() - t)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--root", default=None, help="a folder of JPEGs to use instead of generated ones")
    ap.add_argument("--images", type=int, default=240)
    ap.add_argument("--workers", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--batch", type=int, default=16, help="loader batch size (small: many batches per pass)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--model-batch", type=int, default=None, help="batch of the model-rate measurement (default: 112; CPU: 8)"
    )
    ap.add_argument(
        "--model-steps", type=int, default=None, help="steps of the model-rate measurement (default 20; CPU 2)"
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    print(
        f"# {datetime.date.today()} {platform.node()}, {os.cpu_count()} cores, torch {torch.__version__}, device {device}"
        f"{' (' + torch.cuda.get_device_name(device) + ')' if device.type == 'cuda' else ''}, threads {args.threads}"
    )
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        if args.root:
            paths = sorted(Path(args.root).rglob("*.jpg"))[: args.images]
        else:
            t = time.perf_counter()
            paths = write_jpegs(Path(tmp) / "images", args.images)
            print(f"wrote {len(paths)} JPEGs in {time.perf_counter() - t:.1f} s", flush=True)
        ds = ImageListDataset(
            paths, np.arange(len(paths)) % 10, make_transform("resnet50", train=True), name="bench", split="train"
        )
        for w in args.workers:
            rows.append(
                (
                    "PIL path: decode + RandomResizedCrop + flip + normalise per item",
                    w,
                    loader_rate(SeededViews(ds), args.batch, w),
                    os.getloadavg()[0],
                )
            )
            print(rows[-1], flush=True)
        t = time.perf_counter()
        cached = cache_images(ds, cache_dir=Path(tmp) / "cache", num_workers=max(args.workers), progress=False)
        rows.append(
            (
                "cache build (once): decode + resize to 256",
                max(args.workers),
                len(ds) / (time.perf_counter() - t),
                os.getloadavg()[0],
            )
        )
        print(rows[-1], flush=True)
        for w in args.workers:
            rows.append(
                (
                    "cache path: uint8 from the memory map, padded batch",
                    w,
                    loader_rate(RawItems(cached), args.batch, w, pad_collate),
                    os.getloadavg()[0],
                )
            )
            print(rows[-1], flush=True)
        aug = cached.batch_transform
        gen = torch.Generator().manual_seed(0)

        def on_device(b):
            aug(b["x"].to(device, non_blocking=True), b["sizes"], gen)
            if device.type == "cuda":
                torch.cuda.synchronize()

        for w in args.workers[-1:]:
            rows.append(
                (
                    f"cache path + BatchAugment on {device} (crop, flip, normalise)",
                    w,
                    loader_rate(RawItems(cached), args.batch, w, pad_collate, consume=on_device),
                    os.getloadavg()[0],
                )
            )
            print(rows[-1], flush=True)
    cpu = device.type == "cpu"
    mb = args.model_batch or (8 if cpu else 112)
    rate = model_rate(device, mb, args.model_steps or (2 if cpu else 20))
    rows.append(
        (f"model: bare ResNet50 fwd+bwd+Adam at 224 px, batch {mb}, on {device}", "-", rate, os.getloadavg()[0])
    )
    print("\n| pipeline | workers | images/s | vs model | load avg |\n| --- | ---: | ---: | ---: | ---: |")
    for what, w, r, load in rows:
        print(f"| {what} | {w} | {r:.1f} | {r / rate:.2f}x | {load:.1f} |")


if __name__ == "__main__":
    main()
