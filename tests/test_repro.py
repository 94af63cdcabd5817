"""The reproduction harness: parameter files fit their notebooks, the collector reads a checked-in set of runs,
tables and claims come out as documented."""

from pathlib import Path

import numpy as np
import pandas as pd
import papermill
import pytest
import yaml

from dml_nb.reproduction.claims import Claims, Verdict, better
from dml_nb.reproduction.notebook import params_base, setup
from dml_nb.reproduction.repro import collect_runs, compare, summarize, paper_numbers, Row, base_config, smoke
from dml_nb.reproduction.transfer import regime_v2_file
from dml_nb.core.config import ConfigError, make_config

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
    base = params_base(raw)
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
    assert list(df["run"]) == [
        "baseline-shapes-000000000001",
        "baseline-shapes-000000000002",
        "diva-shapes-000000000003",
    ]
    assert list(df["method"]) == ["baseline", "baseline", "diva"]
    assert df.loc[2, "test/shared/recall@1"] == pytest.approx(0.2)
    assert np.isnan(df.loc[0, "test/shared/recall@1"])
    with pytest.raises(FileNotFoundError, match="not a folder of runs"):
        collect_runs(ROOT / "tests" / "fixtures" / "missing")


def test_collected_runs_make_a_table_with_the_paper_beside(tmp_path):
    df = collect_runs(ROOT / "tests" / "fixtures" / "runs")
    per_seed = df.rename(columns=lambda c: c[len("test/") :] if c.startswith("test/") and c.count("/") == 1 else c)
    per_seed = per_seed.assign(row=df["method"], status="ok")
    table = summarize(per_seed, metrics=("recall@1", "nmi"))
    assert table.loc["baseline", "R@1"] == pytest.approx(31.0)
    assert table.loc["baseline", "R@1 std"] == pytest.approx(np.std([30, 32], ddof=1))
    assert np.isnan(table.loc["diva", "R@1 std"]) and table.loc["diva", "seeds"] == 1
    paper = pd.DataFrame({"R@1": [63.6, 66.4]}, index=pd.Index(["baseline", "diva"], name="row"))
    out = compare(table, paper, ["R@1"])
    assert out.loc["baseline", "R@1 ours"] == "31.0 ± 1.4" and out.loc["diva", "R@1 paper"] == "66.4"
    claims = Claims("fixture", tmp_path)
    # diva ran one seed: 4 points above the baseline, but one seed has no spread to judge by
    assert claims.check("diva beats baseline", better(table, "diva", "baseline")) == Verdict.UNRESOLVED
    assert claims.frame()["verdict"].tolist() == ["unresolved"]


def test_paper_numbers_of_the_flagship():
    p = paper_numbers("repro_table3", "cub200")
    assert p.loc["DiVA-512", "R@1"] == pytest.approx(69.2) and p.loc["Margin-128", "NMI"] == pytest.approx(69.0)
    with pytest.raises(FileNotFoundError, match="paper.csv"):
        paper_numbers("repro_no_such_item")


def test_smoke_shrinks_only_when_asked(monkeypatch):
    monkeypatch.setattr("dml_nb.reproduction.repro.in_test", lambda: False)
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
    from dml_nb.reproduction.repro import portable

    msg = f"weights missing: none of a.pth is in {torch.hub.get_dir()}/checkpoints (home {Path.home()})"
    out = portable(msg)
    assert "$TORCH_HOME/hub/checkpoints" in out and str(Path.home()) not in out


def test_committed_figures_hold_no_machine_specific_paths():
    import re

    bad = []
    for f in sorted((ROOT / "figures").rglob("*")):
        if f.suffix in (".md", ".csv"):
            for hit in re.findall(r"(/root/|/home/\w+|/tmp/|/Users/\w+)", f.read_text()):
                bad.append(f"{f.name}: {hit}")
    assert not bad, bad


