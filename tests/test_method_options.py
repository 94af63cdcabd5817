"""Method options as typed data (`dml_nb.methods.options`): checked by `make_config` before any data or torch, taken by
the recipes' constructors, one name per concept with the former names keeping their run hashes, the DiVA and D&C
presets, the smoke sizes declared on the options classes, MIC's k-means seed, and the label noise as declared data."""

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from dml_nb.core.config import ConfigError, config_to_dict, make_config, method_options_class
from dml_nb.core.registry import PRESETS
from dml_nb.methods.options import BSPMLOptions, DiVAOptions, DnCOptions, MICOptions, SharingOptions
from dml_nb.experiments.results import run_key

ROOT = Path(__file__).resolve().parents[1]
OPTIONS = {"diva": DiVAOptions, "sharing": SharingOptions, "mic": MICOptions, "dnc": DnCOptions, "bspml": BSPMLOptions}


def backbone():
    from dml_nb.blocks.models import build_backbone

    return build_backbone("small_cnn", width=4, feature_dim=16)


def test_every_recipe_registers_its_options_class():
    assert {name: method_options_class(name) for name in OPTIONS} == OPTIONS
    assert method_options_class("baseline") is None  # its options are the loss's and miner's, checked by make_config


@pytest.mark.parametrize(
    "method, option, value, message",
    [
        ("diva", "queue_batches", 0, "queue_batches must be >= 1, got 0"),
        ("diva", "normalize", "keys", "Did you mean 'key'"),
        ("diva", "tasks", ["discriminative", "dance", "dance"], "without repeats"),
        ("diva", "weights", {"shard": 0.5}, "Did you mean 'shared'"),
        ("diva", "decorrelation_weight", -1.0, "decorrelation_weight (rho) must be >= 0"),
        ("sharing", "shared_probability", 1.5, "shared_probability must be in [0, 1]"),
        ("sharing", "group_on", "early", "unknown group_on value 'early'"),
        ("sharing", "regressor_lr", 0.0, "decorrelation_lr must be > 0"),
        ("mic", "kmeans_seed", -1, "kmeans_seed must be in [0, 2**31)"),
        ("dnc", "rematch", "offical", "Did you mean 'official'"),
        ("dnc", "full_embedding_fraction", 2.0, "share of the run's epochs in [0, 1]"),
        ("bspml", "c", 0.5, "c (the age multiplier) must be >= 1"),
        ("bspml", "solver", "exakt", "Did you mean 'exact'"),
        ("bspml", "spl", 1, "spl is true or false (YAML: spl: false), got 1"),
        ("dnc", "num_learners", 2.5, "num_learners must be int, got 2.5"),
    ],
)
def test_a_bad_option_stops_the_config_naming_the_option(method, option, value, message):
    with pytest.raises(ConfigError, match=f"^method '{method}': .*" + __import__("re").escape(message)):
        make_config({"method": {"name": method, option: value}})


