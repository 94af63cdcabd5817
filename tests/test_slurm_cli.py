"""The SLURM launcher as users run it: the README's cluster commands from the command line, through submitit's real
SLURM executor, against stand-ins of SLURM's `sbatch`, `srun` and `sacct` on PATH (`_fake_slurm`); and `--launch
slurm` (or `launch(plan, "slurm")`) on a machine without SLURM: an error of one line, never a silent local run.

The commands run in a process of their own, outside the test's mode (no `PYTEST_CURRENT_TEST`): as a user's, with the
run cache in `$DML_RUNS` and the results folder in `$DML_RESULTS`, both under `tmp_path`."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dml_nb.experiments.experiment import RUN_THREADS
from dml_nb.sweeps.launch import LauncherUnavailable, launch
from dml_nb.reproduction.repro import base_config, smoke
from dml_nb.reproduction.reproduce import reproduce_main
from dml_nb.sweeps.sweep import Plan, plan_configs

ROOT = Path(__file__).resolve().parents[1]
_ENTRY = Path(sys.executable).with_name("dml-reproduce")  # the installed entry point, else the same call
DML_REPRODUCE = (
    [str(_ENTRY)]
    if _ENTRY.exists()
    else [
        sys.executable,
        "-c",
        "import sys; from dml_nb.reproduction.reproduce import reproduce_main; sys.exit(reproduce_main())",
    ]
)
SLURM_TOOLS = ("sbatch", "srun", "sacct")

# SLURM's commands, as far as submitit uses them. `sbatch FILE` records FILE, starts each task of its array in the
# background (submitit moves a task's pickle into place only after sbatch answers) and answers "Submitted batch job
# ID"; a task runs FILE with bash, with the SLURM_* variables of its job, and leaves its state (RUNNING, then
# COMPLETED or FAILED) where `sacct` reads it. `srun [--opt VALUE ...] CMD` runs CMD as the job's single task, its
# output in the --output and --error files (%A, %a, %j, %t filled in).
FAKE_SLURM = r"""
import os, re, subprocess, sys
from pathlib import Path

STATE = Path(__file__).resolve().parent.parent / "slurm_state"


def sbatch(script):
    STATE.mkdir(exist_ok=True)
    jid = str(100 * (1 + len(list(STATE.glob("sbatch-*.sh")))))
    text = Path(script).read_text()
    (STATE / f"sbatch-{jid}.sh").write_text(text)
    m = re.search(r"^#SBATCH --array=(\d+)-(\d+)", text, re.M)
    for t in range(int(m[1]), int(m[2]) + 1) if m else [None]:
        key = jid if t is None else f"{jid}_{t}"
        (STATE / f"job-{key}").write_text("PENDING")
        env = {**os.environ, "SLURM_JOB_ID": jid if t is None else str(int(jid) + 1 + t)}
        if t is not None:
            env.update(SLURM_ARRAY_JOB_ID=jid, SLURM_ARRAY_TASK_ID=str(t))
        with open(STATE / f"task-{key}.log", "w") as log:
            subprocess.Popen([sys.executable, __file__, "--task", script, key], env=env, stdin=subprocess.DEVNULL,
                             stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    print(f"Submitted batch job {jid}")


def task(script, key):
    (STATE / f"job-{key}").write_text("RUNNING")
    code = subprocess.call(["bash", script])
    (STATE / f"job-{key}").write_text("COMPLETED" if code == 0 else "FAILED")


def srun(args):
    files = {}
    while args and args[0].startswith("--"):
        opt = args.pop(0)
        if opt in ("--output", "--error"):
            files[opt] = args.pop(0)
    env = os.environ
    env.update(SLURM_NTASKS="1", SLURM_PROCID="0", SLURM_LOCALID="0", SLURM_NODEID="0", SLURM_JOB_NUM_NODES="1",
               SLURM_JOB_NODELIST="localhost", SLURM_STEP_NODELIST="localhost")
    subs = {"%A": env.get("SLURM_ARRAY_JOB_ID", ""), "%a": env.get("SLURM_ARRAY_TASK_ID", ""),
            "%j": env["SLURM_JOB_ID"], "%t": "0"}
    for fd, path in ((1, files.get("--output")), (2, files.get("--error", files.get("--output")))):
        if path:
            for k, v in subs.items():
                path = path.replace(k, v)
            os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644), fd)
    os.execvp(args[0], args)


