"""`dml-reproduce --write-notebooks`: an executed reproduction notebook written back over its source keeps its outputs
and its sources, and loses papermill's timings, this machine's folders and the progress bars."""

import copy
import json

import pytest

from dml_nb.reproduction.reproduce import WIDGET, scrub_notebook, write_executed


def source_notebook():
    code = lambda i, s, **md: {
        "cell_type": "code",
        "execution_count": None,
        "id": i,
        "metadata": md,
        "outputs": [],
        "source": s,
    }
    return {
        "cells": [
            code("p", ["seeds = [0, 1, 2]  # one run per seed"], tags=["parameters"]),
            {"cell_type": "markdown", "id": "m", "metadata": {}, "source": ["## Table 3"]},
            code("t", ["table"]),
            code("f", ["fig"]),
        ],
        "metadata": {"kernelspec": {"display_name": "python3", "language": "python", "name": "python3"}},
        "nbformat": 4,
        "nbformat_minor": 5,
    }


def executed_copy(src, root, runs):
    "What papermill writes: an injected cell, timings and status in every cell, execution counts, outputs naming this machine."
    exe = copy.deepcopy(src)
    exe["metadata"].update(
        papermill={
            "duration": 61.2,
            "start_time": "2026-11-26T20:00:00.1",
            "end_time": "2026-11-26T20:01:01.3",
            "exception": None,
            "input_path": str(root / "nbs" / "repro_x.ipynb"),
            "parameters": {},
        },
        language_info={"name": "python", "version": "3.11.9"},
        widgets={"state": {}},
    )
    exe["cells"].insert(
        1,
        {
            "cell_type": "code",
            "execution_count": 2,
            "id": "injected",
            "outputs": [],
            "source": ["seeds = [0]"],
            "metadata": {"tags": ["injected-parameters"]},
        },
    )
    for n, c in enumerate(exe["cells"]):
        if c["cell_type"] != "code":
            continue
        c["execution_count"] = n + 1
        c["metadata"] = {
            **c["metadata"],
            "execution": {"iopub.execute_input": "2026-11-26T20:00:01.2"},
            "papermill": {
                "duration": 12.5,
                "end_time": "2026-11-26T20:00:13",
                "exception": False,
                "start_time": "2026-11-26T20:00:01",
                "status": "completed",
            },
        }
    exe["cells"][3]["outputs"] = [  # the cell "table" (after the injected one)
        {"output_type": "stream", "name": "stderr", "text": ["runs: 100%|##########| 3/3 [00:12<00:00]\n"]},
        {
            "output_type": "display_data",
            "metadata": {},
            "data": {WIDGET: {"model_id": "x", "version_major": 2}, "text/plain": ["HBox(children=())"]},
        },
        {
            "output_type": "stream",
            "name": "stdout",
            "text": [f"Ours: written to {root}/figures/repro_x.md; runs in {runs}/baseline-abc\n"],
        },
        {
            "output_type": "execute_result",
            "execution_count": 3,
            "metadata": {},
            "data": {
                "text/plain": ["     R@1\nM   61.2\n"],
                "text/html": [f"<table><td>{runs}/baseline-abc</td></table>"],
            },
        },
    ]
    exe["cells"][4]["outputs"] = [
        {
            "output_type": "display_data",
            "metadata": {"needs_background": "light"},
            "data": {"image/png": "iVBORw0KGgo=\n", "text/plain": ["<Figure size 640x480 with 2 Axes>"]},
        }
    ]
    return exe


@pytest.fixture
def folders(tmp_path):
    root, runs = tmp_path / "project", tmp_path / "shared" / "runs"
    (root / "nbs").mkdir(parents=True)
    runs.mkdir(parents=True)
    return root, runs


def test_scrubbing_keeps_sources_and_outputs_and_drops_paths_and_timings(folders):
    root, runs = folders
    src = source_notebook()
    out = scrub_notebook(executed_copy(src, root, runs), src, root, runs)
    assert [(c["id"], c["source"], c["metadata"]) for c in out["cells"]] == [
        (c["id"], c["source"], c["metadata"]) for c in src["cells"]
    ]
    assert out["metadata"] == src["metadata"]  # no papermill, language_info or widget state
    assert all(c.get("execution_count") is None for c in out["cells"])
    table, fig = out["cells"][2]["outputs"], out["cells"][3]["outputs"]
    assert [o["output_type"] for o in table] == ["stream", "execute_result"]  # stderr and the widget dropped
    assert table[0]["text"] == "Ours: written to <project>/figures/repro_x.md; runs in <runs>/baseline-abc\n"
    assert table[1]["data"]["text/plain"] == "     R@1\nM   61.2\n" and table[1]["execution_count"] is None
    assert fig[0]["data"]["image/png"] == "iVBORw0KGgo=" and fig[0]["metadata"] == {"needs_background": "light"}
    text = json.dumps(out)
    for trace in (str(root), str(runs), "papermill", "duration", "start_time", "2026-11-26", "injected"):
        assert trace not in text, trace


def test_the_written_notebook_is_what_nbdev_clean_leaves_unchanged(folders):
    clean = pytest.importorskip("nbdev.clean")
    root, runs = folders
    src = source_notebook()
    nb_path, exe_path = root / "nbs" / "repro_x.ipynb", root / "repro_x.out.ipynb"
    nb_path.write_text(json.dumps(src, sort_keys=True, indent=1) + "\n")
    exe_path.write_text(json.dumps(executed_copy(src, root, runs)))
    written = write_executed(exe_path, nb_path, root, runs).read_text()
    nb = json.loads(written)
    assert nb["cells"][2]["outputs"] and nb["cells"][3]["outputs"]  # outputs kept
    again = copy.deepcopy(nb)
    clean.clean_nb(again, allowed_cell_metadata_keys=["tags"], clean_ids=True)  # settings.ini: clear_all = False
    assert again == nb
    assert written == json.dumps(again, sort_keys=True, indent=1, ensure_ascii=False) + "\n"


def test_an_executed_copy_of_another_version_is_never_written(folders):
    root, runs = folders
    src = source_notebook()
    exe = executed_copy(src, root, runs)
    exe["cells"][-1]["source"] = ["fig2"]
    with pytest.raises(ValueError, match="cells differ"):
        scrub_notebook(exe, src, root, runs)
