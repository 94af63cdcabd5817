"""Tests for dml_nb.blocks.proxy_nce: agreement with pytorch-metric-learning (PML, a dev-only reference), float64
gradient checks, DaNCE against an independent loop implementation of DiVA eq. 6, and edge cases.

Intended differences from PML (not tested as equalities):
* ProxyNCALoss defaults to the paper's denominator without the positive proxy (`include_positive=False`);
  PML always includes it, so the comparison uses `include_positive=True`. PML also silently drops samples
  whose softmax probability underflows to exactly 0; we keep them (their loss is large, not infinite).
* InfoNCELoss counts a negative pair mined twice once; PML counts it twice. PML also returns 0 whenever
  there is at most one positive and at most one negative pair (`len(x) <= 1`); we compute the loss.
"""

from __future__ import annotations
import math

import pytest
import torch
import torch.nn.functional as F
from torch.autograd import gradcheck
from torch.func import functional_call

from dml_nb.blocks.decorrelation import Decorrelation
from dml_nb.blocks.heads import grad_reverse
from dml_nb.blocks.proxy_nce import DaNCELoss, InfoNCELoss, ProxyAnchorLoss, ProxyNCALoss, QueueNCELoss

pml_losses = pytest.importorskip("pytorch_metric_learning.losses")


def _batch(n=24, dim=8, num_classes=5, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim, generator=g, dtype=dtype)
    y = torch.randint(0, num_classes, (n,), generator=g)
    return x, y


def _grads(loss_fn, x, params=()):
    x = x.clone().requires_grad_(True)
    loss = loss_fn(x)
    grads = torch.autograd.grad(loss, [x, *params])
    return loss.detach(), grads


# ---------------------------------------------------------------- PML agreement


@pytest.mark.parametrize("scale", [1.0, 9.0])
def test_proxy_nca_matches_pml(scale):
    x, y = _batch(num_classes=6)
    ours = ProxyNCALoss(6, 8, scale=scale, include_positive=True).double()
    ref = pml_losses.ProxyNCALoss(6, 8, softmax_scale=scale)
    with torch.no_grad():
        ref.proxies.data = ours.proxies.data.clone()
    l1, g1 = _grads(lambda e: ours(e, y), x, [ours.proxies])
    l2, g2 = _grads(lambda e: ref(e, y), x, [ref.proxies])
    torch.testing.assert_close(l1, l2)
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b)


def test_proxy_nca_paper_denominator_excludes_positive():
    x, y = _batch(num_classes=4)
    loss = ProxyNCALoss(4, 8, scale=9.0).double()
    logits = -9.0 * torch.cdist(F.normalize(x, dim=1), F.normalize(loss.proxies.detach(), dim=1)) ** 2
    per = [
        -logits[i, y[i]] + torch.logsumexp(torch.cat([logits[i, : y[i]], logits[i, y[i] + 1 :]]), 0)
        for i in range(len(x))
    ]
    torch.testing.assert_close(loss(x, y).detach(), torch.stack(per).mean())


@pytest.mark.parametrize("num_classes", [5, 40])  # 40 > batch classes: many proxies without positives
def test_proxy_anchor_matches_pml(num_classes):
    x, y = _batch(num_classes=5)
    ours = ProxyAnchorLoss(num_classes, 8).double()
    ref = pml_losses.ProxyAnchorLoss(num_classes, 8, margin=0.1, alpha=32)
    with torch.no_grad():
        ref.proxies.data = ours.proxies.data.clone()
    l1, g1 = _grads(lambda e: ours(e, y), x, [ours.proxies])
    l2, g2 = _grads(lambda e: ref(e, y), x, [ref.proxies])
    torch.testing.assert_close(l1, l2)
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("temperature", [0.07, 0.5])
def test_infonce_matches_pml_ntxent_with_labels(temperature):
    x, y = _batch(n=20, num_classes=4)
    ref = pml_losses.NTXentLoss(temperature=temperature)
    l1, g1 = _grads(lambda e: InfoNCELoss(temperature)(e, y), x)
    l2, g2 = _grads(lambda e: ref(e, y), x)
    torch.testing.assert_close(l1, l2)
    torch.testing.assert_close(g1[0], g2[0])


