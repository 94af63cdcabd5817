#!/usr/bin/env python
"""Run library notebooks and keep their outputs, so that JupyterLab or a web viewer shows the pictures and results.

    python tools/refresh_outputs.py                 # every library notebook (nbs/[0-9]*.ipynb and nbs/index.ipynb)
    python tools/refresh_outputs.py nbs/62_viz.ipynb

Cells flagged with a test flag of settings.ini (`#| slow`, `#| gpu`) and `#| eval: false` cells are skipped, as
`nbdev_test` skips them; their old outputs are dropped. Figures are stored at 72 dpi to keep the files small, and
a large picture that compresses far better as a JPEG (a grid of photos) is stored as one. The
notebooks run with their own defaults (not the smoke size of `nbdev_test`). Outputs are kept as `dml-reproduce` keeps
a reproduction's: this machine's folders named (`<project>`, `<tmp>`, `~`), no stderr, no object addresses.
Afterwards the script runs `nbdev_clean`.
Each notebook runs in its own process (a registration made by one must not leak into the next).
Reproduction notebooks (`repro_*`) are not run here: `dml-reproduce` runs them and writes `figures/`.
"""

import argparse
import configparser
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def skip_flags() -> set:
    ini = configparser.ConfigParser()
    ini.read(ROOT / "settings.ini")
    return set(ini["DEFAULT"].get("tst_flags", "").split())


def skipped(cell, flags) -> bool:
    if cell.cell_type != "code":
        return True
    heads = [l for l in cell.source.splitlines() if l.startswith("#|")]
    return any(l.split("|", 1)[1].split()[0] in flags for l in heads if l.split("|", 1)[1].split()) or any(
        re.match(r"#\|\s*eval:\s*false", l) for l in heads
    )


def shrink_pictures(nb, limit: int = 100 << 10, quality: int = 80) -> int:
    """Store a PNG output larger than `limit` bytes as a JPEG when that is at most half its size (photo grids: a
    third to a sixth; line plots stay PNG, sharp and small already). Returns the bytes saved."""
    import base64
    import io
    from PIL import Image

    saved = 0
    for c in nb.cells:
        for o in c.get("outputs", []):
            png = o.get("data", {}).get("image/png")
            if not png or len(png) <= limit:
                continue
            img = Image.open(io.BytesIO(base64.b64decode(png)))
            buf = io.BytesIO()
            img.convert("RGB").save(buf, "JPEG", quality=quality, optimize=True)
            jpg = base64.b64encode(buf.getvalue()).decode()
            if 2 * len(jpg) > len(png):
                continue
            del o["data"]["image/png"]
            o["data"]["image/jpeg"] = jpg
            saved += len(png) - len(jpg)
    return saved


def refresh(path: Path, flags: set) -> float:
    from execnb.nbio import read_nb, write_nb
    from execnb.shell import CaptureShell

    os.environ.pop("IN_TEST", None)
    nb = read_nb(path)
    for c in nb.cells:
        if c.cell_type == "code":
            c.outputs, c.execution_count = [], None
    shell = CaptureShell(path)
    shell.run_cell("import matplotlib; matplotlib.rcParams['figure.dpi'] = 72; matplotlib.rcParams['savefig.dpi'] = 72")
    t0, cwd = time.time(), os.getcwd()
    os.chdir(path.parent)
    try:
        shell.run_all(nb, exc_stop=True, preproc=lambda c: skipped(c, flags))
    finally:
        os.chdir(cwd)
    if shell.exc:
        raise RuntimeError(f"{path.name} failed: {shell.prettytb(fname=path)}")
    shrink_pictures(nb)
    scrub(nb)
    write_nb(nb, path)
    return time.time() - t0


def scrub(nb) -> None:
    "Each output as a committed notebook keeps it (`scrub_output`): this machine's folders named, no stderr, no addresses."
    from dml_nb.reproduction.reproduce import machine_paths, scrub_output

    subs = machine_paths(ROOT)
    for c in nb.cells:
        if c.cell_type == "code":
            c.outputs = [o for o in (scrub_output(o, subs) for o in c.outputs) if o is not None]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("notebooks", nargs="*", type=Path)
    ap.add_argument("--no-clean", action="store_true", help="skip the final nbdev_clean")
    args = ap.parse_args(argv)
    nbs = args.notebooks or sorted((ROOT / "nbs").glob("[0-9]*.ipynb")) + [ROOT / "nbs" / "index.ipynb"]
    if len(nbs) > 1:  # each notebook in its own process: registrations made by one notebook must not leak into the next
        failed = [nb.name for nb in nbs if subprocess.run([sys.executable, __file__, "--no-clean", str(nb)]).returncode]
        if failed:
            print("failed:", " ".join(failed), flush=True)
    else:
        print(f"{nbs[0].name}: ", end="", flush=True)
        print(f"{refresh(nbs[0].resolve(), skip_flags()):.0f} s, {nbs[0].stat().st_size // 1024} KB", flush=True)
        failed = []
    if not args.no_clean:
        subprocess.run(["nbdev_clean"], cwd=ROOT, check=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
