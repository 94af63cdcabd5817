"""A run is composed once: its entry point builds and checks one `Config`, and everything below receives that object.
Counted with a profile hook on `make_config`'s code, so that a call through any imported name is seen."""

import sys
from pathlib import Path

import pytest

from dml_nb.core.config import as_config, config_to_dict, load_config, make_config
from dml_nb.experiments.experiment import run

ROOT = Path(__file__).resolve().parents[1]
TINY = [
    "data.images_per_class=4",
    "train.epochs=1",
    "train.batch_size=16",
    "train.batches_per_epoch=2",
    "eval.metrics=[recall@1]",
]


class Calls:
    "How often `make_config` ran inside the block."

    def __init__(self):
        self.n, self.code = 0, make_config.__code__

    def __enter__(self):
        self.before = sys.getprofile()

        def hook(frame, event, arg):
            if event == "call" and frame.f_code is self.code:
                self.n += 1

        sys.setprofile(hook)
        return self

    def __exit__(self, *exc):
        sys.setprofile(self.before)


def test_a_stored_parameter_file_is_composed_once(tmp_path):
    "`run(load_config(file))`: the one `make_config` is `load_config`'s; `run` and everything under it rebuild nothing."
    with Calls() as c:
        cfg = load_config(ROOT / "params" / "train" / "shapes_baseline.yaml", overrides=TINY)
        result = run(cfg, runs_dir=tmp_path, progress=False)
    assert c.n == 1, f"make_config ran {c.n} times for one run"
    assert 0 <= result.metrics["test/recall@1"] <= 1
    with Calls() as c:  # a finished run, read back: still nothing rebuilt
        run(cfg, runs_dir=tmp_path, progress=False)
    assert c.n == 0


def test_a_mapping_is_checked_once_at_the_entry_point(tmp_path):
    raw = config_to_dict(load_config(ROOT / "params" / "train" / "shapes_baseline.yaml", overrides=TINY))
    with Calls() as c:
        run(raw, runs_dir=tmp_path, progress=False)
    assert c.n == 1


def test_as_config_hands_a_config_down_and_checks_a_mapping():
    cfg = make_config({"train": {"epochs": 2}})
    assert as_config(cfg) is cfg
    assert as_config({"train": {"epochs": 2}}) == cfg
    with pytest.raises(Exception, match="train.epochs"):
        as_config({"train": {"epochs": -1}})