def test_tables_say_which_epoch_their_runs_report():
    from dml_nb.reproduction.repro import reported_as

    last, best = "last epoch", "best epoch by test/recall@1"
    assert reported_as(pd.DataFrame({"row": ["a", "b"], "reported": [best, best]})) == best
    assert reported_as(pd.DataFrame({"row": ["a", "b"], "reported": [last, best]})) == f"mixed: {last} (a) / {best} (b)"
    assert reported_as(pd.DataFrame({"row": ["a"], "status": ["not run: no data"]})) == last


def test_paper_scale_runs_write_their_own_figure_folder(tmp_path, monkeypatch):
    from dml_nb.reproduction.repro import output_dirs, paper_variant

    assert paper_variant(base_config("shapes")) is None and paper_variant(base_config("digits")) is None
    raw = yaml.safe_load((ROOT / "params" / "repro_table3" / "cub200.yaml").read_text())
    variant = paper_variant(params_base(raw))
    assert variant == "cub200-resnet50"
    monkeypatch.setattr("dml_nb.reproduction.repro.in_test", lambda: False)
    (tmp_path / "settings.ini").write_text("[DEFAULT]\nlib_name = dml_nb\n")
    monkeypatch.chdir(tmp_path)
    f, _ = output_dirs(variant=variant)
    assert f == tmp_path / "figures" / "cub200-resnet50" and output_dirs()[0] == tmp_path / "figures"


# The collector's golden test: real run folders (smoke-size runs of these rows, regenerated by
# tests/fixtures/collector/regenerate.py) and the collector's whole output, checked in.
COLLECTOR = ROOT / "tests" / "fixtures" / "collector"
COLLECTOR_BASE = base_config()
COLLECTOR_SEEDS = [0, 1]
COLLECTOR_ROWS = [
    Row("Margin", {"name": "baseline", "embedding_dim": 32}),
    Row("MultiSim", {"name": "baseline", "embedding_dim": 32, "loss": "multi_similarity", "miner": "multi_similarity"}),
    Row("MIC phi*", {"name": "mic", "embedding_dim": 32}, head="phi_star", group="sharing"),
]


def collector_outputs(runs: Path) -> dict:
    "Everything the collector gives on `runs`, as text: every finished run, a notebook's per-seed frame, its table."
    rows = [
        *COLLECTOR_ROWS,
        Row("Margin (GPU)", {"name": "baseline", "embedding_dim": 48}),
        Row("never run", {"name": "baseline", "embedding_dim": 16}),
    ]
    skipped = {
        ("Margin (GPU)", s): "not run: needs a GPU (train.device is cuda) and none is available"
        for s in COLLECTOR_SEEDS
    }
    per_seed = collect_runs(runs, rows, COLLECTOR_BASE, COLLECTOR_SEEDS, skipped)
    paper = pd.DataFrame(
        {"R@1": [63.6, 60.0], "NMI": [69.0, np.nan]}, index=pd.Index(["Margin", "paper only"], name="row")
    )
    table = summarize(per_seed, metrics=("recall@1", "recall@2", "nmi"))
    return {
        "runs.csv": collect_runs(runs).to_csv(index=False),
        "per_seed.csv": per_seed.to_csv(index=False),
        "table.csv": table.to_csv(),
        "compare.csv": compare(table, paper, ["R@1", "NMI"]).to_csv(),
    }


@pytest.mark.parametrize("name", ["runs.csv", "per_seed.csv", "table.csv", "compare.csv"])
def test_collector_whole_output_is_golden(name):
    "Any change of a number, a column or the order of rows in what the collector gives fails here."
    got = collector_outputs(COLLECTOR / "runs")[name]
    want = (COLLECTOR / "expected" / name).read_text()
    assert got == want, f"collector output {name} changed; if on purpose, run tests/fixtures/collector/regenerate.py"


