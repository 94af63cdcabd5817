"""The reproduction harness: parameter files fit their notebooks, the collector reads a checked-in set of runs,
tables and claims come out as documented."""
from pathlib import Path

import numpy as np
import pandas as pd
import papermill
import pytest
import yaml

from dml_nb.repro import Claims, better, collect_runs, compare, summarize, paper_numbers, Row, base_config, smoke
from dml_nb.experiment import ConfigError, make_config

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "nbs").glob("repro_*.ipynb"))
PARAM_FILES = sorted(p for p in (ROOT / "params").glob("repro_*/*.yaml"))


def test_every_repro_notebook_has_params_and_paper_numbers():
    assert NOTEBOOKS, "no reproduction notebooks found"
    for nb in NOTEBOOKS:
        folder = ROOT / "params" / nb.stem
        assert list(folder.glob("*.yaml")), f"{nb.name}: no paper-scale parameter file in params/{nb.stem}/"


@pytest.mark.parametrize("path", PARAM_FILES, ids=[f"{p.parent.name}/{p.name}" for p in PARAM_FILES])
def test_params_keys_are_notebook_parameters(path):
    "papermill only warns about unknown keys: here an unknown key fails, naming the valid ones."
    nb = ROOT / "nbs" / f"{path.parent.name}.ipynb"
    assert nb.exists(), f"{path} has no notebook nbs/{path.parent.name}.ipynb"
    params = set(papermill.inspect_notebook(str(nb)))
    keys = set(yaml.safe_load(path.read_text()) or {})
    unknown = keys - params
    assert not unknown, f"{path}: {sorted(unknown)} are not parameters of {nb.name}; valid: {sorted(params)}"


@pytest.mark.parametrize("path", PARAM_FILES, ids=[f"{p.parent.name}/{p.name}" for p in PARAM_FILES])
def test_params_rows_build_valid_configs(path):
    "Every row of a parameter file layers into a config that passes validation (method options included)."
    raw = yaml.safe_load(path.read_text())
    base = base_config(raw.get("dataset", "shapes"), raw.get("data"), raw.get("model"), raw.get("train"), raw.get("eval"))
    make_config(base)
    for name, spec in (raw.get("rows") or {}).items():
        make_config(Row(name, spec).config(base))


def test_paper_csv_files_parse():
    for csv in sorted((ROOT / "params").glob("repro_*/paper.csv")):
        df = pd.read_csv(csv, comment="#")
        assert {"row", "dataset"} <= set(df.columns), f"{csv}: needs columns row, dataset"
        metrics = [c for c in df.columns if c.startswith(("R@", "MAP@R")) or c in ("NMI",)]
        for c in metrics:
            assert np.issubdtype(df[c].dtype, np.number), f"{csv}: metric column {c!r} is not numeric"


def test_collect_runs_reads_finished_runs_only():
    df = collect_runs(ROOT / "tests" / "fixtures" / "runs")
    assert list(df["run"]) == ["baseline-shapes-000000000001", "baseline-shapes-000000000002", "diva-shapes-000000000003"]
    assert list(df["method"]) == ["baseline", "baseline", "diva"]
    assert df.loc[2, "test/shared/recall@1"] == pytest.approx(0.2)
    assert np.isnan(df.loc[0, "test/shared/recall@1"])
    with pytest.raises(FileNotFoundError, match="not a folder of runs"):
        collect_runs(ROOT / "tests" / "fixtures" / "missing")


