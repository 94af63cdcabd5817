"""What a verdict hinges on (`dml_nb.reproduction.sensitivity`, `nbs/67c_sensitivity.ipynb`): the labels a
sensitivity table gives the claims, their place in the claims file and REPORT.md's count."""

import pandas as pd

from dml_nb.reproduction.claims import Claims, Verdict, load_claims
from dml_nb.reproduction.reproduce import sensitivity_counts
from dml_nb.reproduction.sensitivity import Sensitivity, rates_tied, sensitivity_label

TABLE = pd.DataFrame({"R@1": [40.0, 30.0, 30.5], "R@1 std": [0.5, 0.5, 0.5], "seeds": [5, 5, 5]}, index=["A", "B", "C"])


def _sens(labels: dict) -> Sensitivity:
    frame = pd.DataFrame({"claim": list(labels), "label": list(labels.values())})
    frame.attrs["seeds"] = 5
    return Sensitivity(frame, {}, {}, {"col": "what col changes"})


def test_labels_reach_the_claims_file_its_markdown_and_the_report_count(tmp_path):
    c = Claims("repro_demo", tmp_path)
    c.beats("A beats B", TABLE, "A", "B")  # holds
    c.beats("B beats A", TABLE, "B", "A")  # fails
    c.beats("C beats B", TABLE, "C", "B")  # unresolved
    c.label(
        _sens({"A beats B": "robust to col", "B beats A": "sensitive to col (unresolved)", "C beats B": ""}), "t.md"
    )
    c.save()
    data = load_claims(tmp_path / "repro_demo_claims.json")
    assert [x["sensitivity"] for x in data["claims"]] == ["robust to col", "sensitive to col (unresolved)", ""]
    assert data["sensitivity"] == {"columns": {"col": "what col changes"}, "seeds": 5, "table": "t.md"}
    md = (tmp_path / "repro_demo_claims.md").read_text()
    assert "| hinges on |" in md and "sensitive to col (unresolved)" in md and "**Sensitivity.**" in md
    count = sensitivity_counts(tmp_path)
    assert "2 decided verdict(s) of 1 notebook(s)" in count and "1 robust" in count and "1 sensitive" in count, count


def test_a_claims_file_without_labels_renders_as_before(tmp_path):
    c = Claims("repro_demo", tmp_path)
    c.beats("A beats B", TABLE, "A", "B")
    c.save()
    md = (tmp_path / "repro_demo_claims.md").read_text()
    assert "hinges on" not in md and "Sensitivity" not in md and sensitivity_counts(tmp_path) == ""


def test_the_label_names_what_changes_a_decided_verdict():
    assert sensitivity_label("holds", {"x": "unresolved", "y": "holds"}, {"x": True, "y": True}) == (
        "sensitive to x (unresolved); robust to y"
    )
    assert sensitivity_label("fails", {"x": "fails"}, {"x": False}) == "no column changes its rows"


def test_rates_tied_leaves_a_fixed_beta_and_a_tied_regressor_alone():
    assert rates_tied({"name": "dnc", "loss": "margin", "loss_options": {"learn_beta": False}}, 100.0) is None
    mic = rates_tied({"name": "mic", "gamma": 2500.0}, 100.0)
    assert "decorrelation_lr" not in mic and abs(mic["loss_options"]["param_lr"] - 5e-2) < 1e-12


def test_a_claim_names_the_rows_it_compares_and_the_column_reads_them():
    "The rows a column touches come from the claim's own record, not from a row name found in its numbers' text."
    from dml_nb.reproduction.sensitivity import _rows_of

    table = pd.DataFrame(
        {"R@1": [40.0, 30.0, 35.0], "R@1 std": [0.5] * 3, "seeds": [5] * 3}, index=["Margin-128", "Margin-1280", "A"]
    )
    c = Claims("repro_demo", "unused")
    c.beats("A above Margin-1280", table, "A", "Margin-1280")
    c.beats_all("A above both", table, [("A", "Margin-128"), ("A", "Margin-1280")])
    c.check("judged another way", Verdict.HOLDS, "A 35.0 against Margin-1280 30.0")
    first, both, other = c.items
    assert first["rows"] == ["A", "Margin-1280"] and _rows_of(first, table) == {"A", "Margin-1280"}
    assert _rows_of(both, table) == {"A", "Margin-128", "Margin-1280"}
    assert _rows_of(other, table) == {"A", "Margin-1280"}  # whole names only: Margin-128 is not in "Margin-1280"


def test_the_other_reading_leaves_a_row_that_reads_as_the_text_alone():
    "A DiVA row that already weights its heads equally (Table 2's file, the text) gets no column: it would train the same run."
    from dml_nb.reproduction.sensitivity import other_reading

    tasks = ["discriminative", "dance"]
    assert other_reading({"name": "diva", "tasks": tasks}) is None
    assert (
        other_reading({"name": "diva", "tasks": tasks, "embed_weights": {"discriminative": 1.0, "dance": 1.0}}) is None
    )
    code = {"name": "diva", "tasks": tasks, "embed_weights": {"discriminative": 0.75, "dance": 1.25}}
    assert other_reading(code)["embed_weights"] == {"discriminative": 1.0, "dance": 1.0}
