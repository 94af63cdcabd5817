"""Lloyd rounds that recompute only what moved centroids can change give the same k-means as full rounds."""

import numpy as np
import pytest
import torch

from dml_nb.evaluation import clustering as M


def data(n, k, dim, noise, seed):
    rng = np.random.default_rng(seed)
    c = rng.standard_normal((k, dim))
    x = c[rng.integers(0, k, n)] + noise * rng.standard_normal((n, dim))
    x[: n // 10] = x[n // 10 : 2 * (n // 10)]  # exact duplicates: equal distances
    return torch.from_numpy(x.astype(np.float32))


@pytest.mark.parametrize(
    "n,k,dim,noise,runs",
    [
        (600, 10, 8, 0.5, 3),
        (900, 150, 16, 0.3, 2),  # few / many per cluster
        (400, 120, 4, 1.0, 1),
    ],
)  # empty clusters re-seeded
@pytest.mark.parametrize("seed", [0, 1])
def test_reassign_equals_full_rounds(n, k, dim, noise, runs, seed):
    x = data(n, k, dim, noise, seed)
    full = M._lloyd(x, k, 30, runs, torch.Generator().manual_seed(seed), reassign=False)
    fast = M._lloyd(x, k, 30, runs, torch.Generator().manual_seed(seed), reassign=True)
    assert torch.equal(full[0], fast[0]) and torch.equal(full[1], fast[1])  # the same clusters and centroids
    assert fast[2] == pytest.approx(full[2], rel=1e-6)  # distances from differently shaped products: last bits


def test_reassign_skips_work_once_few_centroids_move(monkeypatch):
    "The round after convergence is cheap: most points are compared with the few moved centroids only."
    x = data(3000, 300, 16, 0.2, 0)
    rows = []
    real = M._assign
    monkeypatch.setattr(M, "_assign", lambda x_, *a, **kw: rows.append((len(x_), len(a[1]))) or real(x_, *a, **kw))
    M._lloyd(x, 300, 30, 1, torch.Generator().manual_seed(0))
    full = 3000 * 300
    assert rows[0] == (3000, 300)  # the first assignment is a full pass
    assert sum(r * c for r, c in rows) < 0.9 * full * len([1 for r, c in rows if r == 3000 and c == 300]) + full
    assert any(r * c < full / 2 for r, c in rows)  # some rounds cost less than half a pass
