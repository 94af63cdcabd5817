"""The probes of Reliability IV for the reproduction layer (`dml-reproduce`, plans, collect-only, the notebook harness,
the results folder). Each test is a probe: the line a user sees, and a check that nothing was adopted, restored or
written where it must not be. Every probe fails on the code before these fixes and passes now; the last one is a
guard on the committed results/.

No fixed name in a shared temporary folder (the executed notebooks, the smoke folder), no write through a planted
link; collect-only reads only the config it asks for; one rule for relative paths (the folder the command was
started in); the README's cluster lines on a machine without the data; no restore before a command has checked
its own arguments, and then only of the runs it reads."""

import json
import os
import stat
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from dml_nb.core.config import ConfigError, config_to_dict, make_config
from dml_nb.experiments.experiment import run_dir_for, run_key
from dml_nb.reproduction.repro import Row, collect_runs, job_config, output_dirs
from dml_nb.reproduction.reproduce import reproduce, reproduce_main
from dml_nb.experiments.results import RESULTS_ENV, RunPolicy, result_checksum, result_problem, run_folder_name
from dml_nb.sweeps.sweep import Plan, SweepMode, notebook_parameters, plan_configs

from test_reliability import TINY, snapshot

ROOT = Path(__file__).resolve().parents[1]
A = {**TINY, "seed": 0}
B = {**A, "train": {**A["train"], "lr": 0.5}}


