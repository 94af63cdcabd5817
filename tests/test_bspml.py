"""dml_nb.methods.bspml: the SPL weight sub-problem (objective, exact and stochastic gradients of eq. 8 against autograd and
finite differences, the per-sample terms of either scope and their floor, the stationary-point bound on MAW, the exact
projected-gradient solver and the paper's stochastic Algorithm 3, KKT conditions, the mu = 0 threshold rule, brute
force on tiny problems) and the BSPML recipe (weights looked up by batch index, history fields, flipped mask,
ablations, the age schedule in floor units, exact resume with the SPL state for both solvers)."""

import csv
import itertools
import math

import numpy as np
import pytest
import torch

from dml_nb.methods.bspml import BSPML
from dml_nb.methods.balanced_spl import (
    SOLVERS,
    XI_SCOPES,
    ClassIndex,
    pair_loss_floor,
    projected_gradient_norm,
    sample_terms,
    solve_spl_weights,
    spl_gradient,
    spl_objective,
    spl_stochastic_gradient,
    terms_chunk_rows,
)
from dml_nb.blocks.losses import WeightedMultiSimilarityLoss
from dml_nb.training.learner import eval_view
from dml_nb.data.datasets import add_label_noise, load_dataset, make_transform
from dml_nb.training.callbacks import Callback
from dml_nb.training.learner import Learner
from dml_nb.training.checkpoint import load_checkpoint
from dml_nb.evaluation.metrics import maw_sdaw
from dml_nb.blocks.models import build_backbone
from dml_nb.data.samplers import ClassBalancedBatchSampler

torch.set_num_threads(1)  # tiny tensors: one thread avoids thread-pool overhead on a shared machine
F64 = torch.float64


def problem(sizes=(3, 2, 4, 1, 5), seed=0):
    "Random weights and terms for classes of the given sizes (float64)."
    g = torch.Generator().manual_seed(seed)
    y = torch.cat([torch.full((s,), c) for c, s in enumerate(sizes)])
    perm = torch.randperm(len(y), generator=g)  # classes interleaved, not sorted
    y = y[perm]
    return (
        torch.rand(len(y), generator=g, dtype=F64),
        3 * torch.rand(len(y), generator=g, dtype=F64),
        torch.rand(len(y), generator=g, dtype=F64),
        y,
    )


def synthetic(classes=30, per_class=12, noise=0.2, seed=0):
    g = torch.Generator().manual_seed(seed)
    y = torch.arange(classes).repeat_interleave(per_class)
    flipped = torch.rand(len(y), generator=g) < noise
    xi_pos = 1.3 + 0.2 * torch.randn(len(y), generator=g, dtype=F64) + 0.6 * flipped
    xi_neg = 0.05 + 0.02 * torch.rand(len(y), generator=g, dtype=F64) + 0.1 * flipped
    return xi_pos, xi_neg, y, flipped


def objective_by_loops(w, xp, xn, y, lam, mu):
    "Eq. 6 (negative term with class mean weights) written out with Python loops, straight from the formula."
    classes = sorted(set(y.tolist()))
    C = len(classes)
    members = {c: [i for i in range(len(y)) if int(y[i]) == c] for c in classes}
    zeta = {c: sum(float(w[i]) for i in members[c]) for c in classes}
    N = {c: len(members[c]) for c in classes}
    total = 0.0
    for c in classes:
        for a in members[c]:
            pos = (zeta[c] - float(w[a])) / (N[c] - 1) * float(xp[a]) if N[c] > 1 else 0.0
            neg = sum(zeta[k] / N[k] for k in classes if k != c) / (C - 1) * float(xn[a])
            total += float(w[a]) / N[c] * (pos + neg)
    total -= lam * sum(zeta[c] / N[c] for c in classes)
    total += mu / (C - 1) * sum((zeta[c] / N[c] - zeta[k] / N[k]) ** 2 for c, k in itertools.combinations(classes, 2))
    return total


# ---------------------------------------------------------------------------------------------- the math
@pytest.mark.parametrize("lam,mu", [(1.3, 0.0), (0.5, 2.0), (3.0, 0.7)])
def test_objective_matches_formula_and_gradient_matches_autograd(lam, mu):
    w, xp, xn, y = problem()
    assert spl_objective(w, xp, xn, y, lam, mu).item() == pytest.approx(
        objective_by_loops(w, xp, xn, y, lam, mu), rel=1e-12
    )
    wg = w.clone().requires_grad_()
    (auto,) = torch.autograd.grad(spl_objective(wg, xp, xn, y, lam, mu), wg)
    torch.testing.assert_close(spl_gradient(w, xp, xn, y, lam, mu), auto, rtol=1e-10, atol=1e-12)
    # a precomputed ClassIndex gives the same
    torch.testing.assert_close(spl_gradient(w, xp, xn, ClassIndex(y), lam, mu), auto, rtol=1e-10, atol=1e-12)
    # central finite differences of the objective (a quadratic: exact up to rounding)
    h, E = 1e-5, torch.eye(len(w), dtype=F64)
    fd = torch.stack(
        [
            (spl_objective(w + h * e, xp, xn, y, lam, mu) - spl_objective(w - h * e, xp, xn, y, lam, mu)) / (2 * h)
            for e in E
        ]
    )
    torch.testing.assert_close(spl_gradient(w, xp, xn, y, lam, mu), fd, rtol=1e-7, atol=1e-9)


