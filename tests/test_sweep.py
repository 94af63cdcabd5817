"""Sweeps: the plan of a notebook is the runs it then uses, the launchers give the run folders of the sequential
path bit for bit, a killed sweep resumes to the same results, and the README's cluster workflow (plan, launch,
collect) works on the local launcher.

Bit for bit holds at the same CPU thread count: on a CPU the count changes a run's last bits (oneDNN's convolution
weight gradients, whole-tensor sums; `_configs(epochs=4, batches=6)` ends at another loss on 1 and on 2 threads on
an AVX-512 Xeon, and the 2 x 2 batch runs do on an AMD EPYC). So every comparison here names its count: the
sequential runs train on `RUN_THREADS` (what `run_rows` and the local and SLURM launchers default to), and a resumed
run keeps the count it started with, whatever the launcher that resumes it is given."""

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pandas as pd
import pytest

from dml_nb.experiments.experiment import RUN_THREADS, run
from dml_nb.reproduction.repro import base_config, output_dirs, smoke
from dml_nb.reproduction.reproduce import reproduce_main
from dml_nb.sweeps.launch import launch
from dml_nb.sweeps.sweep import MissingRunsError, Plan, PlanStop, SweepMode, SweepResult, _add_jobs, plan_configs
from dml_nb.experiments.experiment import load_result
from dml_nb.experiments.results import RESULTS_ENV, RunPolicy, restore_results, restored, save_result

ROOT = Path(__file__).resolve().parents[1]


def _configs(epochs=2, batches=2, seeds=(0,)):
    "Tiny shapes runs: two rows over `seeds`."
    out = {}
    for dim in (16, 32):
        for s in seeds:
            raw = smoke({**base_config(), "method": {"name": "baseline", "embedding_dim": dim}, "seed": s}, force=True)
            raw["train"].update(epochs=epochs, batches_per_epoch=batches)
            raw["eval"]["every"] = epochs
            out[f"dim {dim} seed {s}"] = raw
    return out


def _same_runs(a: Path, b: Path, threads: int = RUN_THREADS):
    "metrics.json (less the wall time and the finishing time) and history.csv (less the time column) are equal; both trained on `threads` CPU threads."
    assert (a / "done").exists() and (b / "done").exists()
    ma, mb = (json.loads((d / "metrics.json").read_text()) for d in (a, b))
    assert ma["threads"] == mb["threads"] == threads, (ma["threads"], mb["threads"], threads)
    for k in ("wall_time_s", "finished"):
        ma.pop(k), mb.pop(k)
    assert ma == mb
    ha, hb = (pd.read_csv(d / "history.csv").drop(columns=["time"]) for d in (a, b))
    pd.testing.assert_frame_equal(ha, hb, check_exact=True)
    assert (a / "config.yaml").read_text() == (b / "config.yaml").read_text()


@pytest.fixture(scope="module")
def sequential(tmp_path_factory):
    "The sequential path: each config run in this process, one after another, on `RUN_THREADS` threads (as `run_rows`)."
    runs = tmp_path_factory.mktemp("sequential")
    return {
        name: run(raw, runs_dir=runs, progress=False, threads=RUN_THREADS).run_dir for name, raw in _configs().items()
    }


def test_local_two_workers_match_the_sequential_path(tmp_path, sequential):
    plan = plan_configs(_configs(), tmp_path / "plan", tmp_path / "runs")
    assert len(plan.pending()) == 2
    launch(plan, "local", workers=2, progress=False)
    assert plan.pending() == []
    for job, name in zip(plan.jobs, _configs()):
        assert Path(job.run_dir).name == sequential[name].name  # the same hashed folder
        _same_runs(Path(job.run_dir), sequential[name])
    assert {p.name for p in (tmp_path / "plan" / "logs").iterdir()} == {f"{j.hash}.log" for j in plan.jobs}


def test_a_failed_run_is_named_with_its_log(tmp_path):
    from dml_nb.sweeps.launch import SweepFailed

    plan = plan_configs(dict(list(_configs().items())[:1]), tmp_path / "plan", tmp_path / "runs")
    plan.jobs[0].config_file(plan.plan_dir).write_text("train: {epochs: -1}\n")  # dml-train refuses it
    with pytest.raises(SweepFailed) as e:
        launch(plan, "local", workers=1, progress=False)
    (f,) = e.value.failures
    assert f.job is plan.jobs[0] and f.error == "dml-train exit status 2" and "epochs" in f.log.read_text()
    assert str(f.log) in str(e.value) and plan.jobs[0].uses[0] in str(e.value)


