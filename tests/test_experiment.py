"""The experiment runner: which epoch a run reports, batch shapes that cannot learn refused before anything is
written, and the run-directory hashes of configs that do not use the new switches left unchanged."""

import json

import pytest
import torch

from dml_nb.core.base import config_hash
from dml_nb.experiments.experiment import run
from dml_nb.core.config import ConfigError, config_to_dict, make_config

TINY = {
    "data": {"name": "shapes", "images_per_class": 4, "size": 32},
    "model": {"backbone": "small_cnn", "options": {"width": 4, "feature_dim": 16}},
    "method": {"name": "baseline", "embedding_dim": 8, "loss": "triplet", "miner": "semihard"},
    "train": {"epochs": 3, "batch_size": 16, "samples_per_class": 4, "batches_per_epoch": 3, "lr": 1e-3},
    "eval": {"every": 1, "metrics": ["recall@1"], "save_embeddings": False},
}


def test_best_and_last_epoch_are_both_recorded(tmp_path):
    last = run({**TINY}, runs_dir=tmp_path, progress=False)
    best = run({**TINY, "eval": {**TINY["eval"], "report": "best"}}, runs_dir=tmp_path, progress=False)
    assert last.run_dir != best.run_dir
    r1 = [h["test/recall@1"] for h in last.history]
    assert last.info["reported"] == "last epoch" and last.metrics["test/recall@1"] == pytest.approx(r1[-1])
    assert last.info["best_epoch"] == r1.index(max(r1)) + 1
    assert best.info["reported"] == "best epoch by test/recall@1"
    assert best.metrics["test/recall@1"] == pytest.approx(max(r1))  # same training: only the report differs
    stored = json.loads((best.run_dir / "metrics.json").read_text())
    assert stored["best_metrics"]["test/recall@1"] == pytest.approx(max(r1))


def test_new_switches_at_their_defaults_keep_the_hash():
    a = config_to_dict(make_config(TINY))
    assert "report" not in a["eval"] and "stop_on_empty_tuples" not in a["train"]
    b = config_to_dict(
        make_config(
            {
                **TINY,
                "eval": {**TINY["eval"], "report": "last"},
                "train": {**TINY["train"], "stop_on_empty_tuples": True},
            }
        )
    )
    assert config_hash(a) == config_hash(b)
    c = config_to_dict(make_config({**TINY, "eval": {**TINY["eval"], "report": "best"}}))
    assert c["eval"]["report"] == "best" and config_hash(c) != config_hash(a)


@pytest.mark.parametrize("batch, k", [(4, 4), (8, 1)])
def test_batches_that_cannot_form_tuples_are_refused_before_training(tmp_path, batch, k):
    raw = {**TINY, "train": {**TINY["train"], "batch_size": batch, "samples_per_class": k}}
    with pytest.raises(ConfigError, match="needs at least 2 classes"):
        run(raw, runs_dir=tmp_path, progress=False)
    assert not any(tmp_path.iterdir())  # nothing written
    ok = {**raw, "train": {**raw["train"], "stop_on_empty_tuples": False}}
    make_config(ok)  # the switch lets a user insist
    proxy = {**raw, "method": {"name": "baseline", "embedding_dim": 8, "loss": "proxy_nca"}}
    make_config(proxy)  # proxy losses need no tuples


def test_unknown_report_is_a_config_error():
    with pytest.raises(ConfigError, match="report"):
        make_config({**TINY, "eval": {**TINY["eval"], "report": "median"}})


def test_on_unreadable_at_its_default_keeps_the_hash():
    a = config_to_dict(make_config(TINY))
    assert "on_unreadable" not in a["data"]
    b = config_to_dict(make_config({**TINY, "data": {**TINY["data"], "on_unreadable": "error"}}))
    c = config_to_dict(make_config({**TINY, "data": {**TINY["data"], "on_unreadable": "skip"}}))
    assert config_hash(a) == config_hash(b) != config_hash(c) and c["data"]["on_unreadable"] == "skip"
    with pytest.raises(ConfigError, match="one of 'error', 'skip'"):
        make_config({**TINY, "data": {**TINY["data"], "on_unreadable": "ignore"}})