def test_collected_runs_make_a_table_with_the_paper_beside():
    df = collect_runs(ROOT / "tests" / "fixtures" / "runs")
    per_seed = df.rename(columns=lambda c: c[len("test/"):] if c.startswith("test/") and c.count("/") == 1 else c)
    per_seed = per_seed.assign(row=df["method"], status="ok")
    table = summarize(per_seed, metrics=("recall@1", "nmi"))
    assert table.loc["baseline", "R@1"] == pytest.approx(31.0)
    assert table.loc["baseline", "R@1 std"] == pytest.approx(np.std([30, 32], ddof=1))
    assert np.isnan(table.loc["diva", "R@1 std"]) and table.loc["diva", "seeds"] == 1
    paper = pd.DataFrame({"R@1": [63.6, 66.4]}, index=pd.Index(["baseline", "diva"], name="row"))
    out = compare(table, paper, ["R@1"])
    assert out.loc["baseline", "R@1 ours"] == "31.0 ± 1.4" and out.loc["diva", "R@1 paper"] == "66.4"
    claims = Claims("fixture")
    assert claims.check("diva beats baseline", better(table, "diva", "baseline")) is True
    assert claims.frame()["verdict"].tolist() == ["holds"]


def test_paper_numbers_of_the_flagship():
    p = paper_numbers("repro_table3", "cub200")
    assert p.loc["DiVA-512", "R@1"] == pytest.approx(69.2) and p.loc["Margin-128", "NMI"] == pytest.approx(69.0)
    with pytest.raises(FileNotFoundError, match="paper.csv"):
        paper_numbers("repro_no_such_item")


def test_smoke_shrinks_only_when_asked(monkeypatch):
    monkeypatch.setattr("dml_nb.repro.in_test", lambda: False)
    raw = {**base_config(), "method": {"name": "bspml"}}
    # pytest sets PYTEST_CURRENT_TEST, so in_test() is true here: force=False still shrinks; check the sizes
    s = smoke(raw, force=True)
    assert s["train"]["epochs"] == 2 and s["train"]["batches_per_epoch"] == 2 and s["method"]["solver_iters"] == 30
    assert raw["train"]["epochs"] == 6, "smoke must not modify its input"


def test_row_spec_errors_name_the_sections():
    with pytest.raises(ConfigError, match="unknown section"):
        Row("x", {"method": {"name": "baseline"}, "optimiser": {}}).config(base_config())


def test_status_messages_name_no_machine_folders():
    import torch.hub
    from dml_nb.repro import portable
    msg = f"weights missing: none of a.pth is in {torch.hub.get_dir()}/checkpoints (home {Path.home()})"
    out = portable(msg)
    assert "$TORCH_HOME/hub/checkpoints" in out and str(Path.home()) not in out


def test_committed_figures_hold_no_machine_specific_paths():
    import re
    bad = []
    for f in sorted((ROOT / "figures").rglob("*")):
        if f.suffix in (".md", ".csv"):
            for hit in re.findall(r"(/root/|/home/\w+|/tmp/|/Users/\w+)", f.read_text()): bad.append(f"{f.name}: {hit}")
    assert not bad, bad


def test_tables_say_which_epoch_their_runs_report():
    from dml_nb.repro import reported_as
    last, best = "last epoch", "best epoch by test/recall@1"
    assert reported_as(pd.DataFrame({"row": ["a", "b"], "reported": [best, best]})) == best
    assert reported_as(pd.DataFrame({"row": ["a", "b"], "reported": [last, best]})) == f"mixed: {last} (a) / {best} (b)"
    assert reported_as(pd.DataFrame({"row": ["a"], "status": ["not run: no data"]})) == last


def test_paper_scale_runs_write_their_own_figure_folder(tmp_path, monkeypatch):
    from dml_nb.repro import output_dirs, paper_variant
    assert paper_variant(base_config("shapes")) is None and paper_variant(base_config("digits")) is None
    raw = yaml.safe_load((ROOT / "params" / "repro_table3" / "cub200.yaml").read_text())
    variant = paper_variant(base_config(raw["dataset"], raw.get("data"), raw.get("model"), raw.get("train"), raw.get("eval")))
    assert variant == "cub200-resnet50"
    monkeypatch.setattr("dml_nb.repro.in_test", lambda: False)
    (tmp_path / "settings.ini").write_text("[DEFAULT]\nlib_name = dml_nb\n")
    monkeypatch.chdir(tmp_path)
    f, _ = output_dirs(variant=variant)
    assert f == tmp_path / "figures" / "cub200-resnet50" and output_dirs()[0] == tmp_path / "figures"
