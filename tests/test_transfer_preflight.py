"""Before regime v3's full re-run: every reproduction notebook's paper file transfers by the rule
(`transferred_parameters`), and every transferred row builds a valid config on the v3 base (`PREMISE_BASE`), so a
paper file or recipe change that breaks the re-run fails here, not hours into it."""

import pytest

from dml_nb.core.config import make_config, method_options_class
from dml_nb.reproduction.repro import Row, base_config
from dml_nb.reproduction.transfer import method_specs, regime_v2_parameters, stems_of, transferred_parameters

BASE = base_config("finegrained_premise")
EPOCHS = int(BASE["train"]["epochs"])


@pytest.mark.parametrize("stem", stems_of(None))
def test_every_transferred_row_builds_a_valid_v3_config(stem):
    rows = [(w, s) for w, s in method_specs(transferred_parameters(stem, EPOCHS)) if "name" in s.get("method", s)]
    assert rows, f"{stem}: its paper file gave no row with a recipe name"
    for where, spec in rows:
        cfg = make_config({**Row(where, spec).config(BASE), "seed": 0})  # as job_config, without the test's smoke size
        assert (cfg.data.name, cfg.train.epochs) == ("finegrained_premise", EPOCHS), where
        options = method_options_class(cfg.method.name)
        if options is not None:
            options.of(cfg.method.options)  # a transferred option the recipe does not accept raises here


def _named(spec) -> bool:
    "Whether a method spec names its recipe: `name` in it, or in its `method` section (a row with sections)."
    return isinstance(spec, dict) and ("name" in spec or "name" in (spec.get("method") or {}))


@pytest.mark.parametrize("stem", stems_of(None))
def test_every_transferred_spec_keeps_the_notebooks_shape(stem):
    """A transferred parameter names its recipe exactly where the notebook's own does: the notebook's code reads a
    method spec (`{"name": "diva", ...}`) or options it names itself (`diva: {...}` in Table 2), and one in the other
    shape fails only when the notebook runs (DiVA Fig. 5's paper file has `diva: {method: ..., train: ...}`)."""
    v2 = regime_v2_parameters(stem)  # the notebook's rows of regime v2, which its code is known to run
    v3 = transferred_parameters(stem, EPOCHS)
    mine = dict(method_specs(v2))
    for where, _ in method_specs(v3):
        if where in mine:
            node, ours = v3, v2
            for k in where.split("/"):
                node, ours = node[k], ours[k]
            assert _named(node) == _named(ours), f"{stem}: {where} names its recipe in one and not the other"
