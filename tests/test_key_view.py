"""DiVA's harder key view (`key_view='realistic'`, the authors' `--realistic_augmentation`): colour jitter and
greyscale for the key only, drawn per image, off by default (the sample runs), and a wrong name is one line."""

import pytest
import torch

from dml_nb.core.config import ConfigError, make_config
from dml_nb.data.preprocessing import Preprocessing
from dml_nb.experiments.experiment import run
from dml_nb.methods.diva import realistic_view

from test_reliability import TINY

DIVA = {
    **TINY,
    "method": {"name": "diva", "embedding_dim": 16, "tasks": ["discriminative", "dance"], "queue_batches": 2},
}


@pytest.mark.parametrize("order", ["RGB", "BGR"])
def test_the_realistic_view_undoes_the_normalisation_around_the_jitter(order, monkeypatch):
    import dml_nb.methods.diva as D

    pre = Preprocessing(32, 36, (0.5, 0.4, 0.3), (0.2, 0.25, 0.3), order)
    x = pre.normalize(torch.rand(4, 3, 8, 8, generator=torch.Generator().manual_seed(0)))
    monkeypatch.setattr(D, "colour_jitter", lambda rgb: rgb)  # no jitter: the view comes back as it was
    torch.testing.assert_close(realistic_view(x, pre), x, atol=1e-5, rtol=0)
    monkeypatch.undo()
    torch.manual_seed(0)
    y = realistic_view(x, pre)
    assert y.shape == x.shape and torch.isfinite(y).all() and not torch.allclose(y, x, atol=1e-3)


def test_a_diva_run_with_the_realistic_key_view_trains_and_differs(tmp_path):
    cfg = lambda view: {**DIVA, "method": {**DIVA["method"], **({"key_view": view} if view else {})}}
    plain = run(cfg(None), runs_dir=tmp_path, progress=False, threads=1)
    harder = run(cfg("realistic"), runs_dir=tmp_path, progress=False, threads=1)
    assert plain.run_dir != harder.run_dir
    key = "positive_similarity/dance"
    assert key in plain.history[-1] and plain.history[-1][key] != harder.history[-1][key]
    assert make_config(cfg("standard")).method.options["key_view"] == "standard"  # checked, kept as written


def test_an_unknown_key_view_is_one_line_naming_the_choices():
    with pytest.raises(ConfigError) as e:
        make_config({**DIVA, "method": {**DIVA["method"], "key_view": "hard"}})
    msg = str(e.value)
    assert "\n" not in msg and "key_view" in msg and "realistic" in msg and "standard" in msg, msg
