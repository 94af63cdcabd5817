"""One home per setting: the config sections hold every training and evaluation default, the `Learner`, `Evaluator`
and `metrics.evaluate` read them, and the run hash of every committed config is what it was before (an unchanged
config keeps its run folder)."""

import json
from pathlib import Path

import pytest

from dml_nb.core.config import config_to_dict, load_config, make_config
from dml_nb.experiments.experiment import run_dir_for, run_key
from dml_nb.reproduction.repro import smoke

ROOT = Path(__file__).resolve().parents[1]
RUN_HASHES = ROOT / "tests" / "fixtures" / "run_hashes.json"


def committed_configs() -> dict:
    """{case: raw config} of every committed config: params/train/*.yaml, and every method spec of the reproduction
    parameter files and notebook defaults (the cases `test_repro` checks `smoke` on), at full size and smoke size."""
    from test_repro import _smoke_cases

    out = {f"train/{p.name}": p for p in sorted((ROOT / "params" / "train").glob("*.yaml"))}
    for case, raw in _smoke_cases().items():
        out[case], out[f"{case}:smoke"] = raw, smoke(raw, force=True)
    return out


def run_hashes() -> dict:
    "{case: '<run folder name> <run_key>'} of every committed config."
    out = {}
    for case, raw in committed_configs().items():
        cfg = load_config(raw) if isinstance(raw, Path) else make_config(raw)
        out[case] = f"{run_dir_for(cfg).name} {run_key(config_to_dict(cfg))}"
    return out


def test_committed_configs_keep_their_run_folders():
    """The run folder and run key of every committed config are those recorded before the settings moved to one home
    (the notebook defaults' were recorded again when the reproductions moved to regime v2, `finegrained_novel`). A
    notebook switched to regime v3 keeps its v2 cases through `params/regime_v2/` (so its v2 runs keep their folders)
    and adds `<notebook>@v3` cases, recorded when it was switched."""
    # train/cub200_*.yaml (the GPU paper files) were recorded again when they took `train.task_grad_every: 25`: the
    # grad/<task> logs, a diagnostic that changes no parameter, every 25th step (no committed run trained them)
    # the DiVA rows with DaNCE or MoCo of regime v3 (six notebooks' `@v3` cases) were recorded again when the transfer
    # rule kept their queue at the paper file's 30 batches (a count of negatives; it had scaled it as epochs to 1 or 2):
    # their runs were trained again under it (nbs/67b_transfer.ipynb, rule 2)
    want = json.loads(RUN_HASHES.read_text())
    got = run_hashes()
    assert sorted(got) == sorted(want), f"cases added or gone: {sorted(set(got) ^ set(want))[:5]}"
    changed = sorted(k for k in want if got[k] != want[k])
    assert not changed, f"{len(changed)} committed configs changed their run hash, e.g. {changed[:3]}"


def _fields(cls, prefix=""):
    import dataclasses
    import typing

    for f in dataclasses.fields(cls):
        yield prefix + f.name, f
        tp = typing.get_type_hints(cls)[f.name]
        if dataclasses.is_dataclass(tp):
            yield from _fields(tp, f"{prefix}{f.name}.")


def test_every_field_says_how_it_enters_the_run_hash():
    "A field declared without `hashed` or `added_later` fails here (and `config_to_dict` refuses it)."
    from dml_nb.core.config import Config, HASH_RULES

    undeclared = [name for name, f in _fields(Config) if f.metadata.get("hash") not in HASH_RULES]
    assert not undeclared, f"fields without a run-hash rule (declare them with added_later(default)): {undeclared}"


def test_added_later_fields_at_their_default_leave_the_dict_unchanged():
    "The fields that were once the `_OMITTED_AT_DEFAULT` table (and the ones added since) are out of the dict at their defaults."
    from dml_nb.core.config import Config

    d = config_to_dict(make_config({}))
    later = [name for name, f in _fields(Config) if f.metadata.get("hash") == "omit_at_default"]
    assert {
        "data.cache",
        "data.decode",
        "train.compile",
        "train.zero_grad",
        "eval.nmi_average",
        "eval.self_match",
    } <= set(later)
    for name in later:
        sec, key = name.split(".")
        assert key not in d[sec], name


