"""Every paper-scale recipe trains: the real parameter files (params/train/cub200_*.yaml and every row of
params/repro_table3/cub200.yaml), with only size keys shrunk, run one short epoch on a tiny dataset in the real
CUB200 on-disk format, and every task (and every D&C learner) gets tuples."""

from __future__ import annotations
from pathlib import Path

import pytest
import torch
import yaml

from dml_nb.data.checks import write_fake_dataset
from dml_nb.experiments.experiment import run
from dml_nb.core.config import config_to_dict, make_config, merge_layers, read_yaml
from dml_nb.reproduction.notebook import params_base
from dml_nb.reproduction.repro import Row

ROOT = Path(__file__).resolve().parents[1]
CLASSES_PER_BATCH = 6


def paper_configs():
    out = [(f"train/{f.name}", read_yaml(f)) for f in sorted((ROOT / "params" / "train").glob("cub200_*.yaml"))]
    raw = yaml.safe_load((ROOT / "params" / "repro_table3" / "cub200.yaml").read_text())
    base = params_base(raw)
    out += [(f"repro_table3/{name}", Row(name, spec).config(base)) for name, spec in raw["rows"].items()]
    return out


CONFIGS = paper_configs()


def shrink(raw: dict, root: Path) -> dict:
    "Only size keys change: epochs, batches, batch size (classes per batch), image size, workers, weights, evaluation."
    cfg = config_to_dict(make_config(raw))
    k = cfg["train"]["samples_per_class"]
    opts = cfg["method"]["options"]
    small = {
        "data": {"root": str(root), "size": 32},
        "model": {"pretrained": False},
        "train": {
            "epochs": 1,
            "batches_per_epoch": 2,
            "batch_size": CLASSES_PER_BATCH * k,
            "num_workers": 0,
            "device": "cpu",
        },
        "eval": {"every": 1, "metrics": ["recall@1"], "save_embeddings": False},
    }
    if "queue_size" in opts:
        small["method"] = {"options": {"queue_size": min(opts["queue_size"], 4 * CLASSES_PER_BATCH * k)}}
    return merge_layers(cfg, small)


@pytest.fixture(scope="module")
def cub(tmp_path_factory):
    return write_fake_dataset("cub200", tmp_path_factory.mktemp("cub"), n_classes=32, per_class=6, size=40)


# the flagship's rows that repeat a train/cub200_* recipe at another size run on demand (pytest -m slow): about 45 s
SAME_RECIPE = {f"repro_table3/{r}" for r in ("Margin-128", "Margin-512", "D&C-128", "MIC-128", "DiVA-512", "BSPML-512")}


@pytest.mark.parametrize(
    "name, raw",
    [pytest.param(n, r, id=n, marks=[pytest.mark.slow] if n in SAME_RECIPE else []) for n, r in CONFIGS],
)
def test_paper_recipe_gets_tuples_in_every_task(name, raw, cub, tmp_path):
    torch.set_num_threads(1)
    res = run(shrink(raw, cub), runs_dir=tmp_path, progress=False)  # a task with no tuples stops the run
    assert (res.run_dir / "metrics.json").exists() and "test/recall@1" in res.metrics
    counts = {k: v for k, v in res.history[-1].items() if k == "tuples" or k.startswith("tuples/")}
    if not counts:
        assert _tupleless(res.config), f"{name}: no tuples logged"
    assert all(v > 0 for v in counts.values()), f"{name}: {counts}"


def _tupleless(cfg: dict) -> bool:
    "Recipes whose every task learns without mined tuples (proxy losses): nothing to count."
    return cfg["method"]["options"].get("loss") in ("proxy_nca", "proxy_anchor")
