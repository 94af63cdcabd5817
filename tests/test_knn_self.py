"""The self-retrieval search (each distance block once) and its bfloat16-candidate variant equal brute force.

Brute force: float64 distances, a stable argsort (ties by the smaller index, the library's contract). The data
have exact ties (small integer coordinates: every distance is exact in float32 and float64), exact duplicates and
near-duplicates (copies moved by 1e-3, far below bfloat16's resolution), and the blocks are small so that many
blocks, partial screening groups and a short last block are exercised.
"""

import numpy as np
import pytest
import torch

from dml_nb.evaluation import faiss_backend as F
from dml_nb.evaluation import neighbours as M
from dml_nb.evaluation.metrics import evaluate, map_at_r, recall_at_k
from dml_nb.evaluation.neighbours import knn

from test_metrics import brute_map_at_r, brute_neighbours, brute_recall


def hard(n=300, dim=8, seed=0):
    """Integer points (exact ties), 20 exact duplicates and 40 near-duplicates (one coordinate moved by 2^-6: every
    distance stays exact in float32, so brute force in float64 is the float32 truth); labels in 12 classes."""
    rng = np.random.default_rng(seed)
    x = rng.integers(-2, 3, (n, dim)).astype(np.float32)
    x[20:40] = x[:20]  # exact duplicates
    x[40:80] = x[100:140]
    x[np.arange(40, 80), rng.integers(0, dim, 40)] += rng.choice([-1, 1], 40) / 64  # near-duplicates
    return x, rng.integers(0, 12, n)