def test_run_folders_of_older_recipes_are_not_reused(monkeypatch, tmp_path):
    "A default that changes what an unchanged config trains bumps RECIPES_VERSION: the run folder moves."
    import dml_nb.experiments.experiment as ex

    cfg = make_config(TINY)
    now = ex.run_dir_for(cfg, tmp_path)
    assert now.name != f"baseline-shapes-{config_hash(config_to_dict(cfg))}"  # the name before the fidelity defaults
    monkeypatch.setattr(ex, "RECIPES_VERSION", ex.RECIPES_VERSION + 1)
    assert ex.run_dir_for(cfg, tmp_path) != now


def test_named_random_streams_move_run_folders_only_through_recipes_version(monkeypatch, tmp_path):
    "Named random streams (RECIPES_VERSION 3) change the draws, not the configs: the config hash is the one of before."
    import dml_nb.experiments.experiment as ex

    cfg = make_config(TINY)
    assert config_hash(config_to_dict(cfg)) == "56ad0a368312"  # unchanged since RECIPES_VERSION 2
    assert ex.RECIPES_VERSION == 3
    now = ex.run_dir_for(cfg, tmp_path).name
    monkeypatch.setattr(ex, "RECIPES_VERSION", 2)
    assert ex.run_dir_for(cfg, tmp_path).name == "baseline-shapes-1e2984cc9f75" != now  # the folder before the streams


def test_nmi_seeds_is_checked_and_keeps_the_hash_at_its_default():
    with pytest.raises(ConfigError, match="eval.nmi_seeds"):
        make_config({**TINY, "eval": {**TINY["eval"], "nmi_seeds": 0}})
    assert "nmi_seeds" not in config_to_dict(make_config(TINY))["eval"]  # default 1: existing run hashes unchanged
    assert config_to_dict(make_config({**TINY, "eval": {**TINY["eval"], "nmi_seeds": 3}}))["eval"]["nmi_seeds"] == 3


@pytest.mark.parametrize(
    "method",
    [
        {"name": "baseline", "embedding_dim": 8, "loss": "triplet", "miner": "semihard"},
        {"name": "diva", "embedding_dim": 16, "tasks": ["discriminative", "shared", "intra", "dance"]},
        {"name": "dnc", "embedding_dim": 8, "num_learners": 2, "recluster_every": 1},
        {"name": "mic", "embedding_dim": 8},
        {"name": "bspml", "embedding_dim": 8},
    ],
)
def test_saved_embeddings_are_those_of_the_final_weights(tmp_path, method, monkeypatch):
    """`embeddings.pt` reuses the last evaluation's feature pass instead of a second one: it must hold exactly what a
    fresh pass of the restored final weights gives, for every method and every head, and take no extra pass."""
    import torch
    from dml_nb.training.learner import Learner
    from dml_nb.reproduction.repro import load_learner, smoke

    raw = smoke(
        {
            **TINY,
            "method": method,
            "train": {**TINY["train"], "epochs": 2},
            "eval": {**TINY["eval"], "every": 2, "save_embeddings": True},
        },
        force=True,
    )
    passes, during_save = [], []
    embed, eval_embeddings = Learner.embed, Learner.eval_embeddings

    def counted(self):
        n = len(passes)
        out = eval_embeddings(self)
        during_save.append(len(passes) - n)
        return out

    monkeypatch.setattr(Learner, "embed", lambda self, *a, **k: passes.append(1) or embed(self, *a, **k))
    monkeypatch.setattr(Learner, "eval_embeddings", counted)
    result = run(raw, runs_dir=tmp_path, progress=False)
    assert during_save == [0]  # the saved embeddings reuse the last evaluation's pass
    stored = torch.load(result.run_dir / "embeddings.pt", weights_only=True)
    fresh = load_learner(result).eval_embeddings()  # a new learner: nothing to reuse, a new pass of each set
    assert during_save == [0, 2] and stored.keys() == fresh.keys() == {"test", "train"}
    for name in stored:
        assert stored[name].keys() == fresh[name].keys()
        for k in stored[name]:
            assert torch.equal(stored[name][k], fresh[name][k]), (name, k)


