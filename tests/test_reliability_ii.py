"""The probes of issue 35 (Reliability II), each with the one line a user sees and a check that nothing on disk
changed. Every test here fails on the code before the issue was fixed (checked against that commit) and passes now.

A run never writes into a folder it does not own, never adopts another config's results, refuses out-of-range
values before anything is written, keeps dataset paths inside their root, and the reproduction notebooks never
write over the committed figures."""
import json
import math
import os
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from dml_nb.config import ConfigError, RANGES, _numeric_fields, load_config, make_config
from dml_nb.experiment import run

from test_reliability import TINY, cli, cub, one_line_error, snapshot   # noqa: F401 (fixtures below)
from test_reliability import image_cache, params                        # noqa: F401


# 1. -o into a folder that is not a run folder -------------------------------------------------------------------------

def test_o_into_a_users_folder_is_refused_and_nothing_is_changed(tmp_path, params, capsys):
    mine = tmp_path / "mine"; mine.mkdir()
    (mine / "config.yaml").write_text("my: own notes\n"); (mine / "notes.txt").write_text("do not touch\n")
    before = snapshot(mine)
    code, _, err = cli(capsys, params, "-o", mine, "--no-progress")
    assert code == 2 and "is not empty and not a dml_nb run folder (it holds notes.txt" in one_line_error(err)
    assert snapshot(mine) == before
    # results-like files and a temporary the run did not write: none replaced, none deleted
    other = tmp_path / "other"; other.mkdir()
    (other / "history.csv").write_text("epoch\n1\n"); (other / "metrics.json").write_text("{}")
    (other / ".scratch.tmp").write_text("mine")
    before = snapshot(other)
    code, _, err = cli(capsys, params, "-o", other, "--no-progress")
    assert code == 2 and ".scratch.tmp" in one_line_error(err) and snapshot(other) == before
    # a config.yaml alone that dml-train did not write is not taken over either
    alone = tmp_path / "alone"; alone.mkdir(); (alone / "config.yaml").write_text("seed: 99\n")
    code, _, err = cli(capsys, params, "-o", alone, "--no-progress")
    assert code == 2 and "holds a config.yaml that dml-train did not write" in one_line_error(err)
    assert (alone / "config.yaml").read_text() == "seed: 99\n"
    # an empty folder is used
    empty = tmp_path / "empty"; empty.mkdir()
    assert cli(capsys, params, "-o", empty, "--no-progress")[0] == 0 and (empty / "done").exists()


# 3. a run folder proves which config it holds ---------------------------------------------------------------------------

def test_a_finished_run_without_its_config_yaml_is_not_adopted_by_another_config(tmp_path, params, capsys):
    run_dir = tmp_path / "run"
    assert cli(capsys, params, "-o", run_dir, "--no-progress")[0] == 0
    assert json.loads((run_dir / "metrics.json").read_text())["config_key"]
    (run_dir / "config.yaml").unlink()
    before = snapshot(run_dir)
    code, _, err = cli(capsys, params, "-o", run_dir, "--set", "train.lr=0.5", "--no-progress")
    assert code == 2 and "holds a finished run of a different config (its metrics.json" in one_line_error(err)
    assert snapshot(run_dir) == before
    # the run's own config still finds it (and gets its config.yaml back)
    code, out, err = cli(capsys, params, "-o", run_dir, "--no-progress")
    assert code == 0, err
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["train"]["lr"] == TINY["train"]["lr"]


