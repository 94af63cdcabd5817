"""Time dml_nb.evaluation.metrics against pytorch-metric-learning's AccuracyCalculator on the same embeddings.

Metrics: Recall@1,2,4,8 + MAP@R (ours: one shared neighbour search) and NMI (k-means with k = number of classes).
PML computes precision_at_1 (= Recall@1), mean_average_precision_at_r and r_precision from its faiss k-NN with
k = "max_bin_count" (the setting MAP@R needs) and NMI from its faiss k-means (niter=20).

Data: synthetic L2-normalised 512-d embeddings with class structure (class centre + Gaussian noise) at
CUB scale (5,924 x 512, 100 classes) and SOP scale (60,502 x 512, 11,316 classes of 2 or more images).

    python benchmarks/eval.py --scale cub|sop|all [--threads 2] [--no-pml] [--device cpu|cuda] [--bf16] [--breakdown]

Every table comes with the machine: CPU model, the SIMD flags that matter here (AVX2/FMA, AVX-512, AVX512-BF16,
AMX), cores, torch's and faiss's thread settings, the sustained float32 and bfloat16 GEMM rates (torch.mm), the
FLOP lower bound they imply for the symmetric distance matrix, and the 1-minute load average before and after
each part (the ratios are what to read on a shared machine). NMI rows carry the k-means objective
(sum of squared distances to the centroids) beside the time: ours from `kmeans` (what `nmi` runs), PML's from
`faiss.Kmeans` called as PML calls it (niter=20, faiss's default seed), re-run untimed. Our NMI row runs our default
(3 k-means restarts where cheap, as at CUB scale); the last row of each scale, "total, one k-means run each", adds our
retrieval and one k-means run, like for like with PML's single faiss run.
"""

from __future__ import annotations
import argparse
import logging
import os
import platform
import re
import time

try:
    import faiss  # optional: PML's calculator and the faiss rows need it
except ImportError:
    faiss = None
import numpy as np
import torch

from sklearn.metrics import normalized_mutual_info_score

from dml_nb.evaluation.metrics import evaluate
from dml_nb.evaluation.clustering import _assign, _auto_nredo, kmeans
from dml_nb.evaluation.faiss_backend import set_num_threads
from dml_nb.evaluation.neighbours import block_rows, _cache_bytes, _knn_self, _knn_self_lowp, lowp_supported

# noise chosen so that Recall@1 lands near the real benchmarks (CUB ~0.7, SOP ~0.8)
SCALES = {"cub": dict(n=5924, classes=100, noise=0.15), "sop": dict(n=60502, classes=11316, noise=0.1, min_size=2)}
RETRIEVAL = ("recall@1", "recall@2", "recall@4", "recall@8", "map@r", "r_precision")