def test_nmi_readings_reach_the_learner_and_keep_the_hash_at_their_defaults():
    "eval.nmi_kmeans / nmi_average: checked by the schema, passed to every evaluation, left out of the hash at the default."
    from dml_nb.training.build import build_learner

    assert not {"nmi_kmeans", "nmi_average"} & set(config_to_dict(make_config(TINY))["eval"])
    for bad in ({"nmi_kmeans": "faiss20"}, {"nmi_average": "max"}):
        with pytest.raises(ConfigError, match=f"eval.{next(iter(bad))}"):
            make_config({**TINY, "eval": {**TINY["eval"], **bad}})
    cfg = make_config({**TINY, "eval": {**TINY["eval"], "nmi_kmeans": "faiss_100", "nmi_average": "geometric"}})
    assert config_to_dict(cfg)["eval"]["nmi_kmeans"] == "faiss_100"
    learner = build_learner(cfg, progress=False)
    assert learner.evaluator.readings == {
        "nmi_seeds": 1,
        "nmi_kmeans": "faiss_100",
        "nmi_average": "geometric",
        "nmi_on": "query",
        "self_match": "index",
    }


def test_config_eval_names_are_the_library_readings():
    "The schema's allowed values for the eval readings and reports are exactly those the library defines."
    import typing
    from dml_nb.core.config import EvalConfig
    from dml_nb.evaluation.clustering import NMI_AVERAGES, NMI_KMEANS
    from dml_nb.evaluation.metrics import NMI_ON, SELF_MATCH
    from dml_nb.training.learner import REPORTS

    hints = typing.get_type_hints(EvalConfig)
    for key, names in (
        ("nmi_kmeans", tuple(NMI_KMEANS)),
        ("nmi_average", NMI_AVERAGES),
        ("nmi_on", NMI_ON),
        ("self_match", SELF_MATCH),
        ("report", REPORTS),
    ):
        assert typing.get_args(hints[key]) == names, key


def test_report_best_each_takes_every_metric_at_its_own_best_epoch():
    "report='best_each' (DiVA's and MIC's summaries): each metric's maximum over the evaluated epochs, NaN rows skipped."
    from types import SimpleNamespace
    from dml_nb.evaluation.evaluator import EvalLoop

    history = [
        {"epoch": 0, "test/recall@1": 0.50, "test/nmi": 0.70},
        {"epoch": 1, "test/recall@1": float("nan")},
        {"epoch": 2, "test/recall@1": 0.60, "test/nmi": 0.65},
        {"epoch": 3, "test/recall@1": 0.55, "test/nmi": 0.66},
    ]
    fake = SimpleNamespace(
        latest_metrics={"test/recall@1": 0.55, "test/nmi": 0.66}, eval_sets={"test": None}, history=history, epoch=3
    )
    got = {
        r: EvalLoop.reported_metrics(SimpleNamespace(**vars(fake), evaluator=SimpleNamespace(report=r)))
        for r in ("last", "best", "best_each")
    }
    assert got["last"]["metrics"] == {"test/recall@1": 0.55, "test/nmi": 0.66}
    assert got["best"]["metrics"] == {"test/recall@1": 0.60, "test/nmi": 0.65} and got["best"]["best_epoch"] == 2
    assert got["best_each"]["metrics"] == {"test/recall@1": 0.60, "test/nmi": 0.70}
    assert got["best_each"]["reported"] == "each metric's best epoch" and got["best_each"]["best_epoch"] == 2


