"""The JPEG path (`data.decode: jpeg_batch`) against the PIL path: images/s of the training data pipeline on
CUB-sized JPEGs (RandomResizedCrop(224) from the full image, flip, normalise; both give the same tensors).

Pipelines, per worker count:
  PIL path      SeededViews over make_transform: PIL decode + crop + resize + flip + normalise per item in the workers;
  JPEG, worker  JpegImages(decode_on='worker'): libjpeg-turbo decode + the same crop/resize/normalise in the workers
                (what the JPEG path does without a GPU);
  JPEG, device  JpegImages(decode_on='device'): the workers read bytes and draw the boxes; the main process decodes the
                batch on --device (nvJPEG on CUDA) and crops, resizes, flips and normalises there (what it does on a GPU);
  JPEG, workers' part only   the device path's worker side alone (read, header, draws): the rate a GPU could be fed at.
Rates are whole passes (worker start-up included) in wall time, and per CPU second (this process and its workers:
getrusage), the figure to read on a shared machine.

    python benchmarks/jpeg.py [--images 160] [--workers 0 1 2] [--device cpu] [--batch 16] [--threads 1]
"""

from __future__ import annotations
import argparse
import datetime
import os
import platform
import resource
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from data import write_jpegs  # noqa: E402  (CUB-sized generated JPEGs)
from dml_nb.data.batches import JpegImages, SeededViews, jpeg_collate, to_device  # noqa: E402
from dml_nb.data.datasets import ImageListDataset, make_transform  # noqa: E402


def cpu_seconds() -> float:
    "CPU seconds of this process and of its finished children (the loader's workers, once joined)."
    s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime


def pipeline_rate(items, collate, n: int, batch: int, workers: int, consume=None, seed: int = 0) -> tuple[float, float]:
    "(images/s wall, images per CPU second) of one pass over items (index, seed) through a DataLoader, then `consume`."
    batches = [[(i, seed + i) for i in range(a, min(a + batch, n))] for a in range(0, n, batch)]
    c0, t0 = cpu_seconds(), time.perf_counter()
    loader = torch.utils.data.DataLoader(items, batch_sampler=batches, num_workers=workers, collate_fn=collate)
    done = 0
    for b in loader:
        if consume is not None:
            consume(b)
        done += len(b["y"])
    del loader  # joins the workers: their CPU time is counted
    wall, cpu = time.perf_counter() - t0, cpu_seconds() - c0
    return done / wall, done / max(cpu, 1e-9)


def jpeg_rows(paths, device, workers, batch: int, reps: int = 1) -> list[tuple]:
    "The four pipelines at every worker count: rows (pipeline, workers, images/s wall, images per CPU s, load)."
    device = torch.device(device)
    src = ImageListDataset(
        paths, np.arange(len(paths)) % 10, make_transform("resnet50", train=True), name="bench", split="train"
    )
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    dev = JpegImages(src, decode_on="device")
    d_items, d_collate = dev.loader_items(1, device)
    w_items, _ = JpegImages(src, decode_on="worker").loader_items(1, device)

    def decode_on_device(b):
        to_device(b, device, transform=dev.batch_transform)
        sync()

    pipelines = [
        ("PIL path (per item in the workers)", SeededViews(src), None, None),
        ("JPEG path, decoded in the workers (no GPU)", w_items, None, None),
        (f"JPEG path, decoded on {device} in batches", d_items, jpeg_collate, decode_on_device),
        ("JPEG path, the workers' part only (bytes, header, boxes)", d_items, jpeg_collate, None),
    ]
    rows = []
    for w in workers:
        for name, items, collate, consume in pipelines:
            best = max(
                (pipeline_rate(items, collate, len(src), batch, w, consume) for _ in range(reps)), key=lambda r: r[1]
            )
            rows.append((name, w, *best, os.getloadavg()[0]))
            print(rows[-1], flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--root", default=None, help="a folder of JPEGs to use instead of generated ones")
    ap.add_argument("--images", type=int, default=160)
    ap.add_argument("--workers", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the main process (workers use one each)")
    ap.add_argument(
        "--reps", type=int, default=2, help="passes per pipeline; the one with the most images per CPU s is kept"
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    import torchvision

    print(
        f"# {datetime.date.today()} {platform.node()}, {os.cpu_count()} cores, torch {torch.__version__}, torchvision "
        f"{torchvision.__version__}, device {device}{' (' + torch.cuda.get_device_name(device) + ')' if device.type == 'cuda' else ''}, "
        f"threads {args.threads}, load {os.getloadavg()[0]:.1f}"
    )
    with tempfile.TemporaryDirectory() as tmp:
        paths = (
            sorted(Path(args.root).rglob("*.jpg"))[: args.images]
            if args.root
            else write_jpegs(Path(tmp) / "images", args.images)
        )
        rows = jpeg_rows(paths, device, args.workers, args.batch, args.reps)
    print(
        "\n| pipeline | workers | images/s (wall) | images per CPU second | load avg |\n| --- | ---: | ---: | ---: | ---: |"
    )
    for name, w, wall, cpu, load in rows:
        print(f"| {name} | {w} | {wall:.1f} | {cpu:.1f} | {load:.1f} |")


if __name__ == "__main__":
    main()
