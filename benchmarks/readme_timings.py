#!/usr/bin/env python
"""Re-measure every time the README quotes, each with its command, and print them as a Markdown table with the machine.

    python benchmarks/readme_timings.py                      # quick start, main job, flagship from results/
    python benchmarks/readme_timings.py --only quickstart    # one row (--help lists them), or several
    python benchmarks/readme_timings.py --only tests         # the README's test command (about 20 minutes)
    python benchmarks/readme_timings.py --only tests-slow    # the paper-path tests, `pytest -m slow` (hours)
    python benchmarks/readme_timings.py --only flagship-train   # the flagship's 35 + 65 runs from an empty run cache
    python benchmarks/readme_timings.py --only whole-set    # every notebook from an empty run cache (hours)
    python benchmarks/readme_timings.py --only whole-set-recorded   # the runs in results/, their recorded times summed

Each command runs as a child process in a fresh temporary run cache (nothing of the project's `runs/` or `figures/`
is read or written), so a stored result never stands in for the training. The table gives the wall time, the CPU
time of the children (user + system) and the load average before and after: on a shared machine the wall time
grows with the load, the CPU time much less.

`whole-set-recorded` is the one row that trains nothing: the whole v3 set from an empty run cache takes longer than a
working day on 2 cores, so the README quotes what `tools/set_cost.py` reads from the committed `results/`, each run's
own recorded wall time, summed (about 19 minutes to plan every notebook). Its quoted lines are printed under the row,
and they say which part is measured (the sum) and which is an estimate (the sum over two workers).
"""

import argparse
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

QUICKSTART = """
from dml_nb.core.base import project_root
from dml_nb.experiments.experiment import run
from dml_nb.core.config import load_config
import sys
cfg = load_config(str(project_root() / "params/train/shapes_baseline.yaml"))
res = run(cfg, runs_dir=sys.argv[1], progress=False)
print({k: round(v, 3) for k, v in res.metrics.items() if k.startswith("test/")})
"""


TRAIN_FLAGS = ["--launch", "local", "--workers", "2", "--threads", "1", "--results-dir", "none"]


def train_from_empty(py: str, tmp: Path, notebooks: list) -> list:
    "argv of `dml-reproduce` training `notebooks` (all: []) into an empty run cache under `tmp`, figures there too."
    return [
        str(Path(py).parent / "dml-reproduce"),
        *notebooks,
        *TRAIN_FLAGS,
        "--runs-dir",
        str(tmp / "runs"),
        "-y",
        f"output: {{figures_dir: {tmp / 'figures'}}}",
    ]


SET_COST = ["tools/set_cost.py", "--regime", "finegrained_premise", "--results", "results"]


def quoted(name: str, output: str) -> list:
    "The lines of a command's output the README quotes besides its time (set_cost's summary for whole-set-recorded)."
    if name != "whole-set-recorded":
        return []
    keys = ("measured:", "trained on:", "estimate:")
    lines = [l.strip() for l in output.splitlines() if l.strip().startswith(keys) or "distinct runs," in l]
    return [l.replace("|", "/") for l in lines]  # each goes into the Markdown table as one cell


