"""The paper-scale path, proven on CPU (slow: `pytest -m slow tests/test_paper_path.py`, about 2.5 h on 2 cores).

Every parameter file under params/train/ and every params/repro_*/*.yaml runs through the entry point a user calls
(`dml-train`, papermill) on a tiny dataset in that dataset's real on-disk format written here, with only size keys
shrunk (epochs, batches, batch shape, image size, workers, `pretrained: false`, R@k beyond the written split,
D&C's K; see MAX_LEARNERS); metrics are written and every task
gets tuples (a task without tuples stops the run). Without the data, every reproduction notebook stops in `setup`,
before training, with the one-line message `dml-train` gives, and writes nothing."""

from __future__ import annotations
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from dml_nb.data.checks import write_fake_dataset

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
P = 6  # classes per batch after shrinking
N_CLASSES, PER_CLASS = 96, 6  # each split: 48 classes x 6 = 288 images
# D&C's K is a size key here: k-means on the features of an untrained ResNet50 over these grey-level images
# leaves some of 8 clusters with one class or one image, which D&C refuses (ClusterError, as the official code
# cannot train them either); 2 learners keep every phase, the slices and the re-matching in the path
MAX_LEARNERS = 2
TRAIN_FILES = [f for f in sorted((ROOT / "params" / "train").glob("*.yaml")) if not f.name.startswith("shapes_")]
REPRO_FILES = sorted((ROOT / "params").glob("repro_*/*.yaml"))
FORMAT = {"cub200": "cub200", "cars196": "cars196", "sop": "sop", "inshop": "inshop", "vehicleid": "vehicleid"}


@pytest.fixture(scope="module")
def data_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    # 48 classes a split, enough for D&C's 8 clusters to form batches; 6 images a class for R@128 (BSPML on SOP)
    for name in FORMAT:
        write_fake_dataset(name, root / name, n_classes=N_CLASSES, per_class=PER_CLASS, size=40)
    return root


def _env(**extra) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "2", "MPLBACKEND": "Agg", **extra}
    env.pop("PYTEST_CURRENT_TEST", None)
    return env


def _shrink_train(t: dict | None) -> dict:
    t = dict(t or {})
    k = int(t.get("samples_per_class", 4))
    if "batch_size" in t:
        t["batch_size"] = min(int(t["batch_size"]), P * k)
    return t


@pytest.mark.parametrize("path", TRAIN_FILES, ids=[f.name for f in TRAIN_FILES])
def test_dml_train_runs_every_paper_file(path, data_root, tmp_path):
    from dml_nb.core.config import load_config

    cfg = load_config(path)
    k = cfg.train.samples_per_class
    sets = [
        f"data.root={data_root / cfg.data.name}",
        "data.size=32",
        "model.pretrained=false",
        "train.epochs=1",
        "train.batches_per_epoch=2",
        f"train.batch_size={min(cfg.train.batch_size, P * k)}",
        "train.num_workers=0",
        "train.device=cpu",
        "eval.save_embeddings=false",
        "eval.every=1",
    ]
    cmd = [str(Path(sys.executable).parent / "dml-train"), str(path), "-o", str(tmp_path / "run"), "--no-progress"]
    for s in sets:
        cmd += ["--set", s]
    out = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=1800)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())["metrics"]
    assert any(k.endswith("recall@1") for k in metrics)
    import pandas as pd

    hist = pd.read_csv(tmp_path / "run" / "history.csv")
    counts = {c: float(hist[c].iloc[-1]) for c in hist.columns if c == "tuples" or c.startswith("tuples/")}
    assert all(v > 0 for v in counts.values()), counts


def _too_large(metric: str) -> bool:
    "R@k with k beyond what a split of the written datasets holds (N_CLASSES / 2 classes x PER_CLASS images)."
    return metric.startswith("recall@") and metric[7:].isdigit() and int(metric[7:]) >= N_CLASSES // 2 * PER_CLASS