def synthetic(n: int, classes: int, dim: int = 512, noise: float = 0.1, min_size: int | None = None, seed: int = 0):
    """Unit-norm embeddings: a random unit centre per class plus isotropic noise, renormalised. Classes are equal
    in size, or (`min_size` given, SOP-like) `min_size` plus a multinomial share of the rest."""
    rng = np.random.default_rng(seed)
    if min_size is not None:
        sizes = min_size + rng.multinomial(n - min_size * classes, np.ones(classes) / classes)
    else:
        sizes = np.full(classes, n // classes)
        sizes[: n - sizes.sum()] += 1
    labels = np.repeat(np.arange(classes), sizes)
    centres = rng.standard_normal((classes, dim)).astype(np.float32)
    centres /= np.linalg.norm(centres, axis=1, keepdims=True)
    emb = centres[labels] + noise * rng.standard_normal((n, dim)).astype(np.float32)
    emb /= np.linalg.norm(emb, axis=1, keepdims=True)
    return torch.from_numpy(emb), torch.from_numpy(labels)


FLAGS = ("avx", "avx2", "fma", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16")


def load() -> float:
    return float(open("/proc/loadavg").read().split()[0])


def gemm_rate(dtype, device, n: int = 4096, d: int = 512) -> float:
    "Sustained GFLOP/s of torch.mm (n x d) @ (d x n), best of 5."
    a, b = torch.randn(n, d, device=device).to(dtype), torch.randn(n, d, device=device).to(dtype)
    torch.mm(a, b.T)
    best = float("inf")
    for _ in range(5):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        torch.mm(a, b.T)
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    return 2 * n * n * d / best / 1e9


def machine(device) -> dict:
    "Print and return what the timings depend on."
    info = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
    model = re.search(r"^model name\s*:\s*(.*)$", info, re.M)
    flags = set((re.search(r"^flags\s*:(.*)$", info, re.M) or re.match("()", "")).group(1).split())
    m = dict(
        cpu=model.group(1) if model else platform.processor(),
        flags=[f for f in FLAGS if f in flags],
        cores=os.cpu_count(),
        usable_cores=len(os.sched_getaffinity(0)),
        torch_threads=torch.get_num_threads(),
        faiss_threads=faiss.omp_get_max_threads() if faiss else None,
        torch_cpu_capability=torch.backends.cpu.get_cpu_capability(),
        cache_MiB=_cache_bytes() >> 20,
        bf16_units=lowp_supported(device),
        versions=f"torch {torch.__version__}, faiss {faiss.__version__ if faiss else 'not installed'}",
    )
    if device.type == "cuda":
        m["gpu"] = torch.cuda.get_device_name(device)
    m["fp32_GFLOPs"] = round(gemm_rate(torch.float32, device), 1)
    m["bf16_GFLOPs"] = round(gemm_rate(torch.bfloat16, device), 1)
    print("machine:", ", ".join(f"{k}={v}" for k, v in m.items()), flush=True)
    return m


def timed(fn, repeats: int = 1):
    "Result and the best wall time of `repeats` runs (the machine is shared: the minimum is the least disturbed)."
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t)
    return out, best


def bf16_search(emb, labels, repeats: int):
    """The self-search alone at the k the retrieval metrics use, in float32 (what `"torch"` runs) and with bfloat16
    candidates (`"torch_bf16"`), with the share of rows the bf16 certificate accepts (the rest are searched again)."""
    k = int(labels.bincount().max()) + 1
    _, t32 = timed(lambda: _knn_self(emb, k), repeats)
    st = {}
    _, t16 = timed(lambda: _knn_self_lowp(emb, k, stats=st), repeats)
    print(
        f"self-search, k = {k}: float32 {t32:.2f} s, bf16 candidates {t16:.2f} s "
        f"({st.get('certified', 0) / max(1, st.get('rows', 0)):.1%} of the rows certified)",
        flush=True,
    )


def breakdown(emb, labels, repeats: int):
    """Where the time goes. The self-search at the k the retrieval metrics use, against its block products alone
    (the same blocks, nothing else); one k-means assignment pass (k = classes, centroids a fixed sample of the rows)
    against faiss's flat search of the same size (what `faiss.Kmeans` runs each iteration)."""
    x, n, d = emb, len(emb), emb.shape[1]
    K, B, sq = int(labels.bincount().max()) + 1, block_rows(len(emb), emb.device), emb.pow(2).sum(1)
    blocks = [(s, t) for s in range(0, n, B) for t in range(s, n, B)]

    def products():
        for s, t in blocks:
            torch.addmm(sq[t : t + B], x[s : s + B], x[t : t + B].T, alpha=-2)
        if x.device.type == "cuda":
            torch.cuda.synchronize()

    _, t_all = timed(lambda: _knn_self(x, K), repeats)
    _, t_p = timed(products, repeats)
    flop = 2 * d * sum(min(B, n - s) * min(B, n - t) for s, t in blocks)
    print(
        f"self-search, k = {K}: {t_all:.2f} s; its {len(blocks)} block products alone {t_p:.2f} s "
        f"({flop / t_p / 1e9:.0f} GFLOP/s); the rest (screening, merging, diagonal top-k) {t_all - t_p:.2f} s",
        flush=True,
    )
    k = len(labels.unique())
    c = x[torch.randperm(n, generator=torch.Generator().manual_seed(0))[:k].to(x.device)]
    _, t_a = timed(lambda: _assign(x, sq, c), repeats)
    index = faiss.IndexFlatL2(d)
    index.add(c.cpu().numpy())
    xn = x.cpu().numpy()
    _, t_f = timed(lambda: index.search(xn, 1), repeats)
    print(
        f"one k-means assignment, {n} points x {k} centroids ({2 * n * k * d / 1e12:.2f} TFLOP): ours {t_a:.2f} s, "
        f"faiss's flat search (CPU) {t_f:.2f} s",
        flush=True,
    )


def run_scale(
    name: str, pml: bool, repeats: int, device, rate: float, bf16: bool = False, show_breakdown: bool = False
) -> list[tuple]:
    emb, labels = synthetic(**SCALES[name])
    emb, labels = emb.to(device), labels.to(device)
    n, d, k = len(emb), emb.shape[1], len(labels.unique())
    print(
        f"\n== {name}: {tuple(emb.shape)}, {k} classes, "
        f"class sizes {int(labels.bincount().min())}-{int(labels.bincount().max())}; the symmetric distance matrix "
        f"is n^2 d = {n * n * d / 1e12:.2f} TFLOP (multiply-add = 2), >= {n * n * d / rate / 1e9:.1f} s at "
        f"{rate:.0f} GFLOP/s",
        flush=True,
    )
    l0 = load()
    ours_r, t_r = timed(lambda: evaluate(emb, labels, metrics=RETRIEVAL), repeats)

    def ours_nmi():  # what `nmi` runs, keeping the objective
        clusters, _, obj = kmeans(emb, k)
        return normalized_mutual_info_score(labels.cpu().numpy(), clusters.cpu().numpy()), obj

    (ours_n, ours_obj), t_n = timed(ours_nmi, repeats)
    if _auto_nredo(n, k) == 1:
        one, t_1 = (None, None, ours_obj), t_n  # the default already is one run
    else:
        one, t_1 = timed(lambda: kmeans(emb, k, nredo=1), repeats)  # one Lloyd run, as PML's single faiss run
    if bf16:
        bf16_search(emb, labels, repeats)
    if show_breakdown:
        breakdown(emb, labels, repeats)
    l1 = load()
    print(
        f"ours: retrieval {t_r:.2f} s {ours_r}\nours: nmi {t_n:.2f} s nmi={ours_n:.4f} objective={ours_obj:.1f}"
        f" (load {l0:.2f} -> {l1:.2f})",
        flush=True,
    )
    print(f"ours: k-means, one run {t_1:.2f} s objective={one[2]:.1f}", flush=True)
    rows = [
        [name, "R@1,2,4,8 + MAP@R + R-prec.", t_r],
        [name, "NMI (k-means: default nredo)", t_n],
        [name, "total", t_r + t_n],
        [name, "k-means, one run (as PML)", t_1],
        [name, "total, one k-means run each", t_r + t_1],
    ]
    objective = [None, f"{ours_obj:.1f}", None, f"{one[2]:.1f}", None]
    if not pml:
        return [r + [float("nan"), o, f"{l0:.1f}-{l1:.1f}"] for r, o in zip(rows, objective)]
    from pytorch_metric_learning.utils.accuracy_calculator import AccuracyCalculator

    logging.getLogger("PML").setLevel(logging.ERROR)
    calc = AccuracyCalculator(
        include=("precision_at_1", "mean_average_precision_at_r", "r_precision"), k="max_bin_count", device=device
    )
    pml_r, p_r = timed(lambda: calc.get_accuracy(emb, labels), repeats)
    calc = AccuracyCalculator(include=("NMI",), device=device)
    pml_n, p_n = timed(lambda: calc.get_accuracy(emb, labels), repeats)
    l2 = load()
    km = faiss.Kmeans(d, k, niter=20, gpu=device.type == "cuda")  # PML's call, untimed, for its objective
    x = emb.cpu().numpy()
    km.train(x)
    pml_obj = float(km.index.search(x, 1)[0].astype(np.float64).sum())
    print(
        f"PML:  retrieval {p_r:.2f} s {pml_r}\nPML:  nmi {p_n:.2f} s {pml_n} objective={pml_obj:.1f}"
        f" (load {l1:.2f} -> {l2:.2f})",
        flush=True,
    )
    objective[1] += f" / {pml_obj:.1f}"
    objective[3] += f" / {pml_obj:.1f}"
    return [r + [p, o, f"{l0:.1f}-{l2:.1f}"] for r, p, o in zip(rows, (p_r, p_n, p_r + p_n, p_n, p_r + p_n), objective)]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scale", choices=("cub", "sop", "all"), default="cub")
    ap.add_argument("--threads", type=int, default=2, help="torch and faiss threads (set together)")
    ap.add_argument(
        "--repeats", type=int, default=None, help="best of this many runs (default: 3 at CUB scale, 1 at SOP)"
    )
    ap.add_argument("--no-pml", action="store_true", help="time only dml_nb.evaluation.metrics")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (embeddings, our torch back end and PML there)")
    ap.add_argument(
        "--bf16",
        action="store_true",
        help="also time the self-search with bf16 candidates (opt-in "
        "backend 'torch_bf16') against float32, with its certified share of rows",
    )
    ap.add_argument(
        "--breakdown",
        action="store_true",
        help="also time the self-search's block products alone and "
        "one k-means assignment pass against faiss's flat search of the same size",
    )
    args = ap.parse_args()
    set_num_threads(args.threads)
    device = torch.device(args.device)
    m = machine(device)
    rows = []
    for name in ("cub", "sop") if args.scale == "all" else (args.scale,):
        rows += run_scale(
            name,
            not args.no_pml,
            args.repeats or (3 if name == "cub" else 1),
            device,
            m["fp32_GFLOPs"],
            args.bf16,
            args.breakdown,
        )
    print(
        f"\nmachine: {m['cpu']}, flags {' '.join(m['flags'])}, {m['usable_cores']} cores, torch/faiss threads "
        f"{m['torch_threads']}/{m['faiss_threads']}, fp32 {m['fp32_GFLOPs']} / bf16 {m['bf16_GFLOPs']} GFLOP/s, "
        f"fast bf16 units {'yes' if m['bf16_units'] else 'no'} (bf16 candidates: opt-in, --bf16)"
        f"{', ' + m['gpu'] if 'gpu' in m else ''}"
    )
    print("| scale | metrics | ours s | PML s | ours/PML | k-means objective ours / PML | load |")
    print("| --- | --- | ---: | ---: | ---: | ---: | --- |")
    for name, what, ours, theirs, obj, ld in rows:
        print(f"| {name} | {what} | {ours:.2f} | {theirs:.2f} | {ours / theirs:.2f} | {obj or ''} | {ld} |")


if __name__ == "__main__":
    main()
