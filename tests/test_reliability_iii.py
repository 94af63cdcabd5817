"""The probes of Reliability III: a results folder and a plan are a trust boundary. Each test is a probe, with the
line a user sees and a check that nothing was adopted or written where it must not be. Every probe here fails on
the code before the issue was fixed (checked against that commit) and passes now; the last test is a guard (the
committed results pass the checks) that passes on both.

A results entry is checked before it is restored or read (its shape, no links, its config and keys, its metrics
against its history, the checksum in its `done`), a restore is atomic and repairs the half a kill left,
`save_result` writes only inside the results folder and never through a link, a plan is checked before it is
launched, and the small ones: `DML_RESULTS=none`, bounded `--workers` / `--threads`, one-line stopped reasons."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pandas as pd
import pytest
import yaml

from dml_nb.experiments.cli import main as dml_train
from dml_nb.experiments.experiment import load_result, run, run_dir_for, run_key
from dml_nb.sweeps.launch import launch
from dml_nb.reproduction.reproduce import reproduce_main, results_folder
from dml_nb.experiments.results import (
    RESULTS_ENV,
    RunPolicy,
    RunStopped,
    check_stopped,
    restore_results,
    restored,
    results_dir,
    save_result,
)
from dml_nb.sweeps.sweep import Plan, SweepMode, plan_configs
from dml_nb.core.config import ConfigError, config_to_dict, load_config, make_config

from test_reliability import TINY, snapshot

ROOT = Path(__file__).resolve().parents[1]
A = {**TINY, "train": {**TINY["train"], "epochs": 2}}  # two epochs: a history that can be cut
B = {**A, "train": {**A["train"], "lr": 0.5}}


@pytest.fixture(autouse=True)
def quiet_env(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg-cache"))
    monkeypatch.delenv("DML_DATA", raising=False)
    monkeypatch.delenv(RESULTS_ENV, raising=False)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict:
    "Runs of configs A and B, trained once and saved in a results folder: {'A': its entry, 'B': ..., 'runs': run cache}."
    base = tmp_path_factory.mktemp("saved")
    out = {"runs": base / "runs"}
    for k, raw in (("A", A), ("B", B)):
        out[k] = save_result(run(raw, runs_dir=base / "runs", progress=False).run_dir, base / "results")
    return out


def entry(saved, tmp_path, which="A") -> Path:
    "A copy of a saved entry in a fresh results folder under `tmp_path`."
    dest = tmp_path / "results" / saved[which].name
    shutil.copytree(saved[which], dest)
    return dest


def restore(tmp_path, capsys) -> tuple[list, str]:
    "restore_results of `tmp_path/results` into `tmp_path/runs`: (the folders written, stderr)."
    got = restore_results(tmp_path / "results", tmp_path / "runs")
    return got, capsys.readouterr().err


def skipped(err: str, e: Path, *why: str) -> None:
    "One line on stderr, naming the entry and saying why."
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert e.name in err and all(w in err for w in why), err


def not_restored(tmp_path, capsys, e: Path, *why: str) -> None:
    got, err = restore(tmp_path, capsys)
    assert got == [] and not (tmp_path / "runs" / e.name).exists(), (got, err)
    skipped(err, e, *why)


def drop_checksum(e: Path) -> None:
    "The entry as saved before `done` recorded a checksum."
    (e / "done").write_text("".join(l for l in (e / "done").read_text().splitlines(True) if not l.startswith("sha256")))


# 1. results entries are verified before they are used ---------------------------------------------------------------


@pytest.mark.parametrize("with_checksum", [True, False])
def test_an_edited_recall_in_metrics_json_is_not_restored(saved, tmp_path, capsys, with_checksum):
    e = entry(saved, tmp_path)
    if not with_checksum:
        drop_checksum(e)  # an entry saved before: the history gives it away
    info = json.loads((e / "metrics.json").read_text())
    info["metrics"]["test/recall@1"] = 0.999
    (e / "metrics.json").write_text(json.dumps(info))
    not_restored(tmp_path, capsys, e, "test/recall@1")


def test_an_entry_holding_another_runs_files_is_not_restored(saved, tmp_path, capsys):
    e = entry(saved, tmp_path)
    for f in e.iterdir():  # B's files under A's name
        shutil.copy(saved["B"] / f.name, f)
    not_restored(tmp_path, capsys, e, "config of", saved["B"].name)
    for name in ("metrics.json", "history.csv"):  # A's config, B's metrics and history
        shutil.copy(saved["A"] / "config.yaml", e / "config.yaml")
        shutil.copy(saved["B"] / name, e / name)
    drop_checksum(e)
    not_restored(tmp_path, capsys, e, "records another config")


def test_a_cut_history_csv_is_not_restored(saved, tmp_path, capsys):
    e = entry(saved, tmp_path)
    drop_checksum(e)
    lines = (e / "history.csv").read_text().splitlines(keepends=True)
    (e / "history.csv").write_text("".join(lines[:-1]))  # the last epoch gone
    not_restored(tmp_path, capsys, e, "ends at epoch 1")
    (e / "history.csv").write_text("".join(lines[:-1]) + lines[-1][: len(lines[-1]) // 2])  # cut inside the last line
    not_restored(tmp_path, capsys, e, "history.csv")


def test_done_without_metrics_json_is_not_restored(saved, tmp_path, capsys):
    e = entry(saved, tmp_path)
    (e / "metrics.json").unlink()
    not_restored(tmp_path, capsys, e, "metrics.json")


def test_a_stopped_record_of_another_config_is_not_restored(saved, tmp_path, capsys):
    e = entry(saved, tmp_path)
    for name in ("done", "metrics.json"):
        (e / name).unlink()
    other = run_key(config_to_dict(make_config(B)))
    (e / "stopped").write_text(json.dumps({"error": "NoTuplesError", "message": "x", "config_key": other}))
    not_restored(tmp_path, capsys, e, "stopped", other)
    own = run_key(config_to_dict(make_config(A)))  # its own config's record is restored
    (e / "stopped").write_text(json.dumps({"error": "NoTuplesError", "message": "x", "config_key": own}))
    assert restore(tmp_path, capsys)[0] == [tmp_path / "runs" / e.name]


def test_a_results_entry_that_is_a_symlink_is_not_restored(saved, tmp_path, capsys):
    (tmp_path / "results").mkdir()
    e = tmp_path / "results" / saved["A"].name
    e.symlink_to(saved["A"], target_is_directory=True)
    not_restored(tmp_path, capsys, e, "symbolic link")


@pytest.mark.parametrize("name", ["metrics.json", "history.csv", "config.yaml", "done"])
def test_an_entry_whose_files_link_outside_is_not_restored(saved, tmp_path, capsys, name):
    e = entry(saved, tmp_path)
    (e / name).unlink()
    (e / name).symlink_to("/etc/passwd")
    not_restored(tmp_path, capsys, e, name, "link")


def test_save_result_writes_a_checksum_that_catches_any_later_edit(saved, tmp_path, capsys):
    assert (saved["A"] / "done").read_text().splitlines()[-1].startswith("sha256 ")
    e = entry(saved, tmp_path)
    text = (e / "history.csv").read_text()
    (e / "history.csv").write_text(text.replace(",", ", ", 1))  # a column the other checks do not read
    not_restored(tmp_path, capsys, e, "checksum")
    drop_checksum(e)  # an entry saved before checksums: the other rules only
    assert restore(tmp_path, capsys) == ([tmp_path / "runs" / e.name], "")


def test_a_restored_run_edited_in_the_cache_is_not_read_by_plan_or_collect(saved, tmp_path, capsys):
    e = entry(saved, tmp_path)
    (run_dir,) = restore(tmp_path, capsys)[0]
    info = json.loads((run_dir / "metrics.json").read_text())
    info["metrics"]["test/recall@1"] = 0.999
    (run_dir / "metrics.json").write_text(json.dumps(info))
    row = SimpleNamespace(name="A", group=None)
    got = SweepMode(collect=True).job(row, 0, A, tmp_path / "runs", None)
    assert isinstance(got, str) and got.startswith("missing"), got
    skipped(capsys.readouterr().err, e, "test/recall@1")
    plan = tmp_path / "plan.jsonl"
    assert SweepMode(plan=plan).job(row, 0, A, tmp_path / "runs", None).startswith("planned")
    (rec,) = [json.loads(l) for l in plan.read_text().splitlines()]
    assert rec["done"] is False and rec["rebuild"] is True  # trained again by the launcher
    capsys.readouterr()
    res = run(A, runs_dir=tmp_path / "runs", progress=False)  # `run` trains it again rather than read it
    assert not restored(run_dir) and res.metrics == load_result(saved["runs"] / e.name).metrics


# 2. restore is atomic --------------------------------------------------------------------------------------------------

KILL_AT_HISTORY = """
import os, signal, sys
from dml_nb.experiments.results import restore_results
results, runs = sys.argv[1], sys.argv[2]
def hook(event, args):
    if event == "open" and str(args[0]).startswith(results) and str(args[0]).endswith("history.csv"):
        os.kill(os.getpid(), signal.SIGKILL)  # killed while reading the entry
