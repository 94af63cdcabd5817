"""Figures that show what the claims test: the forest plot draws each claim's difference with the very threshold its
verdict used (t SE), the paper's difference and zero; the claims file says the smallest difference the seeds resolve; absolute bars
show the SE and leave zero out where it would hide the spread. A claim made of several comparisons (`beats_all`) draws
each part with its own interval under the claim's name; a paper difference across two papers' tables is not drawn."""

import json
import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import numpy as np
import pandas as pd
import pytest

from dml_nb.reproduction.claims import Claims, Verdict, all_hold, better, critical, difference, judge, resolvable, stat
from dml_nb.reproduction.reproduce import claims_summary, resolution
from dml_nb.experiments.viz import hides_spread, plot_bars


def flagship_like():
    "Seven rows within 2 points, std about 1 over 5 seeds: the shape of the flagship table."
    rows = ["Margin-512", "DiVA-512", "Margin-128", "D&C-128", "MIC-128", "MultiSim-512", "BSPML-512"]
    return pd.DataFrame(
        {
            "R@1": [62.1, 63.8, 62.5, 62.1, 63.0, 62.4, 63.3],
            "R@1 std": [1.3, 0.8, 1.0, 1.1, 0.9, 1.2, 0.7],
            "NMI": [55.0, 57.5, 55.2, 55.1, 55.9, 54.8, 56.0],
            "NMI std": [0.5, 0.6, 0.4, 0.5, 0.6, 0.5, 0.4],
            "seeds": [5] * 7,
        },
        index=pd.Index(rows, name="row"),
    )


@pytest.fixture
def claims(tmp_path):
    paper = pd.DataFrame({"R@1": [63.9, 69.2, 60.7, 65.9]}, index=["Margin-512", "DiVA-512", "Margin-128", "D&C-128"])
    c = Claims("repro_demo", tmp_path, paper=paper)
    t = flagship_like()
    c.beats("DiVA beats Margin (R@1)", t, "DiVA-512", "Margin-512")
    c.beats("D&C beats Margin", t, "D&C-128", "Margin-128")
    c.beats("DiVA beats Margin on NMI", t, "DiVA-512", "Margin-512", "NMI")
    c.beats("MIC beats Margin", t, "MIC-128", "Margin-128")  # the paper file has no MIC row
    c.check("DiVA beats all", Verdict.UNRESOLVED, "several comparisons")
    return c, t


def test_the_forest_interval_is_the_verdicts_own_threshold(claims):
    c, t = claims
    fig = c.plot()
    ax = fig.axes[0]
    labels = [x.get_text() for x in ax.get_yticklabels()]  # drawn top to bottom, in the order checked
    assert labels == [
        "DiVA beats Margin (R@1)",
        "D&C beats Margin [R@1]",
        "DiVA beats Margin on NMI [NMI]",
        "MIC beats Margin [R@1]",
    ]
    intervals = sorted(
        tuple(np.round(l.get_xdata(), 6))
        for l in ax.lines
        if len(l.get_xdata()) == 2
        and l.get_linestyle() == "-"
        and l.get_color() == "black"
        and not l.get_xdata()[0] == l.get_xdata()[1] == 0
    )  # not the zero line
    expected = []
    for a, b, m in (
        ("DiVA-512", "Margin-512", "R@1"),
        ("D&C-128", "Margin-128", "R@1"),
        ("DiVA-512", "Margin-512", "NMI"),
        ("MIC-128", "Margin-128", "R@1"),
    ):
        diff = difference(stat(t, a, m), stat(t, b, m))
        d, thr = diff[0], diff.threshold
        verdict = judge(stat(t, a, m), stat(t, b, m))
        assert (verdict == Verdict.HOLDS) == (d - thr > 0) and (verdict == Verdict.FAILS) == (d + thr < 0)
        expected.append(tuple(np.round([d - thr, d + thr], 6)))
    assert intervals == sorted(expected)
    paper = [l for l in ax.lines if l.get_label() == "the paper's difference"][0]
    np.testing.assert_allclose(
        paper.get_xdata(), [69.2 - 63.9, 65.9 - 60.7, np.nan, np.nan]
    )  # no NMI / MIC in the paper file
    assert any(l.get_xdata()[0] == 0 == l.get_xdata()[1] and len(l.get_xdata()) == 2 for l in ax.lines)  # zero marked
    assert (c.figures_dir / "repro_demo_claims.png").stat().st_size > 0


