"""The probes of Reliability IV in the core, data and experiment layers: no planted link is written through, the
image cache sees a file rewritten in place, one bound on the CPU threads of a run whichever path asks for them, and
every mistake in a parameter file, an override or a tool's arguments is one line. Each test is a probe with the line
a user sees; every probe here fails on the code before the issue was fixed (checked against that commit) and passes
now, except those marked as guards (they pass on both and keep the audit's answer true)."""

import json
import os
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from PIL import Image

from dml_nb.core.base import RunLockedError, atomic_write, lock_dir
from dml_nb.core.config import ConfigError, load_config, make_config, read_yaml
from dml_nb.core.params import parse_yaml
from dml_nb.experiments.cli import main as dml_train
from dml_nb.experiments.experiment import RunResult, recorded_threads, run, train_again
from dml_nb.experiments.results import RESULTS_ENV

from test_reliability import TINY
from tool_scripts import tool

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def quiet_env(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg-cache"))
    monkeypatch.delenv("DML_DATA", raising=False)
    monkeypatch.delenv(RESULTS_ENV, raising=False)


def one_line(err: str) -> None:
    assert err.count("\n") == 1 and "Traceback" not in err, err[:2000]


# 1. a planted .lock is never written through ----------------------------------------------------------------------


@pytest.fixture
def victim(tmp_path) -> Path:
    v = tmp_path / "victim.txt"
    v.write_text("another user's notes\n")
    return v


def test_a_lock_file_planted_as_a_link_is_refused_and_its_target_kept(tmp_path, victim):
    folder = tmp_path / "runs" / "r"
    folder.mkdir(parents=True)
    (folder / ".lock").symlink_to(victim)
    with pytest.raises(RunLockedError) as e:
        with lock_dir(folder):
            pass
    msg = str(e.value)
    assert "\n" not in msg and str(folder) in msg and "link" in msg and "remove" in msg, msg
    assert victim.read_text() == "another user's notes\n"


def test_dml_train_into_a_folder_with_a_planted_lock_link_is_one_line_and_the_target_kept(tmp_path, capsys, victim):
    folder = tmp_path / "runs" / "r"
    folder.mkdir(parents=True)
    (folder / ".lock").symlink_to(victim)
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(TINY))
    code = dml_train([str(tmp_path / "p.yaml"), "-o", str(folder), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and str(folder) in err and ".lock" in err, err
    one_line(err)
    assert victim.read_text() == "another user's notes\n"
    assert sorted(p.name for p in folder.iterdir()) == [".lock"]  # nothing trained, nothing written


@pytest.mark.parametrize("kind", ["hardlink", "fifo"])
def test_a_lock_file_that_is_not_a_plain_file_of_ones_own_is_not_truncated(tmp_path, victim, kind):
    folder = tmp_path / "r"
    folder.mkdir()
    if kind == "hardlink":
        os.link(victim, folder / ".lock")
    else:
        os.mkfifo(folder / ".lock")
    with pytest.raises(RunLockedError) as e:
        with lock_dir(folder):
            pass
    assert "\n" not in str(e.value) and str(folder) in str(e.value), str(e.value)
    assert victim.read_text() == "another user's notes\n"


def test_a_plain_lock_file_still_locks_and_records_its_holder(tmp_path):
    "guard: the usual case is unchanged (the record is written, and cleared on release)."
    with lock_dir(tmp_path / "r") as lock:
        assert json.loads((tmp_path / "r" / ".lock").read_text())["pid"] == os.getpid()
        assert lock.fd is not None and os.get_inheritable(lock.fd) is False
    assert (tmp_path / "r" / ".lock").read_text() == ""


@pytest.mark.parametrize("name", ["config.yaml", "metrics.json", "history.csv", "checkpoint.pt", "done"])
def test_atomic_write_replaces_a_planted_link_and_never_writes_through_it(tmp_path, victim, name):
    "guard (the audit): every other file a run writes goes through atomic_write, which replaces a link itself."
    (tmp_path / name).symlink_to(victim)
    atomic_write(tmp_path / name, b"new")
    assert victim.read_text() == "another user's notes\n"
    assert not (tmp_path / name).is_symlink() and (tmp_path / name).read_bytes() == b"new"


# 5. the image cache sees an image rewritten with the same byte size -----------------------------------------------


def test_an_image_rewritten_with_the_same_size_is_cached_again(tmp_path):
    from dml_nb.data.cache import cache_images
    from dml_nb.data.datasets import ImageListDataset, make_transform

    paths = []
    for i in range(3):
        p = tmp_path / "images" / f"{i}.ppm"  # uncompressed: same dimensions, same byte size
        p.parent.mkdir(exist_ok=True)
        Image.fromarray(np.full((20, 24, 3), 40 * i, np.uint8)).save(p)
        paths.append(p)
    ds = ImageListDataset(paths, [0, 0, 1], make_transform("resnet50", train=False), name="toy", split="train")
    first = cache_images(ds, tmp_path / "cache", progress=False)
    assert float(first.load(1).float().mean()) == 40.0
    size, before = paths[1].stat().st_size, paths[1].stat().st_mtime_ns
    Image.fromarray(np.full((20, 24, 3), 255, np.uint8)).save(paths[1])
    os.utime(paths[1], ns=(before + 10**9, before + 10**9))  # a later write: a coarse clock could give the same time
    assert paths[1].stat().st_size == size
    again = cache_images(
        ImageListDataset(paths, [0, 0, 1], make_transform("resnet50", train=False), name="toy", split="train"),
        tmp_path / "cache",
        progress=False,
    )
    assert float(again.load(1).float().mean()) == 255.0


# 6. one bound on the CPU threads of a run -------------------------------------------------------------------------


@pytest.fixture
def set_threads(monkeypatch) -> list:
    "torch.set_num_threads recorded (and never given a count past 512: an earlier version would try 100000)."
    calls, real = [], torch.set_num_threads

    def record(n):
        calls.append(n)
        assert n <= 512, f"torch.set_num_threads({n}) was called"
        real(n)

    monkeypatch.setattr(torch, "set_num_threads", record)
    return calls


@pytest.mark.parametrize("threads", [100000, 513, 0, True, 2.0])
def test_run_with_too_many_threads_is_one_line_before_anything_is_written(tmp_path, set_threads, threads):
    with pytest.raises(ConfigError) as e:
        run(TINY, runs_dir=tmp_path / "runs", progress=False, threads=threads)
    msg = str(e.value)
    assert "\n" not in msg and "512" in msg and repr(threads) in msg, msg
    assert not (tmp_path / "runs").exists() and all(n <= 512 for n in set_threads)


def test_a_recorded_thread_count_past_the_bound_is_refused(tmp_path, set_threads):
    run_dir = tmp_path / "r"
    run_dir.mkdir()
    (run_dir / "metrics.json").write_text(json.dumps({"metrics": {}, "threads": 100000}))
    with pytest.raises(ConfigError) as e:
        recorded_threads(run_dir)
    assert "\n" not in str(e.value) and "metrics.json" in str(e.value) and "512" in str(e.value), str(e.value)
    result = RunResult(tmp_path / "r2", make_config(TINY), {}, [], {"threads": 100000})
    with pytest.raises(ConfigError) as e:  # a results entry's recorded count: train_again runs on it
        train_again(result)
    assert "512" in str(e.value) and "100000" in str(e.value)
    assert all(n <= 512 for n in set_threads)


def test_a_notebooks_thread_count_past_the_bound_is_refused_before_its_first_run(tmp_path, set_threads):
    "A notebook's `output.threads` reaches its runs through `run_one`: refused there, before anything is written."
    from dml_nb.reproduction.repro import run_one

    with pytest.raises(ConfigError) as e:
        run_one(TINY, tmp_path / "runs", progress=False, threads=100000)
    assert "\n" not in str(e.value) and "512" in str(e.value), str(e.value)
    assert not (tmp_path / "runs").exists() and all(n <= 512 for n in set_threads)


@pytest.mark.parametrize("threads", [100000, 0])
def test_a_notebooks_thread_count_past_the_bound_is_refused_when_its_parameters_are_read(tmp_path, threads):
    "`output.threads` is checked by `setup`, with the parameters, before a run or a restore (it was at the first run)."
    from dml_nb.reproduction.notebook import notebook_defaults, setup

    params = dict(notebook_defaults("repro_dnc_fig1"), output={"threads": threads, "runs_dir": str(tmp_path / "runs")})
    with pytest.raises(ValueError) as e:
        setup("repro_dnc_fig1", params)
    msg = str(e.value)
    assert "\n" not in msg and "output.threads" in msg and "512" in msg and str(threads) in msg, msg
    assert not (tmp_path / "runs").exists()


def test_a_run_folder_planted_as_a_link_is_refused_and_its_target_untouched(tmp_path):
    "A run folder that is itself a symbolic link (to another user's folder) is refused before its lock is opened."
    victim = tmp_path / "elsewhere"
    victim.mkdir()
    (victim / "notes.txt").write_text("kept\n")
    runs = tmp_path / "runs"
    runs.mkdir()
    (runs / "r").symlink_to(victim)
    with pytest.raises(RunLockedError) as e:
        with lock_dir(runs / "r"):
            pass
    msg = str(e.value)
    assert "\n" not in msg and "symbolic link" in msg and "remove" in msg, msg
    assert sorted(p.name for p in victim.iterdir()) == ["notes.txt"]  # no .lock written through the link


def test_the_one_thread_bound_is_the_command_lines():
    "guard: dml-train --threads, dml-reproduce --threads and run(threads=...) share one bound."
    from dml_nb.core.base import MAX_THREADS
    from dml_nb.experiments.results import MAX_COUNT

    assert MAX_THREADS == MAX_COUNT == 512


# YAML parameter files -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["sequence", "mapping"])
def test_yaml_nested_500_deep_is_one_line_not_a_recursion_error(tmp_path, kind):
    text = (
        "[" * 500 + "]" * 500
        if kind == "sequence"
        else "".join(" " * i + "a:\n" for i in range(500)) + " " * 500 + "1\n"
    )
    with pytest.raises(ConfigError) as e:
        parse_yaml(text, "deep.yaml")
    msg = str(e.value)
    assert "\n" not in msg and "deep.yaml" in msg and "nested" in msg and "line" in msg, msg[:500]


def test_a_huge_parameter_file_is_refused_by_its_size_before_it_is_read(tmp_path, capsys):
    big = tmp_path / "big.yaml"
    with open(big, "wb") as f:
        f.truncate(100 * 2**20)  # 100 MB (sparse): reading and parsing it would take minutes
    t0 = time.perf_counter()
    with pytest.raises(ConfigError) as e:
        read_yaml(big)
    assert time.perf_counter() - t0 < 1
    msg = str(e.value)
    assert "\n" not in msg and str(big) in msg and "MB" in msg and "at most" in msg, msg
    with pytest.raises(ConfigError):  # a string (dml-reproduce -y, --set) has the same cap
        parse_yaml("a: 1\n" * 300_000, "-y")


def test_yaml_numbers_and_booleans_are_yaml_1_2():
    "guard: the project's reader (dml-reproduce -f/-y use it too): 1e-5 is a float, no/yes/on stay strings."
    assert parse_yaml("a: 1e-5\nb: no\nc: yes\nd: on\ne: 1_000\nf: true\n") == {
        "a": 1e-5,
        "b": "no",
        "c": "yes",
        "d": "on",
        "e": "1_000",
        "f": True,
    }
    bomb = "a: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join([f'*{chr(97 + i)}'] * 10)}]\n" for i in range(7)
    )
    with pytest.raises(ConfigError, match="alias"):
        parse_yaml(bomb, "bomb.yaml")


# backbone and method sizes, the device ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "override,key",
    [
        ("model.width=1000000000", "model.width"),
        ("model.width=0", "model.width"),
        ("model.feature_dim=100000000", "model.feature_dim"),
        ("method.embedding_dim=1000000000", "method.embedding_dim"),
        ("method.embedding_dim=-1", "method.embedding_dim"),
        ("method.embedding_dim=12.5", "method.embedding_dim"),
    ],
)
def test_a_size_past_its_bound_is_one_line_before_the_data_is_built(tmp_path, capsys, override, key):
    with pytest.raises(ConfigError) as e:  # at load: before any data or torch
        load_config(overrides=["model.backbone=small_cnn", override])
    msg = str(e.value)
    assert "\n" not in msg and f"bad value for {key}" in msg and "up to" in msg, msg
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(TINY))
    code = dml_train(
        [str(tmp_path / "p.yaml"), "--runs-dir", str(tmp_path / "runs"), "--set", override, "--no-progress"]
    )
    err = capsys.readouterr().err
    assert code == 2 and key in err, err
    one_line(err)
    assert not (tmp_path / "runs").exists()


