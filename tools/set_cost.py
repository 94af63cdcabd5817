"""What a set of reproduction notebooks costs to train: the distinct runs of their plan and the wall time each run
recorded in its own `metrics.json`.

    dml-reproduce --plan --json plan.json           # every notebook's default runs (no training), run hashes shared
    python tools/set_cost.py plan.json              # runs, trained, pending, hours summed, per notebook
    python tools/set_cost.py plan.json --results results --csv cost.csv
    python tools/set_cost.py --regime finegrained_premise --results results    # every notebook in regime v3 (minutes)

With `--regime DATASET` (and optionally `--notebooks`) it makes the plan itself: each notebook's rows transferred by
the rule to that regime (`transferred_parameters`, what a switched notebook's defaults are and what
`tools/regime_pilot.py` runs), planned with `dml-reproduce <notebook> -f ... --plan` in a temporary folder, the jobs
merged by run hash.

A run counts once however many notebooks use it (the run cache shares it). A finished run is read from its run-cache
folder (the plan's `run_dir`), else from the results folder (`results/<run folder name>`, what `--write-committed`
keeps). The summed wall time is a measurement of the runs as they were trained (each run's `wall_time_s`, with its
recorded thread count); how long the set takes two runs at a time is about half of it on 2 cores, and the pending
runs' share is an extrapolation at the trained runs' mean: both are printed as estimates, never as measurements.
It also counts the CPUs the trained runs recorded (`metrics.json`'s `cpu`: model and the instruction set torch
used); a run saved before runs recorded their CPU is counted as "not recorded". A job without a `hash` or `run_dir`,
or whose `run_dir` is not named as a run folder (only that name is looked up in the results folder), stops it with
one line that names the job.
"""

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import pandas as pd
import yaml
from tqdm.auto import tqdm

from dml_nb.experiments.results import RUN_NAME, count_arg


def _uses(job) -> list:
    u = job.get("uses") or []
    return [u] if isinstance(u, str) else list(u)


def _notebook(use: str) -> str:
    return use.split(":", 1)[0].strip()


def finished(job, results: Path | None) -> dict | None:
    "The finished run's metrics (run cache first, then the results folder), or None when it has not been trained."
    run = Path(job["run_dir"])
    for folder in [run] + ([results / run.name] if results is not None else []):
        if (folder / "done").exists() and (folder / "metrics.json").exists():
            return json.loads((folder / "metrics.json").read_text())
    return None


def stopped(job, results: Path | None) -> bool:
    """Whether the run stopped by design (a `stopped` record in its run-cache folder or the results folder: its recipe
    cannot form the batches it needs on its data, as `repro_dnc_tables1_5`'s `digits` D&C check). It trains nothing,
    so it is neither trained nor pending."""
    run = Path(job["run_dir"])
    return any((f / "stopped").is_file() for f in [run] + ([results / run.name] if results is not None else []))


def job_problem(i: int, job) -> str | None:
    "Why the plan's job number `i` cannot be costed (not an object, no string `hash` or `run_dir`), or None."
    if not isinstance(job, dict):
        return f"job {i} is a {type(job).__name__}, not an object"
    missing = [k for k in ("hash", "run_dir") if not isinstance(job.get(k), str) or not job.get(k)]
    if missing:
        return f"job {i} ({job.get('hash', 'no hash')!r}) has no {' and no '.join(missing)}"
    if not RUN_NAME.fullmatch(Path(job["run_dir"]).name):  # its name is looked up in the results folder
        return f"job {i} ({job['hash']!r}): run_dir {job['run_dir']!r} is not a run folder (<method>-<dataset>-<12 hex digits>)"
    return None


def _cpu(m: dict | None) -> str | None:
    "The CPU a finished run recorded (`model (capability)`), or None for a run saved before runs recorded one."
    c = (m or {}).get("cpu")
    return f"{c.get('model')} ({c.get('capability')})" if isinstance(c, dict) else None


