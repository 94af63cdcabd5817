"""An explicit reproduction flow: the run policy is read from the environment only at an entry point and passed down;
reading a run saves nothing; a parameters cell is read, never run; progress bars are scoped to a run and drawn at
once; a bare `dml-reproduce` changes no tracked file; one count parser for every command."""

import ast
import io
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

import dml_nb
from dml_nb.experiments.results import POLICY_ENV, RunPolicy, run_policy

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = Path(dml_nb.__file__).parent

# Where a `DML_*` variable may be read: the one translation into a run policy, and the dataset folder (`DML_DATA`, a
# data location like TORCH_HOME, not a run policy). {(module path, function): names}
ENTRY_READS = {
    ("experiments/results.py", "RunPolicy.from_env"): set(POLICY_ENV.values()),
    ("core/base.py", "data_root"): {"DML_DATA"},
    ("data/build.py", "config_data_root"): {"DML_DATA"},
    ("reproduction/repro.py", "portable"): {"DML_DATA"},
}
RESTORES = {("sweeps/sweep.py", "env_vars")}  # reads a variable it sets only to put it back after its block


def _string_constants(trees) -> dict:
    "Module-level NAME = 'text' (and NAME1, NAME2 = 'a', 'b') bindings of every module: how a key may be named."
    out = {}
    for tree in trees:
        for st in tree.body:
            if not isinstance(st, ast.Assign):
                continue
            for t in st.targets:
                pairs = [(t, st.value)]
                if isinstance(t, ast.Tuple) and isinstance(st.value, ast.Tuple):
                    pairs = list(zip(t.elts, st.value.elts))
                for name, value in pairs:
                    if isinstance(name, ast.Name) and isinstance(value, ast.Constant) and isinstance(value.value, str):
                        out[name.id] = value.value
    return out


def _is_environ(node) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "environ" and getattr(node.value, "id", None) == "os"