def test_train_sampler_reaches_the_run_and_dnc_refuses_class_random(tmp_path, monkeypatch):
    """train.sampler builds the named draw; D&C, whose cluster batches follow its own code (distinct classes), refuses
    class_random and mic, and passes reshuffle on to every cluster's sampler."""
    import typing
    import dml_nb.methods.dnc as dnc_module
    from dml_nb.core.config import TrainConfig
    from dml_nb.training.build import build_learner
    from dml_nb.data.samplers import SAMPLER_DRAWS
    from dml_nb.training.learner import ZERO_GRADS

    assert typing.get_args(typing.get_type_hints(TrainConfig)["sampler"]) == SAMPLER_DRAWS
    assert typing.get_args(typing.get_type_hints(TrainConfig)["zero_grad"]) == ZERO_GRADS
    assert not {"sampler", "zero_grad"} & set(
        config_to_dict(make_config(TINY))["train"]
    )  # defaults: the hash is unchanged
    cfg = make_config({**TINY, "train": {**TINY.get("train", {}), "zero_grad": "zeros"}})
    assert (
        build_learner(cfg, progress=False).train_config.zero_grad == "zeros"
        and config_to_dict(cfg)["train"]["zero_grad"] == "zeros"
    )
    for draw in ("class_random", "reshuffle", "mic"):
        cfg = make_config({**TINY, "train": {**TINY.get("train", {}), "sampler": draw}})
        assert build_learner(cfg, progress=False).sampler.draw == draw
    dnc = lambda draw: make_config(
        {
            **TINY,
            "train": {**TINY.get("train", {}), "sampler": draw},
            "method": {"name": "dnc", "embedding_dim": 8, "num_learners": 2, "recluster_every": 1},
        }
    )
    for draw in ("class_random", "mic"):
        with pytest.raises(ValueError, match="train.sampler: reshuffle"):
            run(dnc(draw), runs_dir=tmp_path, progress=False)
    seen, original = [], dnc_module.cluster_batch_sampler
    monkeypatch.setattr(
        dnc_module, "cluster_batch_sampler", lambda *a, **k: (seen.append(k["draw"]), original(*a, **k))[1]
    )
    run(dnc("reshuffle"), runs_dir=tmp_path, progress=False)
    assert seen and set(seen) == {"reshuffle"}


# --- the CPU thread count: recorded, and kept by a resume (a CPU's count changes a run's last bits) -----------------


def test_a_run_records_its_thread_count_and_leaves_the_process_count_alone(tmp_path):
    import torch

    before = torch.get_num_threads()
    r = run(TINY, runs_dir=tmp_path, progress=False, threads=2)
    assert r.info["threads"] == 2 and torch.get_num_threads() == before
    ck = torch.load(r.run_dir / "checkpoint.pt", weights_only=False)
    assert ck["threads"] == 2
    assert run(TINY, runs_dir=tmp_path / "own", progress=False).info["threads"] == before  # None: this process's count


def test_a_resumed_run_keeps_the_thread_count_it_started_with(tmp_path, capsys):
    "An unfinished run (its checkpoint, no `done`) asked for 1 thread resumes on the 2 its checkpoint records."
    from dml_nb.experiments.experiment import recorded_threads

    r = run(TINY, runs_dir=tmp_path, progress=False, threads=2)
    for name in ("done", "metrics.json"):
        (r.run_dir / name).unlink()
    assert recorded_threads(r.run_dir) == 2
    again = run(TINY, run_dir=r.run_dir, progress=True, threads=1)
    assert again.info["threads"] == 2 and "resumed on the 2 thread(s) it started with, not 1" in capsys.readouterr().err


@pytest.mark.parametrize("bad", [0, -3, 1.5, True, "2"])
def test_a_bad_thread_count_is_refused_before_anything_is_written(tmp_path, bad):
    with pytest.raises(ConfigError, match="threads must be a whole number of at least 1"):
        run(TINY, runs_dir=tmp_path, progress=False, threads=bad)
    assert not any(tmp_path.iterdir())


def test_dml_train_threads(tmp_path, capsys):
    import yaml
    from dml_nb.experiments.cli import main

    (params := tmp_path / "p.yaml").write_text(yaml.safe_dump(TINY))
    with pytest.raises(SystemExit) as e:
        main([str(params), "--threads", "0", "-o", str(tmp_path / "r")])
    assert e.value.code == 2 and "--threads: expected a whole number from 1 to 512; got '0'" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()
    assert main([str(params), "--threads", "2", "-o", str(tmp_path / "r"), "--no-progress"]) == 0
    info = json.loads((tmp_path / "r" / "metrics.json").read_text())
    assert info["threads"] == 2
    # the CPU it ran on: what a run's bit-identity depends on, with the thread count
    assert info["cpu"]["capability"] == torch.backends.cpu.get_cpu_capability() and info["cpu"]["model"]