def sacct(args):  # sacct -o JobID,State,NodeList --parsable2 -j ID [-j ID ...]
    ids = {args[i + 1] for i, a in enumerate(args) if a == "-j"}
    print("JobID|State|NodeList")
    for f in sorted(STATE.glob("job-*")):
        if f.name[4:].split("_")[0] in ids:
            print(f"{f.name[4:]}|{f.read_text()}|localhost")


if sys.argv[1:2] == ["--task"]:
    task(*sys.argv[2:4])
else:
    {"sbatch": lambda a: sbatch(a[-1]), "srun": srun, "sacct": sacct}[Path(sys.argv[0]).name](sys.argv[1:])
"""


def _fake_slurm(tmp_path: Path) -> Path:
    "A folder holding `sbatch`, `srun` and `sacct` (links to one script); they keep their state in tmp_path/slurm_state."
    bin_dir = tmp_path / "slurm_bin"
    bin_dir.mkdir()
    script = bin_dir / "fake_slurm.py"
    script.write_text(f"#!{sys.executable}\n{FAKE_SLURM}")
    script.chmod(0o755)
    for name in SLURM_TOOLS:
        (bin_dir / name).symlink_to(script)
    return bin_dir


def _path_without_slurm() -> str:
    "PATH less every folder holding one of SLURM's commands: this machine as one without SLURM."
    dirs = os.environ.get("PATH", "").split(os.pathsep)
    return os.pathsep.join(d for d in dirs if d and not any((Path(d) / c).exists() for c in SLURM_TOOLS))


def _env(tmp_path: Path, path: str) -> dict:
    "A user's environment (not the tests' mode): this checkout's dml_nb, the run cache and results folder in tmp_path."
    env = {k: v for k, v in os.environ.items() if k not in ("PYTEST_CURRENT_TEST", "IN_TEST")}
    env.update(
        PATH=path,
        PYTHONPATH=str(ROOT),
        DML_RUNS=str(tmp_path / "runs"),
        DML_RESULTS=str(tmp_path / "results"),
        OMP_NUM_THREADS="1",
        MPLBACKEND="Agg",
    )
    return env


def _dml_reproduce(args, env, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*DML_REPRODUCE, *map(str, args)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )


def _small_plan(tmp_path: Path, dims=(16,)) -> Path:
    "A plan of tiny shapes runs, one per embedding size in `dims` (test_sweep's size), saved as JSON; nothing trained."
    configs = {}
    for dim in dims:
        raw = smoke({**base_config(), "method": {"name": "baseline", "embedding_dim": dim}, "seed": 0}, force=True)
        raw["train"].update(epochs=2, batches_per_epoch=2)
        raw["eval"]["every"] = 2
        configs[f"dim {dim} seed 0"] = raw
    return plan_configs(configs, tmp_path / "plan", tmp_path / "runs").save(tmp_path / "plan.json")


LAUNCH = ["--partition", "gpu", "--time", "720", "--gpus-per-run", "1", "--no-collect"]  # the README's options


def _final_states(state: Path, timeout: float = 60.0) -> list:
    """The job array's task states once each is final, COMPLETED or FAILED (or whatever they are after `timeout` s).

    submitit returns as soon as a task's result file exists, which the task writes before it exits; the stand-in
    records COMPLETED only after the task's `bash` has returned, a moment later (SLURM's accounting lags the same
    way). Reading the states at once raced that moment: CI once read ['COMPLETED', 'RUNNING']. A state file read
    while the stand-in rewrites it can be empty for a moment, so only a final state ends the wait."""
    deadline = time.monotonic() + timeout
    while True:
        states = sorted(f.read_text() for f in state.glob("job-*"))
        if set(states) <= {"COMPLETED", "FAILED"} or time.monotonic() > deadline:
            return states
        time.sleep(0.1)


def _launched_on_slurm(tmp_path: Path, plan_json: Path) -> None:
    """The plan's two runs went through submitit's SLURM path: one sbatch file (a job array of two tasks) with the
    command line's partition, time and GPUs, its tasks run by `srun` and COMPLETED, the runs finished in the run cache."""
    state = tmp_path / "slurm_state"
    (sbatch_file,) = state.glob("sbatch-*.sh")  # one job array
    header = sbatch_file.read_text()
    for line in ("--partition=gpu", "--time=720", "--gpus-per-node=1", "--array=0-1%2"):
        assert f"#SBATCH {line}\n" in header, (line, header)
    assert "\nsrun " in header and "submitit.core._submit" in header, header
    assert _final_states(state) == ["COMPLETED"] * 2
    plan = Plan.load(plan_json)
    assert len(plan.jobs) == 2 and plan.pending() == []
    for job in plan.jobs:
        run_dir = Path(job.run_dir)
        assert run_dir.parent == tmp_path / "runs" and (run_dir / "done").exists(), sorted(run_dir.iterdir())
        assert json.loads((run_dir / "metrics.json").read_text())["threads"] == RUN_THREADS  # the launcher's default


