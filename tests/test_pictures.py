"""Every library notebook (the `nbs/[0-9]*.ipynb` that `tools/refresh_outputs.py` runs, and `index.ipynb`) shows at
least one picture in its committed outputs, a figure of values it computes or a diagram, so that a reader in JupyterLab
or on a web viewer sees what the notebook is about without running it. The exceptions are infrastructure notebooks
in which no picture helps; they are listed below, each with the reason, and the list stays exact: a notebook on it
that gains a picture must leave it. Reproduction notebooks (`repro_*`) are written by `dml-reproduce` and not checked
here."""

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

NO_PICTURE = {  # notebook: why no picture helps
    "00_core": "seeding, devices, atomic writes, hashing: plumbing with nothing to plot",
    "01_registry": "name -> class tables and the unknown-name error",
    "02_params": "the strict YAML reader and its one error",
    "03_threads": "what importing the package does (threads, lazy modules)",
    "04_config": "the config schema and its validation messages",
    "59_options": "the methods' options as typed data: tables of groups, presets and renamed keys, and their checks",
    "10_formats": "readers of the datasets' index files, checked against the release sizes",
    "13_checks": "tiny fake dataset trees and the image check's verdicts",
    "18_data": "the data layer's public names only",
    "25_pretrain": "the pretraining stage and its shipped weights file with a checksum; its numbers are tables",
    "33_evaluator": "the order of feature passes and metrics; the metrics' pictures are in 32_metrics",
    "34_faiss_backend": "an optional back end of knn: imports, GPU discovery, thread pools",
    "40_context": "what a method sees of the run: named random streams, feature passes",
    "41_callbacks": "evaluation, history, progress and checkpoint hooks of the learner",
    "43_checkpoint": "what a checkpoint holds and the bit-identical resume",
    "44_distributed": "process groups, DDP and gathered passes",
    "45a_build_learner": "a config composed into its learner: construction, nothing to plot",
    "46_training": "the training loop's public names only",
    "60_experiment": "config -> run directory, cache, lock and done marker",
    "60a_results": "the committed results folder and its records",
    "61_cli": "the dml-train command line",
    "61a_pretrain_cli": "the dml-pretrain command line",
    "64_repro": "the harness of the reproduction notebooks: rows, seeds, tables",
    "65_reproduce": "the dml-reproduce command and the verdict table of REPORT.md",
    "62a_sweep": "planning and launching sweeps",
    "68_notebook": "the setup call every reproduction notebook starts with",
    "62b_launch": "where a sweep's runs are launched (processes, GPUs, SLURM)",
}


def library_notebooks() -> list[Path]:
    return sorted((ROOT / "nbs").glob("[0-9]*.ipynb")) + [ROOT / "nbs" / "index.ipynb"]


def has_picture(path: Path) -> bool:
    "Whether a code cell of `path` has a committed output holding an image (PNG, JPEG or SVG)."
    cells = json.loads(path.read_text())["cells"]
    return any(
        key.startswith("image/")
        for cell in cells
        if cell["cell_type"] == "code"
        for output in cell.get("outputs", [])
        for key in output.get("data", {})
    )


def test_every_library_notebook_shows_a_picture():
    missing = [p.name for p in library_notebooks() if p.stem not in NO_PICTURE and not has_picture(p)]
    assert not missing, (
        "library notebooks without a picture in their committed outputs (add a figure of values the notebook "
        "computes, or a diagram, execute the cell and commit its output; or, for an infrastructure notebook where "
        "no picture helps, add it to NO_PICTURE in tests/test_pictures.py with the reason): " + ", ".join(missing)
    )


def test_the_list_of_notebooks_without_pictures_is_exact():
    names = {p.stem for p in library_notebooks()}
    gone = sorted(set(NO_PICTURE) - names)
    assert not gone, f"NO_PICTURE names notebooks that do not exist (remove them): {gone}"
    pictured = sorted(n for n in NO_PICTURE if has_picture(ROOT / "nbs" / f"{n}.ipynb"))
    assert not pictured, f"these notebooks now show a picture: remove them from NO_PICTURE: {pictured}"


def test_has_picture_reads_image_outputs(tmp_path):
    def notebook(outputs):
        p = tmp_path / "x.ipynb"
        p.write_text(json.dumps({"cells": [{"cell_type": "code", "source": [], "outputs": outputs}]}))
        return p

    assert has_picture(notebook([{"output_type": "display_data", "data": {"image/png": "iVBOR", "text/plain": ""}}]))
    assert has_picture(notebook([{"output_type": "display_data", "data": {"image/jpeg": "/9j/"}}]))
    assert not has_picture(notebook([{"output_type": "stream", "name": "stdout", "text": "image/png"}]))
    assert not has_picture(notebook([{"output_type": "execute_result", "data": {"text/plain": "<Figure>"}}]))