def test_the_claims_file_says_what_the_seeds_resolve(claims):
    c, t = claims
    rows = ["DiVA-512", "Margin-512", "D&C-128", "Margin-128", "MIC-128"]
    spread = math.sqrt(np.mean(t.loc[rows, "R@1 std"] ** 2))
    assert (
        c.resolves()["R@1"]
        == pytest.approx(critical(8) * spread * math.sqrt(2 / 5))
        == pytest.approx(resolvable(t, rows=rows))
    )
    c.save()
    f = c.figures_dir / "repro_demo_claims.json"  # the claims as data: the Markdown beside it is rendered from it
    assert f"R@1 {c.resolves()['R@1']:.1f}, NMI {c.resolves()['NMI']:.1f}" == resolution(f)
    table, total = claims_summary(c.figures_dir)
    assert f"| {resolution(f)} |" in table and total["unresolved"] == sum(i["verdict"] == "unresolved" for i in c.items)


def test_one_seed_draws_a_dot_without_an_interval(tmp_path):
    t = flagship_like().assign(**{"R@1 std": np.nan, "seeds": 1})
    c = Claims("repro_one", tmp_path)
    c.beats("DiVA beats Margin", t, "DiVA-512", "Margin-512")
    assert math.isnan(c.resolves()["R@1"]) and "No compared row has two seeds" in c.resolution()
    ax = c.plot().axes[0]
    assert not [l for l in ax.lines if len(l.get_xdata()) == 2 and l.get_linestyle() == "-" and l.get_xdata()[0] != 0]


def test_absolute_bars_show_the_se_and_leave_out_zero_when_it_hides_the_spread():
    t = flagship_like()
    assert hides_spread(t["R@1"].values, t["R@1 std"].values)
    fig = plot_bars(t["R@1"], t["R@1 std"], seeds=t["seeds"])
    ax = fig.axes[0]
    assert ax.get_ylim()[0] > 55, "the 1.7-point spread must not sit on bars from zero"
    labels = ax.get_legend_handles_labels()[1]
    assert "± 1 SE over seeds (std/√n)" in labels and "± std over seeds" not in labels
    seg = [c for c in ax.collections if hasattr(c, "get_segments")][0].get_segments()
    np.testing.assert_allclose([s[1][1] - s[0][1] for s in seg], 2 * t["R@1 std"].values / math.sqrt(5))
    wide = plot_bars(pd.Series([20.0, 60.0], index=["a", "b"]), pd.Series([1.0, 1.0], index=["a", "b"]))
    assert wide.axes[0].get_ylim()[0] == 0  # a spread the bars show: from zero


