"""Run reproduction notebooks in another regime, their rows transferred from the paper files by the rule.

    python tools/regime_pilot.py repro_table3 repro_diva_table2 --dataset finegrained_premise --runs-dir runs

builds each notebook's method-spec parameters with `dml_nb.reproduction.transfer.transferred_parameters` for the
regime's epochs (the base config of `--dataset`: `PREMISE_BASE` for `finegrained_premise`, regime v3), then runs a
bare `dml-reproduce` of the notebook with them (`-y`: it writes only `figures/local-.../` and the run cache), at
`--threads` CPU threads per run and `--workers` runs at a time. `--keep DIR` copies each notebook's claims file,
table and figures into DIR (for example `figures/regime_v3_pilot`), the parameters it ran with beside them
(`<notebook>_parameters.yaml`). `--print` only prints the parameters.
"""

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

from dml_nb.reproduction.repro import base_config
from dml_nb.experiments.results import count_arg
from dml_nb.reproduction.transfer import stems_of, transferred_parameters

ROOT = Path(__file__).resolve().parents[1]


def parameters(stem: str, dataset: str) -> dict:
    "The papermill parameters of `stem` in the regime of `dataset`: the dataset and the transferred method specs."
    epochs = int(base_config(dataset)["train"]["epochs"])
    return {"dataset": dataset, **transferred_parameters(stem, epochs)}


def latest_output(figures: Path, stem: str) -> Path:
    """The folder a bare `dml-reproduce <stem>` run just wrote: of `figures/local` (parameters equal to the notebook's
    defaults, as every notebook's transferred rows are since its switch to v3) and `figures/local-<what differs>`, the
    one with the newest `<stem>_claims.json`."""
    made = [d for d in [figures / "local", *sorted(figures.glob("local-*"))] if (d / f"{stem}_claims.json").exists()]
    if not made:
        raise FileNotFoundError(f"{stem}: no claims file under {figures}/local*: did its dml-reproduce run finish?")
    return max(made, key=lambda d: (d / f"{stem}_claims.json").stat().st_mtime)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("notebooks", nargs="+")
    p.add_argument("--dataset", default="finegrained_premise", help="the regime's embedded set (default: v3's)")
    p.add_argument("--runs-dir", default=str(ROOT / "runs"), help="the run cache (default <project>/runs)")
    p.add_argument(
        "--results-dir",
        help="the results folder restored into the run cache first (default: dml-reproduce's, <project>/results; "
        "'none' for a retraining that must train every run, as a flip-rate run)",
    )
    p.add_argument("--workers", type=count_arg, default=2, help="runs at a time (1 to 512; default 2)")
    p.add_argument("--threads", type=count_arg, default=1, help="CPU threads per run (1 to 512; default 1)")
    p.add_argument("--keep", help="copy each notebook's claims, table and figures here")
    p.add_argument("--print", action="store_true", help="print the parameters and stop")
    args = p.parse_args(argv)
    try:
        stems_of(args.notebooks)  # every name checked before anything runs
    except ValueError as e:
        p.error(str(e))
    for stem in args.notebooks:
        params = parameters(stem, args.dataset)
        if args.print:
            print(f"# {stem}\n{json.dumps(params, indent=1)}")
            continue
        with tempfile.NamedTemporaryFile("w", suffix=".yaml", prefix=f"{stem}-") as f:  # YAML: 1.0e-05 stays a number
            yaml.safe_dump(params, f, sort_keys=False)
            f.flush()
            cmd = ["dml-reproduce", stem, "-f", f.name, "--runs-dir", args.runs_dir, "--force"]
            cmd += ["--launch", "local", "--workers", str(args.workers), "--threads", str(args.threads)]
            cmd += ["--results-dir", args.results_dir] if args.results_dir else []
            print("+", " ".join(cmd[:2]), "-f <transferred parameters>", *cmd[4:], flush=True)
            out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        print(out.stdout[-3000:], out.stderr[-3000:] if out.returncode else "", sep="\n", flush=True)
        if out.returncode:
            return out.returncode
        if args.keep:
            try:
                made = latest_output(ROOT / "figures", stem)
            except FileNotFoundError as e:  # one line, not a traceback: the training above is kept in its run cache
                sys.exit(f"{e} (its runs are in {args.runs_dir}: run the same command again to collect them)")
            keep = Path(args.keep)
            keep.mkdir(parents=True, exist_ok=True)
            for f in made.glob(f"{stem}*"):
                shutil.copy2(f, keep / f.name)
            (keep / f"{stem}_parameters.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
            print(f"kept {stem}'s files from {made.relative_to(ROOT)} in {keep}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