@pytest.fixture(autouse=True)
def quiet_env(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg-cache"))
    for k in ("DML_DATA", RESULTS_ENV, "DML_RUNS", "DML_PLAN", "DML_COLLECT_ONLY", "DML_RESTORE"):
        monkeypatch.delenv(k, raising=False)


def fake_run(folder: Path, raw: dict, checkpoint: bool = True) -> Path:
    "A finished run of config `raw` in `folder`, written by hand (no training): config, metrics, history, done."
    cdict = config_to_dict(make_config(raw))
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.yaml").write_text(yaml.safe_dump(cdict, sort_keys=True))
    info = {"metrics": {"test/recall@1": 0.25}, "config_key": run_key(cdict), "last_epoch": 1, "epochs": 1}
    (folder / "metrics.json").write_text(json.dumps(info))
    (folder / "history.csv").write_text("epoch,test/recall@1\n1,0.25\n")
    if checkpoint:
        (folder / "checkpoint.pt").write_bytes(b"not read")
    (folder / "done").write_text("2026-01-01T00:00:00+00:00\n")
    return folder


def fake_entry(results: Path, raw: dict) -> Path:
    "A results entry of config `raw` (`save_result`'s shape, with its checksum)."
    e = fake_run(results / run_folder_name(make_config(raw)), raw, checkpoint=False)
    files = {n: (e / n).read_bytes() for n in ("config.yaml", "metrics.json", "history.csv")}
    (e / "done").write_text(f"2026-01-01T00:00:00+00:00\nsha256 {result_checksum(files)}\n")
    assert result_problem(e) is None
    return e


def exit_code(argv) -> int:
    "The exit status of `dml-reproduce argv` (an argument error exits 2 through argparse)."
    try:
        return reproduce_main(argv)
    except SystemExit as e:
        return e.code


def one_line_error(capsys, *words) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert all(w in err for w in words), err
    return err


class Papermill:
    "A stand-in for papermill.execute_notebook: records each call; writes the output as papermill does (through links)."

    def __init__(self):
        self.calls = []

    def __call__(self, nb, out, parameters=None, cwd=None, **kw):
        self.calls.append({"nb": nb, "out": out, "parameters": parameters, "cwd": cwd, "env": dict(os.environ)})
        with open(out, "w") as f:
            f.write(Path(nb).read_text())


@pytest.fixture
def papermill(monkeypatch):
    import papermill as pm

    stand_in = Papermill()
    monkeypatch.setattr(pm, "execute_notebook", stand_in)
    return stand_in


def fake_project(tmp_path: Path) -> Path:
    root = tmp_path / "project"
    (root / "nbs").mkdir(parents=True)
    (root / "settings.ini").write_text("[DEFAULT]\nlib_name = dml_nb\n")
    nb = {"cells": [{"cell_type": "code", "source": ["x = 1"], "metadata": {}, "outputs": []}], "metadata": {}}
    (root / "nbs" / "repro_x.ipynb").write_text(json.dumps(nb))
    return root


# 1. no fixed name in a shared temporary folder, no write through a planted link ----------------------------------------


def test_reproduce_writes_each_executed_notebook_into_a_fresh_private_folder(tmp_path, monkeypatch, papermill):
    shared = tmp_path / "tmp"
    shared.mkdir()
    monkeypatch.setattr("tempfile.tempdir", str(shared))
    victim = tmp_path / "victim.txt"
    victim.write_text("kept")
    (shared / "dml_nb_reproduce").mkdir()  # what another user planted in a shared /tmp
    (shared / "dml_nb_reproduce" / "repro_x.ipynb").symlink_to(victim)
    root = fake_project(tmp_path)
    reproduce(["repro_x"], force=True, root=root, progress=False)
    reproduce(["repro_x"], force=True, root=root, progress=False)
    assert victim.read_text() == "kept", "papermill wrote through the planted link"
    first, second = (Path(c["out"]).parent for c in papermill.calls)
    assert first != second, "two runs share one output folder"
    for c in papermill.calls:
        assert Path(c["out"]).parent.name != "dml_nb_reproduce"


def test_the_smoke_folder_is_private_and_a_planted_link_there_is_refused(tmp_path, monkeypatch):
    shared = tmp_path / "tmp"
    shared.mkdir()
    monkeypatch.setattr("tempfile.tempdir", str(shared))
    victim = tmp_path / "victim"
    victim.mkdir()
    from dml_nb.core.base import source_hash

    (shared / f"dml_nb_smoke_{source_hash()}").symlink_to(victim, target_is_directory=True)  # the old fixed name
    figures, runs = output_dirs()
    smoke = figures.parent
    assert not any(victim.iterdir()), "the smoke folders were made through the planted link"
    st = smoke.lstat()
    assert not stat.S_ISLNK(st.st_mode) and st.st_uid == os.getuid() and stat.S_IMODE(st.st_mode) == 0o700
    smoke.rename(tmp_path / "moved")
    smoke.symlink_to(victim, target_is_directory=True)  # planted at the name now in use
    with pytest.raises(ValueError) as e:
        output_dirs()
    assert "\n" not in str(e.value) and str(smoke) in str(e.value) and "link" in str(e.value), e.value
    assert not any(victim.iterdir())


def test_a_plan_record_file_that_is_a_link_is_not_written_through(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("kept")
    (tmp_path / "records.jsonl").symlink_to(victim)
    with pytest.raises(OSError):
        SweepMode(plan=tmp_path / "records.jsonl").job(SimpleNamespace(name="A", group=""), 0, A, tmp_path, None)
    assert victim.read_text() == "kept"


# 2. a run folder is read only when it holds the config the reader asks for ---------------------------------------------


def foreign(tmp_path) -> Path:
    "B's finished run (with its checkpoint: trained here, not restored) in the folder of A."
    return fake_run(run_dir_for(make_config(A), tmp_path / "runs"), B)


def test_collect_only_refuses_a_run_folder_holding_another_config(tmp_path):
    run_dir = foreign(tmp_path)
    before = snapshot(run_dir)
    with pytest.raises(ConfigError) as e:
        SweepMode(collect=True).job(SimpleNamespace(name="A", group=""), 0, A, tmp_path / "runs", None)
    msg = str(e.value)
    assert "\n" not in msg and str(run_dir) in msg and "another config" in msg and "A (seed 0)" in msg, msg
    assert snapshot(run_dir) == before


def test_planning_refuses_a_run_folder_holding_another_config(tmp_path):
    run_dir = foreign(tmp_path)
    with pytest.raises(ConfigError, match="another config"):
        SweepMode(plan=tmp_path / "rec.jsonl").job(SimpleNamespace(name="A", group=""), 0, A, tmp_path / "runs", None)
    with pytest.raises(ConfigError, match="another config"):
        plan_configs({"A": A}, tmp_path / "plan", tmp_path / "runs")
    assert not (tmp_path / "plan" / "plan.json").exists() and (run_dir / "done").exists()


def test_the_collector_refuses_a_run_folder_holding_another_config(tmp_path):
    base = {k: v for k, v in A.items() if k != "seed"}
    asked = make_config(job_config(Row("A", {}), base, 0))  # at smoke size, as under nbdev_test
    run_dir = fake_run(run_dir_for(asked, tmp_path / "runs"), B)
    with pytest.raises(ConfigError) as e:
        collect_runs(tmp_path / "runs", [Row("A", {})], base, [0])
    assert "\n" not in str(e.value) and str(run_dir) in str(e.value), e.value


# 3. one rule for relative paths: the folder the command was started in ---------------------------------------------------


def test_a_relative_runs_dir_and_parameter_file_reach_the_notebook_absolute(tmp_path, monkeypatch, papermill):
    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)
    (here / "p.yaml").write_text("seeds: [0]\n")
    nb = ROOT / "nbs" / "repro_table3.ipynb"
    assert (
        reproduce_main(["--results-dir", "none", "--collect-only", str(nb), "--runs-dir", "relruns", "-f", "p.yaml"])
        == 0
    )
    (call,) = papermill.calls
    assert call["parameters"]["output"]["runs_dir"] == str(here / "relruns"), call["parameters"]
    assert call["cwd"] == str(ROOT / "nbs")


def test_a_relative_dml_runs_is_taken_from_the_folder_the_command_started_in(monkeypatch, papermill):
    here = ROOT / "nbs"  # a folder of the project other than its root: not the project root's relruns
    monkeypatch.chdir(here)
    monkeypatch.setenv("DML_RUNS", "relruns")
    nb = ROOT / "nbs" / "repro_table3.ipynb"
    assert reproduce_main(["--results-dir", "none", "--collect-only", str(nb), "-y", "seeds: [0]"]) == 0
    (call,) = papermill.calls
    assert call["parameters"]["output"]["runs_dir"] == str(here / "relruns")
    assert call["env"]["DML_RUNS"] == str(here / "relruns")
    assert not (here / "relruns").exists() and not (ROOT / "relruns").exists()


def test_a_relative_plan_folder_and_json_are_the_command_folders(tmp_path, monkeypatch, papermill):
    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)
    nb = ROOT / "nbs" / "repro_table3.ipynb"
    assert (
        reproduce_main(["--results-dir", "none", "--plan", str(nb), "--runs-dir", "relruns", "--json", "p.json"]) == 0
    )
    (call,) = papermill.calls
    assert Path(call["env"]["DML_PLAN"]).is_absolute(), call["env"]["DML_PLAN"]
    assert Path(call["env"]["DML_PLAN"]).is_relative_to(here / "relruns" / ".plans")
    assert call["parameters"]["output"]["runs_dir"] == str(here / "relruns")
    assert Plan.load("p.json").plan_dir.is_absolute() and (here / "p.json").exists()
    assert (
        reproduce_main(
            [
                "--results-dir",
                "none",
                "--launch",
                "local",
                "--from-plan",
                "p.json",
                "--runs-dir",
                "relruns",
                "--no-collect",
            ]
        )
        == 0
    )


