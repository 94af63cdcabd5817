"""Sweeps: the plan of a notebook is the runs it then uses, the launchers give the run folders of the sequential
path bit for bit, a killed sweep resumes to the same results, and the README's cluster workflow (plan, launch,
collect) works on the local launcher."""
import json, os, signal, subprocess, sys, time, uuid
from pathlib import Path

import pandas as pd
import pytest

from dml_nb.reproduction.experiment import run
from dml_nb.reproduction.repro import base_config, output_dirs, smoke
from dml_nb.reproduction.reproduce import reproduce_main
from dml_nb.reproduction.launch import launch
from dml_nb.reproduction.sweep import Plan, plan_configs

ROOT = Path(__file__).resolve().parents[1]


def _configs(epochs=2, batches=2, seeds=(0,)):
    "Tiny shapes runs: two rows over `seeds`."
    out = {}
    for dim in (16, 32):
        for s in seeds:
            raw = smoke({**base_config(), "method": {"name": "baseline", "embedding_dim": dim}, "seed": s}, force=True)
            raw["train"].update(epochs=epochs, batches_per_epoch=batches); raw["eval"]["every"] = epochs
            out[f"dim {dim} seed {s}"] = raw
    return out


def _same_runs(a: Path, b: Path):
    "metrics.json (less the wall time and the finishing time) and history.csv (less the time column) are equal."
    assert (a / "done").exists() and (b / "done").exists()
    ma, mb = (json.loads((d / "metrics.json").read_text()) for d in (a, b))
    for k in ("wall_time_s", "finished"): ma.pop(k), mb.pop(k)
    assert ma == mb
    ha, hb = (pd.read_csv(d / "history.csv").drop(columns=["time"]) for d in (a, b))
    pd.testing.assert_frame_equal(ha, hb, check_exact=True)
    assert (a / "config.yaml").read_text() == (b / "config.yaml").read_text()


@pytest.fixture(scope="module")
def sequential(tmp_path_factory):
    "The sequential path: each config run in this process, one after another."
    runs = tmp_path_factory.mktemp("sequential")
    return {name: run(raw, runs_dir=runs, progress=False).run_dir for name, raw in _configs().items()}


def test_local_two_workers_match_the_sequential_path(tmp_path, sequential):
    plan = plan_configs(_configs(), tmp_path / "plan", tmp_path / "runs")
    assert len(plan.pending()) == 2
    launch(plan, "local", workers=2, progress=False)
    assert plan.pending() == []
    for job, name in zip(plan.jobs, _configs()):
        assert Path(job.run_dir).name == sequential[name].name   # the same hashed folder
        _same_runs(Path(job.run_dir), sequential[name])
    assert {p.name for p in (tmp_path / "plan" / "logs").iterdir()} == {f"{j.hash}.log" for j in plan.jobs}


def test_a_failed_run_is_named_with_its_log(tmp_path):
    from dml_nb.reproduction.launch import SweepFailed
    plan = plan_configs(dict(list(_configs().items())[:1]), tmp_path / "plan", tmp_path / "runs")
    plan.jobs[0].config_file(plan.plan_dir).write_text("train: {epochs: -1}\n")   # dml-train refuses it
    with pytest.raises(SweepFailed) as e: launch(plan, "local", workers=1, progress=False)
    (f,) = e.value.failures
    assert f.job is plan.jobs[0] and f.error == "dml-train exit status 2" and "epochs" in f.log.read_text()
    assert str(f.log) in str(e.value) and plan.jobs[0].uses[0] in str(e.value)


def test_a_failed_launch_exits_non_zero_naming_runs_and_logs(tmp_path, capsys):
    plan = plan_configs(dict(list(_configs().items())[:1]), tmp_path / "plan", tmp_path / "runs")
    plan.jobs[0].config_file(plan.plan_dir).write_text("train: {epochs: -1}\n")
    assert reproduce_main(["--launch", "local", "--from-plan", str(tmp_path / "plan" / "plan.json"), "--no-collect"]) == 1
    err = capsys.readouterr().err
    assert "these runs failed" in err and str(plan.jobs[0].log_file(plan.plan_dir)) in err and plan.jobs[0].uses[0] in err


def test_killed_sweep_relaunched_gives_the_same_results(tmp_path):
    configs = _configs(epochs=4, batches=6, seeds=(0,))
    plan = plan_configs(configs, tmp_path / "plan", tmp_path / "runs")
    code = f"from dml_nb.reproduction.sweep import Plan; from dml_nb.reproduction.launch import launch; launch(Plan.load({str(plan.plan_dir / 'plan.json')!r}), 'local', workers=1, progress=False)"
    sweep = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    first = Path(plan.jobs[0].run_dir)
    try:
        deadline = time.time() + 120
        while not (first / "checkpoint.pt").exists() and time.time() < deadline and sweep.poll() is None: time.sleep(0.02)
        os.killpg(sweep.pid, signal.SIGKILL)   # the launcher and its dml-train worker, mid-run
    finally: sweep.wait()
    assert (first / "checkpoint.pt").exists() and not (first / "done").exists(), "the kill must land inside the first run"
    assert len(plan.pending()) == 2
    launch(plan, "local", workers=2, progress=False)   # relaunch: the first run resumes, the second starts
    assert plan.pending() == []
    for job, raw in zip(plan.jobs, configs.values()):
        fresh = run(raw, runs_dir=tmp_path / "sequential", progress=False).run_dir
        _same_runs(Path(job.run_dir), fresh)