def test_a_failed_launch_exits_non_zero_naming_runs_and_logs(tmp_path, capsys):
    plan = plan_configs(dict(list(_configs().items())[:1]), tmp_path / "plan", tmp_path / "runs")
    plan.jobs[0].config_file(plan.plan_dir).write_text("train: {epochs: -1}\n")
    assert (
        reproduce_main(["--launch", "local", "--from-plan", str(tmp_path / "plan" / "plan.json"), "--no-collect"]) == 1
    )
    err = capsys.readouterr().err
    assert (
        "these runs failed" in err and str(plan.jobs[0].log_file(plan.plan_dir)) in err and plan.jobs[0].uses[0] in err
    )


def test_killed_sweep_relaunched_gives_the_same_results(tmp_path):
    "Killed on 2 threads a run, relaunched on 1 (the default), resumes on its 2 and ends as an uninterrupted 2-thread run."
    configs = _configs(epochs=4, batches=6, seeds=(0,))
    plan = plan_configs(configs, tmp_path / "plan", tmp_path / "runs")
    code = f"from dml_nb.sweeps.sweep import Plan; from dml_nb.sweeps.launch import launch; launch(Plan.load({str(plan.plan_dir / 'plan.json')!r}), 'local', workers=1, threads=2, progress=False)"
    sweep = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    first = Path(plan.jobs[0].run_dir)
    try:
        deadline = time.time() + 120
        while not (first / "checkpoint.pt").exists() and time.time() < deadline and sweep.poll() is None:
            time.sleep(0.02)
        os.killpg(sweep.pid, signal.SIGKILL)  # the launcher and its dml-train worker, mid-run
    finally:
        sweep.wait()
    assert (first / "checkpoint.pt").exists() and not (first / "done").exists(), (
        "the kill must land inside the first run"
    )
    assert len(plan.pending()) == 2
    launch(
        plan, "local", workers=2, progress=False
    )  # relaunch on 1 thread each: the first run resumes on its 2, the second starts on 1
    assert plan.pending() == []
    for job, raw, threads in zip(plan.jobs, configs.values(), (2, RUN_THREADS)):
        fresh = run(raw, runs_dir=tmp_path / f"sequential{threads}", progress=False, threads=threads).run_dir
        _same_runs(Path(job.run_dir), fresh, threads)


def test_readme_cluster_workflow_on_the_local_launcher(tmp_path, monkeypatch):
    """Plan, launch, collect on a small notebook at smoke size: the plan lists exactly the run folders its
    collect-only execution then reads, and nothing else is trained. Every run read is saved in the results folder,
    and a second machine given that folder plans no run again but the ones whose embeddings the figure reads."""
    monkeypatch.setenv(RESULTS_ENV, str(tmp_path / "results"))
    nb = "repro_dnc_fig8"
    runs = (
        output_dirs()[1].parent / f"sweep-{uuid.uuid4().hex[:8]}"
    )  # under pytest the notebooks keep to the smoke folder
    plan_json = tmp_path / "plan.json"
    assert (
        reproduce_main(
            [nb, "--plan", "--runs-dir", str(runs), "--plan-dir", str(tmp_path / "plan"), "--json", str(plan_json)]
        )
        == 0
    )
    plan = Plan.load(plan_json)
    assert plan.jobs and all(j.status == "pending" for j in plan.jobs)
    assert plan.stopped == [nb]  # its planning stopped at its runs: a launch plans it again (`launch_later`)
    assert not runs.exists() or not any(runs.iterdir()), "planning trains nothing"
    assert (
        reproduce_main([nb, "--launch", "local", "--workers", "2", "--from-plan", str(plan_json), "--no-collect"]) == 0
    )
    assert reproduce_main([nb, "--collect-only", "--runs-dir", str(runs)]) == 0
    assert {p for p in runs.iterdir() if p.is_dir()} == {Path(j.run_dir) for j in plan.jobs}
    assert all((Path(j.run_dir) / "done").exists() for j in plan.jobs)
    saved = tmp_path / "results"  # every run, without checkpoint or embeddings
    assert {p.name for p in saved.iterdir()} == {Path(j.run_dir).name for j in plan.jobs}
    assert all(
        sorted(f.name for f in p.iterdir()) == ["config.yaml", "done", "history.csv", "metrics.json"]
        for p in saved.iterdir()
    )
    runs2 = runs.with_name(runs.name + "-second")  # the second machine's empty run cache
    assert (
        reproduce_main(
            [
                nb,
                "--plan",
                "--runs-dir",
                str(runs2),
                "--plan-dir",
                str(tmp_path / "plan2"),
                "--json",
                str(tmp_path / "plan2.json"),
            ]
        )
        == 0
    )
    plan2 = Plan.load(tmp_path / "plan2.json")
    assert {Path(j.run_dir).name for j in plan2.jobs} == {Path(j.run_dir).name for j in plan.jobs}
    assert all(j.rebuild and j.status.startswith("pending (restored") for j in plan2.jobs), [
        j.status for j in plan2.jobs
    ]
    assert not any((Path(j.run_dir) / "checkpoint.pt").exists() for j in plan2.jobs), "planning trains nothing"