def test_readme_slurm_launch_command(tmp_path):
    """README.md, "On several GPUs or a cluster", its launch command as written:

        dml-reproduce --launch slurm --from-plan plan.json --partition gpu --time 720 --gpus-per-run 1 --no-collect

    on a plan of two tiny runs (made here with `plan_configs`; the slow test below makes it with the README's
    `--plan` command). submitit's SLURM executor submits one job array to the stand-in `sbatch`."""
    pytest.importorskip("submitit", reason="the optional extra: pip install 'dml_nb[slurm]'")
    plan_json = _small_plan(tmp_path, dims=(16, 32))
    env = _env(tmp_path, f"{_fake_slurm(tmp_path)}{os.pathsep}{os.environ['PATH']}")
    p = _dml_reproduce(["--launch", "slurm", "--from-plan", plan_json, *LAUNCH], env)
    assert p.returncode == 0, (p.stdout[-2000:], p.stderr[-4000:])
    _launched_on_slurm(tmp_path, plan_json)


@pytest.mark.slow  # about 70 s on 2 cores (two notebook executions, two runs): the launch alone is the test above
def test_readme_slurm_workflow_from_the_command_line(tmp_path):
    """README.md, "On several GPUs or a cluster", its three commands as written:

        dml-reproduce --plan repro_table3 -f params/repro_table3/cub200.yaml --json plan.json
        dml-reproduce --launch slurm --from-plan plan.json --partition gpu --time 720 --gpus-per-run 1 --no-collect
        dml-reproduce --collect-only repro_table3 -f params/repro_table3/cub200.yaml

    with `-f` a small parameter file (two shapes rows, one seed, 2 epochs of 2 batches: test_sweep's size) and the
    files in tmp_path. The plan lists the two runs in `$DML_RUNS`; submitit's SLURM executor submits them as one job
    array to the stand-in `sbatch`, whose tasks train them; the collect reads them and writes the table and figure."""
    pytest.importorskip("submitit", reason="the optional extra: pip install 'dml_nb[slurm]'")
    params = tmp_path / "small.yaml"
    params.write_text(
        json.dumps(
            {
                "dataset": "shapes",
                "config": {
                    "data": {"images_per_class": 6},
                    "train": {"epochs": 2, "batches_per_epoch": 2},
                    "eval": {"every": 2},
                },
                "seeds": [0],
                "rows": {
                    "Margin-16": {"name": "baseline", "embedding_dim": 16},
                    "Margin-32": {"name": "baseline", "embedding_dim": 32},
                },
                "output": {"figures_dir": str(tmp_path / "figures")},
            }
        )
    )  # JSON is YAML
    plan_json = tmp_path / "plan.json"
    env = _env(tmp_path, f"{_fake_slurm(tmp_path)}{os.pathsep}{os.environ['PATH']}")
    for args in (
        ["--plan", "repro_table3", "-f", params, "--json", plan_json],
        ["--launch", "slurm", "--from-plan", plan_json, *LAUNCH],
        ["--collect-only", "repro_table3", "-f", params],
    ):
        p = _dml_reproduce(args, env)
        assert p.returncode == 0, (args, p.stdout[-2000:], p.stderr[-4000:])
        if args[0] == "--plan":
            plan = Plan.load(plan_json)
            assert [j.status for j in plan.jobs] == ["pending"] * 2, plan.table()
            assert not any((tmp_path / "runs").glob("*/done")), "planning trains nothing"
    _launched_on_slurm(tmp_path, plan_json)
    figures = tmp_path / "figures"
    table = figures / "repro_table3.csv"
    assert table.exists(), sorted(p.name for p in figures.iterdir()) if figures.exists() else "no figures folder"
    text = table.read_text()
    assert "Margin-16" in text and "Margin-32" in text, text
    assert (figures / "repro_table3.png").exists()