def _env_reads(tree, constants: dict):
    """(function qualname, key or None when not a constant, line) of every read of the environment in `tree`:
    os.environ[...], os.environ.get(...), os.getenv(...), `... in os.environ`, and `env.get(...)` on a name bound to
    os.environ."""
    reads = []

    def key_of(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return node.value
        if isinstance(node, ast.Name) and node.id in constants:
            return constants[node.id]
        if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id == "POLICY_ENV":
            return "DML_*"  # POLICY_ENV["..."]: a run-policy variable
        return None

    def visit(node, scope):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            scope = f"{scope}.{node.name}" if scope else node.name
        if isinstance(node, ast.Subscript) and _is_environ(node.value) and isinstance(node.ctx, ast.Load):
            reads.append((scope, key_of(node.slice), node.lineno))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args:
            f = node.func
            if (f.attr == "get" and _is_environ(f.value)) or (
                f.attr == "getenv" and getattr(f.value, "id", "") == "os"
            ):
                reads.append((scope, key_of(node.args[0]), node.lineno))
            elif (
                f.attr == "get" and isinstance(f.value, ast.Name) and f.value.id == "env" and scope.endswith("from_env")
            ):
                reads.append((scope, key_of(node.args[0]), node.lineno))  # RunPolicy.from_env's `env = os.environ`
        if isinstance(node, ast.Compare) and any(_is_environ(c) for c in node.comparators):
            reads.append((scope, key_of(node.left), node.lineno))
        for child in ast.iter_child_nodes(node):
            visit(child, scope)

    visit(tree, "")
    return reads


def test_no_dml_variable_is_read_below_an_entry_point():
    files = sorted(p for p in PACKAGE.rglob("*.py") if p.name != "_modidx.py")
    trees = {p: ast.parse(p.read_text()) for p in files}
    constants = _string_constants(trees.values())
    found, bad = set(), []
    for path, tree in trees.items():
        rel = path.relative_to(PACKAGE).as_posix()
        for scope, key, line in _env_reads(tree, constants):
            allowed = ENTRY_READS.get((rel, scope), set())
            if key is None and (rel, scope) in RESTORES:
                continue
            if key is None:  # a key that is not a constant: it could be any DML_* variable
                bad.append(f"{rel}:{line} ({scope}) reads the environment with a key that is not a constant")
            elif key.startswith("DML_"):
                if key in allowed or (key == "DML_*" and allowed):
                    found.add((rel, scope))
                else:
                    bad.append(f"{rel}:{line} ({scope or 'module'}) reads ${key} below an entry point")
    assert not bad, "\n".join(bad)
    assert found == set(ENTRY_READS), f"an entry-point reader moved or was renamed: {set(ENTRY_READS) - found}"


def test_the_scan_catches_a_read_below_an_entry_point():
    "The scan above is not vacuous: a module that reads $DML_PLAN, or the environment with a computed key, is caught."
    tree = ast.parse(
        "import os\nPLAN = 'DML_PLAN'\ndef mode():\n    return os.environ.get(PLAN)\n"
        "def anything(name):\n    return os.getenv(name)\ndef data():\n    return 'DML_RUNS' in os.environ\n"
    )
    reads = _env_reads(tree, _string_constants([tree]))
    assert reads == [("mode", "DML_PLAN", 4), ("anything", None, 6), ("data", "DML_RUNS", 8)], reads


def test_a_notebooks_policy_travels_as_environment_variables_and_back(tmp_path):
    "What `dml-reproduce` hands a notebook's process (`environ`) is what the notebook's `setup` reads (`from_env`)."
    for p in (
        RunPolicy(),
        RunPolicy("collect", results=tmp_path / "kept", runs=tmp_path / "runs"),
        RunPolicy("plan", plan=tmp_path / "plan.jsonl", runs=tmp_path / "runs"),
    ):
        env = {k: v for k, v in p.environ().items() if v is not None}
        assert RunPolicy.from_env(tmp_path, results_default=tmp_path / "default", environ=env) == p


def test_load_result_saves_nothing(tmp_path, monkeypatch):
    from dml_nb.experiments.experiment import load_result, run
    from dml_nb.experiments.results import save_result

    raw = {
        "data": {"images_per_class": 8},
        "train": {"epochs": 1, "batch_size": 16, "samples_per_class": 4},
        "method": {"name": "baseline", "embedding_dim": 8},
        "model": {"options": {"width": 8}},
        "eval": {"metrics": ["recall@1"]},
    }
    res = run(raw, runs_dir=tmp_path / "runs", progress=False, threads=1)
    monkeypatch.setenv("DML_RESULTS", str(tmp_path / "env-results"))  # the old way it was told to save
    with RunPolicy(results=tmp_path / "kept").applied():
        again = load_result(res.run_dir)
    assert again.metrics == res.metrics
    assert not (tmp_path / "kept").exists() and not (tmp_path / "env-results").exists()
    assert save_result(res.run_dir, tmp_path / "kept") == tmp_path / "kept" / res.run_dir.name  # the caller's step


# one count parser ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", ["0", "-1", "x", "513"])
def test_both_commands_refuse_a_bad_count_with_the_same_message(bad, tmp_path, capsys):
    from dml_nb.experiments.cli import main as dml_train
    from dml_nb.reproduction.reproduce import reproduce_main

    (params := tmp_path / "p.yaml").write_text("seed: 0\n")
    runs = [
        ("dml-train --threads", lambda: dml_train([str(params), "--threads", bad])),
        ("dml-reproduce --threads", lambda: reproduce_main(["--threads", bad])),
        ("dml-reproduce --workers", lambda: reproduce_main(["--workers", bad])),
    ]
    messages = []
    for what, call in runs:
        with pytest.raises(SystemExit) as e:
            call()
        err = capsys.readouterr().err
        assert e.value.code == 2, (what, err)
        messages.append(err.strip().split(": error: ", 1)[1])
    option = lambda m: m.split(":", 1)[0]
    assert [option(m) for m in messages] == ["argument --threads", "argument --threads", "argument --workers"]
    assert {m.split(": ", 1)[1] for m in messages} == {f"expected a whole number from 1 to 512; got {bad!r}"}


def test_dml_train_takes_the_largest_count(tmp_path):
    from dml_nb.experiments.cli import _parser

    assert _parser().parse_args(["p.yaml", "--threads", "512"]).threads == 512


# a bare dml-reproduce changes no tracked file -------------------------------------------------------------------------


@pytest.fixture
def clone(tmp_path, monkeypatch):
    """A git clone-like project: a notebook, REPORT.md with a claim table, committed figures/ and results/, all tracked;
    papermill replaced by a stand-in notebook that writes its figures where its parameters say, as `setup` picks them."""
    import papermill

    import dml_nb.reproduction.reproduce as R

    root = tmp_path / "project"
    (root / "nbs").mkdir(parents=True)
    (root / "settings.ini").write_text("[DEFAULT]\nlib_name = dml_nb\n")
    (root / "nbs" / "repro_x.ipynb").write_text(
        json.dumps({"cells": [], "metadata": {}, "nbformat": 4, "nbformat_minor": 5})
    )
    (root / "REPORT.md").write_text("# x\n<!-- claims -->\nold table\n<!-- /claims -->\n")
    (root / "figures").mkdir()
    (root / "figures" / "repro_x.md").write_text("committed\n")
    (root / "results").mkdir()
    (root / ".gitignore").write_text("/runs/\n/figures/*/\n")
    git = lambda *a: subprocess.run(["git", *a], cwd=root, check=True, capture_output=True)
    git("init", "-q")
    git("-c", "user.email=t@t", "-c", "user.name=t", "add", ".")
    git("-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "x")
    calls = []

    def notebook(nb, out, parameters, **kw):  # what the real notebook's setup does with `output.figures_dir`
        calls.append(parameters)
        figures = Path(parameters["output"].get("figures_dir") or root / "figures" / "local")
        figures.mkdir(parents=True, exist_ok=True)
        (figures / "repro_x.md").write_text("new\n")
        Path(out).write_text((root / "nbs" / "repro_x.ipynb").read_text())

    monkeypatch.setattr(papermill, "execute_notebook", notebook)
    monkeypatch.setattr(R, "project_root", lambda: root)
    monkeypatch.setattr(R, "update_readme_claims", lambda readme, figures: Path(readme).write_text("rewritten\n"))
    monkeypatch.chdir(root)
    status = lambda: git("status", "--porcelain", "--untracked-files=all").stdout.decode()
    return SimpleNamespace(root=root, calls=calls, status=status)


def test_a_bare_dml_reproduce_modifies_no_tracked_file(clone, capsys):
    from dml_nb.reproduction.reproduce import reproduce_main

    assert reproduce_main(["repro_x", "--runs-dir", str(clone.root / "runs")]) == 0
    assert clone.status() == "", clone.status()  # nothing tracked changed, nothing new outside ignored folders
    assert (clone.root / "figures" / "local" / "repro_x.md").read_text() == "new\n"
    assert (clone.root / "figures" / "local" / ".reproduced.json").exists()
    assert "figures_dir" not in clone.calls[0]["output"]


def test_write_committed_writes_the_committed_outputs(clone):
    from dml_nb.reproduction.reproduce import reproduce_main

    assert reproduce_main(["repro_x", "--write-committed", "--runs-dir", str(clone.root / "runs")]) == 0
    changed = sorted(line[3:] for line in clone.status().splitlines())
    assert changed == ["REPORT.md", "figures/.reproduced.json", "figures/repro_x.md"], changed


def test_write_notebooks_asks_for_write_committed(clone, capsys):
    from dml_nb.reproduction.reproduce import reproduce_main

    with pytest.raises(SystemExit) as e:
        reproduce_main(["repro_x", "--write-notebooks"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "give --write-committed too" in err and err.count("\n") == 1, err
    assert clone.calls == [] and clone.status() == ""


def test_help_says_what_a_bare_run_writes(capsys):
    from dml_nb.reproduction.reproduce import reproduce_main

    with pytest.raises(SystemExit):
        reproduce_main(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "Alone it writes no tracked file" in out and "--write-committed" in out, out


# progress bars ---------------------------------------------------------------------------------------------------------


def test_terminal_bars_are_scoped_to_the_block_even_when_it_raises():
    import tqdm.auto

    from dml_nb.reproduction.notebook import terminal_bars

    before = tqdm.auto.tqdm
    with pytest.raises(RuntimeError):
        with terminal_bars() as bar:
            assert tqdm.auto.tqdm is bar and bar.to_terminal
            raise RuntimeError("a run failed")
    assert tqdm.auto.tqdm is before


def _fake_learner(**kw):
    fields = dict(epoch=0, epochs=3, step=1, steps_in_epoch=4, is_main=True)
    return SimpleNamespace(**{**fields, **kw}, running=lambda k: 0.5, headline_recall=lambda: None)


class _Stream(io.StringIO):
    def __init__(self, tty: bool):
        super().__init__()
        self.tty = tty

    def isatty(self):
        return self.tty


@pytest.mark.parametrize("tty,interval", [(True, 1.0), (False, 30.0)])
def test_the_learners_bar_draws_its_first_step_at_once(tty, interval):
    from dml_nb.training.callbacks import ProgressCallback

    stream = _Stream(tty)
    p = ProgressCallback(file=stream)
    p.after_step(_fake_learner(), {})
    assert p.bar.mininterval == interval  # a terminal redraws in place; a log keeps each redraw as text
    assert "epoch 1/3" in stream.getvalue() and "1/12" in stream.getvalue(), stream.getvalue()
    drawn = stream.getvalue()
    p.after_step(_fake_learner(step=2), {})
    assert stream.getvalue() == drawn  # the next within the interval: not drawn
    p.after_fit(None)


def test_a_run_leaves_no_policy_or_bar_behind(tmp_path, monkeypatch):
    "`Reproduction.run` applies its policy and bars to its rows only."
    import tqdm.auto

    import dml_nb.reproduction.notebook as N

    seen = {}

    def run_rows(rows, base, seeds, **kw):
        seen["policy"], seen["bar"] = run_policy(), tqdm.auto.tqdm
        import pandas as pd

        return pd.DataFrame({"row": [], "seed": [], "status": []}), {}

    monkeypatch.setattr(N, "run_rows", run_rows)
    before_bar, policy = tqdm.auto.tqdm, RunPolicy("collect")
    base = {"train": {"epochs": 1}, "model": {"backbone": "small_cnn"}, "eval": {"metrics": []}}
    nb = N.Reproduction("repro_x", "shapes", "shapes", base, [0], tmp_path, tmp_path, True, 1, policy, True)
    nb.run([])
    assert seen["policy"] is policy and getattr(seen["bar"], "to_terminal", False)
    assert run_policy() == RunPolicy() and tqdm.auto.tqdm is before_bar


def test_a_papermill_notebook_reads_its_policy_in_setup(tmp_path):
    "The notebook process boundary: a kernel started with $DML_COLLECT_ONLY gets a collect-only policy from `setup`."
    env = {k: v for k, v in os.environ.items() if k not in ("PYTEST_CURRENT_TEST",)}
    env.update(PYTHONPATH=str(ROOT), DML_COLLECT_ONLY="1", DML_RESULTS="none", IN_TEST="1")
    code = (
        "import json\nfrom dml_nb.reproduction.notebook import setup, notebook_defaults\n"
        "from dml_nb.experiments.results import run_policy\n"
        "p = {**notebook_defaults('repro_table3'), 'output': {'progress': False}}\n"
        "nb = setup('repro_table3', p)\n"
        "print(json.dumps([nb.policy.mode, run_policy().mode, str(nb.policy.results)]))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT / "nbs", env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1]) == ["collect", "collect", "None"]


def test_dml_reproduce_passes_its_policy_down_to_the_launcher(tmp_path, monkeypatch):
    "The command's policy (threads, results folder) reaches the launcher, which is handed it rather than reading it."
    import dml_nb.sweeps.launch as L
    from dml_nb.reproduction.reproduce import reproduce_main
    from dml_nb.sweeps.sweep import plan_configs

    raw = {"method": {"name": "baseline", "embedding_dim": 8}, "seed": 0}
    plan_configs({"A": raw}, tmp_path / "plan", tmp_path / "runs")
    seen = {}

    def launch(plan, launcher, threads=None, **kw):
        seen.update(threads=threads, policy=run_policy(), env=os.environ.get("DML_RESULTS"))
        return []

    monkeypatch.setattr(L, "launch", launch)
    monkeypatch.setenv("DML_RESULTS", str(tmp_path / "from-env"))
    argv = ["--launch", "local", "--from-plan", str(tmp_path / "plan" / "plan.json"), "--no-collect", "--threads", "3"]
    assert reproduce_main(argv) == 0
    assert seen["threads"] == 3 and seen["policy"].threads == 3
    assert seen["policy"].results == tmp_path / "from-env"  # read once, at the command's start
    assert seen["env"] == str((tmp_path / "from-env").resolve())  # and handed on to the processes it starts
    assert run_policy() == RunPolicy()  # the command's policy ends with it


def test_a_notebooks_run_saves_what_it_read_in_the_policys_results_folder(tmp_path):
    "Reading saves nothing, so `Reproduction.run` keeps its rows' runs in the results folder its policy names."
    import uuid

    import dml_nb.reproduction.notebook as N
    from dml_nb.reproduction.repro import Row, base_config, output_dirs

    runs = (
        output_dirs()[1].parent / f"keep-{uuid.uuid4().hex[:8]}"
    )  # under pytest the harness keeps to the smoke folder
    base = base_config()
    policy = RunPolicy(results=tmp_path / "kept")
    nb = N.Reproduction("repro_x", "shapes", "shapes", base, [0], tmp_path / "figures", runs, False, 1, policy, False)
    per_seed, _ = nb.run([Row("M", {"name": "baseline", "embedding_dim": 8})])
    assert per_seed["status"].tolist() == ["ok"]
    assert [p.name for p in (tmp_path / "kept").iterdir()] == per_seed["run"].tolist()
    nb.policy = RunPolicy()  # no results folder: nothing saved
    nb.run([Row("N", {"name": "baseline", "embedding_dim": 16})])
    assert len(list((tmp_path / "kept").iterdir())) == 1