def test_a_restored_run_a_figure_needs_is_planned_and_trained_again(tmp_path, sequential, monkeypatch):
    "A run restored from a results folder: finished for the tables; a figure that needs its embeddings lists it in the plan, and the launcher trains it again, to the same numbers."
    name = "dim 16 seed 0"
    save_result(sequential[name], tmp_path / "results")
    (run_dir,) = restore_results(tmp_path / "results", tmp_path / "runs")
    assert run_dir.name == sequential[name].name and restored(run_dir)
    assert plan_configs({name: _configs()[name]}, tmp_path / "p0", tmp_path / "runs").pending() == []
    records = tmp_path / "records.jsonl"
    records.touch()  # as `run_rows` reads it in a notebook that `plan_notebook` executes
    read = SweepResult(**vars(load_result(run_dir)), mode=SweepMode(plan=records))
    with pytest.raises(PlanStop, match="trained again"):
        read.embeddings()
    with pytest.raises(MissingRunsError, match="restored from a results folder"):  # collect-only: named, not trained
        SweepResult(**vars(load_result(run_dir)), mode=SweepMode(collect=True)).embeddings()
    jobs = {}
    _add_jobs(jobs, [json.loads(l) for l in records.read_text().splitlines()], "nb", tmp_path / "plan")
    plan = Plan(tmp_path / "plan", list(jobs.values()), ["nb"])
    assert [j.status for j in plan.jobs] == ["pending (restored without embeddings or weights: trained again)"]
    launch(plan, "local", workers=1, progress=False)
    assert plan.pending() == [] and not restored(run_dir) and (run_dir / "embeddings.pt").exists()
    _same_runs(run_dir, sequential[name])


@pytest.mark.slow  # 45 s; tests/test_slurm_cli.py runs the README's command through submitit's SLURM path instead
def test_slurm_launcher_through_submitits_local_executor(tmp_path, sequential):
    "The job array and its waiting, run by submitit's local executor (no SLURM here); the submission parameters are checked in nbs/62a_sweep.ipynb."
    pytest.importorskip("submitit", reason="the optional extra: pip install 'dml_nb[slurm]'")
    from dml_nb.sweeps.launch import slurm_executor

    plan = plan_configs(_configs(), tmp_path / "plan", tmp_path / "runs")
    ex = slurm_executor(
        tmp_path / "plan" / "slurm", partition="gpu", time_min=10, gpus_per_run=0, cpus=1, cluster="local"
    )
    launch(plan, "slurm", executor=ex, progress=False)  # the default count: RUN_THREADS, as the sequential path
    for job, name in zip(plan.jobs, _configs()):
        _same_runs(Path(job.run_dir), sequential[name])