def test_the_claims_file_says_which_tasks_idled(tmp_path, monkeypatch):
    """`Reproduction.tasks` reads each finished run's epochs: an idle task is named with the epoch from which it stayed
    idle in how many seeds, why in the last epoch and its own logs (more cases: test_idle_epoch.py)."""
    import types
    import dml_nb.reproduction.notebook as N

    hist = {
        "r0": {
            "epoch": 8,
            "loss/discriminative": 0.5,
            "grad/discriminative": 0.25,
            "loss/dance": 0.0,
            "grad/dance": 0.0,
            "nonzero_weights/dance": 1.0,
        },
        "r1": {
            "epoch": 8,
            "loss/discriminative": 0.4,
            "grad/discriminative": 0.2,
            "loss/dance": 2e-4,
            "grad/dance": 1e-5,
            "nonzero_weights/dance": 0.9,
        },
        "b0": {"epoch": 8, "loss": 0.3, "grad_norm": 0.1},
    }
    monkeypatch.setattr(
        N, "load_result", lambda d: types.SimpleNamespace(history_frame=lambda: pd.DataFrame([hist[Path(d).name]]))
    )
    nb = N.Reproduction("repro_demo", "shapes", "cub200", {}, [0, 1], tmp_path, tmp_path, False)
    nb.per_seed = pd.DataFrame(
        {
            "row": ["DiVA", "DiVA", "Margin", "Margin"],
            "seed": [0, 1, 0, 1],
            "status": ["ok", "ok", "ok", "x"],
            "run": ["r0", "r1", "b0", None],
        }
    )
    text = nb.tasks()
    assert (
        "DiVA: dance idle from epoch 8 in 2 of 2 seeds (seed 0: from 8; seed 1: from 8; in the last epoch: zero loss "
        "and gradient; gradient 5.0e-05 of the largest task's; mean nonzero_weights 0.95); discriminative never idle."
    ) in text
    assert text.endswith("Never idle in any epoch: the single-task rows Margin.")
    hist["r0"].update({"loss/dance": 0.1, "grad/dance": 0.1})
    hist["r1"].update({"loss/dance": 0.1, "grad/dance": 0.1})
    assert nb.tasks().endswith(
        ": none. Never idle in any epoch: every task of DiVA (discriminative, dance; 2 seeds); the single-task rows Margin."
    )


def test_a_row_run_again_replaces_its_per_seed_lines(tmp_path, monkeypatch):
    "Running a cell again (the same rows) keeps one line per row and seed, so the difference can still be paired."
    import dml_nb.reproduction.notebook as N

    frames = iter(
        [
            pd.DataFrame({"row": ["A", "A"], "seed": [0, 1], "status": ["ok", "ok"], "recall@1": [0.3, 0.4]}),
            pd.DataFrame({"row": ["B", "B"], "seed": [0, 1], "status": ["ok", "ok"], "recall@1": [0.2, 0.3]}),
            pd.DataFrame({"row": ["A", "A"], "seed": [0, 1], "status": ["ok", "ok"], "recall@1": [0.5, 0.6]}),
        ]
    )
    monkeypatch.setattr(N, "run_rows", lambda *a, **k: (next(frames), {}))
    nb = N.Reproduction("repro_demo", "shapes", "cub200", {"train": {"epochs": 1}}, [0, 1], tmp_path, tmp_path, False)
    for rows in ({"A": {}}, {"B": {}}, {"A": {}}):
        nb.run(rows)
    assert sorted(zip(nb.per_seed["row"], nb.per_seed["seed"])) == [("A", 0), ("A", 1), ("B", 0), ("B", 1)]
    assert nb.per_seed.loc[nb.per_seed["row"] == "A", "recall@1"].tolist() == [0.5, 0.6]


def flagship_claims(tmp_path, paper=None):
    "The flagship's claims on `flagship_like` numbers: two single comparisons and DiVA above each of five rows."
    t = flagship_like()
    c = Claims("repro_demo", tmp_path, paper=paper)
    c.beats("DiVA beats the margin baseline (R@1)", t, "DiVA-512", "Margin-512")
    others = ["Margin-512", "Margin-128", "MultiSim-512", "D&C-128", "MIC-128"]
    c.beats_all("DiVA beats every other method (R@1)", t, [("DiVA-512", o) for o in others])
    c.beats("BSPML beats Multi-Similarity (R@1)", t, "BSPML-512", "MultiSim-512")
    return c, t, others