def test_infonce_matches_pml_ntxent_with_mined_pairs():
    x, y = _batch(n=16, num_classes=4)
    same = y[:, None] == y[None, :]
    a1, p = (same & ~torch.eye(16, dtype=torch.bool)).nonzero(as_tuple=True)
    a2, n = (~same).nonzero(as_tuple=True)
    keep_p, keep_n = torch.arange(len(a1)) % 3 == 0, torch.arange(len(a2)) % 2 == 0  # a mined subset, no repeats
    pairs = (a1[keep_p], p[keep_p], a2[keep_n], n[keep_n])
    ref = pml_losses.NTXentLoss(temperature=0.1)
    torch.testing.assert_close(InfoNCELoss(0.1)(x, y, pairs), ref(x, y, pairs))


# ---------------------------------------------------------------- gradient checks (float64)


def _params_as_inputs(module):
    names = [n for n, _ in module.named_parameters()]
    values = [p.detach().clone().requires_grad_(True) for _, p in module.named_parameters()]
    return names, values


def test_gradcheck_proxy_losses():
    x, y = _batch(n=6, dim=4, num_classes=3)
    x.requires_grad_(True)
    for loss in [
        ProxyNCALoss(3, 4, scale=3.0).double(),
        ProxyNCALoss(3, 4, include_positive=True).double(),
        ProxyAnchorLoss(3, 4, alpha=4.0).double(),
    ]:
        names, values = _params_as_inputs(loss)
        fn = lambda e, *ps: functional_call(loss, dict(zip(names, ps)), (e, y))
        assert gradcheck(fn, (x, *values))


def test_gradcheck_infonce():
    x, y = _batch(n=8, dim=4, num_classes=3)
    assert gradcheck(lambda e: InfoNCELoss(0.5)(e, y), (x.requires_grad_(True),))


def _qkq(b=5, dim=6, k=30, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, dim, generator=g, dtype=torch.float64, requires_grad=True) for s in (b, b, k)]


@pytest.mark.parametrize("include_positive", [True, False])
def test_gradcheck_queue_nce(include_positive):
    q, k, queue = _qkq()
    loss = QueueNCELoss(0.2, include_positive=include_positive)
    assert gradcheck(lambda a, b, c: loss(a, keys=b, queue=c), (q, k, queue))


@pytest.mark.parametrize("include_positive", [True, False])
def test_dance_with_unit_weights_is_plain_nce(include_positive):
    q, k, queue = _qkq()
    dance = DaNCELoss(temperature=0.2, include_positive=include_positive)
    dance._weights = lambda sim, dim: torch.ones_like(sim)
    nce = QueueNCELoss(temperature=0.2, include_positive=include_positive)
    torch.testing.assert_close(dance(q, keys=k, queue=queue), nce(q, keys=k, queue=queue))


@pytest.mark.parametrize("include_positive", [False, True])
def test_gradcheck_dance(include_positive):
    """The weights are detached, so the gradient is that of eq. 6 with w held constant: check exactly that, by
    freezing the weights at the evaluation point (finite differences would otherwise see w move)."""
    q, k, queue = _qkq(dim=6)
    loss = DaNCELoss(temperature=0.2, upper_cutoff=1.9, include_positive=include_positive)
    w0 = loss.negative_weights(q, queue)
    assert (w0 > 0).any(1).all()
    frozen = DaNCELoss(temperature=0.2, upper_cutoff=1.9, include_positive=include_positive)
    frozen._weights = lambda sim, dim: w0
    assert gradcheck(lambda a, b, c: frozen(a, keys=b, queue=c), (q, k, queue))
    # and the real loss has exactly that gradient at the evaluation point (weights carry no gradient)
    g_real = torch.autograd.grad(loss(q, keys=k, queue=queue), (q, k, queue))
    g_frozen = torch.autograd.grad(frozen(q, keys=k, queue=queue), (q, k, queue))
    for a, b in zip(g_real, g_frozen):
        torch.testing.assert_close(a, b)