def test_collector_fixture_is_small_and_real():
    files = [f for f in (COLLECTOR / "runs").rglob("*") if f.is_file()]
    assert sum(f.stat().st_size for f in files) < 200_000
    assert {f.name for f in files} == {"config.yaml", "metrics.json", "history.csv", "done"}
    per_seed = collector_outputs(COLLECTOR / "runs")["per_seed.csv"]
    assert per_seed.count(",ok,") == len(COLLECTOR_ROWS) * len(COLLECTOR_SEEDS), (
        "every fixture row must find its run folder"
    )


def _setup_defaults(nb: Path) -> dict | None:
    "The `defaults=` a reproduction notebook passes to `setup` (its own config sections), read from its code."
    import ast
    import json

    for c in json.loads(nb.read_text())["cells"]:
        if c["cell_type"] != "code" or "setup(" not in "".join(c["source"]):
            continue
        for node in ast.walk(ast.parse("".join(c["source"]))):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setup":
                return next((ast.literal_eval(k.value) for k in node.keywords if k.arg == "defaults"), None)
    raise AssertionError(f"{nb.name}: no setup(...) call")


def _smoke_cases():
    "Every method spec of the parameter files and of the notebooks' parameters cells, on its base: {case id: config}."
    import json
    from dml_nb.core.registry import METHODS

    def specs(obj, path=""):
        if isinstance(obj, dict):
            if isinstance(obj.get("name"), str) and obj["name"] in METHODS:
                yield path, obj
                return
            for k, v in obj.items():
                yield from specs(v, f"{path}/{k}")
        elif isinstance(obj, (list, tuple)):
            for i, v in enumerate(obj):
                yield from specs(v, f"{path}/{i}")

    sources = [(f"{f.parent.name}/{f.name}", yaml.safe_load(f.read_text()) or {}) for f in PARAM_FILES]
    for nb in NOTEBOOKS:
        cells = json.loads(nb.read_text())["cells"]
        k = next(i for i, c in enumerate(cells) if "parameters" in c["metadata"].get("tags", []))
        ns = {}
        exec("".join(cells[k]["source"]), ns)
        if "defaults" in cells[k + 1]["metadata"].get("tags", []):  # the long defaults of the parameters
            exec("".join(cells[k + 1]["source"]), ns)
        ns = {n: v for n, v in ns.items() if not n.startswith("DEFAULT_") and not n.startswith("__")}
        v2 = regime_v2_file(nb.stem)
        if v2.exists():  # a notebook switched to regime v3: its v3 defaults are new cases, its v2 run keeps its ids
            sources.append((f"{nb.stem}@v3", dict(ns), _setup_defaults(nb)))
            ns = {**ns, **(yaml.safe_load(v2.read_text()) or {})}
        sources.append((nb.stem, ns, _setup_defaults(nb)))
    out = {}
    for cid, p, *defaults in sources:
        base = params_base(p, *defaults)
        for path, spec in specs({k: v for k, v in p.items() if k not in ("config", "output")}):
            out[f"{cid}:{path}"] = Row(path, {"method": spec}).config(base)
        out[f"{cid}:base"] = base
    return out


def test_smoke_sizes_unchanged_since_methods_declare_them():
    """`smoke` reads each method's declared sizes (`SMOKE`, `SMOKE_IF_SET`, `SMOKE_UNLESS`); its output on every
    config of the parameter files and notebook defaults equals what the former hard-coded table in `repro` gave.
    A notebook switched to regime v3 keeps its ids for its v2 run (`params/regime_v2/`); its v3 defaults, ids
    `<notebook>@v3`, came after that table and pin `smoke` as it was when they were added."""
    import hashlib
    import json

    # three DiVA rows with a queue were recorded again when the transfer rule kept it at 30 batches (it had been 1):
    # smoke caps it at 2, so their smoke configs changed with it (nbs/67b_transfer.ipynb, rule 2)
    want = json.loads((ROOT / "tests" / "fixtures" / "smoke_hashes.json").read_text())
    got = {
        k: hashlib.sha1(json.dumps(smoke(v, force=True), sort_keys=True).encode()).hexdigest()[:16]
        for k, v in _smoke_cases().items()
    }
    missing = sorted(set(want) - set(got))
    assert not missing, f"configs no longer found (a parameter or notebook changed?): {missing[:5]}"
    changed = sorted(k for k in want if got[k] != want[k])
    assert not changed, f"smoke() changed for {len(changed)} configs, e.g. {changed[:5]}"