def test_help_states_the_rule_for_relative_paths(capsys):
    with pytest.raises(SystemExit):
        reproduce_main(["--help"])
    out = " ".join(capsys.readouterr().out.split()).lower()
    assert "relative" in out and "the folder the command was started in" in out, out


# 4. the README's cluster lines, on a machine without the data; no restore before the arguments are checked -------------


@pytest.fixture
def committed(tmp_path, monkeypatch):
    "A results folder holding one entry, as the command's results folder ($DML_RESULTS), and an empty run cache."
    results = tmp_path / "results"
    entry = fake_entry(results, A)
    monkeypatch.setenv(RESULTS_ENV, str(results))
    monkeypatch.setenv("DML_RUNS", str(tmp_path / "runs"))
    return SimpleNamespace(results=results, entry=entry, runs=tmp_path / "runs")


def nothing_restored(committed):
    assert not committed.runs.exists() or not any(committed.runs.iterdir()), list(committed.runs.iterdir())


@pytest.mark.parametrize("sweep", [[], ["--plan"], ["--collect-only"], ["--launch", "local"]])
def test_an_unknown_notebook_is_one_line_with_a_suggestion_before_any_restore(committed, capsys, sweep):
    capsys.readouterr()
    assert exit_code(["repro_tabel3", *sweep]) == 2
    one_line_error(capsys, "repro_tabel3", "did you mean repro_table3")
    nothing_restored(committed)


