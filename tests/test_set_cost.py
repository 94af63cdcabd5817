"""`tools/set_cost.py`, on a small plan and run folders written here: a run shared by two notebooks counts once, a
finished run is found in the run cache or in the results folder, and what is measured is told apart from what is
estimated."""

import json
import math
import subprocess
from pathlib import Path

import pytest
import yaml
from tool_scripts import tool


set_cost = tool("set_cost")


def _finished(folder: Path, wall: float, threads: int = 1, cpu: dict | None = None):
    folder.mkdir(parents=True)
    info = {"wall_time_s": wall, "threads": threads} | ({"cpu": cpu} if cpu else {})
    (folder / "metrics.json").write_text(json.dumps(info))
    (folder / "done").write_text("")


def _plan(tmp_path):
    runs = tmp_path / "runs"
    jobs = [
        {
            "hash": "a",
            "run_dir": str(runs / "baseline-d-00000000000a"),
            "uses": ["nb1: Margin (seed 0)", "nb2: Base (seed 0)"],
        },
        {"hash": "b", "run_dir": str(runs / "diva-d-00000000000b"), "uses": ["nb1: DiVA (seed 0)"]},
        {"hash": "c", "run_dir": str(runs / "diva-d-00000000000c"), "uses": "nb2: DiVA (seed 1)"},
        {"hash": "d", "run_dir": str(runs / "diva-d-00000000000d"), "uses": ["nb2: DiVA (seed 2)"]},
        {"hash": "a", "run_dir": str(runs / "baseline-d-00000000000a"), "uses": ["nb2: Base (seed 0)"]},
    ]
    _finished(runs / "baseline-d-00000000000a", 120.0, cpu={"model": "AMD EPYC", "capability": "AVX2"})
    _finished(tmp_path / "results" / "diva-d-00000000000b", 360.0)
    (runs / "diva-d-00000000000d").mkdir(parents=True)  # started, never finished: no `done`
    (runs / "diva-d-00000000000d" / "metrics.json").write_text(json.dumps({"wall_time_s": 999.0}))
    return {"jobs": jobs}


def test_a_shared_run_counts_once_and_results_are_read(tmp_path):
    plan = _plan(tmp_path)
    runs = set_cost.cost(plan, tmp_path / "results")
    assert list(runs["hash"]) == ["a", "b", "c", "d"]
    assert runs.set_index("hash")["trained"].to_dict() == {"a": True, "b": True, "c": False, "d": False}
    assert runs.set_index("hash").loc["a", "notebooks"] == "nb1 nb2"
    nb = set_cost.per_notebook(runs)
    assert nb.loc["nb1"].to_dict() == {"runs": 2, "trained": 2, "minutes": 8.0, "own runs": 1}
    assert nb.loc["nb2"].to_dict() == {"runs": 3, "trained": 1, "minutes": 2.0, "own runs": 2}
    # without the results folder, the run kept only there is pending
    assert not set_cost.cost(plan, None).set_index("hash").loc["b", "trained"]


def test_the_summary_says_what_is_measured_and_what_is_estimated(tmp_path):
    runs = set_cost.cost(_plan(tmp_path), tmp_path / "results")
    lines = set_cost.summary(runs, workers=2)
    assert lines[0] == "4 distinct runs, 2 trained, 2 pending"
    assert lines[1].startswith("measured: the 2 trained runs took 0.1 h of wall time summed (mean 4.0 min a run")
    assert "threads per run: 1" in lines[1]
    # the CPUs the measured runs trained on: a run saved before runs recorded one is counted as such
    assert lines[2] == "trained on: AMD EPYC (AVX2): 1 runs; not recorded: 1 runs"
    # 480 s measured + the pending diva runs at the trained diva run's 360 s: 1200 s summed; over 2 workers 600 s
    assert lines[3].startswith("estimate: all 4 runs about 0.3 h summed (each of the 2 pending at the mean of")
    assert math.isclose(set_cost.summary_hours(runs), 1200 / 3600)
    assert lines[4].startswith("estimate: about 0.2 h of wall clock, 2 runs at a time")
    assert math.isclose(runs["wall_time_s"].sum(), 480.0)


def test_a_run_the_plan_cannot_train_here_is_left_out(tmp_path):
    plan = _plan(tmp_path)
    plan["jobs"][2]["unavailable"] = "backbone weights missing"
    runs = set_cost.cost(plan, tmp_path / "results")
    assert runs.set_index("hash")["unavailable"].to_dict() == {"a": False, "b": False, "c": True, "d": False}
    lines = set_cost.summary(runs)
    assert (
        lines[0]
        == "4 distinct runs, 2 trained, 1 pending, 1 not trainable here (the plan's `unavailable`; left out of the estimates)"
    )
    assert lines[3].startswith("estimate: all 3 runs about 0.2 h summed")  # 480 s + 1 diva run x 360 s