def test_every_part_of_a_composite_claim_is_drawn_with_its_own_interval(tmp_path):
    c, t, others = flagship_claims(tmp_path)
    assert c.items[1]["verdict"] == all_hold(better(t, "DiVA-512", o) for o in others).value  # the rule's verdict
    f = c.forest()
    assert list(f["label"]) == [
        "DiVA beats the margin baseline (R@1)",
        "DiVA beats every other method (R@1)",
        *[f"DiVA-512 vs {o}" for o in others],
        "BSPML beats Multi-Similarity (R@1)",
    ]
    assert list(f["group"]) == [False] + [True] * 6 + [False]
    assert set(f.loc[f["group"], "claim"]) == {"DiVA beats every other method (R@1)"}  # grouped under its name
    for line in f.itertuples():
        if line.label.startswith("DiVA-512 vs "):
            a, b = "DiVA-512", line.label.removeprefix("DiVA-512 vs ")
        elif line.group:
            assert np.isnan(line.difference) and np.isnan(line.threshold)  # the header: the claim's name only
            continue
        else:
            a, b = ("DiVA-512", "Margin-512") if line.label.startswith("DiVA") else ("BSPML-512", "MultiSim-512")
        diff = difference(stat(t, a), stat(t, b))
        assert line.verdict == judge(stat(t, a), stat(t, b)).value
        np.testing.assert_allclose(
            [line.difference, line.se, line.t, line.low, line.high],
            [diff[0], diff[1], critical(diff.df), diff[0] - diff.threshold, diff[0] + diff.threshold],
        )  # its own t SE: the very threshold its own verdict used
    ax = c.plot().axes[0]
    assert [x.get_text() for x in ax.get_yticklabels()] == list(f["label"])
    assert [x.get_fontweight() for x in ax.get_yticklabels()][1] == "bold"  # the claim's name over its parts
    drawn = sorted(
        tuple(np.round(l.get_xdata(), 6))
        for l in ax.lines
        if len(l.get_xdata()) == 2 and l.get_color() == "black" and not l.get_xdata()[0] == l.get_xdata()[1] == 0
    )
    want = sorted(tuple(np.round([lo, hi], 6)) for lo, hi in zip(f["low"], f["high"]) if np.isfinite(lo))
    assert drawn == want and len(drawn) == 7  # two single claims and five parts, each its own interval
    assert "not drawn" not in ax.get_title()


def test_a_paper_difference_across_two_papers_tables_is_marked_and_not_drawn(tmp_path):
    paper = pd.DataFrame(
        {
            "R@1": [64.4, 63.6, 65.7, 65.9, 66.1, 69.2, 50.6],
            "source": [
                "DiVA Table 3 (Margin-R50-512)",
                "DiVA Table 3 (Margin [59])",
                "DiVA Table 3 (MultiSim [58])",
                "DiVA Table 3 (D&C [48])",
                "DiVA Table 3 (MIC [46])",
                "DiVA Table 3 (DiVA-R50-512)",
                "BSPML Table 1",
            ],
        },
        index=["Margin-512", "Margin-128", "MultiSim-512", "D&C-128", "MIC-128", "DiVA-512", "BSPML-512"],
    )
    c, t, others = flagship_claims(tmp_path, paper)
    f = c.forest()
    np.testing.assert_allclose(f["paper"].iloc[[0, 2, 3]], [69.2 - 64.4, 69.2 - 64.4, 69.2 - 63.6])
    assert np.isnan(f["paper"].iloc[-1])  # BSPML Table 1 beside DiVA Table 3: not drawn
    why = "BSPML-512's number is from BSPML Table 1, MultiSim-512's from DiVA Table 3"
    assert f["paper_omitted"].iloc[-1] == why and set(f["paper_omitted"].iloc[:-1]) == {""}
    ax = c.plot().axes[0]
    paper_line = [l for l in ax.lines if l.get_label() == "the paper's difference"][0]
    assert np.isnan(paper_line.get_xdata()[-1]) and np.isfinite(paper_line.get_xdata()[0])
    c.save()
    data = json.loads((tmp_path / "repro_demo_claims.json").read_text())
    assert data["claims"][-1]["paper_difference"] == pytest.approx(50.6 - 65.7)  # kept in the file, marked
    assert data["claims"][-1]["paper_omitted"] == why and data["claims"][0]["paper_omitted"] is None
    parts = data["claims"][1]["parts"]
    assert [p["b"] for p in parts] == others and all(p["paper_omitted"] is None for p in parts)
    assert parts[0]["margin"] == pytest.approx(
        c.items[1]["parts"][0]["difference"] / c.items[1]["parts"][0]["threshold"]
    )
    md = (tmp_path / "repro_demo_claims.md").read_text()
    assert "**Paper.** The paper's difference is shown only where both numbers come from one table of one paper; " in md
    assert f"BSPML beats Multi-Similarity (R@1) ({why})." in md