def test_multi_gpu_launches_one_process_per_gpu(tmp_path, monkeypatch):
    "No GPU here: the commands and environments the multi_gpu launcher starts are recorded by a stand-in for Popen."
    import dml_nb.sweeps.launch as S

    started, busy = [], set()

    class FakeProcess:
        def __init__(self, cmd, env, stdout, stderr):
            gpu = env["CUDA_VISIBLE_DEVICES"]
            assert gpu not in busy, "two processes on one GPU"
            busy.add(gpu)
            started.append((cmd, gpu, env["OMP_NUM_THREADS"]))
            self.cmd, self.gpu, self.polls = cmd, gpu, 0
            self.returncode = None

        def poll(self):
            self.polls += 1
            if self.polls < 2:
                return None
            run_dir = Path(self.cmd[self.cmd.index("-o") + 1])
            run_dir.mkdir(parents=True)
            (run_dir / "done").write_text("")
            busy.discard(self.gpu)
            self.returncode = 0
            return 0

    monkeypatch.setattr(S.subprocess, "Popen", FakeProcess)
    configs = _configs(seeds=(0, 1, 2))
    plan = plan_configs(configs, tmp_path / "plan", tmp_path / "runs")
    launch(plan, "multi_gpu", gpus=["0", "3"], threads=4, progress=False)
    assert [c[3:] for c, _, _ in started] == [
        j.command(plan.plan_dir)[1:] for j in plan.jobs
    ]  # dml-train's arguments, in plan order
    assert all(c[:3] == [sys.executable, "-c", S._DML_TRAIN] for c, _, _ in started)
    assert [g for _, g, _ in started[:2]] == ["0", "3"] and {g for _, g, _ in started} == {"0", "3"}
    assert {t for _, _, t in started} == {"4"} and len(started) == 6
    started.clear()
    plan = plan_configs(_configs(seeds=(7,)), tmp_path / "plan2", tmp_path / "runs")
    plan.jobs[0].unavailable = "needs weights not on disk"  # as the plan found it: left out here, not a failure
    launch(plan, "multi_gpu", gpus=["0"], progress=False)
    assert [c[c.index("-o") + 1] for c, _, _ in started] == [plan.jobs[1].run_dir]