def test_launch_slurm_without_slurm_is_refused_before_any_restore(committed, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    capsys.readouterr()
    argv = ["--launch", "slurm", "--from-plan", str(tmp_path / "plan.json"), "--partition", "gpu", "--time", "720"]
    assert reproduce_main([*argv, "--gpus-per-run", "1", "--no-collect"]) == 2
    one_line_error(capsys, "slurm: no sbatch")
    nothing_restored(committed)


def test_collect_only_restores_only_the_runs_it_reads(committed, tmp_path, papermill):
    other = fake_entry(committed.results, B)
    nb = ROOT / "nbs" / "repro_table3.ipynb"
    assert reproduce_main(["--collect-only", str(nb), "-y", "seeds: [0]"]) == 0
    nothing_restored(committed)  # the stand-in notebook reads nothing
    (call,) = papermill.calls
    policy = RunPolicy.from_env(environ=call["env"])
    assert policy.restore == committed.results and policy.runs == committed.runs
    with policy.applied():  # what the notebook's run_rows does when it reads A's run
        got = SweepMode(collect=True).job(SimpleNamespace(name="A", group=""), 0, A, committed.runs, None)
    assert got.metrics == {"test/recall@1": 0.25}
    assert [p.name for p in committed.runs.iterdir()] == [committed.entry.name] and other.exists()


@pytest.mark.slow  # two executions of the flagship notebook in a kernel of their own: a minute on 2 cores
def test_the_readme_cluster_lines_run_as_written_without_the_data(tmp_path):
    """README.md, "On several GPUs or a cluster", its three lines with the paper-scale cub200 file, on a machine
    without the dataset, the ImageNet weights or SLURM (a login node): the plan lists the flagship's runs as pending,
    not here; the SLURM launch is refused in one line; collect-only names the runs that are missing in one line.
    Nothing of the results folder is restored (none of its runs is read)."""
    from test_slurm_cli import LAUNCH, _dml_reproduce, _env, _path_without_slurm

    env = {**_env(tmp_path, _path_without_slurm()), "DML_DATA": str(tmp_path / "no-data"), "TORCH_HOME": str(tmp_path)}
    fake_entry(tmp_path / "results", A)
    cub = str(ROOT / "params" / "repro_table3" / "cub200.yaml")
    p = _dml_reproduce(["--plan", "repro_table3", "-f", cub, "--json", str(tmp_path / "plan.json")], env)
    assert p.returncode == 0, p.stderr[-3000:]
    plan = Plan.load(tmp_path / "plan.json")
    assert len(plan.jobs) >= 8 and all(j.status.startswith("pending (not here: dataset cub200") for j in plan.jobs)
    assert sorted(q.name for q in (tmp_path / "runs").iterdir()) == [".plans"], "a run restored or trained"
    argv = ["--launch", "slurm", "--from-plan", str(tmp_path / "plan.json"), *LAUNCH]
    p = _dml_reproduce(argv, env)
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and "slurm: no sbatch" in p.stderr, p.stderr[-3000:]
    figures = f"output: {{figures_dir: {tmp_path / 'figures'}}}"  # not the project's figures/
    p = _dml_reproduce(["--collect-only", "repro_table3", "-f", cub, "-y", figures], env)
    (line,) = [l for l in p.stderr.splitlines() if l.startswith("dml-reproduce:")]  # beside a progress bar
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-3000:]
    assert line.startswith("dml-reproduce: collect-only stopped: MissingRunsError") and "Margin-128 (seed 0)" in line
    assert sorted(q.name for q in (tmp_path / "runs").iterdir()) == [".plans"]


def test_setup_in_plan_or_collect_mode_does_not_need_the_data(tmp_path, monkeypatch):
    from dml_nb.reproduction import notebook as N

    monkeypatch.setattr(N, "in_test", lambda: False)
    monkeypatch.setattr("dml_nb.reproduction.repro.in_test", lambda: False)
    monkeypatch.setenv("DML_DATA", str(tmp_path / "no-data"))
    params = yaml.safe_load((ROOT / "params" / "repro_table3" / "cub200.yaml").read_text())
    out = {"runs_dir": str(tmp_path / "runs"), "figures_dir": str(tmp_path / "figures"), "results": False}
    with pytest.raises(FileNotFoundError, match="cub200"):  # a training run needs the data: told at once
        N.setup("repro_table3", {**params, "output": out})
    for env in ({"DML_PLAN": str(tmp_path / "rec.jsonl")}, {"DML_COLLECT_ONLY": "1"}):
        with monkeypatch.context() as m:
            for k, v in env.items():
                m.setenv(k, v)
            nb = N.setup("repro_table3", {**params, "output": out})
            assert nb.dataset == "cub200" and nb.policy.mode in ("plan", "collect")


def test_a_paper_scale_run_this_machine_cannot_start_is_planned_or_missing(tmp_path):
    raw = {**A, "data": {"name": "cub200"}}
    why = "dataset cub200 not on disk: no such folder"
    row = SimpleNamespace(name="Margin-128", group="")
    mode = SweepMode(plan=tmp_path / "rec.jsonl")
    assert mode.job(row, 0, raw, tmp_path / "runs", why).startswith("planned")
    (rec,) = [json.loads(l) for l in (tmp_path / "rec.jsonl").read_text().splitlines()]
    assert rec["unavailable"] == why and rec["done"] is False
    mode = SweepMode(collect=True)
    assert mode.job(row, 0, raw, tmp_path / "runs", why).startswith("missing")
    with pytest.raises(Exception) as e:
        mode.finish()
    assert "Margin-128 (seed 0)" in str(e.value) and "\n" not in str(e.value)


