"""Before regime v3's full re-run: every reproduction notebook's paper file transfers by the rule
(`transferred_parameters`), and every transferred row builds a valid config on the v3 base (`PREMISE_BASE`), so a
paper file or recipe change that breaks the re-run fails here, not hours into it."""

import pytest

from dml_nb.core.config import make_config, method_options_class
from dml_nb.reproduction.repro import Row, base_config
from dml_nb.reproduction.transfer import method_specs, stems_of, transferred_parameters

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
