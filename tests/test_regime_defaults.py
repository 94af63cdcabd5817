"""Regime v3 is a reproduction notebook's default run exactly as the transfer rule gives it, and its regime v2 run stays
reproducible from `params/regime_v2/<notebook>.yaml` (`tools/regime_defaults.py` switches a notebook)."""

import json
from pathlib import Path

import pytest
import yaml

from dml_nb.reproduction.notebook import notebook_defaults
from dml_nb.reproduction.repro import base_config
from dml_nb.reproduction.transfer import regime_of, regime_v2_file, stems_of, transferred_parameters

ROOT = Path(__file__).resolve().parents[1]
EPOCHS = int(base_config("finegrained_premise")["train"]["epochs"])


@pytest.mark.parametrize("stem", stems_of(None))
def test_default_run_is_one_regime(stem):
    regime, defaults = regime_of(stem), notebook_defaults(stem)
    assert regime in ("v2", "v3"), f"{stem}: default dataset {defaults['dataset']!r} is neither regime's"
    if regime == "v2":  # not switched yet: nothing half-done
        assert not regime_v2_file(stem).exists(), f"{stem}: a v2 parameter file beside a v2 default run"
        return
    v3 = transferred_parameters(stem, EPOCHS)
    for k, v in v3.items():
        assert defaults[k] == v, f"{stem}: the default of {k!r} is not the rule's (run tools/regime_defaults.py)"
    v2 = yaml.safe_load(regime_v2_file(stem).read_text())
    assert v2["dataset"] == "finegrained_novel" and set(v2) >= {"dataset", *v3}, f"{stem}: {regime_v2_file(stem)}"
    for k in set(v2) - {"dataset", *v3}:  # a setting v3 changed with the rows (Fig. 8's k-means K = its learners)
        assert k in defaults and v2[k] != defaults[k], f"{stem}: {k!r} in the v2 file is not a changed parameter"
    kept = json.loads((ROOT / "figures" / "regime_v2" / f"{stem}_claims.json").read_text())
    assert kept and "finegrained_novel" in (ROOT / "figures" / "regime_v2" / f"{stem}_claims.md").read_text()


def test_claim_table_gives_each_switched_notebook_its_v2_verdicts():
    "The claim table of REPORT.md puts a v3 notebook's regime v2 counts (`figures/regime_v2/`) beside its v3 verdicts."
    from dml_nb.reproduction.reproduce import claims_summary

    table = claims_summary(ROOT / "figures")[0].splitlines()
    col = table[0].split(" | ").index("regime v2: hold / fail / unresolved")
    for stem in stems_of(None):
        line = next(x for x in table if x.startswith(f"| [`{stem}`]"))
        cell = line.split(" | ")[col]
        if regime_of(stem) == "v2":
            assert cell == "", stem
            continue
        c = [
            x["verdict"]
            for x in json.loads((ROOT / "figures" / "regime_v2" / f"{stem}_claims.json").read_text())["claims"]
        ]
        assert cell == f"{c.count('holds')} / {c.count('fails')} / {c.count('unresolved')}", stem
        assert "| finegrained_premise |" in line, f"{stem}: its committed claims are not regime v3's"


def test_a_v2_file_that_is_not_one_is_an_error_naming_it(tmp_path, monkeypatch):
    import dml_nb.reproduction.transfer as T

    bad = tmp_path / "repro_table3.yaml"
    monkeypatch.setattr(T, "regime_v2_file", lambda stem: bad)
    for text in ("- a list\n", "dataset: finegrained_premise\n"):
        bad.write_text(text)
        with pytest.raises(ValueError, match="not a regime v2 parameter file"):
            T.regime_v2_parameters("repro_table3")


def _markdown(stem: str) -> str:
    nb = json.loads((ROOT / "nbs" / f"{stem}.ipynb").read_text())
    return "\n".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "markdown")


@pytest.mark.parametrize("stem", stems_of(None))
def test_the_prose_describes_the_default_run_and_rule(stem):
    "A notebook's text says which regime its default run trains, and describes the claims' rule as it is (Welch's t)."
    text = _markdown(stem)
    default_run = text[text.index("**The default run**") :].split("\n\n")[0]
    dataset = "finegrained_premise" if regime_of(stem) == "v3" else "finegrained_novel"
    assert f"`{dataset}`" in default_run, f"{stem}: its default-run paragraph does not name `{dataset}`"
    if regime_of(stem) == "v3":
        assert "NOVEL_BASE" not in default_run and f"params/regime_v2/{stem}.yaml" in default_run, stem
    assert "2 standard\nerrors" not in text and "2 standard errors" not in text, (
        f"{stem}: the rule is Welch's t, not 2 SE"
    )