def test_smoke_queue_alternatives_and_phase_epochs():
    s = smoke({**base_config(), "method": {"name": "diva", "queue_size": 3360}}, force=True)["method"]
    assert s["queue_size"] == 120 and "queue_batches" not in s and s["num_clusters"] == 8
    s = smoke({**base_config(), "method": {"name": "mic", "options": {"num_groups": 40}}}, force=True)["method"][
        "options"
    ]
    assert s == {"num_groups": 4, "kmeans_iterations": 5}
    s = smoke(
        {**base_config(), "method": {"name": "dnc", "full_embedding_epoch": 190, "finetune_epoch": None}}, force=True
    )["method"]
    assert s["full_embedding_epoch"] == 1 and s["finetune_epoch"] is None and s["kmeans_iterations"] == 5


def test_setup_reads_the_parameters_and_shrinks_them(monkeypatch, tmp_path):
    from dml_nb.data.checks import write_fake_dataset

    monkeypatch.setenv("DML_DATA", str(tmp_path / "data"))  # setup checks a paper dataset is there
    write_fake_dataset("cars196", tmp_path / "data" / "cars196")
    params = {
        "dataset": "cars196",
        "config": {"model": {"backbone": "resnet50"}},
        "seeds": [0, 1, 2],
        "paper_dataset": "cub200",
        "gammas": [1.0, 2.0, 3.0],
        "rows": {"a": {}, "b": {}, "c": {}},
        "output": {"progress": False},
    }
    nb = setup("repro_sharing_table7", params, shrink={"gammas": 2, "rows": 1})
    assert (
        params["seeds"] == [0] and params["gammas"] == [1.0, 2.0] and params["rows"] == {"a": {}}
    )  # pytest: in_test()
    assert nb.shown == "cars196" and not nb.embedded and nb.figures.name == "cars196-resnet50"
    assert nb.note(compare="the ordering").endswith("paper: cars196."), "no embedded-data sentence on a paper dataset"
    with pytest.raises(KeyError, match="not a parameter"):
        setup("repro_sharing_table7", dict(params), shrink={"gamma": 1})
    monkeypatch.setattr("dml_nb.reproduction.repro.in_test", lambda: False)
    monkeypatch.setattr("dml_nb.reproduction.notebook.in_test", lambda: False)
    params = {
        "dataset": "shapes",
        "seeds": [0, 1],
        "paper_dataset": "cars196",
        "output": {"figures_dir": tmp_path, "runs_dir": tmp_path},
    }
    nb = setup("repro_sharing_table7", params, shrink={"seeds": 1})
    assert nb.seeds == [0, 1] and nb.shown == "cars196" and nb.embedded


def test_a_run_the_method_cannot_train_is_a_row_with_its_reason(monkeypatch, tmp_path):
    "A D&C run whose clusters cannot form batches (or a run with no tuples) is shown as stopped with the reason; the table goes on."
    import dml_nb.reproduction.repro as R
    from dml_nb.methods.dnc import ClusterError

    def stop(raw, runs_dir, progress=True, threads=None):
        raise ClusterError("1 of 2 clusters cannot form a batch with negatives")

    monkeypatch.setattr(R, "run_one", stop)
    per_seed, results = R.run_rows(
        [Row("D&C", {"name": "dnc", "num_learners": 2})],
        base_config("digits"),
        seeds=[0],
        runs_dir=tmp_path,
        progress=False,
    )
    assert results == {}
    assert per_seed["status"].tolist() == ["stopped: 1 of 2 clusters cannot form a batch with negatives"]
