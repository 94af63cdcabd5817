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


def test_rows_named_alike_in_two_columns_keep_their_own_runs_and_reasons(monkeypatch, tmp_path):
    """`run_rows(by_group=True)` keys each finished run by its column; one column's reason for a run that stopped is not
    shown on the same-named row of another column (a sensitivity table's rows repeat across its columns)."""
    import dml_nb.reproduction.repro as R
    from dml_nb.methods.dnc import ClusterError
    from dml_nb.reproduction.repro import Row, base_config

    calls = []

    def one(raw, runs_dir, progress=True, threads=None):
        calls.append(raw)
        if len(calls) == 1:
            raise ClusterError("1 of 2 clusters cannot form a batch with negatives")
        return "the y run"

    monkeypatch.setattr(R, "run_one", one)
    rows = [Row("A", {"name": "baseline", "embedding_dim": 32}, group=g) for g in ("x", "y")]
    rows[1] = Row("A", {"name": "baseline", "embedding_dim": 64}, group="y")
    per_seed, results = R.run_rows(rows, base_config("digits"), [0], runs_dir=tmp_path, progress=False, by_group=True)
    assert results == {("y", "A", 0): "the y run"}
    status = dict(zip(per_seed["group"], per_seed["status"]))
    assert status["x"].startswith("stopped: 1 of 2 clusters"), status
    assert status["y"].startswith("not run: no finished run"), status  # its folder is empty: not x's reason


def test_a_column_reads_its_own_runs_into_a_table_built_from_them(monkeypatch, tmp_path):
    """A notebook whose claims read a table built from the runs (`sensitivity(table=...)`, Table 5) is judged on the
    column's own runs in place of the headline's, and the table rows of a changed run are the rows it changed."""
    import types

    import dml_nb.reproduction.repro as R
    from dml_nb.experiments.results import RunPolicy
    from dml_nb.reproduction.repro import base_config
    from dml_nb.reproduction.sensitivity import _column_results, sensitivity

    rows = {
        "Margin": {"name": "baseline", "embedding_dim": 128},
        "Ours (T*)": {"name": "sharing", "embedding_dim": 128},
    }
    seeds = [0, 1, 2]
    lines = pd.DataFrame([{"row": n, "group": "", "seed": s, "status": "ok"} for n in rows for s in seeds])
    headline = {(n, s): 30.0 + s if n == "Margin" else 40.0 + s for n in rows for s in seeds}  # "a run": its R@1

    def fake_run_rows(every, base, seeds, by_group=False, **kw):
        assert by_group  # the columns' rows share names
        got = {(r.group, r.name, s): (50.0 if r.name == "Margin" else 20.0) + s for r in every for s in seeds}
        out = [{"row": r.name, "group": r.group, "seed": s, "status": "ok"} for r in every for s in seeds]
        return pd.DataFrame(out), got

    monkeypatch.setattr(R, "run_rows", fake_run_rows)

    def table_of(lines, results):
        recs = pd.DataFrame(
            [{"row": f"{n} {rep}", "v": v + d} for (n, s), v in results.items() for rep, d in [("phi", 0), ("f", 1)]]
        )
        g = recs.groupby("row", sort=False)["v"]
        out = pd.DataFrame({"R@1": g.mean(), "R@1 std": g.std(ddof=1), "seeds": g.size()})
        out.attrs["sources"] = {t: t.rsplit(" ", 1)[0] for t in out.index}
        return out

    def judge(claims, table):
        claims.beats("ours phi beats the margin phi", table, "Ours (T*) phi", "Margin phi")
        return claims

    nb = types.SimpleNamespace(
        stem="repro_sharing_table5",
        base=base_config("finegrained_premise"),
        seeds=seeds,
        runs=tmp_path,
        progress=False,
        threads=1,
        policy=RunPolicy(),
        per_seed=lines,
        run_results=headline,
        claims=lambda: Claims("repro_sharing_table5", tmp_path),
        keep=lambda rows: None,
    )
    sens = sensitivity(nb, rows, judge, None, ["3x training"], table=table_of)
    assert sens.changed["3x training"] == ["Margin phi", "Margin f", "Ours (T*) phi", "Ours (T*) f"]
    assert sens.tables["3x training"].loc["Margin phi", "R@1"] == 51.0  # the column's runs, not the headline's 31
    assert sens.headline.loc["Margin phi", "R@1"] == 31.0
    assert sens.frame["headline"][0].startswith("holds") and sens.frame["3x training"][0].startswith("fails")
    assert sens.labels() == {"ours phi beats the margin phi": "sensitive to 3x training (fails)"}
    assert list(sens.columns) == ["3x training"]  # no DiVA row: no diagnostic column
    # a changed run that did not finish is left out, not taken from the headline
    assert _column_results({("A", 0): 1, ("B", 0): 2}, {("c", "B", 0): 3}, "c", {"A", "B"}) == {("B", 0): 3}


def test_a_diagnostic_of_no_row_here_is_no_column():
    "DiVA's head-alone diagnostic names no row of a table without DiVA (Table 5): `sensitivity` leaves that column out."
    from dml_nb.reproduction.sensitivity import diagnostic_rows

    assert diagnostic_rows({"Margin": {"name": "baseline"}}) == {"DiVA's discriminative head alone": {}}
    assert diagnostic_rows({"DiVA": {"name": "diva", "tasks": ["discriminative", "shared"]}}) == {
        "DiVA's discriminative head alone": {"DiVA": "discriminative"}
    }