# 5. weak items ------------------------------------------------------------------------------------------------------------


def test_parameter_yaml_is_read_with_the_projects_parser(tmp_path):
    got = notebook_parameters(overrides="config: {train: {lr: 1e-5}}\npaper_dataset: no")
    assert got["config"]["train"]["lr"] == 1e-5 and got["paper_dataset"] == "no"
    f = tmp_path / "p.yaml"
    f.write_text(
        "a: &a [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]\n"
        + "".join(f"{c}: &{c} [{', '.join(['*' + p] * 10)}]\n" for p, c in zip("abcdef", "bcdefg"))
    )
    with pytest.raises(ConfigError) as e:
        notebook_parameters(params_file=f)
    assert str(f) in str(e.value) and "\n" not in str(e.value)


def big_plan(tmp_path: Path, n: int) -> Path:
    plan_dir, runs = tmp_path / "plan", tmp_path / "runs"
    (plan_dir / "configs").mkdir(parents=True)
    runs.mkdir()
    jobs = []
    for i in range(n):
        h = f"{i:012x}"
        (plan_dir / "configs" / f"{h}.yaml").write_text("{}\n")
        jobs.append(
            {"hash": h, "run_dir": str(runs / f"baseline-shapes-{h}"), "config": {}, "uses": ["nb: r (seed 0)"]}
        )
    data = {"plan_dir": str(plan_dir), "runs_dir": str(runs), "notebooks": ["nb"], "jobs": jobs}
    (tmp_path / "plan.json").write_text(json.dumps(data))
    return tmp_path / "plan.json"


def test_loading_a_plan_of_ten_thousand_jobs_takes_seconds(tmp_path):
    path = big_plan(tmp_path, 10_000)
    t0 = time.perf_counter()
    plan = Plan.load(path)
    took = time.perf_counter() - t0
    assert len(plan.jobs) == 10_000 and took < 10, f"{took:.1f} s"  # 3.3 s on 2 busy cores; quadratic before: 12 min


def test_a_plan_whose_runs_lie_outside_the_run_cache_in_use_is_refused(tmp_path, capsys):
    plan = plan_configs({"A": A}, tmp_path / "plan", tmp_path / "runs")
    fake_run(Path(plan.jobs[0].run_dir), A)  # finished: a launch would have nothing to train
    capsys.readouterr()
    argv = ["--results-dir", "none", "--launch", "local", "--from-plan", str(tmp_path / "plan" / "plan.json")]
    assert reproduce_main([*argv, "--runs-dir", str(tmp_path / "other"), "--no-collect"]) == 2
    one_line_error(capsys, str(tmp_path / "runs"), str(tmp_path / "other"), "--runs-dir")
    assert reproduce_main([*argv, "--runs-dir", str(tmp_path / "runs"), "--no-collect"]) == 0


# a guard: every committed results entry has the checksum its loader verifies --------------------------------------------


def test_every_committed_results_entry_records_its_checksum():
    entries = sorted(p for p in (ROOT / "results").iterdir() if (p / "done").is_file())
    assert len(entries) > 700
    missing = [p.name for p in entries if "sha256 " not in (p / "done").read_text()]
    assert not missing, f"{len(missing)} entries without a checksum, e.g. {missing[:3]}"
    for p in entries[::50]:
        assert result_problem(p) is None, p.name


def test_dml_train_takes_a_relative_results_folder_from_the_folder_it_was_started_in(tmp_path, monkeypatch, capsys):
    "`dml-train` keeps the one rule of `dml-reproduce`: a relative `$DML_RESULTS` is taken from the shell's folder."
    from dml_nb.experiments.cli import main as dml_train

    import shutil
    import tempfile

    (tmp_path / "params.yaml").write_text(yaml.safe_dump(A))
    here = Path(tempfile.mkdtemp(dir=ROOT, prefix=".test-cwd-"))  # inside the project: its root is found from here
    name = f"relresults-{here.name}"
    try:
        monkeypatch.chdir(here)
        monkeypatch.setenv(RESULTS_ENV, name)
        assert dml_train([str(tmp_path / "params.yaml"), "--runs-dir", str(tmp_path / "runs"), "--no-progress"]) == 0
        assert not (ROOT / name).exists(), "taken from the project root, not the folder the command started in"
        (saved,) = (here / name).iterdir()
        assert (saved / "done").is_file(), capsys.readouterr().err
    finally:
        shutil.rmtree(here, ignore_errors=True)
        shutil.rmtree(ROOT / name, ignore_errors=True)
