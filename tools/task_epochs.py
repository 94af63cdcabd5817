"""One task of multi-task runs, epoch by epoch: its loss, its gradient's share, its own logs, and when it went idle.

    python tools/task_epochs.py runs/diva-finegrained_premise-0fce17034458 --task dance
    python tools/task_epochs.py RUN_DIR ... --task dance --summary     # one line per run

reads each run's `history.csv` and `metrics.json` (a run cache's folder, or one restored from `results/`) and prints,
per epoch, the task's mean loss, its gradient norm over the largest task's (`grad share`), its own logged values
(DaNCE: `positive_similarity`, its positives' mean cosine similarity; `nonzero_weights`), and whether
`task_health` judges it idle in that epoch; then the epoch from which it stayed idle (`idle_epochs`), the run's
test Recall@1, and the run's method settings that differ between the runs given. This is how `67_regime` measures
why DaNCE goes idle in regime v3 and what a longer queue or a higher temperature changes.
"""

import argparse
import json
import sys
from pathlib import Path

import pandas as pd
import yaml

from dml_nb.methods.base import task_health
from dml_nb.reproduction.notebook import idle_epochs


def _flat(tree, prefix=""):
    out = {}
    for k, v in (tree or {}).items():
        out |= _flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v}
    return out


def epochs_of(run: Path, task: str) -> pd.DataFrame:
    "The task's per-epoch lines of one run."
    h = pd.read_csv(run / "history.csv")
    if f"loss/{task}" not in h:
        tasks = sorted(c.split("/", 1)[1] for c in h.columns if c.startswith("loss/"))
        raise SystemExit(f"{run}: no task {task!r} in its history; its tasks: {', '.join(tasks) or 'none'}")
    grads = [c for c in h.columns if c.startswith("grad/")]
    rows = h.to_dict("records")
    out = pd.DataFrame({"epoch": h["epoch"], "loss": h[f"loss/{task}"]})
    out["grad share"] = h[f"grad/{task}"] / h[grads].max(axis=1)
    for c in h.columns:
        if c.endswith(f"/{task}") and c.split("/")[0] not in ("loss", "grad", "tuples", "test", "train"):
            out[c.split("/")[0]] = h[c]
    out["idle"] = [not task_health(rows, epoch=e)[task]["alive"] for e in h["epoch"]]
    return out


def summary(run: Path, task: str) -> dict:
    "One line of a run: the task's idle epochs, its loss and gradient share in the first epoch, test R@1."
    h = pd.read_csv(run / "history.csv")
    t = idle_epochs(h)[task]
    e = epochs_of(run, task)
    m = json.loads((run / "metrics.json").read_text())["metrics"]
    return {
        "run": run.name,
        "seed": yaml.safe_load((run / "config.yaml").read_text()).get("seed"),
        "idle from": t["from"],
        "idle epochs": len(t["idle"]),
        "epoch-1 grad share": round(float(e["grad share"].iloc[0]), 3),
        "last positive_similarity": round(float(e["positive_similarity"].iloc[-1]), 3)
        if "positive_similarity" in e
        else None,
        "test R@1": round(100 * m.get("test/recall@1", float("nan")), 1),
        f"test {task} R@1": round(100 * m.get(f"test/{task}/recall@1", float("nan")), 1),
    }


def differing(runs: list[Path]) -> dict:
    "{run: the method settings in which it differs from the other runs given}."
    flat = {r: _flat(yaml.safe_load((r / "config.yaml").read_text()).get("method")) for r in runs}
    keys = {k for f in flat.values() for k in f}
    varied = sorted(k for k in keys if len({json.dumps(f.get(k)) for f in flat.values()}) > 1)
    return {r: ", ".join(f"{k}={flat[r].get(k)}" for k in varied) for r in runs}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="+", help="run folders (with history.csv, metrics.json, config.yaml)")
    p.add_argument("--task", default="dance")
    p.add_argument("--summary", action="store_true", help="one line per run, no epochs")
    args = p.parse_args(argv)
    runs = [Path(r) for r in args.runs]
    for r in runs:
        if not (r / "history.csv").exists():
            sys.exit(
                f"{r}: no history.csv (not a finished run folder; a run cache's folders are <method>-<data>-<hash>)"
            )
    diff = differing(runs)
    lines = []
    for r in runs:
        if not args.summary:
            print(f"\n{r.name} ({diff[r] or 'no method setting differs between the runs given'})")
            print(epochs_of(r, args.task).round(4).to_string(index=False))
        lines.append({**summary(r, args.task), "settings": diff[r]})
    print()
    print(pd.DataFrame(lines).to_string(index=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