def test_gradcheck_decorrelation():
    """Wrapping both inputs in a second reversal cancels the module's own, so finite differences apply; the
    projector's parameters are checked as inputs too."""
    torch.manual_seed(0)
    decor = Decorrelation(5, 4, weight=2.0, hidden_dim=7).double()
    src, tgt = [torch.randn(6, d, dtype=torch.float64, requires_grad=True) for d in (5, 4)]
    names, values = _params_as_inputs(decor)
    fn = lambda s, t, *ps: functional_call(decor, dict(zip(names, ps)), (grad_reverse(s), grad_reverse(t)))
    assert gradcheck(fn, (src, tgt, *values))


def test_decorrelation_gradient_signs():
    torch.manual_seed(0)
    decor = Decorrelation(5, 4, weight=3.0, hidden_dim=7).double()
    src, tgt = [torch.randn(6, d, dtype=torch.float64, requires_grad=True) for d in (5, 4)]
    params = list(decor.parameters())
    g_loss = torch.autograd.grad(decor(src, tgt), [src, tgt, *params])
    g_r = torch.autograd.grad(decor.correlation(src, tgt), [src, tgt, *params])
    torch.testing.assert_close(g_loss[0], 3.0 * g_r[0])  # embeddings descend on +w r: r decreases
    torch.testing.assert_close(g_loss[1], 3.0 * g_r[1])
    for a, b in zip(g_loss[2:], g_r[2:]):
        torch.testing.assert_close(a, -3.0 * b)  # projector ascends r
    assert Decorrelation.param_lr == 1e-5 and Decorrelation.param_weight_decay == 0.0
    assert Decorrelation(5, 4, param_weight_decay=1e-6).param_weight_decay == 1e-6  # MIC's regressor group


# ---------------------------------------------------------------- DaNCE against a loop reference


def _dance_reference(q, k, queue, tau, lower, upper, include_positive, normalize):
    "DiVA eq. 6 written from the formula, one line (query row or key column) at a time; no code shared with the library."
    q, k, queue = (F.normalize(t, dim=1) for t in (q, k, queue))
    n = q.shape[1]
    s = q @ queue.T
    d = torch.sqrt(torch.clamp(2 - 2 * s, min=0)).detach()
    dc = torch.clamp(d, min=lower)
    logw = -(n - 2) * torch.log(dc) - (n - 3) / 2 * torch.log(1 - dc**2 / 4)
    ok = d <= upper
    w = torch.zeros_like(s)
    lines = range(s.shape[0]) if normalize == "query" else range(s.shape[1])
    for i in lines:
        sel = (i, slice(None)) if normalize == "query" else (slice(None), i)
        if ok[sel].any():
            e = torch.where(ok[sel], torch.exp(logw[sel] - logw[sel][ok[sel]].max()), torch.zeros_like(logw[sel]))
            w[sel] = e / e.sum()
        else:
            w[sel] = 1.0 / len(logw[sel])  # the code's 1e-45 clamp: a line without valid entry is uniform
    losses = []
    for i in range(len(q)):
        pos = q[i] @ k[i] / tau
        neg = w[i] * s[i] / tau
        den = torch.logsumexp(torch.cat([pos[None], neg]) if include_positive else neg, 0)
        losses.append(den - pos)
    return torch.stack(losses).mean()


@pytest.mark.parametrize("normalize", ["key", "query"])
@pytest.mark.parametrize("include_positive", [False, True])
@pytest.mark.parametrize("dim", [16, 128])
def test_dance_matches_loop_reference(include_positive, dim, normalize):
    q, k, queue = _qkq(b=7, dim=dim, k=200, seed=3)
    with torch.no_grad():  # put some keys close to the queries so all weight regimes occur
        queue[:7] = q + 0.3 * torch.randn_like(q)
        queue[7] = -q[0]  # a key far from every query: uniform column (per key)
    loss = DaNCELoss(temperature=0.01, include_positive=include_positive, normalize=normalize)
    ref = _dance_reference(q, k, queue, 0.01, 0.5, 1.4, include_positive, normalize)
    torch.testing.assert_close(loss(q, keys=k, queue=queue), ref)
    g1 = torch.autograd.grad(loss(q, keys=k, queue=queue), (q, k, queue))
    g2 = torch.autograd.grad(ref, (q, k, queue))
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b)