def test_gradient_is_eq8_with_full_sums():
    "Eq. 8 term by term (G_p, G_n, G_b, lambda) for one coordinate, with every partner instead of samples."
    w, xp, xn, y = problem(seed=3)
    lam, mu, a = 0.9, 1.5, 4
    c = int(y[a])
    classes = sorted(set(y.tolist()))
    same = [p for p in range(len(y)) if int(y[p]) == c and p != a]
    g_p = sum(float(w[p] * (xp[p] + xp[a])) for p in same) / max(len(same), 1)
    others = [k for k in classes if k != c]
    g_n = sum(
        sum(float(w[n] * (xn[n] + xn[a])) for n in range(len(y)) if int(y[n]) == k) / int((y == k).sum())
        for k in others
    ) / len(others)
    mean = {k: float(w[y == k].mean()) for k in classes}
    g_b = 2 * mu * (mean[c] - sum(mean[k] for k in others) / len(others))
    expected = (g_p + g_n + g_b - lam) / int((y == c).sum())
    assert spl_gradient(w, xp, xn, y, lam, mu)[a].item() == pytest.approx(expected, rel=1e-12)


def test_stochastic_gradient_is_unbiased_and_deterministic():
    w, xp, xn, y = problem(sizes=(3, 2, 4, 1, 5), seed=1)
    reps, n = 20000, len(y)
    idx = torch.arange(n).repeat(reps)
    G = spl_stochastic_gradient(w, idx, xp, xn, y, 1.1, 0.4, P=2, K=3, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(G.view(reps, n).mean(0), spl_gradient(w, xp, xn, y, 1.1, 0.4), rtol=0, atol=5e-3)
    G2 = spl_stochastic_gradient(w, idx, xp, xn, y, 1.1, 0.4, P=2, K=3, generator=torch.Generator().manual_seed(0))
    assert torch.equal(G, G2)


def test_stochastic_gradient_samples_valid_partners():
    "K class mates never include the anchor; the P classes never include the anchor's class."
    y = torch.tensor([0, 0, 1, 1, 1, 2, 2])
    xp = torch.zeros(7, dtype=F64)
    for a in range(7):
        # xi_pos marks the anchor only: a partner equal to the anchor would add xp[a] twice
        xp_a = xp.clone()
        xp_a[a] = 1.0
        w = torch.ones(7, dtype=F64)
        G = spl_stochastic_gradient(
            w,
            torch.tensor([a] * 500),
            xp_a,
            torch.zeros(7, dtype=F64),
            y,
            0.0,
            0.0,
            P=3,
            K=4,
            generator=torch.Generator().manual_seed(a),
        )
        n_c = int((y == y[a]).sum())
        torch.testing.assert_close(G, torch.full((500,), 1.0 / n_c, dtype=F64))  # G_p = mean(w_p (0 + 1)) = 1
        xn_a = torch.zeros(7, dtype=F64)
        xn_a[y == y[a]] = 5.0
        xn_a[a] = 0.0
        G = spl_stochastic_gradient(
            w,
            torch.tensor([a] * 500),
            torch.zeros(7, dtype=F64),
            xn_a,
            y,
            0.0,
            0.0,
            P=3,
            K=4,
            generator=torch.Generator().manual_seed(a),
        )
        torch.testing.assert_close(G, torch.zeros(500, dtype=F64))  # no sample of class c drawn


def test_bad_input_errors():
    w, xp, xn, y = problem()
    with pytest.raises(ValueError, match="at least two classes"):
        spl_objective(w, xp, xn, torch.zeros_like(y), 1.0)
    with pytest.raises(ValueError, match="one value per sample"):
        spl_gradient(w[:-1], xp, xn, y, 1.0)
    with pytest.raises(ValueError, match="NaN"):
        solve_spl_weights(xp * float("nan"), xn, y, 1.0)
    # the block / sampling options belong to the stochastic solver (no longer the default: solver="exact")
    with pytest.raises(ValueError, match="both None"):
        solve_spl_weights(xp, xn, y, 1.0, solver="stochastic", P=None, K=4)
    with pytest.raises(ValueError, match="block"):
        solve_spl_weights(xp, xn, y, 1.0, solver="stochastic", block=0.0)
    with pytest.raises(ValueError, match="Valid solvers"):
        solve_spl_weights(xp, xn, y, 1.0, solver="newton")
    with pytest.raises(ValueError, match="tol"):
        solve_spl_weights(xp, xn, y, 1.0, tol=-1.0)


# ---------------------------------------------------------------------------------------------- the terms
def embedded(n=90, classes=9, dim=8, seed=0):
    "Random embeddings around class centres, every class present, plus one class of a single sample."
    g = torch.Generator().manual_seed(seed)
    y = torch.cat(
        [torch.arange(classes), torch.randint(0, classes, (n - classes - 1,), generator=g), torch.tensor([classes])]
    )
    return torch.randn(n, dim, generator=g) + 1.5 * torch.randn(classes + 1, dim, generator=g)[y], y


@pytest.mark.parametrize("mine", [False, True])
def test_class_terms_match_the_loss_for_any_chunk(mine):
    e, y = embedded()
    ref = WeightedMultiSimilarityLoss().per_sample_terms(e, y, mine=mine)
    for rows in (1, 5, 64, None):
        got = sample_terms(e, y, mine=mine, chunk_rows=rows)
        for a, b in zip(got, ref):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_batch_terms_are_the_scaled_sums():
    e, y = embedded(seed=1)
    P, K = 3, 4
    xp, xn = sample_terms(e, y, scope="batch", batch=(P, K), chunk_rows=7)
    x = torch.nn.functional.normalize(e, dim=1).double()
    S = x @ x.T
    for a in range(len(y)):
        same = y == y[a]
        pos = same.clone()
        pos[a] = False
        sp = torch.exp(-2 * (S[a][pos] - 1)).sum() * (K - 1) / max(int(pos.sum()), 1)
        sn = torch.exp(50 * (S[a][~same] - 1)).sum() * (P - 1) * K / int((~same).sum())
        assert xp[a].item() == pytest.approx(math.log1p(sp) / 2, rel=1e-5, abs=1e-6)
        assert xn[a].item() == pytest.approx(math.log1p(sn) / 50, rel=1e-4, abs=1e-9)
    # with as many positives as the batch has (N^c = K, P = C), the two scopes agree on xi+
    y4 = torch.arange(5).repeat_interleave(4)
    e4 = torch.randn(20, 8, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(sample_terms(e4, y4, scope="batch", batch=(5, 4))[0], sample_terms(e4, y4)[0])
    with pytest.raises(ValueError, match="Valid xi_scopes"):
        sample_terms(e, y, scope="episode")
    with pytest.raises(ValueError, match="P >= 2"):
        sample_terms(e, y, scope="batch", batch=(16, 1))


@pytest.mark.parametrize("scope", XI_SCOPES)
def test_pair_loss_floor_bounds_the_pair_loss_and_is_reached_by_a_collapsed_class(scope):
    e, y = embedded(seed=3)
    F_a = pair_loss_floor(y, scope=scope)
    n_c = torch.bincount(y)[y].double()
    expected = n_c.log() if scope == "class" else torch.full_like(n_c, math.log(4))
    expected[n_c == 1] = 0.0
    torch.testing.assert_close(F_a, expected)  # alpha 2, rho 1: log N^c or log K
    xp, xn = (t.double() for t in sample_terms(e, y, scope=scope))
    ell = spl_gradient(torch.ones(len(y), dtype=F64), xp, xn, y, 0.0, 0.0) * n_c
    assert (ell >= F_a - 1e-6).all()
    centres = torch.nn.functional.normalize(torch.randn(10, 8, generator=torch.Generator().manual_seed(4)), dim=1)
    xp, _ = sample_terms(centres[y], y, scope=scope, beta=1e3)
    torch.testing.assert_close(2 * xp.double(), F_a, rtol=1e-5, atol=1e-5)  # every class one point: xi+ = F / 2
    # rho < 1: each positive term is at least exp(-alpha (1 - rho))
    torch.testing.assert_close(
        pair_loss_floor(y, alpha=2.0, rho=0.5, scope=scope), torch.log1p((F_a.exp() - 1) * math.exp(-1.0))
    )


def test_chunk_rows_follow_the_memory_budget():
    n = 60000
    rows = terms_chunk_rows(n, "cpu")
    assert 1 <= rows and 3 * 4 * n * rows <= (512 << 20)  # the CPU cap: 512 MiB of buffers
    assert terms_chunk_rows(n, "cpu", cpu_cap=3 * 4 * n * 10) == 10
    assert terms_chunk_rows(10, "cpu") == 10


# ---------------------------------------------------------------------------------------------- the solver
def kkt_violation(w, g, tol=1e-6):
    "Largest violation of the box KKT conditions: w=0 needs g>=0, w=1 needs g<=0, 0<w<1 needs g=0."
    lo, hi = w <= tol, w >= 1 - tol
    mid = ~(lo | hi)
    return float(torch.cat([(-g[lo]).clamp_min(0), g[hi].clamp_min(0), g[mid].abs(), g.new_zeros(1)]).max())


@pytest.mark.parametrize("solver", SOLVERS)
@pytest.mark.parametrize("lam,mu", [(2.0, 0.0), (2.0, 2.0), (1.0, 1.0)])
def test_solver_box_decrease_stationarity_and_denoising(solver, lam, mu):
    xp, xn, y, flipped = synthetic()
    ones = torch.ones(len(y), dtype=F64)
    w, info = solve_spl_weights(
        xp, xn, y, lam, mu, solver=solver, generator=torch.Generator().manual_seed(0), return_info=True
    )
    assert w.dtype == F64 and ((w >= 0) & (w <= 1)).all()
    assert spl_objective(w, xp, xn, y, lam, mu) < spl_objective(ones, xp, xn, y, lam, mu)
    pg0, pg = projected_gradient_norm(ones, xp, xn, y, lam, mu), projected_gradient_norm(w, xp, xn, y, lam, mu)
    assert info["pg"] == pytest.approx(pg, rel=1e-12, abs=1e-15)
    assert info["objective"] == pytest.approx(spl_objective(w, xp, xn, y, lam, mu).item(), rel=1e-12)
    if solver == "exact":  # stops on the projected gradient
        assert pg <= 1e-6 and info["converged"] and info["iters"] < 10000
        assert kkt_violation(w, 12 * spl_gradient(w, xp, xn, y, lam, mu)) < 1e-4
    else:
        assert pg < 0.1 * pg0 and info["iters"] == 1000, (pg0, pg)
    assert w[flipped].mean() < 0.5 * w[~flipped].mean()


def test_exact_solver_beats_the_stochastic_one_at_the_same_problem():
    "Issue 12: the paper's stochastic block method stops short; the exact one reaches a stationary point, lower objective."
    g = torch.Generator().manual_seed(0)
    y = torch.arange(40).repeat_interleave(25)
    flipped = torch.rand(len(y), generator=g) < 0.2
    xp = 0.5 * math.log(25) + 0.3 + 0.1 * torch.rand(len(y), generator=g, dtype=F64) + 0.4 * flipped
    xn = 0.01 * torch.rand(len(y), generator=g, dtype=F64)
    lam = 3.2
    ws, si = solve_spl_weights(
        xp, xn, y, lam, lam, solver="stochastic", generator=torch.Generator().manual_seed(0), return_info=True
    )
    we, ei = solve_spl_weights(xp, xn, y, lam, lam, return_info=True)
    assert ei["pg"] <= 1e-6 < 1e-3 < si["pg"] and ei["objective"] < si["objective"]
    assert we[flipped].mean() < ws[flipped].mean() and we[~flipped].mean() > 0.9
    assert (
        ((we > 0) & (we < 1)).double().mean() < 0.05 < 0.3 < ((ws > 0) & (ws < 1)).double().mean()
    )  # vertices vs stuck inside


@pytest.mark.parametrize("mu", [0.0, 3.0])
@pytest.mark.parametrize("scope", XI_SCOPES)
def test_maw_bound_at_stationary_points(scope, mu):
    "At a stationary point, max_c mean weight <= max_c (lambda / F_c + 1 / N^c): the age is measured against the floor."
    e, y = embedded(n=400, classes=20, seed=5)
    xp, xn = (t.double() for t in sample_terms(e, y, scope=scope))
    F_a, n_c = pair_loss_floor(y, scope=scope), torch.bincount(y)[y].double()
    for lam in (0.3, 0.6, 1.0, 1.5):
        w = solve_spl_weights(xp, xn, y, lam, mu)
        means = torch.zeros(int(y.max()) + 1, dtype=F64).index_add_(0, y, w) / torch.bincount(y).double()
        bound = (lam / F_a[F_a > 0] + 1 / n_c[F_a > 0]).max()
        assert means[torch.bincount(y) > 1].max() <= bound + 1e-9, (lam, float(means.max()), float(bound))


def test_solver_is_deterministic_and_clips_the_start():
    xp, xn, y, _ = synthetic(classes=5, per_class=6)
    w0 = torch.linspace(-1, 2, len(y), dtype=F64)
    a = solve_spl_weights(xp, xn, y, 2.0, 1.0, w0=w0, iters=50, generator=torch.Generator().manual_seed(3))
    b = solve_spl_weights(xp, xn, y, 2.0, 1.0, w0=w0, iters=50, generator=torch.Generator().manual_seed(3))
    assert torch.equal(a, b) and ((a >= 0) & (a <= 1)).all()
    torch.testing.assert_close(solve_spl_weights(xp, xn, y, 2.0, 1.0, w0=w0, iters=0), w0.clamp(0, 1))
    assert torch.equal(w0, torch.linspace(-1, 2, len(y), dtype=F64))  # the start is not modified


def test_mu0_threshold_rule():
    "mu = 0: the result is w_a = 1[l_a(w) < lambda], l_a = N^c dL/dw_a + lambda (independent of w_a itself)."
    xp, xn, y, _ = synthetic(seed=2)
    lam = 2.0
    w = solve_spl_weights(xp, xn, y, lam, 0.0)
    ell = spl_gradient(w, xp, xn, y, lam, 0.0) * 12 + lam
    clear = (ell - lam).abs() > 0.05
    assert clear.float().mean() > 0.9
    assert torch.equal(w[clear], (ell[clear] < lam).to(F64))
    # l_a does not depend on w_a: changing only w_a leaves its own l_a unchanged
    w2 = w.clone()
    w2[0] = 1 - w2[0]
    assert (spl_gradient(w2, xp, xn, y, lam, 0.0)[0] * 12 + lam).item() == pytest.approx(ell[0].item(), rel=1e-12)


def test_mu0_lambda_above_all_losses_keeps_every_sample():
    "The classic SPL limit: if lambda exceeds every l_a(1), w = 1 is stationary and nothing is excluded."
    xp, xn, y, _ = synthetic(seed=4)
    ell1 = spl_gradient(torch.ones(len(y), dtype=F64), xp, xn, y, 0.0, 0.0) * 12
    for solver in SOLVERS:
        w = solve_spl_weights(
            xp, xn, y, float(ell1.max()) + 0.5, 0.0, solver=solver, generator=torch.Generator().manual_seed(0)
        )
        assert torch.equal(w, torch.ones_like(w))


def test_mu0_brute_force_over_vertices():
    "A multilinear objective attains its minimum over the box at a vertex: enumerate all 2^8."
    y = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    xp = torch.tensor([0.4, 0.5, 0.45, 3.0, 0.5, 0.4, 2.5, 0.6], dtype=F64)
    xn = torch.tensor([0.01, 0.02, 0.01, 0.5, 0.02, 0.01, 0.4, 0.02], dtype=F64)
    verts = torch.tensor(list(itertools.product([0.0, 1.0], repeat=8)), dtype=F64)
    vals = torch.stack([spl_objective(v, xp, xn, y, 2.0) for v in verts])
    for opts in (dict(solver="exact"), dict(solver="stochastic", P=None, K=None), dict(solver="stochastic", P=1, K=3)):
        w = solve_spl_weights(xp, xn, y, 2.0, iters=400, block=0.25, generator=torch.Generator().manual_seed(0), **opts)
        assert spl_objective(w, xp, xn, y, 2.0).item() == pytest.approx(vals.min().item(), abs=1e-6)
        assert torch.equal(w.round(), verts[vals.argmin()])


def test_mu_positive_brute_force_on_a_grid():
    """mu > 0, 2 classes x 3. The objective is non-convex (the within-class products w_a w_p), so the solver finds a
    stationary point; started at the grid's global minimum it stays there (up to the grid step), and from w = 1
    it reaches a stationary point with a lower objective."""
    y = torch.tensor([0, 0, 0, 1, 1, 1])
    xp = torch.tensor([0.5, 0.6, 2.4, 0.5, 0.7, 0.6], dtype=F64)
    xn = torch.tensor([0.02, 0.01, 0.3, 0.02, 0.01, 0.02], dtype=F64)
    for lam, mu in [(1.5, 1.5), (0.3, 20.0)]:
        f = lambda w: spl_objective(w, xp, xn, y, lam, mu)
        Q = torch.autograd.functional.hessian(f, torch.zeros(6, dtype=F64))
        b = spl_gradient(torch.zeros(6, dtype=F64), xp, xn, y, lam, mu)
        g = torch.linspace(0, 1, 11, dtype=F64)
        W = torch.cartesian_prod(*[g] * 6)
        vals = 0.5 * ((W @ Q) * W).sum(1) + W @ b  # f(0) = 0: f is this quadratic
        w_star = W[vals.argmin()]
        torch.testing.assert_close(f(w_star), vals.min())
        for opts in (
            dict(solver="exact", tol=1e-9),
            dict(
                solver="stochastic",
                iters=2000,
                block=1 / 6,
                step_decay=0.0,
                P=None,
                K=None,
                generator=torch.Generator().manual_seed(0),
            ),
        ):
            w = solve_spl_weights(xp, xn, y, lam, mu, w0=w_star, **opts)
            assert f(w).item() <= vals.min().item() + 1e-9 and (w - w_star).abs().max() <= 0.1 + 1e-9
            assert projected_gradient_norm(w, xp, xn, y, lam, mu) < 1e-6
            w1 = solve_spl_weights(xp, xn, y, lam, mu, **opts)
            assert projected_gradient_norm(w1, xp, xn, y, lam, mu) < 1e-6
            assert f(w1) < f(torch.ones(6, dtype=F64))
            assert w1[2] == 0.0  # the outlier of class 0 is excluded


def test_balance_term_reduces_sdaw():
    "Paper Fig. 4: the larger mu, the more balanced the classes' mean weights (smaller SDAW)."
    g = torch.Generator().manual_seed(0)
    y = torch.arange(20).repeat_interleave(10)
    hard = (torch.arange(20) < 10).repeat_interleave(10)  # half the classes are harder overall
    xp = 1.2 + 0.2 * torch.rand(200, generator=g, dtype=F64) + 0.5 * hard
    xn = 0.05 + 0.02 * torch.rand(200, generator=g, dtype=F64)
    sd = [
        maw_sdaw(solve_spl_weights(xp, xn, y, 2.5, mu, P=None, K=None, generator=torch.Generator().manual_seed(0)), y)[
            1
        ]
        for mu in (0.0, 2.0, 10.0)
    ]
    assert sd[0] > sd[1] > sd[2], sd


# ---------------------------------------------------------------------------------------------- the recipe
@pytest.fixture(scope="module")
def noisy():
    ds = load_dataset("shapes", split="train", images_per_class=4)
    ds.labels, ds.flipped = add_label_noise(ds.labels, 0.25, seed=0)
    return ds


def method(labels, seed=0, **kw):
    torch.manual_seed(seed)
    return BSPML(
        build_backbone("small_cnn", width=4, feature_dim=16),
        num_classes=int(labels.max()) + 1,
        train_labels=labels,
        embedding_dim=8,
        **{"solver_iters": 100, **kw},
    )


def learner(ds, run_dir=None, epochs=2, steps=3, callbacks=(), m=None, **kw):
    sampler = ClassBalancedBatchSampler(ds.labels, batch_size=16, samples_per_class=4, seed=1, batches_per_epoch=steps)
    return Learner(
        m if m is not None else method(ds.labels, **kw),
        ds,
        sampler,
        epochs=epochs,
        lr=3e-3,
        run_dir=run_dir,
        callbacks=callbacks,
        progress=False,
        seed=5,
        checkpoint_every_steps=1,
    )


def test_registered():
    from dml_nb.core.registry import METHODS

    try:
        cls = METHODS.get("bspml")
    except ModuleNotFoundError as e:  # METHODS imports every recipe module; another one may not exist yet
        pytest.skip(f"METHODS cannot load all recipe modules yet: {e}")
    assert cls is BSPML
    with pytest.raises(TypeError, match="no option 'lambda0'"):
        METHODS.build(
            "bspml",
            backbone=build_backbone("small_cnn", width=4),
            num_classes=2,
            train_labels=np.array([0, 1]),
            lambda0=1.0,
        )


def test_option_errors():
    lab = np.repeat(np.arange(3), 2)
    with pytest.raises(ValueError, match="leave mu unset"):
        method(lab, balance=False, mu=1.0)
    with pytest.raises(ValueError, match="lambda_init <= lambda_inf"):
        method(lab, lambda_init=4.0)
    with pytest.raises(ValueError, match="c \\(the age multiplier\\)"):
        method(lab, c=0.5)
    with pytest.raises(ValueError, match="update_every"):
        method(lab, update_every=0)
    with pytest.raises(ValueError, match="Valid terms_transforms"):
        method(lab, terms_transform="eval")
    with pytest.raises(ValueError, match="0..num_classes-1"):
        BSPML(build_backbone("small_cnn", width=4), num_classes=2, train_labels=lab)
    with pytest.raises(ValueError, match="one entry per training sample"):
        method(lab, flipped=[True, False])
    with pytest.raises(ValueError, match="pass train_labels"):
        BSPML(build_backbone("small_cnn", width=4), num_classes=3)
    with pytest.raises(ValueError, match="Valid xi_scopes"):
        method(lab, xi_scope="all")
    with pytest.raises(ValueError, match="Valid lambda_units"):
        method(lab, lambda_unit="loss")
    with pytest.raises(ValueError, match="Valid solvers"):
        method(lab, solver="sgd")
    with pytest.raises(ValueError, match="xi_batch"):
        method(lab, xi_batch=(16, 1))
    with pytest.raises(ValueError, match="solver_tol"):
        method(lab, solver_tol=-1.0)
    # defaults changed (issue 12): the age in units of the pair-loss floor, lambda0 = 0.5 floor -> lambda_inf = floor,
    # mu = lambda_inf; classes of 2 samples: floor = log 2 (was: lambda0 = 1, lambda_inf = mu = 3 absolute)
    m = method(lab)
    assert m.floor == pytest.approx(math.log(2)) and (m.xi_scope, m.lambda_unit, m.solver["solver"]) == (
        "class",
        "floor",
        "exact",
    )
    assert (m.lambda_init, m.lambda_inf, m.mu, m.c) == pytest.approx((0.5 * math.log(2), math.log(2), math.log(2), 1.2))
    assert float(m.age) == pytest.approx(0.5 * math.log(2))
    assert method(lab, xi_scope="batch").floor == pytest.approx(math.log(4))  # K = 4 of xi_batch (16, 4)
    a = method(lab, lambda_unit="absolute", lambda_init=1.0, lambda_inf=3.0)
    assert (a.lambda_init, a.lambda_inf, a.mu) == (1.0, 3.0, 3.0)
    assert method(lab, mu=1.0).mu == 1.0 and method(lab, balance=False).mu == 0.0
    BSPML(build_backbone("small_cnn", width=4), num_classes=3, spl=False)  # plain MS needs no labels


def test_training_step_uses_weights_by_index():
    lab = np.repeat(np.arange(4), 4)
    m = method(lab)
    m.weights.copy_(torch.arange(16) / 15)
    x = torch.randn(6, 3, 32, 32)
    y = torch.tensor([0, 0, 1, 1, 2, 2])
    index = torch.tensor([1, 0, 5, 4, 9, 8])
    m.eval()  # same outputs on both passes
    out = m.training_step({"x": x, "y": y, "index": index})
    emb = m.model(x)
    pairs = m.miner(emb, y)
    torch.testing.assert_close(out["loss"], m.loss(emb, y, pairs, weights=m.weights[index]))
    assert not torch.allclose(out["loss"], m.loss(emb, y, pairs, weights=m.weights[:6]))
    # samples with weight 0 get no gradient as anchors and carry no weight as partners: all zero -> zero loss
    m.weights.zero_()
    assert m.training_step({"x": x, "y": y, "index": index})["loss"].item() == 0.0


def test_history_fields_flipped_from_dataset_and_schedule(noisy, tmp_path):
    L = learner(noisy, tmp_path, epochs=3, lambda_unit="absolute", lambda_init=1.0, c=2.0, lambda_inf=3.0)
    hist = L.fit()
    rows = list(csv.DictReader(open(tmp_path / "history.csv")))
    for k in (
        "lambda",
        "maw",
        "sdaw",
        "w_zero",
        "w_clean",
        "w_flipped",
        "spl_objective",
        "spl_pg",
        "spl_iters",
        "batch_weight",
    ):
        assert k in rows[0], k
    assert [r["lambda"] for r in hist] == [1.0, 2.0, 3.0]
    assert float(L.method.age) == 3.0 and int(L.method.updates) == 3
    w, f = L.method.weights, torch.as_tensor(noisy.flipped)
    maw, sdaw = maw_sdaw(w, noisy.labels)
    assert hist[-1]["maw"] == pytest.approx(maw) and hist[-1]["sdaw"] == pytest.approx(sdaw)
    assert hist[-1]["w_flipped"] == pytest.approx(float(w[f].mean()))
    assert hist[-1]["w_clean"] == pytest.approx(float(w[~f].mean()))
    assert hist[0]["batch_weight"] == 1.0  # the first epoch trains with w = 1


def test_flipped_option_update_every_and_ablations(noisy):
    flipped = np.zeros(len(noisy), dtype=bool)
    flipped[:3] = True
    L = learner(noisy, epochs=2, flipped=flipped, update_every=2)
    hist = L.fit()
    assert (
        np.isnan(hist[0]["lambda"])
        and hist[1]["lambda"] == pytest.approx(0.5 * L.method.floor)
        and int(L.method.updates) == 1
    )
    assert hist[0]["maw"] == 1.0  # no update after epoch 1
    assert hist[1]["w_flipped"] == pytest.approx(float(L.method.weights[:3].mean()))
    ms = learner(noisy, epochs=1, spl=False).fit()
    assert (ms[-1]["maw"], ms[-1]["sdaw"], ms[-1]["w_clean"], ms[-1]["w_flipped"]) == (1.0, 0.0, 1.0, 1.0)
    spms = learner(noisy, epochs=1, balance=False)
    spms.fit()
    assert spms.method.mu == 0.0 and int(spms.method.updates) == 1


def test_labels_must_match_the_training_set(noisy):
    other = noisy.labels.copy()
    other[0] = (other[0] + 1) % 60
    with pytest.raises(ValueError, match="differ from the training set's labels"):
        learner(noisy, epochs=1, m=method(other)).fit()
    with pytest.raises(ValueError, match="train_labels but the training set has"):
        learner(noisy, epochs=1, m=method(noisy.labels[:-4])).fit()


def test_terms_use_test_transforms_and_the_current_model(noisy):
    L = learner(noisy, epochs=1)
    L.prepare_fit()
    L.method.before_fit(L.context)
    view = L.method.terms_dataset
    clean_view = load_dataset("shapes", split="train", images_per_class=4, augment=False)
    assert torch.equal(view[5][0], clean_view[5][0]) and view.labels is noisy.labels
    xp, xn = L.method.per_sample_terms(L.context)
    emb, _ = L.embed(clean_view)
    ref = L.method.loss.per_sample_terms(emb["embedding"], torch.as_tensor(noisy.labels))
    torch.testing.assert_close((xp, xn), ref)
    Lb = learner(noisy, epochs=1, xi_scope="batch", xi_batch=(4, 3))  # the batch reading reaches the update
    Lb.prepare_fit()
    Lb.method.before_fit(Lb.context)
    torch.testing.assert_close(
        Lb.method.per_sample_terms(Lb.context),
        sample_terms(Lb.embed(clean_view)[0]["embedding"], torch.as_tensor(noisy.labels), scope="batch", batch=(4, 3)),
    )


def test_test_view_for_imagenet_presets():
    from dml_nb.data.datasets import ArrayDataset

    imgs = np.random.default_rng(0).integers(0, 255, (3, 80, 80, 3), dtype=np.uint8)
    ds = ArrayDataset(imgs, np.array([0, 1, 1]), transform=make_transform("resnet50", train=True, size=64))
    ref = make_transform("resnet50", train=False, size=64)
    assert torch.equal(eval_view(ds)[1][0], ref(ds.load(1)))
    ds.transform = lambda x: x.float()  # no random op: used as it is
    assert eval_view(ds) is ds
    from torchvision.transforms import v2

    ds.transform = v2.Compose([v2.RandomHorizontalFlip()])
    with pytest.raises(ValueError, match="train_eval_ds"):
        eval_view(ds)


class KillAt(Callback):
    def __init__(self, epoch, step):
        self.at = (epoch, step)

    def after_step(self, learner, logs):
        if (learner.epoch, learner.step) == self.at:
            raise KeyboardInterrupt("killed")


@pytest.mark.parametrize("kill,solver", [((1, 2), "exact"), ((2, 1), "exact"), ((1, 2), "stochastic")])
def test_resume_is_exact_with_spl_state(noisy, tmp_path, kill, solver):
    ref = learner(noisy, tmp_path / "ref", epochs=3, solver=solver)
    ref_hist = ref.fit()
    d = tmp_path / "killed"
    with pytest.raises(KeyboardInterrupt):
        learner(noisy, d, epochs=3, solver=solver, callbacks=[KillAt(*kill)]).fit()
    ck = load_checkpoint(d / "checkpoint.pt")
    assert (ck["epoch"], ck["step"]) == (kill[0], kill[1] - 1)  # the kill comes before that step's checkpoint
    assert int(ck["method"]["updates"]) == kill[0]  # the SPL state is in the checkpoint
    assert not torch.equal(ck["method"]["weights"], torch.ones_like(ck["method"]["weights"]))
    res = learner(noisy, d, epochs=3, solver=solver)
    res_hist = res.fit()
    assert res.resumed
    sd_ref, sd_res = ref.method.state_dict(), res.method.state_dict()
    assert sd_ref.keys() == sd_res.keys()
    for k in sd_ref:
        assert torch.equal(sd_ref[k], sd_res[k]), k
    drop = lambda h: [{k: v for k, v in r.items() if k != "time"} for r in h]
    assert drop(res_hist) == drop(ref_hist)


def test_named_readings_of_the_age_and_solver():
    "dml_nb's reading (the defaults) and the paper text's (absolute age, Algorithm 3) are named presets that build."
    from dml_nb.methods.bspml import BSPML_DML_NB, BSPML_PAPER_TEXT
    from dml_nb.blocks.models import build_backbone

    from dml_nb.methods.options import BSPMLOptions

    assert {k: getattr(BSPMLOptions(), k) for k in BSPML_DML_NB} == BSPML_DML_NB  # the defaults
    labels = np.repeat(np.arange(6), 10)
    floor = BSPML(build_backbone("small_cnn", width=4, feature_dim=16), 6, labels, embedding_dim=8, **BSPML_DML_NB)
    paper = BSPML(build_backbone("small_cnn", width=4, feature_dim=16), 6, labels, embedding_dim=8, **BSPML_PAPER_TEXT)
    np.testing.assert_allclose((floor.lambda_init, floor.lambda_inf), (0.5 * np.log(10), np.log(10)))  # floor = log N^c
    assert (paper.lambda_init, paper.lambda_inf, paper.solver["solver"]) == (1.0, 3.0, "stochastic")
    assert (
        1 <= BSPML_PAPER_TEXT["lambda_inf"] <= 5 and paper.mu == paper.lambda_inf
    )  # the paper: [1, 5], mu = lambda_inf


def test_paper_readings_are_named_presets_that_resolve_to_their_options():
    "method.preset gives the reading's options (the file's own win); the same options written out are the same run."
    from dml_nb.core.base import config_hash
    from dml_nb.core.registry import PRESETS
    from dml_nb.core.config import ConfigError, config_to_dict, make_config
    from dml_nb.methods.bspml import BSPML_DML_NB, BSPML_PAPER_TEXT

    assert (
        PRESETS.options("bspml", "dml_nb") == BSPML_DML_NB
        and PRESETS.options("bspml", "paper_text") == BSPML_PAPER_TEXT
    )
    for method in ("bspml", "sharing"):
        for name in PRESETS.names(method):
            named = make_config({"method": {"name": method, "preset": name}})
            spelled = make_config({"method": {"name": method, **PRESETS.options(method, name)}})
            assert config_hash(config_to_dict(named)) == config_hash(config_to_dict(spelled)), (method, name)
    cfg = make_config({"method": {"name": "bspml", "preset": "paper_text", "lambda_inf": 2.0}})
    assert cfg.method.options == {**BSPML_PAPER_TEXT, "lambda_inf": 2.0}
    with pytest.raises(ConfigError, match="Did you mean 'paper_text'"):
        make_config({"method": {"name": "bspml", "preset": "paper_txt"}})
