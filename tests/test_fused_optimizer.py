"""`train.fused_optimizer`: torch's fused Adam / AdamW / SGD (one kernel per parameter group), off by default. It is
close to the default optimiser, not bit-equal with it (benchmarks/README.md, "Torch's fused Adam"); a function given
as `train.optimizer` builds its own optimiser and is refused with the option, with the fix named."""

from __future__ import annotations

import pytest
import torch

from dml_nb.blocks.models import build_backbone
from dml_nb.core.config import TrainConfig
from dml_nb.methods.base import BaselineMethod
from dml_nb.training.learner import build_optimizer


def method(seed: int = 0) -> BaselineMethod:
    torch.manual_seed(seed)
    return BaselineMethod(build_backbone("small_cnn", width=4, feature_dim=16), 10, embedding_dim=8, loss="margin")


@pytest.mark.parametrize("name", ["adam", "adamw", "sgd"])
def test_the_option_gives_every_group_torchs_fused_kernel(name):
    m = method()
    default = build_optimizer(m, TrainConfig(optimizer=name))
    fused = build_optimizer(m, TrainConfig(optimizer=name, fused_optimizer=True))
    assert type(fused) is type(default) and len(fused.param_groups) == len(default.param_groups) > 1
    assert all(g["fused"] for g in fused.param_groups)
    assert not any(g.get("fused") for g in default.param_groups)
    for a, b in zip(default.param_groups, fused.param_groups):  # the same groups, rates and weight decay
        assert (a["name"], a["lr"], a["weight_decay"]) == (b["name"], b["lr"], b["weight_decay"])


def test_a_function_as_optimizer_is_refused_with_the_option_naming_the_fix():
    spec = lambda groups: torch.optim.Adam(groups)  # noqa: E731
    with pytest.raises(ValueError, match=r"train\.fused_optimizer applies to the named optimisers.*pass fused=True"):
        build_optimizer(method(), TrainConfig(optimizer=spec, fused_optimizer=True))


def test_fused_adam_stays_within_float_rounding_of_the_default_on_the_same_gradients():
    "50 steps of Adam with weight decay on the same gradients: equal to a few float32 steps, not to the bit."
    out = {}
    for fused in (False, True):
        m = method()
        opt = build_optimizer(m, TrainConfig(optimizer="adam", lr=1e-3, weight_decay=4e-4, fused_optimizer=fused))
        params = [p for g in opt.param_groups for p in g["params"]]
        g = torch.Generator().manual_seed(1)
        for _ in range(50):
            for p in params:
                p.grad = torch.randn(p.shape, generator=g)
            opt.step()
        out[fused] = torch.cat([p.detach().flatten() for p in params])
    diff = (out[False] - out[True]).abs()
    scale = out[False].abs().clamp_min(1e-3)
    assert float((diff / scale).max()) < 1e-5, float(diff.max())
