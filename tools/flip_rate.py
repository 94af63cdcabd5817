"""How many claim verdicts change when the same notebooks are retrained at another thread count (or on another machine).

    python tools/flip_rate.py repro_table3 --threads 2 --runs-dir /tmp/flip_runs

retrains every run of the named notebooks from an empty run cache (`--results-dir none`: nothing restored from
`results/`), at `--threads` CPU threads per run, with `dml-reproduce` (a bare run: it writes only `figures/local/`),
then compares each claim's verdict and margin in `figures/local/<notebook>_claims.json` with the committed
`figures/<notebook>_claims.json`. `--compare-only` skips the training and compares what `figures/local/` holds.
Extra `dml-reproduce` arguments (for example `-y "dataset: finegrained_premise"`) follow `--`; with `--against DIR`
the claims are compared with DIR's files in place of the committed ones, and `--after DIR` names where the retrained
notebooks wrote (default `figures/local/`).
A *flip* is a decided claim (holds or fails) whose verdict changed; a claim moving between unresolved and a
decision is counted apart. `--runs-before DIR` (the run cache of the first training, default `<project>/runs`) with
`--runs-dir` also compares the runs themselves: every run of the retraining against the run of the same config
(same folder name) in DIR, by test Recall@1, with the thread counts and CPUs each recorded; `--runs-csv FILE` writes
that comparison run by run. DIR may be a results folder (`results/`: its runs keep `metrics.json`), which is how a
retraining on another machine is compared with the committed runs.
"""

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

import pandas as pd

from dml_nb.experiments.results import count_arg

ROOT = Path(__file__).resolve().parents[1]
DECIDED = ("holds", "fails")


def verdicts(path: Path) -> dict:
    "{claim: (verdict, margin)} of one claims file."
    return {c["claim"]: (c["verdict"], c.get("margin")) for c in json.loads(path.read_text())["claims"]}


def compare(before: dict, after: dict) -> tuple[list, dict]:
    "Lines of a table, and the counts: decided claims, flips, decided <-> unresolved moves, unchanged."
    lines, n = [], {"claims": 0, "decided before": 0, "flips": 0, "to or from unresolved": 0, "same": 0}
    for claim, (v0, m0) in before.items():
        if claim not in after:
            continue
        v1, m1 = after[claim]
        n["claims"] += 1
        n["decided before"] += v0 in DECIDED
        kind = (
            "same"
            if v0 == v1
            else "flips"
            if v0 in DECIDED and v1 in DECIDED
            else "to or from unresolved"
            if "unresolved" in (v0, v1)
            else "same"
        )
        n[kind] += 1
        fmt = lambda m: "" if m is None else f"{m:+.2f}"
        lines.append(f"| {claim} | {v0} {fmt(m0)} | {v1} {fmt(m1)} | {'' if kind == 'same' else kind} |")
    return lines, n


def run_differences(before: Path, after: Path, metric: str = "recall@1") -> dict:
    """Each run finished in run cache `after` against the run of the same folder name in `before`: the differences of
    the test `metric` of the run's reported embedding (after - before, points), the threads each run recorded, and
    how many runs are identical in it; `rows`: the same run by run, with the CPU capability each recorded (None for a
    run saved before runs recorded their CPU)."""
    diffs, threads, cpus, rows, key = [], set(), set(), [], f"test/{metric}"
    cpu = lambda m: (m.get("cpu") or {}).get("capability")
    for m1 in sorted(after.glob("*/metrics.json")):
        m0 = before / m1.parent.name / "metrics.json"
        if not m0.exists():
            continue
        a, b = json.loads(m0.read_text()), json.loads(m1.read_text())
        if key in a["metrics"] and key in b["metrics"]:
            diffs.append(100 * (b["metrics"][key] - a["metrics"][key]))
            threads.add((a.get("threads"), b.get("threads")))
            cpus.add((cpu(a), cpu(b)))
            rows.append(
                {
                    "run": m1.parent.name,
                    f"before {metric}": 100 * a["metrics"][key],
                    f"after {metric}": 100 * b["metrics"][key],
                    "difference": diffs[-1],
                    "threads before": a.get("threads"),
                    "threads after": b.get("threads"),
                    "cpu before": cpu(a),
                    "cpu after": cpu(b),
                }
            )
    return {
        "rows": rows,
        "cpus": sorted(cpus, key=str),
        "runs": len(diffs),
        "sd": statistics.stdev(diffs) if len(diffs) > 1 else float("nan"),
        "max": max((abs(x) for x in diffs), default=float("nan")),
        "identical runs": sum(x == 0 for x in diffs),
        "threads": sorted(threads, key=str),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("notebooks", nargs="+")
    p.add_argument(
        "--threads", type=count_arg, default=2, help="CPU threads per run for the retraining (1 to 512; default 2)"
    )
    p.add_argument("--workers", type=count_arg, default=1, help="runs at a time (1 to 512; default 1)")
    p.add_argument("--runs-dir", required=True, help="an empty run cache for the retraining")
    p.add_argument("--compare-only", action="store_true", help="compare figures/local/ without training")
    p.add_argument(
        "--runs-before",
        help="the first training's run cache or results folder: compare each retrained run with its own",
    )
    p.add_argument("--runs-csv", help="with --runs-before: write the run-by-run comparison to this CSV file")
    p.add_argument("--against", help="folder of the claims files to compare with (default: the committed figures/)")
    p.add_argument(
        "--after",
        help="folder the retrained notebooks wrote to (default figures/local; a run with other "
        "parameters writes to figures/local-<what differs>)",
    )
    args, extra = p.parse_known_args(argv)
    if args.runs_csv and not args.runs_before:
        p.error("--runs-csv writes the run-by-run comparison: give --runs-before DIR (the first training's runs) too")
    extra = [a for a in extra if a != "--"]
    if not args.compare_only:
        cmd = ["dml-reproduce", *args.notebooks, "--results-dir", "none", "--runs-dir", args.runs_dir, "--force"]
        cmd += ["--launch", "local", "--workers", str(args.workers), "--threads", str(args.threads), *extra]
        print("+", " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True, cwd=ROOT)
    against = Path(args.against) if args.against else ROOT / "figures"
    total = {}
    print("| claim | before: verdict, margin | after | change |\n| --- | --- | --- | --- |")
    for nb in args.notebooks:
        before, after = (
            against / f"{nb}_claims.json",
            (Path(args.after) if args.after else ROOT / "figures" / "local") / f"{nb}_claims.json",
        )
        if not (before.exists() and after.exists()):
            sys.exit(f"{nb}: no claims file to compare ({before if not before.exists() else after} is missing)")
        lines, n = compare(verdicts(before), verdicts(after))
        print(*lines, sep="\n")
        total = {k: total.get(k, 0) + v for k, v in n.items()}
    print(
        f"\n{total['claims']} claims, {total['decided before']} decided before: {total['flips']} flipped, "
        f"{total['to or from unresolved']} moved between unresolved and a decision, {total['same']} unchanged"
    )
    if args.runs_before:
        r = run_differences(Path(args.runs_before), Path(args.runs_dir))
        print(
            f"{r['runs']} runs compared with their first training by test R@1 (threads before, after: "
            f"{r['threads']}): SD of the differences {r['sd']:.2f} points, at most "
            f"{r['max']:.2f}; {r['identical runs']} runs identical; CPUs before, after: {r['cpus']}"
        )
        if args.runs_csv:
            pd.DataFrame(r["rows"]).round(4).to_csv(args.runs_csv, index=False)
            print(f"run by run: {args.runs_csv}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