def test_slurm_submission_parameters_in_submitits_sbatch_file(tmp_path, monkeypatch):
    "The sbatch header submitit writes for the launcher's options (stand-ins of SLURM's commands on PATH: the launcher looks for them)."
    pytest.importorskip("submitit", reason="the optional extra: pip install 'dml_nb[slurm]'")
    from dml_nb.sweeps.launch import slurm_executor

    for name in ("sbatch", "srun", "sacct"):
        (tmp_path / name).write_text("#!/bin/sh\nexit 1\n")
        (tmp_path / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    ex = slurm_executor(
        tmp_path / "slurm",
        partition="gpu",
        time_min=720,
        gpus_per_run=2,
        mem_gb=64,
        cpus=10,
        parallel=4,
        cluster="slurm",
    )
    text = ex._executor._make_submission_file_text(
        "python -u -m submitit.core._submit x", "uid"
    )  # submitit's own sbatch file
    for line in (
        "--partition=gpu",
        "--time=720",
        "--gpus-per-node=2",
        "--mem=64GB",
        "--cpus-per-task=10",
        "--job-name=dml-train",
    ):
        assert f"#SBATCH {line}\n" in text, line
    assert ex._executor.parameters["array_parallelism"] == 4


def test_dml_runs_is_the_default_run_cache(tmp_path, monkeypatch):
    """Every worker and notebook finds the shared cache through the run policy its entry point read from $DML_RUNS;
    an explicit runs_dir still wins."""
    monkeypatch.setattr("dml_nb.reproduction.repro.in_test", lambda: False)
    (tmp_path / "settings.ini").write_text("[DEFAULT]\nlib_name = dml_nb\n")
    monkeypatch.chdir(tmp_path)
    assert output_dirs()[1] == tmp_path / "runs"
    monkeypatch.setenv("DML_RUNS", str(tmp_path / "shared"))
    assert output_dirs()[1] == tmp_path / "runs", "read at an entry point only"
    monkeypatch.setattr("dml_nb.experiments.results._POLICY", RunPolicy.from_env(tmp_path))
    assert output_dirs()[1] == tmp_path / "shared" and output_dirs(runs_dir=tmp_path / "mine")[1] == tmp_path / "mine"


def test_a_run_that_stops_by_design_is_settled_everywhere(tmp_path, monkeypatch):
    """A run whose recipe cannot form its batches records why (`stopped`): run again it stops with the same reason
    without training, a plan and a launcher count it as settled, the results folder keeps it, and a notebook's row shows it."""
    from dml_nb.methods.dnc import ClusterError
    from dml_nb.experiments.experiment import run_dir_for
    from dml_nb.experiments.results import RunStopped, stopped_record
    from dml_nb.reproduction.repro import Row, run_rows
    from dml_nb.core.config import make_config
    from dml_nb.training.learner import Learner

    why = "1 of 2 clusters cannot form a batch with negatives"
    calls = []

    def fit(self):
        calls.append(1)
        raise ClusterError(why)

    monkeypatch.setattr(Learner, "fit", fit)
    monkeypatch.setattr(  # the policy an entry point (dml-train, a notebook's setup) installs from $DML_RESULTS
        "dml_nb.experiments.results._POLICY", RunPolicy(results=tmp_path / "results")
    )
    name, raw = next(iter(_configs().items()))
    run_dir = run_dir_for(make_config(raw), tmp_path / "runs")
    with pytest.raises(ClusterError):
        run(raw, runs_dir=tmp_path / "runs", progress=False)
    assert stopped_record(run_dir)["message"] == why and calls == [1]
    with pytest.raises(RunStopped, match=why):
        run(raw, runs_dir=tmp_path / "runs", progress=False)
    assert calls == [1], "not trained again"
    plan = plan_configs({name: raw}, tmp_path / "plan", tmp_path / "runs")
    assert [j.status for j in plan.jobs] == ["stopped"] and plan.pending() == []
    assert launch(plan, "local", workers=1, progress=False) == []
    assert sorted(p.name for p in (tmp_path / "results" / run_dir.name).iterdir()) == [
        "config.yaml",
        "stopped",
    ]  # fit stopped at once: no history
    (moved,) = restore_results(tmp_path / "results", tmp_path / "second")  # another machine: settled there too
    with pytest.raises(RunStopped, match=why):
        run(raw, runs_dir=tmp_path / "second", progress=False)
    assert calls == [1]
    monkeypatch.setattr("dml_nb.reproduction.repro.in_test", lambda: False)  # run_rows on this exact config
    monkeypatch.setattr("dml_nb.reproduction.repro.smoke", lambda raw, **kw: raw)
    per_seed, results = run_rows(
        [Row("dim 16", {"name": "baseline", "embedding_dim": 16})],
        raw,
        seeds=[raw["seed"]],
        runs_dir=tmp_path / "second",
        progress=False,
    )
    assert results == {} and per_seed["status"].tolist() == [f"stopped: {why}"]


def test_a_launch_plans_again_for_the_runs_later_cells_need(tmp_path, monkeypatch):
    """The flagship's sensitivity columns are planned only once its headline runs are trained (its planning stops at
    them): after a launch, `launch_later` plans the stopped notebooks again and launches what they list, until a plan
    stops nowhere. Before, `dml-reproduce repro_table3 --launch local` trained the headline and then collect-only
    stopped at the sensitivity cell's missing runs."""
    import argparse

    import dml_nb.sweeps.launch as L
    from dml_nb.sweeps.sweep import Job

    def job(name, done=False):
        return Job(name, str(tmp_path / "runs" / f"baseline-shapes-{name}"), {}, [f"nb: {name}"], done)

    first = Plan(tmp_path / "plan", [job("a" * 12)], ["nb", "other"], stopped=["nb"])
    rounds = [  # what planning `nb` again lists: its later cell's run, then nothing new and no stop
        Plan(tmp_path / "later-1", [job("a" * 12, True), job("b" * 12)], ["nb"], stopped=["nb"]),
        Plan(tmp_path / "later-2", [job("a" * 12, True), job("b" * 12, True)], ["nb"]),
    ]
    planned, launched = [], []

    def fake_plan(notebooks, plan_dir, **pp):
        planned.append((list(notebooks), Path(plan_dir).name))
        return rounds.pop(0)

    monkeypatch.setattr(L, "plan_notebook", fake_plan)
    monkeypatch.setattr(L, "_launch_args", lambda args, plan, gpus, threads: launched.append(plan.plan_dir.name))
    monkeypatch.setattr(Job, "status", property(lambda j: "done" if j.done else "pending"))
    assert L.launch_later(argparse.Namespace(), first, {}, None) is None
    assert planned == [(["nb"], "later-1"), (["nb"], "later-2")]  # only the notebook that stopped
    assert launched == ["later-1"] and rounds == []
    assert L.launch_later(argparse.Namespace(), Plan(tmp_path / "p", [], ["nb"]), {}, None) is None
    assert len(planned) == 2, "a plan that stopped nowhere is not planned again"
