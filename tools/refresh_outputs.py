#!/usr/bin/env python
"""Run library notebooks and keep their outputs, so that JupyterLab or a web viewer shows the pictures and results.

    python tools/refresh_outputs.py                 # every library notebook (nbs/[0-9]*.ipynb and nbs/index.ipynb)
    python tools/refresh_outputs.py nbs/08_viz.ipynb

Cells flagged with a test flag of settings.ini (`#| slow`, `#| gpu`) and `#| eval: false` cells are skipped, as
`nbdev_test` skips them; their old outputs are dropped. Figures are stored at 72 dpi to keep the files small. The
notebooks run with their own defaults (not the smoke size of `nbdev_test`). Afterwards the script runs `nbdev_clean`.
Reproduction notebooks (`repro_*`) are not run here: `dml-reproduce` runs them and writes `figures/`.
"""
import argparse, configparser, os, re, subprocess, sys, time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

def skip_flags() -> set:
    ini = configparser.ConfigParser(); ini.read(ROOT / "settings.ini")
    return set(ini["DEFAULT"].get("tst_flags", "").split())

def skipped(cell, flags) -> bool:
    if cell.cell_type != "code": return True
    heads = [l for l in cell.source.splitlines() if l.startswith("#|")]
    return any(l.split("|", 1)[1].split()[0] in flags for l in heads if l.split("|", 1)[1].split()) or \
        any(re.match(r"#\|\s*eval:\s*false", l) for l in heads)

def refresh(path: Path, flags: set) -> float:
    from execnb.nbio import read_nb, write_nb
    from execnb.shell import CaptureShell
    os.environ.pop("IN_TEST", None)
    nb = read_nb(path)
    for c in nb.cells:
        if c.cell_type == "code": c.outputs, c.execution_count = [], None
    shell = CaptureShell(path)
    shell.run_cell("import matplotlib; matplotlib.rcParams['figure.dpi'] = 72; matplotlib.rcParams['savefig.dpi'] = 72")
    t0, cwd = time.time(), os.getcwd()
    os.chdir(path.parent)
    try: shell.run_all(nb, exc_stop=True, preproc=lambda c: skipped(c, flags))
    finally: os.chdir(cwd)
    if shell.exc: raise RuntimeError(f"{path.name} failed: {shell.prettytb(fname=path)}")
    write_nb(nb, path)
    return time.time() - t0

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("notebooks", nargs="*", type=Path)
    args = ap.parse_args(argv)
    nbs = args.notebooks or sorted((ROOT / "nbs").glob("[0-9]*.ipynb")) + [ROOT / "nbs" / "index.ipynb"]
    flags = skip_flags()
    for nb in nbs:
        print(f"{nb.name}: ", end="", flush=True)
        print(f"{refresh(nb.resolve(), flags):.0f} s, {nb.stat().st_size // 1024} KB", flush=True)
    subprocess.run(["nbdev_clean"], cwd=ROOT, check=True)
    return 0

if __name__ == "__main__": sys.exit(main())