def test_dance_weights_per_key_and_per_query():
    q, _, queue = _qkq(b=4, dim=8, k=50)
    wk = DaNCELoss().negative_weights(q, queue)  # default: per key, the authors' code
    torch.testing.assert_close(wk.sum(0), torch.ones(50, dtype=wk.dtype))
    assert not torch.allclose(wk.sum(1), torch.ones(4, dtype=wk.dtype))
    wq = DaNCELoss(normalize="query").negative_weights(q, queue)  # --diva_fixed
    torch.testing.assert_close(wq.sum(1), torch.ones(4, dtype=wq.dtype))
    assert not wk.requires_grad and not wq.requires_grad
    assert DaNCELoss().normalize == "key" and DaNCELoss().upper_cutoff == 1.4


def test_dance_last_stats_and_no_cutoff():
    g = torch.Generator().manual_seed(0)
    q, queue = torch.randn(32, 128, generator=g), torch.randn(512, 128, generator=g)
    for normalize in ("key", "query"):
        loss = DaNCELoss(normalize=normalize)
        loss(q, keys=q, queue=queue)
        within = float(loss.last_stats["within_cutoff_fraction"])
        assert 0.35 < within < 0.47  # random 128-d: about 41% of pairs within 1.4
        assert float(loss.last_stats["nonzero_weight_fraction"]) >= within
        free = DaNCELoss(normalize=normalize, upper_cutoff=None)
        free(q, keys=q, queue=queue)
        assert float(free.last_stats["nonzero_weight_fraction"]) == 1.0


@pytest.mark.parametrize("cls", [DaNCELoss, QueueNCELoss])
def test_queue_losses_compute_in_fp32_under_bf16_autocast(cls):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(16, 32, generator=g, requires_grad=True)
    k, queue = torch.randn(16, 32, generator=g), torch.randn(200, 32, generator=g)
    loss = cls(temperature=0.01)
    ref = loss(q, keys=k, queue=queue)
    (g_ref,) = torch.autograd.grad(ref, q)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = loss(q.to(torch.bfloat16), keys=k.to(torch.bfloat16), queue=queue)  # bf16 inputs as from an autocast head
        out_fp32 = loss(q, keys=k, queue=queue)
    assert out.dtype == torch.float32
    (g_out,) = torch.autograd.grad(out_fp32, q)
    torch.testing.assert_close(out_fp32, ref)
    torch.testing.assert_close(g_out, g_ref)


# ---------------------------------------------------------------- edge cases


def test_no_valid_pair_and_one_class_batches():
    x = torch.randn(6, 4, requires_grad=True)
    distinct, one = torch.arange(6), torch.zeros(6, dtype=torch.long)
    l = InfoNCELoss()(x, distinct)
    assert l.item() == 0 and l.grad_fn is not None
    l.backward()
    assert (x.grad == 0).all()
    for loss in [InfoNCELoss(), ProxyNCALoss(3, 4), ProxyNCALoss(3, 4, include_positive=True), ProxyAnchorLoss(3, 4)]:
        x.grad = None
        l = loss(x, one)
        l.backward()
        assert torch.isfinite(l) and torch.isfinite(x.grad).all(), type(loss).__name__


def test_empty_batch_is_zero_with_graph():
    e = torch.randn(0, 4, requires_grad=True)
    no = torch.zeros(0, dtype=torch.long)
    for loss in [InfoNCELoss(), ProxyNCALoss(3, 4), ProxyAnchorLoss(3, 4)]:
        l = loss(e, no)
        assert l.item() == 0 and l.grad_fn is not None
    for loss in [QueueNCELoss(), DaNCELoss()]:
        l = loss(e, keys=torch.randn(0, 4), queue=torch.randn(5, 4))
        assert l.item() == 0 and l.grad_fn is not None