def test_a_planted_config_yaml_does_not_make_a_run_another_configs(tmp_path, params, capsys):
    a, b = tmp_path / "a", tmp_path / "b"
    assert cli(capsys, params, "-o", a, "--no-progress")[0] == 0
    assert cli(capsys, params, "-o", b, "--set", "train.lr=0.5", "--no-progress")[0] == 0
    (a / "config.yaml").write_bytes((b / "config.yaml").read_bytes())        # B's config.yaml planted in A's folder
    before = snapshot(a)
    code, _, err = cli(capsys, params, "-o", a, "--set", "train.lr=0.5", "--no-progress")
    assert code == 2 and "holds a finished run of a different config" in one_line_error(err)
    assert snapshot(a) == before
    # an unfinished run: its checkpoint holds the proof
    (a / "done").unlink()
    before = snapshot(a)
    code, _, err = cli(capsys, params, "-o", a, "--set", "train.lr=0.5", "--no-progress")
    assert code == 2 and "holds a run of a different config (its checkpoint.pt" in one_line_error(err)
    assert snapshot(a) == before


# 4. every numeric option's range, before anything is written ------------------------------------------------------------

@pytest.mark.parametrize("override,expected", [
    ("train.lr=-1", "train.lr: -1.0; expected a finite number > 0"),
    ("train.lr=.nan", "train.lr: nan; expected a finite number > 0"),
    ("train.lr=.inf", "train.lr: inf; expected a finite number > 0"),
    ("train.weight_decay=-1", "train.weight_decay: -1.0; expected a finite number >= 0"),
    ("train.grad_clip=-.inf", "train.grad_clip: -inf"),
    ("seed=-1", "seed: -1; expected an integer from 0 to 4294967295"),
    ("seed=100000000000000000000000", "seed: 100000000000000000000000; expected an integer from 0"),
    ("eval.batch_size=0", "eval.batch_size: 0; expected a positive integer"),
])
def test_out_of_range_values_are_one_line_and_write_nothing(tmp_path, params, capsys, override, expected):
    run_dir = tmp_path / "run"
    code, _, err = cli(capsys, params, "-o", run_dir, "--set", override, "--no-progress")
    assert code == 2 and f"bad value for {expected}" in one_line_error(err)
    assert not run_dir.exists()


def test_every_numeric_option_has_its_range_in_the_schema():
    assert set(_numeric_fields()) - set(RANGES) == set()
    for key, kind in _numeric_fields().items():       # and no float passes as nan or inf
        sec, _, k = key.rpartition(".")
        for bad in (math.nan, math.inf):
            with pytest.raises(ConfigError, match=f"bad value for {key}"):
                make_config({sec: {k: bad}} if sec else {k: bad})


# 7. tracebacks where one line and exit 2 are promised ------------------------------------------------------------------

def test_o_at_a_file_or_below_one_is_one_line(tmp_path, params, capsys):
    f = tmp_path / "afile"; f.write_text("mine\n")
    for target in (f, f / "run", f / "a" / "b"):
        code, _, err = cli(capsys, params, "-o", target, "--no-progress")
        assert code == 2 and "is a file, not a folder: choose a new folder with -o" in one_line_error(err)
    assert f.read_text() == "mine\n"


def test_a_truncated_or_crafted_checkpoint_is_one_line_with_cli_advice(tmp_path, params, capsys):
    run_dir = tmp_path / "run"
    assert cli(capsys, params, "-o", run_dir, "--no-progress")[0] == 0
    (run_dir / "done").unlink()
    ck = run_dir / "checkpoint.pt"
    whole = ck.read_bytes()
    ck.write_bytes(whole[: len(whole) // 2])                               # truncated
    before = snapshot(run_dir)
    code, _, err = cli(capsys, params, "-o", run_dir, "--no-progress")
    assert code == 2 and "cannot read checkpoint" in one_line_error(err)
    assert "delete it to start the run over, or train into a new folder (-o)" in err and "resume=False" not in err
    assert snapshot(run_dir) == before
    torch.save({"format": 1, "anything": torch.zeros(2)}, ck)              # crafted: a checkpoint of no config
    before = snapshot(run_dir)
    code, _, err = cli(capsys, params, "-o", run_dir, "--no-progress")
    assert code == 2 and "is not a whole learner checkpoint (it has no epoch, step" in one_line_error(err)
    assert snapshot(run_dir) == before