def cost(plan: dict, results: Path | None = None) -> pd.DataFrame:
    """One line per distinct run: hash, the notebooks that use it, trained or not, its wall time, thread count and
    CPU. A job without a `hash` or `run_dir` is a `ValueError` that names it."""
    for i, job in enumerate(plan["jobs"]):
        if (problem := job_problem(i, job)) is not None:
            raise ValueError(problem)
    rows, seen = [], set()
    for job in plan["jobs"]:
        if job["hash"] in seen:
            continue
        seen.add(job["hash"])
        m = finished(job, results)
        wall = None if m is None else m.get("wall_time_s")
        stop = m is None and stopped(job, results)
        rows.append(
            {
                "hash": job["hash"],
                "run": Path(job["run_dir"]).name,
                "notebooks": " ".join(sorted({_notebook(u) for u in _uses(job)})),
                "trained": m is not None,
                "unavailable": m is None and not stop and bool(job.get("unavailable")),
                "stopped": stop,
                "wall_time_s": float(wall) if wall is not None else float("nan"),
                "threads": None if m is None else m.get("threads"),
                "cpu": _cpu(m),
            }
        )
    cols = ["hash", "run", "notebooks", "trained", "unavailable", "stopped", "wall_time_s", "threads", "cpu"]
    return pd.DataFrame(rows, columns=cols)


def _stopped(runs: pd.DataFrame) -> pd.Series:
    "The `stopped` column (False for a table written before it existed)."
    return runs["stopped"].astype(bool) if "stopped" in runs else pd.Series(False, index=runs.index)


def per_notebook(runs: pd.DataFrame) -> pd.DataFrame:
    "Per notebook: its runs, how many are trained, their minutes summed, and the runs no other notebook uses."
    out = {}
    for _, r in runs.iterrows():
        names = r["notebooks"].split()
        for nb in names:
            o = out.setdefault(nb, {"runs": 0, "trained": 0, "minutes": 0.0, "own runs": 0})
            o["runs"] += 1
            o["trained"] += int(r["trained"])
            o["minutes"] += 0.0 if pd.isna(r["wall_time_s"]) else r["wall_time_s"] / 60
            o["own runs"] += int(len(names) == 1)
    df = pd.DataFrame.from_dict(out, orient="index").sort_index()
    df.index.name = "notebook"
    return df.round({"minutes": 1})


def summary_hours(runs: pd.DataFrame) -> float:
    """The trained runs' wall time summed, plus each pending run (not an unavailable one) at the mean of the trained
    runs of its recipe (else of all trained runs), in hours: the whole plan's training, estimated."""
    trained = runs[runs["trained"]]
    pending = runs[~runs["trained"] & ~runs["unavailable"] & ~_stopped(runs)]
    recipe = lambda name: str(name).split("-", 1)[0]  # a run folder is <recipe>-<dataset>-<hash>
    by_recipe = trained.groupby(trained["run"].map(recipe))["wall_time_s"].mean()
    guess = pending["run"].map(recipe).map(by_recipe).fillna(trained["wall_time_s"].mean())
    return float((trained["wall_time_s"].sum() + guess.sum()) / 3600)


def summary(runs: pd.DataFrame, workers: int = 2) -> list[str]:
    "The headline lines: what is measured, then what is estimated from it."
    n, done, away = len(runs), int(runs["trained"].sum()), int(runs["unavailable"].sum())
    stop = int(_stopped(runs).sum())
    wall = runs.loc[runs["trained"], "wall_time_s"].dropna()
    lines = [f"{n} distinct runs, {done} trained, {n - done - away - stop} pending"]
    if stop:  # a `stopped` record: the recipe cannot form its batches on that data, so the run trains nothing
        lines[0] += f", {stop} stopped by design (a `stopped` record; no training)"
    if away:  # the plan says why (a paper row's backbone weights missing here): not counted in the estimates
        lines[0] += f", {away} not trainable here (the plan's `unavailable`; left out of the estimates)"
    n -= away + stop
    if len(wall) == 0:
        return lines + ["no trained run has a recorded wall time: nothing is measured"]
    hours, mean = wall.sum() / 3600, wall.mean() / 60
    threads = sorted({int(t) for t in runs["threads"].dropna()})
    lines.append(
        f"measured: the {len(wall)} trained runs took {hours:.1f} h of wall time summed "
        f"(mean {mean:.1f} min a run; threads per run: {', '.join(map(str, threads)) or 'not recorded'})"
    )
    trained = runs[runs["trained"]]
    cpus = trained["cpu"].fillna("not recorded").value_counts()
    lines.append("trained on: " + "; ".join(f"{c}: {k} runs" for c, k in sorted(cpus.items())))
    pending = runs[~runs["trained"] & ~runs["unavailable"] & ~_stopped(runs)]
    total = summary_hours(runs)
    if len(pending):
        lines.append(
            f"estimate: all {n} runs about {total:.1f} h summed (each of the {len(pending)} pending at the mean of "
            "the trained runs of its recipe, else of all)"
        )
    lines.append(
        f"estimate: about {total / workers:.1f} h of wall clock, {workers} runs at a time "
        f"(the sum over {workers}; each run's wall time was measured with others beside it)"
    )
    return lines