@pytest.mark.parametrize("cls", [QueueNCELoss, DaNCELoss])
def test_queue_errors(cls):
    q = torch.randn(3, 4)
    with pytest.raises(ValueError, match="empty queue"):
        cls()(q, keys=q, queue=torch.zeros(0, 4))
    with pytest.raises(ValueError, match="one positive key per query"):
        cls()(q, keys=q[:2], queue=q)
    with pytest.raises(ValueError, match=r"queue must be \(num_keys, 4\)"):
        cls()(q, keys=q, queue=torch.randn(5, 3))
    with pytest.raises(TypeError):
        cls()(q)  # keys and queue are required keyword arguments


def test_dance_all_keys_far_is_finite():
    q = F.normalize(torch.randn(1, 16), dim=1)
    queue = -q.repeat(5, 1)  # every key at distance 2 > 1.4: uniform weights 1/5
    loss = DaNCELoss(normalize="query")(q, keys=q, queue=queue)
    torch.testing.assert_close(loss, torch.tensor(math.log(5) - 1 / (5 * 0.01) - 1 / 0.01))
    loss = DaNCELoss(normalize="key")(q, keys=q, queue=queue)  # per key over a batch of one query: weight 1
    torch.testing.assert_close(loss, torch.tensor(math.log(5) - 1 / 0.01 - 1 / 0.01))


def test_dance_and_queue_nce_on_float32_at_diva_scale_are_finite():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(112, 128, generator=g, requires_grad=True)
    k, queue = torch.randn(112, 128, generator=g), F.normalize(torch.randn(3360, 128, generator=g), dim=1)
    for loss in [DaNCELoss(), DaNCELoss(include_positive=True), DaNCELoss(normalize="query"), QueueNCELoss(0.01)]:
        l = loss(q, keys=k, queue=queue)
        (g_q,) = torch.autograd.grad(l, q)
        assert torch.isfinite(l) and torch.isfinite(g_q).all()


def test_declared_attributes():
    assert ProxyNCALoss.default_miner is None and ProxyAnchorLoss.default_miner is None
    assert ProxyNCALoss(2, 3, param_lr=1e-2).param_lr == 1e-2
    assert ProxyAnchorLoss.param_lr == 1e-3 and ProxyNCALoss.param_lr == 5e-4
    assert DaNCELoss.extra_inputs == ("keys", "queue")


# ---------------------------------------------------------------- golden tests: the authors' DaNCE and decorrelation

import numpy as np
from golden import arr, load_golden


@pytest.mark.parametrize("case", ["diva", "far_keys"])
@pytest.mark.parametrize("axis", ["key", "query"])
def test_golden_dance_both_axes(axis, case):
    """DiVA's criteria/fast_moco.py: loss and gradient wrt the query, normalised per key (their default) and per query
    (--diva_fixed), with the positive in the denominator as their cross-entropy has it; 'far_keys' has keys (columns)
    and a query (row) with every distance beyond the cutoff, which the code's 1e-45 clamp makes uniform. The other
    axis fails; so does a zero weight for such a line."""
    g = load_golden("blocks_dance")
    inp, out = g["inputs"][case], g["outputs"][case][axis]
    keys, queue = torch.tensor(inp["keys"]), torch.tensor(inp["queue"])

    def value_grad(loss):
        q = torch.tensor(inp["query"], requires_grad=True)
        v = loss(q, keys=keys, queue=queue)
        return v.item(), torch.autograd.grad(v, q)[0].numpy()

    options = dict(
        temperature=inp["temperature"],
        lower_cutoff=inp["lower_cutoff"],
        upper_cutoff=inp["upper_cutoff"],
        include_positive=True,
    )
    v, grad = value_grad(DaNCELoss(normalize=axis, **options))
    assert v == pytest.approx(out["loss"], rel=1e-5)
    np.testing.assert_allclose(grad, arr(out["gradient"]), atol=2e-5, rtol=1e-4)
    other = value_grad(DaNCELoss(normalize="query" if axis == "key" else "key", **options))[0]
    assert abs(other - out["loss"]) > 0.1
    if case == "far_keys":
        zero_lines = DaNCELoss(normalize=axis, **options)
        inner = zero_lines._weights
        zero_lines._weights = lambda sim, dim: inner(sim, dim) * zero_lines._within_cutoff(sim)
        assert abs(value_grad(zero_lines)[0] - out["loss"]) > 1e-3


