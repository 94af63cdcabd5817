"""Time of one BSPML weight update (Algorithm 1, step 4): the per-sample terms xi+/xi- of every training sample
against the whole training set (`dml_nb.methods.balanced_spl.sample_terms`, chunked, O(N^2 d)) and the weight solver
(`solve_spl_weights`: the exact projected-gradient default and the paper's stochastic Algorithm 3), on the CPU and,
when one is present, on a CUDA GPU.

Data: N synthetic unit-norm 512-d embeddings with SOP-like classes (2-12 images per class, mean about 5.3, as SOP's
11,318 training classes of 59,551 images) drawn around random class centres, so the terms and weights are those of
a half-trained model. The age is the pair-loss floor of the scope (lambda_unit 'floor', lambda 1), mu = lambda.

    python benchmarks/bspml.py [--sizes 5000 60000] [--threads 2] [--devices cpu cuda] [--scopes class batch] [--repeats 3] [--old]

`--old` also times the loss' unsorted `per_sample_terms` (the path BSPML used before) at the smallest size.
Prints the machine (CPU model, cores, torch, load average before and after) and one markdown table.
"""

from __future__ import annotations
import argparse
import os
import platform
import time

import torch
import torch.nn.functional as F

from dml_nb.methods.balanced_spl import ClassIndex, pair_loss_floor, sample_terms, solve_spl_weights
from dml_nb.blocks.losses import WeightedMultiSimilarityLoss


def sop_like(n: int, dim: int = 512, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    "n embeddings in classes of 2-12 samples (uniform sizes, mean ~5.3 after truncation, as SOP), around random centres."
    g = torch.Generator().manual_seed(seed)
    sizes = torch.randint(2, 10, (n,), generator=g)  # mean 5.5; the last class is cut at n
    labels = torch.repeat_interleave(torch.arange(n), sizes)[:n]
    centres = F.normalize(torch.randn(int(labels.max()) + 1, dim, generator=g), dim=1)
    emb = F.normalize(centres[labels] + 0.9 / dim**0.5 * torch.randn(n, dim, generator=g), dim=1)
    return emb, labels


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def loadavg() -> str:
    try:
        return open("/proc/loadavg").read().split()[0]
    except OSError:
        return "n/a"


def timed(fn, device, repeats: int):
    "Best of `repeats` wall-clock times (synchronising CUDA), and the last result."
    best, out = float("inf"), None
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t = time.perf_counter()
        out = fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - t)
    return best, out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[5000, 60000])
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--devices", nargs="+", default=["cpu", "cuda"])
    ap.add_argument("--scopes", nargs="+", default=["class", "batch"], choices=["class", "batch"])
    ap.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="best of this many (terms above 20k samples on the CPU and the stochastic solver: 1)",
    )
    ap.add_argument("--old", action="store_true", help="also time the loss' per_sample_terms at the smallest size")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    devices = [torch.device(d) for d in args.devices if d != "cuda" or torch.cuda.is_available()]
    skipped = [d for d in args.devices if d == "cuda" and not torch.cuda.is_available()]
    print(
        f"machine: {cpu_model()}, {os.cpu_count()} cores ({len(os.sched_getaffinity(0))} usable), "
        f"torch {torch.__version__}, threads {args.threads}"
        + (f", GPU {torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else ", no GPU (cuda path skipped)")
    )
    print(f"load average before: {loadavg()}")
    rows = []
    for n in args.sizes:
        emb, labels = sop_like(n, args.dim)
        floor = float(pair_loss_floor(labels, scope="class").mean())
        for dev in devices:
            e, y = emb.to(dev), labels.to(dev)
            reps = 1 if (dev.type == "cpu" and n > 20000) else args.repeats
            for scope in args.scopes:
                t_terms, (xp, xn) = timed(lambda: sample_terms(e, y, scope=scope), dev, reps)
                xp, xn = xp.double(), xn.double()
                lam = floor if scope == "class" else float(pair_loss_floor(labels, scope="batch").mean())
                ci = ClassIndex(y)
                for solver in ("exact", "stochastic"):
                    gen = torch.Generator().manual_seed(0)
                    t_solve, (w, info) = timed(
                        lambda: solve_spl_weights(xp, xn, ci, lam, lam, solver=solver, generator=gen, return_info=True),
                        dev,
                        1 if solver == "stochastic" else args.repeats,
                    )
                    rows.append(
                        (
                            n,
                            int(labels.max()) + 1,
                            dev.type,
                            scope,
                            t_terms,
                            solver,
                            t_solve,
                            info["iters"],
                            info["pg"],
                            float(w.mean()),
                        )
                    )
                    print(f"  done: N={n} {dev.type} {scope} {solver} (load {loadavg()})", flush=True)
        if args.old and n == min(args.sizes):
            loss = WeightedMultiSimilarityLoss()
            t_old, _ = timed(lambda: loss.per_sample_terms(emb, labels), torch.device("cpu"), args.repeats)
            print(f"old path (loss.per_sample_terms, cpu, N={n}): {t_old:.2f} s")
    print(f"load average after: {loadavg()}")
    print("\n| N | classes | device | xi scope | xi s | solver | solver s | iterations | projected gradient | MAW |")
    print("| ---: | ---: | --- | --- | ---: | --- | ---: | ---: | ---: | ---: |")
    for n, C, dev, scope, tt, solver, ts, it, pg, maw in rows:
        print(f"| {n:,} | {C:,} | {dev} | {scope} | {tt:.2f} | {solver} | {ts:.2f} | {it} | {pg:.1e} | {maw:.3f} |")
    for d in skipped:
        print(f"\n({d}: not available on this machine, skipped)")


if __name__ == "__main__":
    main()