def _shrunk_params(path: Path, data_root: Path) -> dict:
    raw = yaml.safe_load(path.read_text())
    name = raw.get("dataset", "shapes")
    config = raw.setdefault("config", {})
    config["data"] = {**(config.get("data") or {}), "root": str(data_root / FORMAT.get(name, name)), "size": 32}
    config["model"] = {**(config.get("model") or {}), "pretrained": False}
    config["train"] = {**_shrink_train(config.get("train")), "num_workers": 0}
    ev = config.get("eval") or {}
    if ev.get("metrics"):  # a size key too: R@k needs k < the split (D&C's R@1000 on SOP)
        config["eval"] = {**ev, "metrics": [m for m in ev["metrics"] if not _too_large(m)]}
    for spec in (raw.get("rows") or {}).values():
        if not isinstance(spec, dict):
            continue
        if isinstance(spec.get("train"), dict):
            spec["train"] = _shrink_train(spec["train"])
        if isinstance(spec.get("model"), dict) and "pretrained" in spec["model"]:
            spec["model"]["pretrained"] = False
        if int(spec.get("num_learners", 1)) > MAX_LEARNERS:
            spec["num_learners"] = MAX_LEARNERS
    return raw


def _papermill(nb: Path, params: dict, out: Path) -> None:
    import papermill

    papermill.execute_notebook(
        str(nb), str(out), parameters=params, cwd=str(ROOT / "nbs"), progress_bar=False, kernel_name="python3"
    )


@pytest.fixture
def smoke_scratch(tmp_path, monkeypatch):
    """A folder inside the smoke folder (the only place a notebook under IN_TEST may write its runs and figures),
    removed afterwards: each of these runs leaves ResNet50 checkpoints of 100-300 MB, and the whole test used to leave
    about 60 GB in the smoke folder until the disk was full."""
    for k, v in _env(IN_TEST="1").items():
        monkeypatch.setenv(k, v)
    from dml_nb.reproduction.repro import output_dirs

    scratch = output_dirs()[1].parent / "paper_path" / tmp_path.name
    yield scratch
    shutil.rmtree(scratch, ignore_errors=True)


@pytest.mark.parametrize("path", REPRO_FILES, ids=[f"{p.parent.name}/{p.name}" for p in REPRO_FILES])
def test_repro_notebook_runs_every_paper_file(path, data_root, tmp_path, smoke_scratch):
    "The notebook with its real parameter file (size keys shrunk), smoke-sized by IN_TEST, on real-format data."
    params = {
        **_shrunk_params(path, data_root),
        "output": {
            "progress": False,
            "runs_dir": str(smoke_scratch / "runs"),
            "figures_dir": str(smoke_scratch / "figures"),
        },
    }
    _papermill(ROOT / "nbs" / f"{path.parent.name}.ipynb", params, tmp_path / "out.ipynb")
    text = (tmp_path / "out.ipynb").read_text()
    assert "not run: dataset" not in text, "a row did not find the real-format data"
    assert any((smoke_scratch / "runs").iterdir()), "the runs were not written where the test asked"


@pytest.mark.parametrize("path", REPRO_FILES, ids=[f"{p.parent.name}/{p.name}" for p in REPRO_FILES])
def test_repro_notebook_without_data_stops_before_training(path, tmp_path, monkeypatch):
    "No row can run: the notebook stops in `setup` with dml-train's message, before any folder or figure is written."
    import papermill

    for k, v in _env(IN_TEST="1", DML_DATA=str(tmp_path / "no_data_here")).items():
        monkeypatch.setenv(k, v)
    raw = yaml.safe_load(path.read_text())
    params = {
        **raw,
        "output": {"progress": False, "figures_dir": str(tmp_path / "figures"), "runs_dir": str(tmp_path / "runs")},
    }
    with pytest.raises(papermill.PapermillExecutionError, match="no_data_here"):  # was: an empty table, exit 0
        _papermill(ROOT / "nbs" / f"{path.parent.name}.ipynb", params, tmp_path / "out.ipynb")
    assert not (tmp_path / "figures").exists() and not (tmp_path / "runs").exists()