def plan_regime(dataset: str, stems=None) -> dict:
    """The plan of notebooks `stems` (None: all) in the regime of `dataset`: each one's rows transferred by the rule,
    planned by `dml-reproduce --plan` (no training), the jobs merged by run hash with every notebook that uses them."""
    from dml_nb.reproduction.repro import base_config
    from dml_nb.reproduction.transfer import stems_of, transferred_parameters

    epochs, jobs = int(base_config(dataset)["train"]["epochs"]), {}
    cli = str(Path(sys.executable).parent / "dml-reproduce")
    with tempfile.TemporaryDirectory(prefix="dml_nb_cost_") as d:
        for stem in tqdm(stems_of(stems), desc="planning", unit="notebook"):
            f, out = Path(d) / f"{stem}.yaml", Path(d) / f"{stem}.json"
            f.write_text(yaml.safe_dump({"dataset": dataset, **transferred_parameters(stem, epochs)}, sort_keys=False))
            argv = [cli, stem, "-f", str(f), "--plan", "--json", str(out), "--plan-dir", str(Path(d) / "plans" / stem)]
            p = subprocess.run(argv, capture_output=True, text=True)
            if p.returncode != 0:
                sys.exit(f"{stem}: `dml-reproduce --plan` failed: {(p.stderr or p.stdout).strip().splitlines()[-1:]}")
            for job in json.loads(out.read_text())["jobs"]:
                have = jobs.setdefault(job["hash"], {**job, "uses": []})
                have["uses"] = have["uses"] + _uses(job)
    return {"jobs": list(jobs.values())}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "plan", type=Path, nargs="?", help="a plan JSON: `dml-reproduce [notebooks] --plan --json plan.json`"
    )
    ap.add_argument("--regime", help="make the plan: every notebook's rows transferred to this regime's dataset")
    ap.add_argument("--notebooks", nargs="+", default=None, help="with --regime: these notebooks (default: all)")
    ap.add_argument("--results", type=Path, default=None, help="a results folder to read finished runs from too")
    ap.add_argument(
        "--workers", type=count_arg, default=2, help="runs at a time, for the wall-clock estimate (1 to 512; default 2)"
    )
    ap.add_argument("--csv", type=Path, default=None, help="write the per-run table here")
    a = ap.parse_args(argv)
    if a.plan is None and a.regime is None:
        sys.exit("give a plan JSON (`dml-reproduce --plan --json plan.json`) or --regime DATASET (finegrained_premise)")
    plan = plan_regime(a.regime, a.notebooks) if a.regime is not None else _read_plan(a.plan)
    try:
        runs = cost(plan, a.results)
    except ValueError as e:
        sys.exit(f"{a.plan or 'the --regime plan'}: {e}; make it again with `dml-reproduce --plan --json FILE`")
    print(per_notebook(runs).to_string())
    print()
    print("\n".join(summary(runs, a.workers)))
    if a.csv is not None:
        runs.to_csv(a.csv, index=False)
        print(f"per-run table: {a.csv}")


def _read_plan(path: Path) -> dict:
    if not path.exists():
        sys.exit(f"{path}: no such plan; make one with `dml-reproduce --plan --json {path}`")
    try:
        plan = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        sys.exit(f"{path}: cannot be read as JSON ({e}); make it again with `dml-reproduce --plan --json {path}`")
    if not isinstance(plan, dict) or not isinstance(plan.get("jobs"), list):
        sys.exit(f"{path}: not a plan (no 'jobs'); make one with `dml-reproduce --plan --json {path}`")
    return plan


if __name__ == "__main__":
    main()
