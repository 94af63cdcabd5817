"""A run restored from a results folder and trained again for its embeddings or weights keeps the saved numbers in
the run cache. Before, the training's own `metrics.json` replaced them, so on another kind of CPU the next notebook
read that machine's numbers for a committed run (`repro_diva_table4` showed Margin-512 at 38.5 for the committed
37.8 after `repro_diva_fig5` had trained it again). Both paths are probed: `train_again` (a notebook's
`RunResult.embeddings`, `repro.load_learner`) and the launcher's (`clear_restored(keep=True)`, then `dml-train`)."""

import json
from pathlib import Path

import pytest

from dml_nb.core.config import make_config
from dml_nb.experiments.experiment import load_result, run, run_dir_for, train_again
from dml_nb.experiments.results import (
    RESTORED_RECORD,
    RESULTS_ENV,
    TRAINED_AGAIN,
    clear_restored,
    restore_results,
    restored,
    save_result,
)
from dml_nb.training.learner import Learner

from test_reliability import TINY

CFG = {**TINY, "eval": {"metrics": ["recall@1"], "save_embeddings": True}}


@pytest.fixture(autouse=True)
def quiet_env(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg-cache"))
    monkeypatch.delenv(RESULTS_ENV, raising=False)


@pytest.fixture
def restored_run(tmp_path) -> tuple[Path, dict]:
    "A run trained in one cache, saved to a results folder and restored into a second cache: (its folder, its saved metrics)."
    first = run(CFG, runs_dir=tmp_path / "first", progress=False, threads=1)
    save_result(first.run_dir, tmp_path / "results")
    restore_results(tmp_path / "results", tmp_path / "cache")
    run_dir = run_dir_for(make_config(CFG), tmp_path / "cache")
    assert restored(run_dir)
    return run_dir, json.loads((run_dir / "metrics.json").read_text())


@pytest.fixture
def another_machine(monkeypatch):
    "This machine's training measures a little differently from the saved run's (another CPU kind, another thread count)."
    real = Learner.reported_metrics

    def shifted(self):
        out = real(self)
        return {**out, "metrics": {k: v + 0.125 if isinstance(v, float) else v for k, v in out["metrics"].items()}}

    monkeypatch.setattr(Learner, "reported_metrics", shifted)


def check_kept(run_dir: Path, saved: dict) -> None:
    assert json.loads((run_dir / "metrics.json").read_text()) == saved
    assert load_result(run_dir).metrics == saved["metrics"]
    mine = json.loads((run_dir / TRAINED_AGAIN).read_text())["metrics"]
    assert mine != saved["metrics"] and mine["test/recall@1"] == saved["metrics"]["test/recall@1"] + 0.125
    assert (run_dir / "embeddings.pt").exists() and (run_dir / "checkpoint.pt").exists() and not restored(run_dir)
    assert not any((run_dir / a).exists() for a in RESTORED_RECORD.values())


def test_train_again_keeps_the_saved_numbers_in_the_cache(restored_run, another_machine, capsys):
    run_dir, saved = restored_run
    result = train_again(load_result(run_dir))
    check_kept(run_dir, saved)
    assert result.metrics == saved["metrics"]
    err = capsys.readouterr().err
    assert "numbers stay the results folder's" in err and TRAINED_AGAIN in err and "test/recall@1" in err, err
    again = run(CFG, runs_dir=run_dir.parent, progress=False)  # the next reader of the cache: the saved numbers
    assert again.metrics == saved["metrics"]
    assert set(again.embeddings()) >= {"test"}  # and the embeddings of the run trained here, without training again


def test_a_launchers_rebuild_keeps_the_saved_numbers_and_survives_a_kill_before_training(restored_run, another_machine):
    run_dir, saved = restored_run
    assert clear_restored(run_dir, keep=True)
    assert not (run_dir / "done").exists() and (run_dir / RESTORED_RECORD["done"]).exists()
    # killed here (before any training): the next run of the job trains it, and still puts the saved record back
    run(CFG, runs_dir=run_dir.parent, progress=False, threads=1)
    check_kept(run_dir, saved)


def test_a_restored_run_that_fails_its_checks_is_trained_again_with_its_own_numbers(restored_run, another_machine):
    "The other path: a saved record that is not sound is not kept; the run's own numbers replace it."
    run_dir, saved = restored_run
    history = run_dir / "history.csv"
    history.write_text(history.read_text() + "cut\n")  # edited after saving: its checksum fails
    out = run(CFG, runs_dir=run_dir.parent, progress=False, threads=1)
    assert out.metrics["test/recall@1"] == saved["metrics"]["test/recall@1"] + 0.125
    assert not (run_dir / TRAINED_AGAIN).exists()


def test_a_record_aside_edited_before_the_run_finishes_is_not_put_back(restored_run, another_machine, capsys):
    "The copy aside is checked against the checksum its `done` holds: an edited one is dropped, and the run keeps its own."
    run_dir, saved = restored_run
    assert clear_restored(run_dir, keep=True)
    aside = run_dir / RESTORED_RECORD["metrics.json"]
    aside.write_text(aside.read_text().replace('"config_key"', '"config_key" ', 1))  # one byte more
    out = run(CFG, runs_dir=run_dir.parent, progress=False, threads=1)
    assert out.metrics["test/recall@1"] == saved["metrics"]["test/recall@1"] + 0.125
    assert not any((run_dir / a).exists() for a in RESTORED_RECORD.values()) and not (run_dir / TRAINED_AGAIN).exists()
    assert "fail their checksum" in capsys.readouterr().err
