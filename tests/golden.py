"""Golden fixtures: numbers computed by running the authors' public code on fixed inputs in a throwaway harness
outside this repository. Only the numbers are stored (never their code); each file names the repository and
commit they came from, the files that were run, and how the harness called them."""

from __future__ import annotations
import json
import re
from pathlib import Path

import numpy as np

GOLDEN = Path(__file__).parent / "fixtures" / "golden"
AUTHORS_REPOS = (
    "Confusezius/ECCV2020_DiVA_MultiFeature_DML",
    "Confusezius/Revisiting_Deep_Metric_Learning_PyTorch",
    "Confusezius/metric-learning-mining-interclass-characteristics",
    "CompVis/metric-learning-divide-and-conquer",
)


def check_source(source: dict, where: str) -> None:
    "A fixture's `source` record: one of the authors' repositories, a 40-hex commit, the files run, the harness."
    if not isinstance(source, dict):
        raise ValueError(f"{where}: 'source' must be a mapping")
    missing = [k for k in ("repo", "commit", "files", "harness") if k not in source]
    if missing:
        raise ValueError(f"{where}: source lacks {missing}")
    if source["repo"] not in AUTHORS_REPOS:
        raise ValueError(f"{where}: repo {source['repo']!r} is not one of {AUTHORS_REPOS}")
    if not re.fullmatch(r"[0-9a-f]{40}", str(source["commit"])):
        raise ValueError(f"{where}: commit must be 40 hex digits")
    if not source["files"] or not all(isinstance(f, str) for f in source["files"]):
        raise ValueError(f"{where}: files must list the paths (in that repository) whose code produced the numbers")


def load_golden(name: str) -> dict:
    "The fixture `tests/fixtures/golden/<name>.json`, its source checked; lists stay lists (use `np.asarray`)."
    path = GOLDEN / f"{name}.json"
    data = json.loads(path.read_text())
    check_source(data.get("source"), str(path))
    return data


def arr(x, dtype=np.float64) -> np.ndarray:
    "A stored list as an array."
    return np.asarray(x, dtype=dtype)
