"""Dependencies as a library declares them: torch and torchvision as a tested range, the exact CI versions in
constraints.txt, faiss optional through two extras that never install together, and the default evaluation and
training running where faiss is not installed at all."""

from __future__ import annotations
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
try:
    import tomllib
except ImportError:
    tomllib = pytest.importorskip("tomli")
from packaging.requirements import Requirement
from packaging.version import Version


def project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def requirements(reqs) -> dict[str, Requirement]:
    return {Requirement(r).name: Requirement(r) for r in reqs}


def pins() -> dict[str, str]:
    out = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, _, version = line.partition("==")
            assert version, f"constraints.txt pins exact versions (name==version); got {line!r}"
            out[name.strip().lower()] = version.strip()
    return out


def test_torch_and_torchvision_are_a_tested_range():
    deps = requirements(project()["dependencies"])
    for name, floor, ceiling, outside in (
        ("torch", "2.11.0", "2.14.1", ("2.10.0", "2.15.0")),
        ("torchvision", "0.26.0", "0.29.1", ("0.25.0", "0.30.0")),
    ):
        spec = deps[name].specifier
        assert floor in spec and ceiling in spec, f"{name} {spec} must admit {floor} (GPU machines) and {ceiling} (CI)"
        assert not any(v in spec for v in outside), f"{name} {spec}: a range, tested at its ends"
        assert not any(s.operator == "==" for s in spec), f"{name} is an exact pin: a range belongs in pyproject.toml"


def test_constraints_pin_what_ci_installs_inside_the_declared_ranges():
    p, proj = pins(), project()
    assert p["torch"] == "2.14.1" and p["torchvision"] == "0.29.1"
    declared = requirements(proj["dependencies"] + [r for rs in proj["optional-dependencies"].values() for r in rs])
    for name, req in declared.items():
        if name.lower() in p:
            assert Version(p[name.lower()]) in req.specifier, (
                f"constraints.txt: {name}=={p[name.lower()]} outside {req}"
            )
    ci = (ROOT / ".ci" / "run").read_text()
    assert '-c constraints.txt -e ".[dev,faiss-cpu]"' in ci


def test_faiss_is_optional_and_its_extras_never_install_together():
    proj = project()
    assert not any(Requirement(r).name.startswith("faiss") for r in proj["dependencies"])
    extras = {k: [Requirement(r).name for r in v] for k, v in proj["optional-dependencies"].items()}
    assert extras["faiss-cpu"] == ["faiss-cpu"] and extras["faiss-gpu"] == ["faiss-gpu"]
    for name, reqs in extras.items():  # no extra pulls two faiss distributions (or another extra with one)
        assert sum(r.startswith("faiss") or r.startswith("dml_nb") or r.startswith("dml-nb") for r in reqs) <= 1, name
    assert not any(r.startswith("faiss") for r in extras["dev"]), "dev must not choose a faiss for the user"


NO_FAISS = """
import sys
sys.modules["faiss"] = None            # import faiss raises ImportError, as where it is not installed
import numpy as np, torch
from dml_nb.evaluation.metrics import evaluate
from dml_nb.evaluation.faiss_backend import FaissMissingError
from dml_nb.evaluation.neighbours import knn
from dml_nb.evaluation.clustering import kmeans
g = np.random.default_rng(0)
y = np.repeat(np.arange(10), 8)
x = torch.from_numpy(g.normal(size=(10, 16))[y] + 0.3 * g.normal(size=(80, 16))).float()
ev = evaluate(x, y)                   # the default metrics and back ends: recall@k, NMI
assert set(ev) >= {"recall@1", "nmi"} and 0 < ev["recall@1"] <= 1, ev
for call in (lambda: knn(x, x, 3, exclude_self=True, backend="faiss"), lambda: kmeans(x, 4, backend="faiss_cpu"),
             lambda: evaluate(x, y, ("nmi",), nmi_kmeans="faiss")):
    try: call()
    except FaissMissingError as e:
        assert "dml_nb[faiss-cpu]" in str(e) and "dml_nb[faiss-gpu]" in str(e) and "backend='torch'" in str(e), e
    else: raise AssertionError("a faiss back end ran without faiss")
from dml_nb.experiments.experiment import run
import tempfile
cfg = {"data": {"name": "shapes", "images_per_class": 4, "size": 32},
       "model": {"backbone": "small_cnn", "options": {"width": 4, "feature_dim": 16}},
       "method": {"name": "baseline", "embedding_dim": 8, "loss": "triplet", "miner": "semihard"},
       "train": {"epochs": 1, "batch_size": 16, "samples_per_class": 4, "batches_per_epoch": 2, "lr": 1e-3},
       "eval": {"every": 1, "save_embeddings": False}}
res = run(cfg, runs_dir=tempfile.mkdtemp(), progress=False)
assert "test/nmi" in res.metrics and sys.modules["faiss"] is None, res.metrics
print("ok", round(ev["recall@1"], 3), round(res.metrics["test/recall@1"], 3))
"""


def test_the_default_evaluation_and_training_run_without_faiss():
    "In a process where `import faiss` fails: the default evaluation and a default run work; a faiss back end names the extras."
    out = subprocess.run(
        [sys.executable, "-c", NO_FAISS],
        capture_output=True,
        text=True,
        timeout=600,
        env={**__import__("os").environ, "PYTHONPATH": str(ROOT)},
    )
    assert out.returncode == 0 and out.stdout.startswith("ok"), out.stdout + out.stderr


def test_two_faiss_distributions_installed_together_are_named(monkeypatch):
    import importlib.metadata as md
    from dml_nb.evaluation import faiss_backend as N

    have = {"faiss-cpu": "1.15.1", "faiss-gpu": "1.15.1"}

    def version(dist):
        if dist in have:
            return have[dist]
        raise md.PackageNotFoundError(dist)

    monkeypatch.setattr(md, "version", version)
    monkeypatch.setattr(N, "_faiss_checked", [])
    with pytest.warns(
        UserWarning,
        match=r"faiss-cpu 1\.15\.1 and faiss-gpu 1\.15\.1 are installed together.*pip uninstall -y faiss-cpu faiss-gpu",
    ):
        N._warn_two_faiss()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        N._warn_two_faiss()  # once per process
    monkeypatch.setattr(N, "_faiss_checked", [])
    have.pop("faiss-gpu")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        N._warn_two_faiss()  # one distribution: nothing to say