def test_the_committed_sizes_are_within_the_bounds():
    "guard: every size a committed run trained with is inside its new bound (the bounds refuse no trained config)."
    from dml_nb.core.config import RANGES, SIZES

    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    seen = set()
    for f in sorted((ROOT / "results").glob("*/config.yaml")):
        c = yaml.load(f.read_text(), Loader=loader)
        for key in SIZES:
            section, option = key.split(".")
            v = (c[section].get("options") or {}).get(option)
            for x in v.values() if isinstance(v, dict) else [v]:
                if x is not None:
                    seen.add(key)
                    assert RANGES[key][0](x), (f, key, x)
    assert {"model.width", "model.feature_dim", "method.embedding_dim"} <= seen, seen


@pytest.mark.parametrize("device", ["foo", "cuda:x", "GPU0", ""])
def test_an_unknown_device_is_one_line_at_load(device):
    with pytest.raises(ConfigError) as e:
        load_config(overrides=[f"train.device={device!r}"])
    msg = str(e.value)
    assert "\n" not in msg and "train.device" in msg and "'cpu'" in msg and "'auto'" in msg, msg


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_cuda_without_a_gpu_is_one_line_before_the_data_is_built(tmp_path, capsys, monkeypatch):
    import dml_nb.experiments.experiment as ex

    def no_data(cfg):
        raise AssertionError("the data was checked before the device")

    monkeypatch.setattr(ex, "check_data", no_data)
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(TINY))
    code = dml_train([str(tmp_path / "p.yaml"), "--runs-dir", str(tmp_path / "runs"), "--set", "train.device=cuda"])
    err = capsys.readouterr().err
    assert code == 2 and "train.device" in err and "cuda" in err and "cpu" in err, err
    one_line(err)
    assert not (tmp_path / "runs").exists()