def commands(tmp: Path) -> dict:
    "name -> (what the README calls it, the command shown, argv, environment additions)."
    py = sys.executable
    return {
        "quickstart": (
            "Quick start (shapes_baseline, 10 epochs, in one process)",
            "the README's quick-start cell",
            [py, "-c", QUICKSTART, str(tmp / "runs_q")],
            {},
        ),
        "main": (
            "Main job (DiVA on shapes, 10 epochs)",
            "dml-train params/train/shapes_diva.yaml",
            [
                str(Path(py).parent / "dml-train"),
                "params/train/shapes_diva.yaml",
                "--runs-dir",
                str(tmp / "runs_m"),
                "--no-progress",
            ],
            {},
        ),
        "flagship": (
            "Flagship from a fresh clone's results/ (restored, then the notebook)",
            "papermill nbs/repro_table3.ipynb out.ipynb",
            [
                py,
                "-m",
                "papermill",
                "--no-progress-bar",
                "nbs/repro_table3.ipynb",
                str(tmp / "out.ipynb"),
                "-y",
                f"output: {{runs_dir: {tmp / 'runs_f'}, figures_dir: {tmp / 'figures_f'}}}",
            ],
            {},
        ),
        "flagship-train": (
            "Flagship from an empty run cache (35 runs, then its sensitivity table's 65, 35 of them of 36 epochs, two at a time, then the notebook)",
            f"dml-reproduce repro_table3 {' '.join(TRAIN_FLAGS)}",
            train_from_empty(py, tmp / "flagship", ["repro_table3"]),
            {},
        ),
        "whole-set": (
            "The whole set from an empty run cache (every notebook's runs, two at a time, then the notebooks)",
            f"dml-reproduce {' '.join(TRAIN_FLAGS)}",
            train_from_empty(py, tmp / "whole", []),
            {},
        ),
        "whole-set-recorded": (
            "The whole v3 set's training as recorded by its runs in results/ (summed; nothing is trained)",
            f"python {' '.join(SET_COST)}",
            [py, *SET_COST],
            {},
        ),
        "tests": (
            "The README's test command",
            "nbdev_test --do_print --timing && pytest -n 3",
            ["bash", "-c", "nbdev_test --do_print --timing && pytest -q -n 3"],
            {"MPLBACKEND": "Agg"},
        ),
        "tests-slow": (
            "The paper-path tests and the GPU check's CPU rehearsal",
            "pytest -m slow",
            ["bash", "-c", "pytest -q -m slow"],
            {"MPLBACKEND": "Agg"},
        ),
    }


def machine() -> str:
    "CPU model, SIMD level, cores, torch and its thread count."
    model, flags = platform.processor() or platform.machine(), ""
    try:
        info = Path("/proc/cpuinfo").read_text()
        model = next(l.split(":", 1)[1].strip() for l in info.splitlines() if l.startswith("model name"))
        fl = next(l.split(":", 1)[1].split() for l in info.splitlines() if l.startswith("flags"))
        flags = "AVX-512" if "avx512f" in fl else "AVX2" if "avx2" in fl else "no AVX2"
    except (OSError, StopIteration):
        pass
    import torch

    return (
        f"{model} ({flags}), {os.cpu_count()} cores, torch {torch.__version__} on {torch.get_num_threads()} "
        f"thread(s), {time.strftime('%Y-%m-%d')}"
    )


def measure(argv, env_extra) -> tuple[float, float, int, str, str]:
    "(wall s, children's CPU s, exit status, the last line of its output, its stdout) of one command run from the project."
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.time()
    p = subprocess.run(argv, cwd=ROOT, env={**os.environ, **env_extra}, capture_output=True, text=True)
    wall = time.time() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    last = (p.stdout.strip().splitlines() or p.stderr.strip().splitlines() or [""])[-1]
    return wall, cpu, p.returncode, last[:160], p.stdout


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--only",
        nargs="+",
        choices=[
            "quickstart",
            "main",
            "flagship",
            "flagship-train",
            "whole-set",
            "whole-set-recorded",
            "tests",
            "tests-slow",
        ],
        default=["quickstart", "main", "flagship"],
    )
    args = ap.parse_args(argv)
    print(f"Machine: {machine()}\n")
    print("| what | command | wall | CPU (children) | load before / after | exit |")
    print("| --- | --- | ---: | ---: | --- | ---: |")
    failed = 0
    with tempfile.TemporaryDirectory(prefix="dml_nb_timings_") as d:
        cmds = commands(Path(d))
        for name in args.only:
            what, shown, argv_, env = cmds[name]
            load0 = os.getloadavg()[0]
            wall, cpu, code, last, out = measure(argv_, env)
            failed += code != 0
            print(
                f"| {what} | `{shown}` | {wall / 60:.1f} min ({wall:.0f} s) | {cpu:.0f} s | "
                f"{load0:.1f} / {os.getloadavg()[0]:.1f} | {code} |",
                flush=True,
            )
            if code != 0:
                print(f"|   ({name} failed: {last}) | | | | | |", flush=True)
            for line in quoted(name, out):
                print(f"|   {line} | | | | | |", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