def _decorrelation_from(reg_state, source_dim, target_dim, weight, hidden):
    decor = Decorrelation(source_dim, target_dim, weight=weight, hidden_dim=hidden)
    decor.psi.load_state_dict({k: torch.tensor(v) for k, v in reg_state.items()})
    return decor


def _check_decorrelation(decor, source, target, out, source_key, target_key):
    s, t = (torch.tensor(x, requires_grad=True) for x in (source, target))
    v = decor(s, t)
    grads = torch.autograd.grad(v, [s, t, *decor.psi.parameters()])
    assert v.item() == pytest.approx(out["loss"], rel=1e-5)
    np.testing.assert_allclose(grads[0].numpy(), arr(out[source_key]), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(grads[1].numpy(), arr(out[target_key]), rtol=1e-4, atol=1e-6)
    for (name, _), gp in zip(decor.psi.named_parameters(), grads[2:]):
        np.testing.assert_allclose(gp.numpy(), arr(out["regressor_gradient"][name]), rtol=1e-4, atol=1e-6)
    return grads


def test_golden_decorrelation_diva():
    """DiVA's criteria/adversarial_separation.py with identical projector weights: the loss, the gradients that reach
    both embeddings through the reversal, and the projector's gradients. Without the reversal the embeddings'
    gradients flip sign and fail."""
    g = load_golden("blocks_decorrelation_diva")
    inp, out = g["inputs"], g["outputs"]
    D = len(inp["source"][0])
    decor = _decorrelation_from(inp["regressor"], D, D, inp["weight"], inp["hidden_dim"])
    _check_decorrelation(decor, inp["source"], inp["target"], out, "source_gradient", "target_gradient")
    s, t = (torch.tensor(x, requires_grad=True) for x in (inp["source"], inp["target"]))
    plain = torch.autograd.grad(-inp["weight"] * decor.correlation(s, t), [s])[0]  # no reversal
    np.testing.assert_allclose(plain.numpy(), -arr(out["source_gradient"]), rtol=1e-4, atol=1e-6)


def test_golden_decorrelation_mic():
    """MIC's losses.py AdvLoss (weight applied outside, as main.py does; the regressor maps the shared embedding
    phi* to the class embedding phi): the same module with source = aux, target = class. Swapping the roles fails."""
    g = load_golden("blocks_decorrelation_mic")
    inp, out = g["inputs"], g["outputs"]
    Da, Dc = len(inp["aux_features"][0]), len(inp["class_features"][0])
    decor = _decorrelation_from(inp["regressor"], Da, Dc, inp["weight"], inp["hidden_dim"])
    _check_decorrelation(decor, inp["aux_features"], inp["class_features"], out, "aux_gradient", "class_gradient")
    with pytest.raises(ValueError, match="needs source"):
        decor(torch.tensor(inp["class_features"]), torch.tensor(inp["aux_features"]))


def test_has_proxies_reads_the_loss_itself():
    from dml_nb.methods.sharing import has_proxies

    assert has_proxies("proxy_nca") and has_proxies("proxy_anchor") and has_proxies(ProxyAnchorLoss(3, 4))
    assert (
        has_proxies(ProxyNCALoss) and not has_proxies("margin") and not has_proxies("triplet")
    )  # margin: num_classes, no proxies
    assert not has_proxies(InfoNCELoss())