sys.addaudithook(hook)
restore_results(results, runs)
"""


def test_a_restore_killed_midway_leaves_no_half_run_and_the_next_one_completes_it(saved, tmp_path, capsys):
    e = entry(saved, tmp_path)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    p = subprocess.run(
        [sys.executable, "-c", KILL_AT_HISTORY, str(tmp_path / "results"), str(tmp_path / "runs")], env=env
    )
    assert p.returncode == -signal.SIGKILL
    dest = tmp_path / "runs" / e.name
    assert not dest.exists() or (dest / "done").exists(), sorted(p.name for p in dest.iterdir())
    got, err = restore(tmp_path, capsys)
    assert (dest / "done").exists() and load_result(dest).metrics == load_result(e).metrics, (got, err)
    assert sorted(p.name for p in dest.iterdir()) == sorted(p.name for p in e.iterdir())


def test_a_half_entry_left_in_the_cache_is_replaced(saved, tmp_path, capsys):
    e = entry(saved, tmp_path)
    half = tmp_path / "runs" / e.name
    half.mkdir(parents=True)
    for name in ("config.yaml", "metrics.json"):  # what the old restore had written when it was killed
        shutil.copy(e / name, half / name)
    got, err = restore(tmp_path, capsys)
    assert got == [half] and err == ""
    assert snapshot(half) == snapshot(e)
    # a run of the cache's own is never touched: one with a checkpoint, or a finished one
    (half / "done").unlink()
    (half / "checkpoint.pt").write_text("mine")
    before = snapshot(half)
    assert restore(tmp_path, capsys) == ([], "") and snapshot(half) == before


def test_a_restore_removes_the_stale_temporary_folders_a_killed_restore_left(saved, tmp_path, capsys):
    e = entry(saved, tmp_path)
    (tmp_path / "runs").mkdir()
    left = {n: tmp_path / "runs" / n for n in (f".{e.name}.restore-k1ll3d_x", f".{e.name}.restore-k1ll3d_y.half")}
    fresh = tmp_path / "runs" / f".{e.name}.restore-inuse123"  # another restore's, now: left alone
    other = tmp_path / "runs" / ".plans"  # not a restore's
    for d in (*left.values(), fresh, other):
        d.mkdir()
        shutil.copy(e / "config.yaml", d / "config.yaml")
    old = time.time() - 2 * 3600
    for d in (*left.values(), other):
        os.utime(d, (old, old))
    got, err = restore(tmp_path, capsys)
    assert got == [tmp_path / "runs" / e.name] and err == "", err
    assert not any(d.exists() for d in left.values()), sorted(p.name for p in (tmp_path / "runs").iterdir())
    assert fresh.is_dir() and other.is_dir()


# 3. save_result never follows links and never writes outside the results folder ---------------------------------------


def test_save_result_refuses_a_destination_that_is_a_symlink(saved, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / saved["A"].name).symlink_to(elsewhere, target_is_directory=True)
    with pytest.raises(Exception, match="is a symbolic link") as e:
        save_result(saved["runs"] / saved["A"].name, tmp_path / "results")
    assert "\n" not in str(e.value) and list(elsewhere.iterdir()) == []


@pytest.mark.parametrize("out", [".", "mine"])
def test_dml_train_into_a_folder_that_is_not_a_run_name_is_not_saved(tmp_path, capsys, monkeypatch, out):
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(A))
    here = tmp_path / "work"  # empty: `-o .` trains into it
    here.mkdir()
    monkeypatch.chdir(here)
    monkeypatch.setenv(RESULTS_ENV, str(tmp_path / "results"))
    assert dml_train([str(tmp_path / "params.yaml"), "-o", out, "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert "not saved in the results folder" in err and "not a run folder's name" in err, err
    assert err.count("\n") == 1, err
    assert snapshot(tmp_path / "results") == {}


# 4. plans are untrusted input ------------------------------------------------------------------------------------------


@pytest.fixture
def plan_json(tmp_path) -> Path:
    "A plan of config A (nothing trained), as dml-reproduce --plan writes it."
    plan_configs({"A": A}, tmp_path / "plan", tmp_path / "runs")
    return tmp_path / "plan" / "plan.json"


def edit_job(path: Path, **changes) -> None:
    data = json.loads(path.read_text())
    data["jobs"][0].update(changes)
    path.write_text(json.dumps(data))


def bad_plan(path: Path, *why: str) -> None:
    with pytest.raises(ValueError) as e:
        Plan.load(path)
    msg = str(e.value)
    assert "\n" not in msg and str(path) in msg and all(w in msg for w in why), msg


def test_a_plan_job_with_a_hash_that_is_not_a_run_hash_is_refused(plan_json):
    assert Plan.load(plan_json).jobs[0].hash == Path(Plan.load(plan_json).jobs[0].run_dir).name[-12:]
    edit_job(plan_json, hash="../../escape")
    bad_plan(plan_json, "hash")


def test_a_plan_job_whose_run_dir_leaves_the_run_cache_is_refused(plan_json, tmp_path):
    job = json.loads(plan_json.read_text())["jobs"][0]
    name = Path(job["run_dir"]).name
    edit_job(plan_json, run_dir=str(tmp_path / "runs" / ".." / ".." / name))
    bad_plan(plan_json, "run folder")
    (tmp_path / "elsewhere" / name).mkdir(parents=True)  # a run folder that is a link to another place
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / name).symlink_to(tmp_path / "elsewhere" / name, target_is_directory=True)
    edit_job(plan_json, run_dir=str(tmp_path / "runs" / name))
    bad_plan(plan_json, "outside")


def test_a_plan_whose_config_file_links_outside_its_folder_is_refused(plan_json, tmp_path):
    plan = Plan.load(plan_json)
    f = plan.jobs[0].config_file(plan.plan_dir)
    (tmp_path / "outside.yaml").write_text(f.read_text())
    f.unlink()
    f.symlink_to(tmp_path / "outside.yaml")
    bad_plan(plan_json, f.name)


@pytest.mark.parametrize(
    "damage", [lambda p: p.unlink(), lambda p: p.write_text("{not json"), lambda p: p.write_text('{"jobs": []}')]
)
def test_a_malformed_plan_is_one_line_and_dml_reproduce_exits_2(plan_json, capsys, damage):
    damage(plan_json)
    bad_plan(plan_json)
    with pytest.raises(SystemExit) as e:
        sys.exit(reproduce_main(["--launch", "local", "--from-plan", str(plan_json), "--no-collect"]))
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and str(plan_json) in err and "Traceback" not in err, err


def test_rebuild_clears_only_a_restored_run_of_the_jobs_config(saved, tmp_path, capsys):
    e = entry(saved, tmp_path, "B")
    (run_dir,) = restore(tmp_path, capsys)[0]  # B's restored run
    plan = plan_configs({"A": A}, tmp_path / "plan", tmp_path / "runs")
    data = json.loads((tmp_path / "plan" / "plan.json").read_text())
    data["jobs"][0].update(run_dir=str(run_dir), hash=run_dir.name[-12:], rebuild=True)  # A's job aimed at B's run
    shutil.copy(plan.jobs[0].config_file(plan.plan_dir), tmp_path / "plan" / "configs" / f"{run_dir.name[-12:]}.yaml")
    (tmp_path / "plan" / "plan.json").write_text(json.dumps(data))
    kept = lambda: {k: v for k, v in snapshot(run_dir).items() if k != ".lock"}
    before = kept()
    with pytest.raises(Exception, match="failed"):
        launch(Plan.load(tmp_path / "plan" / "plan.json"), "local", progress=False)
    assert kept() == before and restored(run_dir), "B's results were cleared for A's job"
    assert e.name in capsys.readouterr().err


# 5. small ones -----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["none", "NONE", " None "])
def test_dml_results_none_means_off(tmp_path, monkeypatch, value):
    monkeypatch.setenv(RESULTS_ENV, value)
    env = RunPolicy.from_env(tmp_path, results_default=tmp_path / "results")
    assert env.results is None and results_folder(None, tmp_path, env) is None


@pytest.mark.parametrize(
    "argv", [["--workers", "0"], ["--workers", "100000000"], ["--threads", "-3"], ["--threads", "two"]]
)
def test_workers_and_threads_are_bounded_before_any_planning(tmp_path, capsys, argv):
    plan = tmp_path / "missing-plan.json"  # never read: the options fail first
    with pytest.raises(SystemExit) as e:
        reproduce_main(["--launch", "local", "--from-plan", str(plan), "--no-collect", *argv])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and argv[0] in err and "512" in err, err


def test_a_stopped_message_with_newlines_is_one_line_in_a_table(tmp_path):
    run_dir = run_dir_for(make_config(A), tmp_path / "runs")
    run_dir.mkdir(parents=True)
    key = run_key(config_to_dict(make_config(A)))
    message = "cannot form a batch:\nclass 3 has 1 image\n\n| a | table |"
    (run_dir / "stopped").write_text(
        json.dumps({"error": "BatchFormationError", "message": message, "config_key": key})
    )
    got = SweepMode(collect=True).job(SimpleNamespace(name="A", group=None), 0, A, tmp_path / "runs", None)
    assert got == "stopped: cannot form a batch: class 3 has 1 image | a | table |", got
    with pytest.raises(RunStopped) as e:
        check_stopped(run_dir, key)
    assert "\n" not in str(e.value)


# a guard: the committed results pass every check (restored, without a line on stderr) --------------------------------------


def test_the_committed_results_pass_the_checks(tmp_path, capsys):
    entries = sorted(p for p in (ROOT / "results").iterdir() if p.is_dir())
    sample = sorted(set(entries[::6]) | {p for p in entries if (p / "stopped").exists()})
    (tmp_path / "results").mkdir()
    for p in sample:
        shutil.copytree(p, tmp_path / "results" / p.name)
    got, err = restore(tmp_path, capsys)
    assert err == "" and {p.name for p in got} == {p.name for p in sample}


# 6. integer options take whole numbers and store them as ints --------------------------------------------------------


@pytest.mark.parametrize(
    "override,key,want",
    [
        ("train.batches_per_epoch=2.0", "train.batches_per_epoch", 2),
        ("train.batches_per_epoch=1e2", "train.batches_per_epoch", 100),
        ("data.size=32.0", "data.size", 32),
        ("train.checkpoint_every_steps=3.0", "train.checkpoint_every_steps", 3),
    ],
)
def test_an_integral_float_for_an_integer_option_is_stored_as_an_int(override, key, want):
    sec, k = key.split(".")
    got = load_config(overrides=[override])
    value = getattr(getattr(got, sec), k)
    assert value == want and type(value) is int, (override, value)
    as_int = load_config(overrides=[f"{key}={want}"])
    assert run_key(config_to_dict(got)) == run_key(config_to_dict(as_int))  # the same run folder


def test_whole_float_milestones_are_the_int_milestones_run():
    "The schedule's milestones given as 55.0 are stored as 55: one setting, one run folder."
    floats = load_config(overrides=["train.schedule={kind: multistep, milestones: [2.0, 1e1], gamma: 0.5}"])
    ints = load_config(overrides=["train.schedule={kind: multistep, milestones: [2, 10], gamma: 0.5}"])
    ms = floats.train.schedule["milestones"]
    assert ms == [2, 10] and all(type(m) is int for m in ms)
    assert run_key(config_to_dict(floats)) == run_key(config_to_dict(ints))


@pytest.mark.parametrize(
    "override,fix",
    [
        ("train.batches_per_epoch=2.5", "write 2 or 3"),
        ("train.checkpoint_every_steps=0.5", "write 0 or 1"),
        ("data.size=true", "not true/false"),
        ("train.epochs=false", "not true/false"),
    ],
)
def test_a_fractional_or_boolean_value_for_an_integer_option_is_one_line(override, fix):
    key, value = override.split("=")
    with pytest.raises(ConfigError) as e:
        load_config(overrides=[override])
    msg = str(e.value)
    assert "\n" not in msg and f"bad value for {key}: " in msg and "whole number" in msg and fix in msg, msg


def test_dml_train_with_an_integral_float_trains_in_the_int_configs_folder(tmp_path, capsys):
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(A))
    runs = tmp_path / "runs"
    argv = [str(tmp_path / "params.yaml"), "--runs-dir", str(runs), "--no-progress"]
    assert dml_train([*argv, "--set", "train.batches_per_epoch=2.0"]) == 0, capsys.readouterr().err
    want = run_dir_for(make_config(A), runs)  # A has batches_per_epoch: 2
    assert [p.name for p in runs.iterdir()] == [want.name]
    assert yaml.safe_load((want / "config.yaml").read_text())["train"]["batches_per_epoch"] == 2


# 7. every numeric option is bounded above ------------------------------------------------------------------------------


def test_every_numeric_option_has_an_upper_bound():
    from dml_nb.core.config import _numeric_fields

    for key, kind in _numeric_fields().items():
        sec, _, k = key.rpartition(".")
        huge = 10**300 if kind is int else 1e300
        with pytest.raises(ConfigError, match=f"bad value for {key}") as e:
            make_config({sec: {k: huge}} if sec else {k: huge})
        assert "\n" not in str(e.value) and "1e+300" in str(e.value), str(e.value)  # the value shown short
    for k in ("gamma", "min_factor"):
        with pytest.raises(ConfigError, match=f"bad value for train.schedule.{k}"):
            make_config({"train": {"schedule": {"kind": "multistep", "milestones": [2], k: 1e300}}})


@pytest.mark.parametrize(
    "override,key,bound",
    [
        ("train.epochs=1e308", "train.epochs", "100000"),
        ("train.num_workers=100000", "train.num_workers", "512"),
        ("eval.nmi_seeds=1000000", "eval.nmi_seeds", "1000"),
        ("train.batch_size=10000000", "train.batch_size", "1000000"),
        ("train.lr=1e12", "train.lr", "at most 1e9"),
        ("train.schedule={kind: multistep, milestones: [3, 1e9], gamma: 0.1}", "train.schedule.milestones", "100000"),
    ],
)
def test_a_too_large_value_is_one_line_and_writes_nothing(tmp_path, capsys, override, key, bound):
    with pytest.raises(ConfigError) as e:  # checked at load: nothing trains
        load_config(overrides=[override])
    msg = str(e.value)
    assert "\n" not in msg and f"bad value for {key}: " in msg and bound in msg and f"set {key}" in msg, msg
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(A))
    runs = tmp_path / "runs"
    code = dml_train([str(tmp_path / "params.yaml"), "--runs-dir", str(runs), "--set", override, "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and f"bad value for {key}" in err, err
    assert not runs.exists()


# 8. eval metrics are checked before the first training step --------------------------------------------------------------


def test_a_recall_k_larger_than_the_test_set_stops_before_training(tmp_path, capsys):
    raw = {**A, "eval": {**A["eval"], "metrics": ["recall@1", "recall@100000"]}}
    with pytest.raises(ConfigError) as e:
        run(raw, runs_dir=tmp_path / "runs", progress=False)
    msg = str(e.value)
    assert "\n" not in msg and "recall@100000" in msg and "recall@239" in msg and "nmi" in msg, msg
    assert snapshot(tmp_path / "runs") == {}  # no run folder, no history: no step ran
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(raw))
    code = dml_train([str(tmp_path / "params.yaml"), "--runs-dir", str(tmp_path / "runs"), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "recall@100000" in err, err
    assert snapshot(tmp_path / "runs") == {}


# 9. duplicate seeds are refused ----------------------------------------------------------------------------------------


def test_duplicate_seeds_are_refused_before_any_run(tmp_path, monkeypatch):
    import dml_nb.reproduction.repro as R
    from dml_nb.reproduction.notebook import Reproduction

    def trained(*a, **k):
        raise AssertionError("a run was started")

    monkeypatch.setattr(R, "run_one", trained)
    nb = Reproduction("repro_table3", "shapes", "shapes", A, [0, 0, 1, 2, 1], tmp_path / "f", tmp_path / "runs")
    with pytest.raises(ConfigError) as e:
        nb.run({"A": {}})
    msg = str(e.value)
    assert "\n" not in msg and "seeds [0, 0, 1, 2, 1]" in msg and "repeat 0, 1" in msg and "[0, 1, 2]" in msg, msg
    with pytest.raises(ConfigError, match="repeat 3"):
        R.collect_runs(tmp_path, [R.Row("A", {})], A, [3, 3])
    assert not (tmp_path / "runs").exists()


# 10. no seed disappears silently ---------------------------------------------------------------------------------------


def fake_runs(runs: Path, rows, base: dict, seeds, r1: dict) -> dict:
    "A finished run folder for every row and seed, test R@1 `r1[row] + seed / 100`: {(row, seed): run folder}."
    from dml_nb.reproduction.repro import job_config

    out = {}
    for row in rows:
        for s in seeds:
            cfg = make_config(job_config(row, base, s))
            cdict, run_dir = config_to_dict(cfg), run_dir_for(cfg, runs)
            run_dir.mkdir(parents=True)
            (run_dir / "config.yaml").write_text(yaml.safe_dump(cdict, sort_keys=True))
            info = {"metrics": {"test/recall@1": r1[row.name] + s / 100}, "config_key": run_key(cdict)}
            (run_dir / "metrics.json").write_text(json.dumps(info))
            (run_dir / "done").write_text("2026-01-01T00:00:00+00:00\n")
            out[(row.name, s)] = run_dir
    return out


def test_a_row_whose_seeds_did_not_all_finish_names_them_in_the_table_and_the_claims(tmp_path):
    from dml_nb.reproduction.claims import Claims
    from dml_nb.reproduction.repro import Row, collect_runs, compare, summarize

    rows, seeds = [Row("A", {}), Row("B", {"train": {"lr": 0.5}})], [0, 1, 2, 3]
    folders = fake_runs(tmp_path / "runs", rows, A, seeds, {"A": 0.5, "B": 0.3})
    (folders[("A", 1)] / "metrics.json").unlink()  # 'done' without its metrics
    stopped = folders[("A", 2)]
    for name in ("done", "metrics.json"):
        (stopped / name).unlink()
    key = run_key(config_to_dict(make_config(yaml.safe_load((stopped / "config.yaml").read_text()))))
    (stopped / "stopped").write_text(json.dumps({"error": "NoTuplesError", "message": "no tuples", "config_key": key}))

    per_seed = collect_runs(tmp_path / "runs", rows, A, seeds)
    status = dict(zip(per_seed["seed"][per_seed["row"] == "A"], per_seed["status"][per_seed["row"] == "A"]))
    assert status[0] == status[3] == "ok" and "metrics.json" in status[1] and status[2] == "stopped: no tuples"
    table = summarize(per_seed, metrics=("recall@1",))
    assert table.loc["A", "seeds"] == 2 and table.loc["B", "status"] == "ok"
    note = table.loc["A", "status"]
    assert note.startswith("seeds 0, 3 ran; ") and "seed 1 not run: " in note and "metrics.json" in note, note
    assert "seed 2 stopped: no tuples" in note and "\n" not in note, note
    assert compare(table, pd.DataFrame(index=pd.Index([], name="row")), ["R@1"]).loc["A", "status"] == note

    claims = Claims("t", tmp_path / "figures", per_seed=per_seed)
    claims.beats("A beats B", table, "A", "B")
    (item,) = claims.data()["claims"]
    assert "seeds 0, 3 ran" in item["numbers"] and "seed 2 stopped" in item["numbers"], item["numbers"]
    claims.save()
    assert "seeds 0, 3 ran" in (tmp_path / "figures" / "t_claims.md").read_text()


# 11. environment folders and the folders dml-reproduce writes to ------------------------------------------------------


def test_a_relative_dml_results_or_dml_runs_is_taken_from_the_project_root(tmp_path, monkeypatch):
    from dml_nb.reproduction.reproduce import machine_paths
    from dml_nb.sweeps.sweep import notebook_parameters

    root = tmp_path.resolve()
    (root / "settings.ini").write_text("[DEFAULT]\nlib_name = dml_nb\n")
    (root / "nbs").mkdir()
    monkeypatch.chdir(root / "nbs")  # where papermill's kernel runs a notebook
    monkeypatch.setenv(RESULTS_ENV, "my-results")
    monkeypatch.setenv("DML_RUNS", "my-runs")
    env = RunPolicy.from_env(root)  # what an entry point reads
    assert env.results == root / "my-results" and env.runs == root / "my-runs"
    assert results_folder(None, root, env) == root / "my-results"
    with env.applied():
        assert results_dir() == root / "my-results"
        assert notebook_parameters()["output"]["runs_dir"] == str(root / "my-runs")
        assert dict(machine_paths(root))[str(root / "my-runs")] == "<runs>"


@pytest.mark.parametrize("under", [False, True], ids=["a-file", "under-a-file"])
def test_dml_runs_naming_a_file_is_one_line_before_anything_runs(tmp_path, monkeypatch, capsys, under):
    f = tmp_path / "a-file"
    f.write_text("kept")
    runs = f / "runs" if under else f
    monkeypatch.setenv("DML_RUNS", str(runs))
    plan = tmp_path / "missing-plan.json"  # never read: the run cache fails first
    with pytest.raises(SystemExit) as e:
        reproduce_main(["--results-dir", "none", "--launch", "local", "--from-plan", str(plan), "--no-collect"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert "DML_RUNS" in err and str(runs) in err and "--runs-dir" in err, err
    assert f.read_text() == "kept"


def test_a_results_folder_under_a_file_is_refused_before_anything_runs(tmp_path, capsys):
    f = tmp_path / "a-file"
    f.write_text("kept")
    plan = tmp_path / "missing-plan.json"
    with pytest.raises(SystemExit) as e:
        reproduce_main(["--results-dir", str(f / "results"), "--launch", "local", "--from-plan", str(plan)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert str(f / "results") in err and "--results-dir none" in err, err


def test_a_results_folder_that_cannot_be_written_says_how_to_turn_saving_off(saved, tmp_path):
    f = tmp_path / "a-file"
    f.write_text("kept")
    with pytest.raises(ConfigError) as e:
        save_result(saved["runs"] / saved["A"].name, f / "results")
    msg = str(e.value)
    assert "\n" not in msg and str(f / "results") in msg, msg
    assert "--results-dir none" in msg and "DML_RESULTS=none" in msg, msg
    assert f.read_text() == "kept"


def test_a_set_key_too_deep_is_one_line_not_a_recursion_error(tmp_path, capsys):
    deep = "a." * 20000 + "b=1"
    with pytest.raises(ConfigError) as e:
        load_config(overrides=[deep])
    msg = str(e.value)
    assert "\n" not in msg and len(msg) < 400 and "'a'" in msg and "train" in msg, msg[:500]
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(A))
    runs = tmp_path / "runs"
    code = dml_train([str(tmp_path / "params.yaml"), "--runs-dir", str(runs), "--set", deep, "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err and "--set" in err, err[:500]
    assert not runs.exists()


@pytest.mark.parametrize(
    "name,text",
    [("metrics.json", ""), ("metrics.json", '{"metrics": {"test/rec'), ("metrics.json", "[1, 2]"), ("history.csv", "")],
)
def test_a_truncated_or_empty_result_file_is_one_line_naming_it_and_the_fix(saved, tmp_path, name, text):
    run_dir = tmp_path / saved["A"].name
    shutil.copytree(saved["runs"] / saved["A"].name, run_dir)
    (run_dir / name).write_text(text)
    with pytest.raises(ValueError) as e:
        load_result(run_dir)
    msg = str(e.value)
    assert "\n" not in msg and str(run_dir / name) in msg and "delete" in msg and "restore" in msg, msg
    assert (run_dir / name).read_text() == text and (run_dir / "done").exists()  # nothing removed


def test_duplicate_seeds_in_a_notebooks_parameters_are_refused_in_setup(tmp_path):
    from dml_nb.reproduction.notebook import notebook_defaults, setup

    output = {
        "progress": False,
        "figures_dir": str(tmp_path / "f"),
        "runs_dir": str(tmp_path / "runs"),
        "results": False,
    }
    params = {**notebook_defaults("repro_table3"), "seeds": [0, 0, 1], "output": output}
    with pytest.raises(ValueError) as e:  # before the seeds are shrunk to one under tests, before any folder is made
        setup("repro_table3", params)
    msg = str(e.value)
    assert "\n" not in msg and "repro_table3" in msg and "repeat 0" in msg and "[0, 1]" in msg, msg
    assert params["seeds"] == [0, 0, 1] and not (tmp_path / "runs").exists() and not (tmp_path / "f").exists()


def test_an_unwritable_run_cache_is_one_line_naming_dml_runs(tmp_path, monkeypatch):
    "The tests run as root, who writes anywhere: the unwritable folder is simulated (os.access says no for it)."
    import dml_nb.experiments.results as R

    folder = tmp_path / "cache"
    folder.mkdir()
    real = os.access
    monkeypatch.setattr(R.os, "access", lambda p, mode: False if Path(p) == folder else real(p, mode))
    monkeypatch.setenv("DML_RUNS", str(folder))
    with pytest.raises(ConfigError, match=r"\$DML_RUNS\) cannot be written to: set \$DML_RUNS or --runs-dir") as e:
        R.check_runs_folder(policy=R.RunPolicy.from_env())
    assert "\n" not in str(e.value)


def test_on_unreadable_sets_the_declared_field_not_a_method_from_outside(tmp_path):
    """`tolerate_unreadable` fills `ImageListDataset.unreadable` (declared in its constructor); `load` stays the class's
    own method, and `read` is the plain file read that a stand-in uses."""
    from PIL import Image

    from dml_nb.data.datasets import ImageListDataset
    from dml_nb.data.build import tolerate_unreadable

    paths = []
    for k in range(4):
        p = tmp_path / f"{k}.jpg"
        Image.new("RGB", (8, 8), (40 * k, 0, 0)).save(p)
        paths.append(p)
    ds = ImageListDataset(paths, [0, 0, 1, 1])
    assert ds.unreadable is None
    tolerate_unreadable(ds, "skip", "test set")
    assert "load" not in vars(ds) and callable(ds.unreadable)
    paths[0].write_bytes(b"not a jpeg")
    with pytest.warns(UserWarning, match="stands in"):
        img = ds.load(0)
    assert img.getpixel((0, 0)) == ds.read(1).getpixel((0, 0))
    with pytest.raises(OSError, match="cannot read image"):
        ds.read(0)