def test_a_run_that_stopped_by_design_is_neither_trained_nor_pending(tmp_path):
    plan = _plan(tmp_path)
    (tmp_path / "results" / "diva-d-00000000000d").mkdir(parents=True)
    (tmp_path / "results" / "diva-d-00000000000d" / "stopped").write_text("{}")  # as results.record_stopped keeps it
    runs = set_cost.cost(plan, tmp_path / "results")
    assert runs.set_index("hash")["stopped"].to_dict() == {"a": False, "b": False, "c": False, "d": True}
    lines = set_cost.summary(runs)
    assert lines[0] == "4 distinct runs, 2 trained, 1 pending, 1 stopped by design (a `stopped` record; no training)"
    assert lines[3].startswith("estimate: all 3 runs about 0.2 h summed")  # 480 s + 1 diva run x 360 s
    assert math.isclose(set_cost.summary_hours(runs), 840 / 3600)


def test_nothing_trained_measures_nothing(tmp_path):
    plan = {"jobs": [{"hash": "x", "run_dir": str(tmp_path / "none-d-000000000000"), "uses": ["nb: r (seed 0)"]}]}
    lines = set_cost.summary(set_cost.cost(plan))
    assert lines == [
        "1 distinct runs, 0 trained, 1 pending",
        "no trained run has a recorded wall time: nothing is measured",
    ]


def test_a_file_that_is_not_a_plan_is_named_with_the_fix(tmp_path):
    bad = tmp_path / "x.json"
    bad.write_text(json.dumps({"runs": []}))
    with pytest.raises(SystemExit, match="not a plan.*dml-reproduce --plan --json"):
        set_cost.main([str(bad)])
    with pytest.raises(SystemExit, match="no such plan"):
        set_cost.main([str(tmp_path / "missing.json")])
    bad.write_text("{not json")
    with pytest.raises(SystemExit, match="cannot be read as JSON"):
        set_cost.main([str(bad)])


@pytest.mark.parametrize(
    "job,says",
    [
        ({"run_dir": "/r/diva-d-000000000000", "uses": ["nb: r (seed 0)"]}, "job 1 ('no hash') has no hash"),
        ({"hash": "x", "uses": ["nb: r (seed 0)"]}, "job 1 ('x') has no run_dir"),
        ({"hash": "x", "run_dir": None}, "job 1 ('x') has no run_dir"),
        (["x"], "job 1 is a list, not an object"),
        (
            {"hash": "x", "run_dir": "/r/.."},
            "job 1 ('x'): run_dir '/r/..' is not a run folder (<method>-<dataset>-<12 hex digits>)",
        ),
    ],
)
def test_a_job_without_a_hash_or_run_folder_is_named(tmp_path, job, says):
    plan = tmp_path / "p.json"
    plan.write_text(json.dumps({"jobs": [{"hash": "a", "run_dir": "/r/baseline-d-00000000000a"}, job]}))
    with pytest.raises(SystemExit) as e:
        set_cost.main([str(plan)])
    assert str(e.value) == f"{plan}: {says}; make it again with `dml-reproduce --plan --json FILE`"


def test_a_regime_plan_merges_each_notebooks_jobs_by_hash(monkeypatch):
    "`--regime`: one `dml-reproduce --plan` per notebook (stood in for here), a run used by two notebooks kept once."
    plans = {
        "repro_sharing_fig3": [
            {"hash": "a", "run_dir": "/r/sharing-d-00000000000a", "uses": ["repro_sharing_fig3: T* (seed 0)"]}
        ],
        "repro_sharing_fig4": [
            {"hash": "a", "run_dir": "/r/sharing-d-00000000000a", "uses": ["repro_sharing_fig4: Ours (seed 0)"]},
            {"hash": "b", "run_dir": "/r/sharing-d-00000000000b", "uses": ["repro_sharing_fig4: Ours (seed 1)"]},
        ],
    }
    seen = []

    def fake_run(argv, **kw):
        stem, params = argv[1], yaml.safe_load(Path(argv[argv.index("-f") + 1]).read_text())
        seen.append((stem, params["dataset"], "--plan" in argv))
        Path(argv[argv.index("--json") + 1]).write_text(json.dumps({"jobs": plans[stem]}))
        return subprocess.CompletedProcess(argv, 0, "", "")

    monkeypatch.setattr(set_cost.subprocess, "run", fake_run)
    plan = set_cost.plan_regime("finegrained_premise", ["repro_sharing_fig3", "repro_sharing_fig4"])
    assert seen == [
        ("repro_sharing_fig3", "finegrained_premise", True),
        ("repro_sharing_fig4", "finegrained_premise", True),
    ]
    assert [(j["hash"], j["uses"]) for j in plan["jobs"]] == [
        ("a", ["repro_sharing_fig3: T* (seed 0)", "repro_sharing_fig4: Ours (seed 0)"]),
        ("b", ["repro_sharing_fig4: Ours (seed 1)"]),
    ]
