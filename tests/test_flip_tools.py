"""The tools that measure regime v3's flip rate and DaNCE's idle epochs (`tools/flip_rate.py`, `tools/task_epochs.py`),
on small run folders and claims files written here: what they count as a flip, how they pair retrained runs with
their first training, and from which epoch they call a task idle."""

import json
import os
from pathlib import Path

import pandas as pd
import pytest
import yaml
from tool_scripts import tool


flip_rate, task_epochs, regime_pilot = tool("flip_rate"), tool("task_epochs"), tool("regime_pilot")


def _run(folder: Path, r1: float, threads: int, seed: int = 0, history=None, method=None) -> Path:
    folder.mkdir(parents=True)
    (folder / "metrics.json").write_text(
        json.dumps({"metrics": {"test/recall@1": r1, "test/dance/recall@1": r1}, "threads": threads})
    )
    (folder / "config.yaml").write_text(yaml.safe_dump({"seed": seed, "method": method or {"name": "diva"}}))
    if history is not None:
        pd.DataFrame(history).to_csv(folder / "history.csv", index=False)
    return folder


def test_a_flip_is_a_decided_verdict_that_changed():
    before = {"a": ("holds", 1.5), "b": ("fails", -2.0), "c": ("unresolved", 0.3), "d": ("holds", 1.1)}
    after = {"a": ("fails", -1.2), "b": ("unresolved", -0.5), "c": ("holds", 1.4), "d": ("holds", 2.0)}
    lines, n = flip_rate.compare(before, after)
    assert n == {"claims": 4, "decided before": 3, "flips": 1, "to or from unresolved": 2, "same": 1}
    assert lines[0].endswith("| flips |") and lines[3].endswith("|  |")


def test_retrained_runs_pair_with_the_run_of_the_same_folder(tmp_path):
    _run(tmp_path / "before/diva-x-1", 0.30, 1)
    _run(tmp_path / "before/diva-x-2", 0.40, 1)
    _run(tmp_path / "before/diva-x-3", 0.50, 1)  # not retrained: left out
    _run(tmp_path / "after/diva-x-1", 0.32, 2)
    _run(tmp_path / "after/diva-x-2", 0.40, 2)
    _run(tmp_path / "after/diva-x-9", 0.10, 2)  # no first training: left out
    r = flip_rate.run_differences(tmp_path / "before", tmp_path / "after")
    assert r["runs"] == 2 and r["identical runs"] == 1 and r["threads"] == [(1, 2)]
    assert r["max"] == pytest.approx(2.0) and r["sd"] == pytest.approx(2**0.5)
    assert [row["run"] for row in r["rows"]] == ["diva-x-1", "diva-x-2"]
    assert r["rows"][0]["difference"] == pytest.approx(2.0) and r["rows"][0]["threads after"] == 2
    assert r["cpus"] == [(None, None)]  # neither run recorded its CPU


def test_the_run_by_run_comparison_names_each_run_s_cpu(tmp_path):
    "Another machine's retraining against a results folder: each pair's CPU capability, and the CSV it writes."
    for side, r1, cap in (("before", 0.30, "AVX512"), ("after", 0.31, "AVX2")):
        f = _run(tmp_path / side / "baseline-x-1", r1, 1)
        m = json.loads((f / "metrics.json").read_text())
        (f / "metrics.json").write_text(json.dumps({**m, "cpu": {"model": "a CPU", "capability": cap}}))
    (tmp_path / "figures").mkdir()
    for d in ("figures", "after_claims"):
        (tmp_path / d).mkdir(exist_ok=True)
        claims = {"claims": [{"claim": "x above y", "verdict": "holds", "margin": 1.5}]}
        (tmp_path / d / "nb_claims.json").write_text(json.dumps(claims))
    out = tmp_path / "runs.csv"
    argv = ["nb", "--compare-only", "--against", str(tmp_path / "figures"), "--after", str(tmp_path / "after_claims")]
    argv += ["--runs-dir", str(tmp_path / "after"), "--runs-before", str(tmp_path / "before"), "--runs-csv", str(out)]
    assert flip_rate.main(argv) == 0
    df = pd.read_csv(out)
    assert df["run"].tolist() == ["baseline-x-1"] and df["difference"].iloc[0] == pytest.approx(1.0)
    assert (df["cpu before"].iloc[0], df["cpu after"].iloc[0]) == ("AVX512", "AVX2")


def test_a_runs_csv_without_the_runs_to_compare_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        flip_rate.main(["nb", "--compare-only", "--runs-dir", str(tmp_path), "--runs-csv", str(tmp_path / "r.csv")])
    assert e.value.code == 2 and "give --runs-before" in capsys.readouterr().err
    assert not (tmp_path / "r.csv").exists()


def test_the_pilot_keeps_the_files_of_the_run_it_just_made(tmp_path):
    "A notebook whose defaults are the transferred rows writes to figures/local, any other to figures/local-<diff>."
    for i, d in enumerate(("local-epochs=8", "local", "local-seeds=0")):
        (tmp_path / d).mkdir()
        f = tmp_path / d / "nb_claims.json"
        f.write_text("{}")
        os.utime(f, (1000 + i, 1000 + i if d != "local" else 5000))
    assert regime_pilot.latest_output(tmp_path, "nb") == tmp_path / "local"
    with pytest.raises(FileNotFoundError, match="other: no claims file"):
        regime_pilot.latest_output(tmp_path, "other")


def _history(dance_loss, dance_grad):
    n = len(dance_loss)
    return {
        "epoch": list(range(1, n + 1)),
        "loss/discriminative": [0.5] * n,
        "grad/discriminative": [0.25] * n,
        "loss/dance": dance_loss,
        "grad/dance": dance_grad,
        "positive_similarity/dance": [0.9 + 0.01 * i for i in range(n)],
    }


def test_a_task_is_idle_from_the_epoch_it_stays_idle_to_the_end(tmp_path):
    # epoch 2 idle, 3 alive again, idle from 4: below 1e-3 of the largest task's gradient counts as idle
    h = _history([0.2, 0.0, 0.1, 1e-3, 0.0], [1.0, 0.0, 0.01, 1e-4, 0.0])
    run = _run(tmp_path / "diva-x-1", 0.3, 1, history=h, method={"name": "diva", "options": {"temperature": 0.01}})
    e = task_epochs.epochs_of(run, "dance")
    assert e["idle"].tolist() == [False, True, False, True, True]
    assert e["grad share"].tolist() == pytest.approx([1.0, 0.0, 0.04, 4e-4, 0.0])
    s = task_epochs.summary(run, "dance")
    assert (s["idle from"], s["idle epochs"], s["test R@1"]) == (4, 3, 30.0)


def test_the_settings_that_differ_between_runs_are_named(tmp_path):
    h = _history([0.2, 0.1], [1.0, 0.5])
    a = _run(tmp_path / "a", 0.3, 1, history=h, method={"name": "diva", "options": {"temperature": 0.01, "rho": 1}})
    b = _run(tmp_path / "b", 0.3, 1, history=h, method={"name": "diva", "options": {"temperature": 0.1, "rho": 1}})
    assert task_epochs.differing([a, b]) == {a: "options.temperature=0.01", b: "options.temperature=0.1"}


def test_a_task_the_run_does_not_have_is_a_clear_error(tmp_path):
    run = _run(tmp_path / "r", 0.3, 1, history=_history([0.2], [1.0]))
    with pytest.raises(SystemExit, match="no task 'intra'.*its tasks: dance, discriminative"):
        task_epochs.epochs_of(run, "intra")