def test_readme_cluster_workflow_on_the_local_launcher(tmp_path):
    """Plan, launch, collect on a small notebook at smoke size: the plan lists exactly the run folders its
    collect-only execution then reads, and nothing else is trained."""
    nb = "repro_dnc_fig8"
    runs = output_dirs()[1].parent / f"sweep-{uuid.uuid4().hex[:8]}"   # under pytest the notebooks keep to the smoke folder
    plan_json = tmp_path / "plan.json"
    assert reproduce_main([nb, "--plan", "--runs-dir", str(runs), "--plan-dir", str(tmp_path / "plan"), "--json", str(plan_json)]) == 0
    plan = Plan.load(plan_json)
    assert plan.jobs and all(j.status == "pending" for j in plan.jobs)
    assert not runs.exists() or not any(runs.iterdir()), "planning trains nothing"
    assert reproduce_main([nb, "--launch", "local", "--workers", "2", "--from-plan", str(plan_json), "--no-collect"]) == 0
    assert reproduce_main([nb, "--collect-only", "--runs-dir", str(runs)]) == 0
    assert {p for p in runs.iterdir() if p.is_dir()} == {Path(j.run_dir) for j in plan.jobs}
    assert all((Path(j.run_dir) / "done").exists() for j in plan.jobs)


def test_slurm_launcher_through_submitits_local_executor(tmp_path, sequential):
    "The job array and its waiting, run by submitit's local executor (no SLURM here); the submission parameters are checked in nbs/66_sweep.ipynb."
    pytest.importorskip("submitit", reason="the optional extra: pip install 'dml_nb[slurm]'")
    from dml_nb.reproduction.launch import slurm_executor
    plan = plan_configs(_configs(), tmp_path / "plan", tmp_path / "runs")
    ex = slurm_executor(tmp_path / "plan" / "slurm", partition="gpu", time_min=10, gpus=0, cpus=1, cluster="local")
    launch(plan, "slurm", threads=1, executor=ex, progress=False)
    for job, name in zip(plan.jobs, _configs()): _same_runs(Path(job.run_dir), sequential[name])


def test_multi_gpu_launches_one_process_per_gpu(tmp_path, monkeypatch):
    "No GPU here: the commands and environments the multi_gpu launcher starts are recorded by a stand-in for Popen."
    import dml_nb.reproduction.launch as S
    started, busy = [], set()
    class FakeProcess:
        def __init__(self, cmd, env, stdout, stderr):
            gpu = env["CUDA_VISIBLE_DEVICES"]
            assert gpu not in busy, "two processes on one GPU"
            busy.add(gpu); started.append((cmd, gpu, env["OMP_NUM_THREADS"])); self.cmd, self.gpu, self.polls = cmd, gpu, 0
            self.returncode = None
        def poll(self):
            self.polls += 1
            if self.polls < 2: return None
            run_dir = Path(self.cmd[self.cmd.index("-o") + 1]); run_dir.mkdir(parents=True); (run_dir / "done").write_text("")
            busy.discard(self.gpu); self.returncode = 0
            return 0
    monkeypatch.setattr(S.subprocess, "Popen", FakeProcess)
    configs = _configs(seeds=(0, 1, 2))
    plan = plan_configs(configs, tmp_path / "plan", tmp_path / "runs")
    launch(plan, "multi_gpu", gpus=["0", "3"], threads=4, progress=False)
    assert [c[3:] for c, _, _ in started] == [j.command(plan.plan_dir)[1:] for j in plan.jobs]   # dml-train's arguments, in plan order
    assert all(c[:3] == [sys.executable, "-c", S._DML_TRAIN] for c, _, _ in started)
    assert [g for _, g, _ in started[:2]] == ["0", "3"] and {g for _, g, _ in started} == {"0", "3"}
    assert {t for _, _, t in started} == {"4"} and len(started) == 6
    started.clear()
    plan = plan_configs(_configs(seeds=(7,)), tmp_path / "plan2", tmp_path / "runs")
    plan.jobs[0].unavailable = "needs weights not on disk"   # as the plan found it: left out here, not a failure
    launch(plan, "multi_gpu", gpus=["0"], progress=False)
    assert [c[c.index("-o") + 1] for c, _, _ in started] == [plan.jobs[1].run_dir]


def test_slurm_submission_parameters_in_submitits_sbatch_file(tmp_path, monkeypatch):
    "The sbatch header submitit writes for the launcher's options (a stand-in `srun` on PATH: submitit looks for it)."
    pytest.importorskip("submitit", reason="the optional extra: pip install 'dml_nb[slurm]'")
    from dml_nb.reproduction.launch import slurm_executor
    (tmp_path / "srun").write_text("#!/bin/sh\nexit 1\n"); (tmp_path / "srun").chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    ex = slurm_executor(tmp_path / "slurm", partition="gpu", time_min=720, gpus=2, mem_gb=64, cpus=10, parallel=4, cluster="slurm")
    text = ex._executor._make_submission_file_text("python -u -m submitit.core._submit x", "uid")   # submitit's own sbatch file
    for line in ("--partition=gpu", "--time=720", "--gpus-per-node=2", "--mem=64GB", "--cpus-per-task=10", "--job-name=dml-train"):
        assert f"#SBATCH {line}\n" in text, line
    assert ex._executor.parameters["array_parallelism"] == 4


def test_dml_runs_is_the_default_run_cache(tmp_path, monkeypatch):
    "Every worker and notebook finds the shared cache through $DML_RUNS; an explicit runs_dir still wins."
    monkeypatch.setattr("dml_nb.reproduction.repro.in_test", lambda: False)
    (tmp_path / "settings.ini").write_text("[DEFAULT]\nlib_name = dml_nb\n")
    monkeypatch.chdir(tmp_path)
    assert output_dirs()[1] == tmp_path / "runs"
    monkeypatch.setenv("DML_RUNS", str(tmp_path / "shared"))
    assert output_dirs()[1] == tmp_path / "shared" and output_dirs(runs_dir=tmp_path / "mine")[1] == tmp_path / "mine"