def test_readme_slurm_launch_command_without_slurm(tmp_path):
    """The README's launch command (as in `test_readme_slurm_launch_command`) where SLURM's commands are not installed
    (no sbatch, srun, sacct on PATH): exit status 2 and one line on stderr naming the problem and the fix, no
    traceback, nothing submitted or trained."""
    plan_json = _small_plan(tmp_path)
    p = _dml_reproduce(["--launch", "slurm", "--from-plan", plan_json, *LAUNCH], _env(tmp_path, _path_without_slurm()))
    assert p.returncode == 2, (p.returncode, p.stderr[-3000:])
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dml-reproduce: error: slurm: no sbatch"), p.stderr
    assert "SLURM's commands" in lines[0] and "--launch local" in lines[0], lines[0]
    assert not (tmp_path / "plan" / "slurm").exists() and not any((tmp_path / "runs").glob("*/done"))


@pytest.mark.parametrize("launcher", ["slurm", "multi_gpu"])
@pytest.mark.parametrize("from_plan", [True, False])
def test_a_launcher_this_machine_lacks_is_told_before_planning(tmp_path, monkeypatch, capsys, launcher, from_plan):
    """`dml-reproduce --launch slurm` without SLURM's commands, `--launch multi_gpu` without a visible GPU: exit
    status 2 and one line, before the plan is read or made (a notebook's plan takes a while), nothing trained."""
    monkeypatch.setenv("PATH", _path_without_slurm())
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.setenv("DML_RUNS", str(tmp_path / "runs"))
    plan_json = _small_plan(tmp_path)
    where = ["--from-plan", str(plan_json)] if from_plan else ["repro_table3", "--plan-dir", str(tmp_path / "plan2")]
    capsys.readouterr()
    assert reproduce_main(["--launch", launcher, *where, *LAUNCH]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"dml-reproduce: error: {launcher}: "), err
    assert "--launch local" in err[0], err
    assert not (tmp_path / "plan2").exists() and not any((tmp_path / "runs").glob("*/done"))


def test_launch_slurm_without_slurm_is_an_error_not_a_local_run(tmp_path, monkeypatch):
    "`launch(plan, 'slurm')` with no SLURM here: submitit's AutoExecutor would run the jobs locally; the launcher refuses."
    plan = Plan.load(_small_plan(tmp_path))
    monkeypatch.setenv("PATH", _path_without_slurm())
    with pytest.raises(LauncherUnavailable, match=r"no sbatch.*--launch local") as e:
        launch(plan, "slurm", progress=False)
    assert "\n" not in str(e.value)
    assert plan.pending() == plan.jobs and not (tmp_path / "plan" / "slurm").exists(), "nothing submitted or trained"