# an echoed value is cut to 200 characters ---------------------------------------------------------------------------

LONG = "x" * 20000


@pytest.mark.parametrize(
    "override",
    [
        f"data.name={LONG}",
        f"model.backbone={LONG}",
        f"method.name={LONG}",
        f"method.loss={LONG}",
        f"train.optimizer={LONG}",
        f"train.epochs={LONG}",
        f"train.device={LONG}",
        f"train.{LONG}=1",
        f"model.{LONG}=1",
        f"train.schedule={{kind: {LONG}}}",
        f"eval.metrics=[{LONG}]",
        f"data.cache_dir={LONG}",
        f"train=[{', '.join(['1'] * 5000)}]",
        f"{LONG}",
        f"train.epochs=[{LONG}",
    ],
)
def test_an_error_cuts_every_value_it_echoes_to_200_characters(override):
    with pytest.raises(ConfigError) as e:
        load_config(overrides=[override])
    msg = str(e.value)
    assert "\n" not in msg and len(msg) < 1500 and "x" * 201 not in msg and "1, " * 200 not in msg, (
        len(msg),
        msg[:300],
    )


# the tools: one line, exit 2 ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name,argv,says",
    [
        ("set_cost", ["plan.json", "--workers", "0"], "--workers"),
        ("set_cost", ["plan.json", "--workers", "-2"], "--workers"),
        ("flip_rate", ["repro_table3", "--runs-dir", "x", "--threads", "0"], "--threads"),
        ("flip_rate", ["repro_table3", "--runs-dir", "x", "--workers", "0"], "--workers"),
        ("regime_pilot", ["repro_table3", "--threads", "0"], "--threads"),
        ("regime_pilot", ["no_such_notebook", "--print"], "repro_table3"),
        ("regime_defaults", ["no_such_notebook"], "repro_table3"),
    ],
)
def test_a_tool_given_a_bad_count_or_an_unknown_notebook_is_one_line_exit_2(capsys, name, argv, says):
    with pytest.raises(SystemExit) as e:  # before anything runs: the commands these tools start take minutes
        tool(name).main(argv)
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1] if err.strip() else ""
    assert e.value.code == 2 and "Traceback" not in err, err[-2000:]
    assert ": error: " in last and says in last, err[-2000:]  # argparse's usage, then the one line