def clustered_unit(n=400, dim=32, classes=40, seed=0):
    """Clustered, nearly unit-norm embeddings on a 2^-10 grid (every float32 distance exact), with near-duplicates
    one grid step apart in one coordinate: distance gaps bfloat16 cannot resolve."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, classes, n)
    c = rng.standard_normal((classes, dim))
    x = c[y] + 0.3 * rng.standard_normal((n, dim))
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    x = np.round(x * 1024) / 1024
    twin = np.arange(0, n - 1, 8)
    x[twin] = x[twin + 1]
    x[twin, rng.integers(0, dim, len(twin))] += rng.choice([-1, 1], len(twin)) / 1024
    return x.astype(np.float32), y


@pytest.mark.parametrize("backend", ["torch", "torch_fp32", "torch_bf16"])
@pytest.mark.parametrize("data", [hard, clustered_unit])
@pytest.mark.parametrize("block", [None, 64, 100])
def test_self_search_equals_brute_force(backend, data, block, monkeypatch):
    if block:
        monkeypatch.setattr(M, "block_rows", lambda n, device: block)
    x, y = data()
    expected = brute_neighbours(x, x, True)
    for k in (1, 5, 23):
        _, idx = knn(torch.from_numpy(x), torch.from_numpy(x), k, exclude_self=True, backend=backend)
        np.testing.assert_array_equal(idx.numpy(), expected[:, :k])
    assert recall_at_k(x, y, backend=backend) == brute_recall(x, y, x, y, (1, 2, 4, 8), True)
    assert map_at_r(x, y, backend=backend) == pytest.approx(brute_map_at_r(x, y, x, y, True), abs=1e-12)


def test_block_search_returns_the_k_smallest_of_each_row():
    x = torch.from_numpy(clustered_unit(n=333)[0])
    d64 = torch.cdist(x.double(), x.double()).pow(2)
    for block in (32, 50, 333):
        vals, idx = M._knn_self(x, 9, block=block)
        torch.testing.assert_close(vals.double(), d64.sort(1).values[:, :9], atol=1e-5, rtol=0)
        torch.testing.assert_close(d64.gather(1, idx), vals.double(), atol=1e-5, rtol=0)


def test_bf16_alone_is_not_exact_but_the_reranking_is():
    "The data defeat a plain bfloat16 search (so the test can fail); re-ranking with the certificate repairs it."
    x = torch.from_numpy(clustered_unit()[0])
    expected = torch.from_numpy(brute_neighbours(x.numpy(), x.numpy(), False)[:, :6])
    _, raw = M._knn_self(x, 6, lowp=True)
    assert not torch.equal(raw, expected)
    _, idx = M._knn_self_lowp(x, 6)
    assert torch.equal(idx, expected)
    _, idx = M._knn_self_lowp(x, 6, extra=0)  # no spare candidates: every row fails the certificate
    assert torch.equal(idx, expected)


def test_the_certificate_margin_is_what_makes_few_candidates_exact(monkeypatch):
    "With one spare candidate the margin decides: the real bound is exact, a zero margin certifies wrong rows."
    x = torch.from_numpy(clustered_unit()[0])
    expected = torch.from_numpy(brute_neighbours(x.numpy(), x.numpy(), False)[:, :6])
    assert torch.equal(M._knn_self_lowp(x, 6, extra=1)[1], expected)
    monkeypatch.setattr(M, "_lowp_margin", lambda x, sq: torch.zeros_like(sq))
    assert not torch.equal(M._knn_self_lowp(x, 6, extra=1)[1], expected)


def test_lowp_margin_bounds_the_bf16_error():
    x = torch.from_numpy(clustered_unit()[0]) * 3
    sq = x.pow(2).sum(1)
    exact = torch.cdist(x.double(), x.double()).pow(2)
    xb = x.bfloat16()
    approx = (sq[:, None] + sq[None] - 2 * torch.mm(xb, xb.T).float()).double()
    assert ((approx - exact).abs() <= M._lowp_margin(x, sq).double()[:, None]).all()


def test_lowp_supported_is_false_on_a_cpu_without_bf16_units(monkeypatch):
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    assert M.lowp_supported("cpu") is False


def test_evaluate_is_the_same_with_every_torch_backend():
    x, y = clustered_unit()
    ref = evaluate(x, y, metrics=("recall@1", "recall@4", "map@r", "r_precision"), knn_backend="faiss_cpu")
    for b in ("torch", "torch_fp32", "torch_bf16"):
        assert evaluate(x, y, metrics=tuple(ref), knn_backend=b) == ref


def test_set_num_threads_sets_torch_and_faiss():
    faiss = pytest.importorskip("faiss")
    n = torch.get_num_threads()
    try:
        F.set_num_threads(1)
        assert torch.get_num_threads() == 1 and faiss.omp_get_max_threads() == 1
    finally:
        F.set_num_threads(n)


@pytest.mark.parametrize("data", [hard, clustered_unit])
def test_bookkeeping_threads_do_not_change_the_neighbours(data, monkeypatch):
    "The screening and merging run on one thread or on all (by idle cores); the result is identical, bit for bit."
    x = torch.from_numpy(data()[0])
    out, n = [], torch.get_num_threads()
    try:
        torch.set_num_threads(2)  # two threads to choose between, even where the default is one
        for idle in (0, 99):
            monkeypatch.setattr(M, "_idle_cores", lambda idle=idle: idle)
            out.append(M._knn_self(x, 7, block=64))
    finally:
        torch.set_num_threads(n)
    assert torch.equal(out[0][0], out[1][0]) and torch.equal(out[0][1], out[1][1])


def test_bookkeeping_threads_follow_idle_cores(monkeypatch):
    n = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        for idle, inside in ((0, 1), (1, 1), (2, 2), (64, 2)):
            monkeypatch.setattr(M, "_idle_cores", lambda idle=idle: idle)
            with M._bookkeeping_threads():
                assert torch.get_num_threads() == inside
            assert torch.get_num_threads() == 2  # restored
    finally:
        torch.set_num_threads(n)


def test_idle_cores_reads_proc_and_is_zero_without_it(monkeypatch):
    import os

    monkeypatch.setattr(M, "_idle_reading", [float("-inf"), 0])  # a cache of its own, restored afterwards
    idle = M._idle_cores(max_age=0)
    assert isinstance(idle, int) and idle <= len(os.sched_getaffinity(0))

    def no_proc(*a, **k):
        raise FileNotFoundError("/proc/loadavg")

    monkeypatch.setattr(M, "open", no_proc, raising=False)  # the module's own `open`, builtins untouched
    assert M._idle_cores(max_age=60) == idle  # a recent reading is reused
    assert M._idle_cores(max_age=0) == 0  # a fresh one: no /proc, nothing counts as idle