def test_learner_defaults_are_the_config_defaults(shapes4):
    "A `Learner` with no settings holds exactly the sections' defaults; `build_learner(Config())` holds the same."
    from dml_nb.core.config import Config, EvalConfig, TrainConfig
    from dml_nb.training.learner import Learner, build_sampler
    from dml_nb.methods.base import BaselineMethod
    from dml_nb.blocks.models import build_backbone
    from dml_nb.training.build import build_learner

    train = shapes4[0]
    method = BaselineMethod(build_backbone("small_cnn", width=8, feature_dim=32), train.num_classes, embedding_dim=8)
    plain = Learner(method, train, build_sampler(TrainConfig(), train.labels), progress=False)
    assert (
        plain.train_config == TrainConfig() and plain.evaluator.config == EvalConfig() and plain.seed == Config().seed
    )
    built = build_learner(Config(), progress=False)
    assert built.train_config == plain.train_config and built.evaluator.config == plain.evaluator.config
    for attr in ("seed", "epochs", "lr", "amp", "channels_last", "device", "eval_batch_size"):
        assert getattr(built, attr) == getattr(plain, attr), attr
    assert [type(c).__name__ for c in built.callbacks] == [type(c).__name__ for c in plain.callbacks]
    assert (built.sampler.batch_size, built.sampler.samples_per_class, built.sampler.draw) == (
        TrainConfig().batch_size,
        TrainConfig().samples_per_class,
        TrainConfig().sampler,
    )


def test_evaluation_defaults_are_written_once():
    "`metrics.evaluate`, `check_eval_readings` and NMI take their defaults from `EvalConfig`; the readings' names too."
    import inspect
    from dml_nb.core.config import EvalConfig, choices
    from dml_nb.evaluation import clustering, metrics
    from dml_nb.evaluation.evaluator import Evaluator

    cfg = EvalConfig()
    for fn in (metrics.evaluate, metrics.check_eval_readings):
        params = inspect.signature(fn).parameters
        for key in Evaluator.READINGS:
            if key in params:
                assert params[key].default == getattr(cfg, key), (fn.__name__, key)
    assert inspect.signature(clustering.nmi).parameters["average"].default == cfg.nmi_average
    assert inspect.signature(clustering.check_nmi_reading).parameters["kmeans"].default == cfg.nmi_kmeans
    assert tuple(clustering.NMI_KMEANS) == choices(EvalConfig, "nmi_kmeans")
    import torch

    x, y = torch.randn(30, 4, generator=torch.Generator().manual_seed(0)), torch.arange(30) % 3
    assert set(metrics.evaluate(x, y)) == set(cfg.metrics)  # the standalone default is the section's metrics
    assert Evaluator().scores(x, y) == metrics.evaluate(x, y)


def test_learner_settings_are_the_sections_fields(shapes4):
    "Single settings by name go to their section; unknown, ambiguous, sampler-only and old spellings are refused."
    from dml_nb.core.config import ConfigError
    from dml_nb.training.learner import learner_sections

    t, e = learner_sections({"epochs": 3}, None, lr=2e-3, metrics=("recall@1",), nmi_seeds=2)
    assert (t.epochs, t.lr, e.metrics, e.nmi_seeds) == (3, 2e-3, ["recall@1"], 2)
    fn = lambda epoch: 0.5
    t, _ = learner_sections(schedule=fn, optimizer=lambda groups: None)
    assert t.schedule is fn and callable(t.optimizer)  # code: the one value beyond the config's types
    for kw, msg in [
        ({"eval_every": 2}, "Did you mean eval.every"),
        ({"eval_batch_size": 64}, "Did you mean eval.batch_size"),
        ({"batch_size": 64}, "ambiguous"),
        ({"samples_per_class": 2}, "read by the sampler"),
        ({"weight_deacy": 0.1}, "Did you mean train.weight_decay"),
    ]:
        with pytest.raises(TypeError, match=msg):
            learner_sections(**kw)
    for kw, msg in [
        ({"amp": None}, "train.amp: None"),
        ({"channels_last": True}, "train.channels_last: True"),
        ({"schedule": ("multistep", [1], 0.1)}, "train.schedule"),
        ({"epochs": 0}, "train.epochs: 0"),
    ]:
        with pytest.raises(ConfigError, match=msg):
            learner_sections(**kw)


def test_learner_takes_at_most_12_named_parameters():
    "The Learner's constructor: sections, the run's own keywords, and single fields by name (no per-field parameters)."
    import inspect
    from dml_nb.training.learner import Learner

    params = [p for n, p in inspect.signature(Learner.__init__).parameters.items() if n != "self"]
    named = [p.name for p in params if p.kind is not inspect.Parameter.VAR_KEYWORD]
    assert len(named) <= 12, named
    assert params[-1].kind is inspect.Parameter.VAR_KEYWORD and {"train", "eval"} <= set(named)