def test_a_bad_option_is_refused_before_torch_loads():
    "The options module reads the valid values of choices that torch modules define from their source."
    code = (
        "import sys\nfrom dml_nb.core.config import ConfigError, make_config\n"
        "try: make_config({'method': {'name': 'diva', 'normalize': 'keys'}})\n"
        "except ConfigError as e: print('refused', 'torch' in sys.modules)\n"
        "make_config({'method': {'name': 'dnc', 'preset': 'paper_text'}}); print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT).stdout
    assert out.split() == ["refused", "False", "False"], out


def test_a_bad_option_stops_build_learner_before_any_dataset(monkeypatch):
    import dml_nb.training.build as build

    def no_data(*a, **k):
        raise AssertionError("the datasets were built before the options were checked")

    monkeypatch.setattr(build, "build_data", no_data)
    with pytest.raises(ConfigError, match="queue_size must be >= 1"):
        build.build_learner({"method": {"name": "diva", "queue_size": 0}})


def test_the_constructor_takes_the_options_object_or_keywords():
    labels = np.repeat(np.arange(6), 4)
    torch.manual_seed(0)
    from dml_nb.methods.diva import DiVA

    a = DiVA(backbone(), 6, labels, embedding_dim=8, rho=3.0, queue_batches=2)
    torch.manual_seed(0)
    b = DiVA(backbone(), 6, labels, DiVAOptions(embedding_dim=8, decorrelation_weight=3.0, queue_batches=2))
    assert a.options == b.options and a.options.decorrelation_weight == 3.0
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    with pytest.raises(TypeError, match="Did you mean 'queue_batches'"):
        DiVA(backbone(), 6, labels, queue_batch=2)
    with pytest.raises(TypeError, match="expected DiVAOptions"):
        DiVA(backbone(), 6, labels, DnCOptions())


def test_one_name_per_concept_keeps_the_run_hash():
    "A renamed option (`rho`, `gamma`, `regressor_*`) given by either name is one run, spelled by its former name."
    for method, old, new, value in [
        ("diva", "rho", "decorrelation_weight", 10.0),
        ("sharing", "gamma", "decorrelation_weight", 100.0),
        ("mic", "regressor_lr", "decorrelation_lr", 1e-5),
        ("sharing", "regressor_weight_decay", "decorrelation_weight_decay", 0.0),
        ("sharing", "regressor_hidden_dim", "decorrelation_hidden_dim", 64),
    ]:
        a, b = (make_config({"method": {"name": method, k: value}}) for k in (old, new))
        assert a.method.options == b.method.options == {new: value}
        assert config_to_dict(a) == config_to_dict(b) and config_to_dict(a)["method"]["options"] == {old: value}
        assert run_key(config_to_dict(a)) == run_key(config_to_dict(b))
        with pytest.raises(ConfigError, match=f"give {new} only"):
            make_config({"method": {"name": method, old: value, new: value}})
    assert make_config({"method": {"name": "bspml", "rho": 0.5}}).method.options == {"rho": 0.5}  # another concept


def test_the_defaults_are_the_recipes_constants():
    from dml_nb.methods.diva import DIVA_TASKS
    from dml_nb.methods.sharing import MIC_CODE, MIC_DEFAULTS

    assert tuple(DiVAOptions().tasks) == DIVA_TASKS
    mic = MICOptions.renamed(MIC_DEFAULTS)
    assert {k: getattr(MICOptions(), k) for k in mic} == mic
    assert MIC_CODE == {**MIC_DEFAULTS, "kmeans_seed": 1234} and SharingOptions().kmeans_seed is None


@pytest.mark.parametrize("method", ["diva", "dnc"])
def test_diva_and_dnc_presets_resolve_and_build(method):
    assert PRESETS.names(method) == ["authors_code", "paper_text"]
    assert f"{method}: preset paper_text - " in PRESETS.listing()  # dml-train --help lists them
    for name in PRESETS.names(method):
        named = make_config({"method": {"name": method, "preset": name}})
        spelled = make_config({"method": {"name": method, **PRESETS.options(method, name)}})
        assert run_key(config_to_dict(named)) == run_key(config_to_dict(spelled))
        OPTIONS[method](**named.method.options)


def test_the_presets_set_what_the_fidelity_tables_say():
    code, text = PRESETS.options("diva", "authors_code"), PRESETS.options("diva", "paper_text")
    assert code == {"queue_fill": "class_random"}
    assert (text["sharing"], text["intra_distinct"], text["normalize"], text["include_positive"]) == (
        "eq3",
        True,
        "query",
        False,
    )
    assert PRESETS.options("dnc", "authors_code") == {
        "rematch": "official",
        "train_split": "floor",
        "feature_dropout": 0.01,
    }
    assert PRESETS.options("dnc", "paper_text")["cluster_on"] == "embedding"


def test_smoke_sizes_are_declared_on_the_options_classes():
    from dml_nb.methods.diva import DiVA
    from dml_nb.methods.bspml import BSPML

    assert DiVAOptions.SMOKE == {"queue_batches": 2, "num_clusters": 8} and MICOptions.SMOKE == SharingOptions.SMOKE
    assert BSPMLOptions.SMOKE == {"solver_iters": 30} and DnCOptions.SMOKE_IF_SET["finetune_epoch"] == 1
    assert not hasattr(DiVA, "SMOKE") and not hasattr(BSPML, "SMOKE")  # nothing attached to the recipes from outside


@pytest.mark.parametrize("kmeans_seed, want", [(1234, [1234, 1234]), (None, [7000, 7001])])
def test_kmeans_seed_reaches_the_k_means_of_every_grouping(monkeypatch, kmeans_seed, want):
    "MIC's code seeds faiss with 1234 at every grouping; `kmeans_seed: None` keeps a seed per epoch (the default)."
    import dml_nb.evaluation.clustering as clustering
    from dml_nb.methods.sharing import MIC

    seen, real = [], clustering.kmeans
    monkeypatch.setattr(clustering, "kmeans", lambda *a, seed, **k: (seen.append(seed), real(*a, seed=seed, **k))[1])
    labels = np.repeat(np.arange(6), 4)
    m = MIC(backbone(), 6, labels, embedding_dim=8, num_groups=3, kmeans_seed=kmeans_seed)
    feats = torch.randn(len(labels), 8, generator=torch.Generator().manual_seed(0))
    m.grouping_features = lambda ctx, on: feats
    for epoch in (0, 1):
        m.regroup(SimpleNamespace(epoch=epoch, seed=lambda stream, epoch: 7000 + epoch))
    assert seen == want


def test_label_noise_is_declared_data_not_attributes_of_the_set():
    from dml_nb.data.build import LabelNoise, build_data
    from dml_nb.training.build import build_learner

    cfg = {
        "data": {"name": "shapes", "images_per_class": 6, "label_noise": 0.25, "eval_train": False},
        "method": {"name": "bspml", "embedding_dim": 8},
        "model": {"options": {"width": 4, "feature_dim": 16}},
        "train": {"batch_size": 12, "samples_per_class": 3},
    }
    train, _, noise = build_data(make_config(cfg), progress=False)
    assert isinstance(noise, LabelNoise) and noise.flipped.any() and (train.labels != noise.clean_labels).any()
    assert not hasattr(train, "flipped") and not hasattr(train, "clean_labels")
    learner = build_learner(cfg, progress=False)
    assert torch.equal(learner.method._flipped, torch.as_tensor(noise.flipped))


def test_keywords_go_over_the_options_object_or_mapping():
    base = DiVAOptions(alpha=0.5)
    assert DiVAOptions.of(base) is base
    assert DiVAOptions.of(base, rho=2.0).changed() == {"alpha": 0.5, "decorrelation_weight": 2.0}
    assert DiVAOptions.of({"rho": 1.0}, decorrelation_weight=3.0).decorrelation_weight == 3.0
    with pytest.raises(TypeError, match="Did you mean 'queue_size'"):
        DiVAOptions.of(base, qeue_size=3)


def test_options_defined_in_a_notebook_kernel_resolve_their_field_types():
    """A class a notebook cell defines has `__module__ == '__main__'` while its names live in the kernel's namespace:
    under `nbdev_test`, a worker that ran `59_options` and then another notebook checked options with such classes
    (the registry keeps the last one registered), and `typing.get_type_hints` looked for `Optional` in `__main__`."""
    ns = {"__name__": "__main__"}
    cell = (
        "from __future__ import annotations\n"
        "import dataclasses\n"
        "from typing import Optional\n"
        "from dml_nb.methods.options import MethodOptions\n"
        "@dataclasses.dataclass(kw_only=True)\n"
        "class CellOptions(MethodOptions):\n"
        "    k: Optional[int] = None\n"
        "    def check(self):\n"
        "        if self.k is not None and self.k < 1:\n"
        "            raise ValueError('k must be >= 1')\n"
    )
    exec(compile(cell, "<ipython-input-1>", "exec"), ns)
    cls = ns["CellOptions"]
    assert cls.__module__ == "__main__" and "Optional" not in vars(__import__("__main__"))
    assert cls(k=3).k == 3
    with pytest.raises(TypeError, match="k must be"):
        cls(k="x")
    with pytest.raises(ValueError, match="k must be >= 1"):
        cls(k=0)
