"""The probes of issue 13 (reliability), each with the message a user sees and a check that nothing already on disk
changed. Every test here fails on the code before the issue was fixed (checked against that commit) and passes now.

Damaged data fails loudly, bad options fail before anything is written (and fast, without importing torch), one
writer per run directory, unreadable images are found up front, disk errors are one line, a diverged run keeps a
sane checkpoint, orphan temporary files are cleaned, and Recall@k breaks distance ties by index."""

import errno
import hashlib
import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch
import yaml

from dml_nb.core.base import RunLockedError
from dml_nb.core.registry import LOSSES, METHODS, MINERS, BACKBONES, _static_registrations
from dml_nb.experiments.experiment import run, run_dir_for
from dml_nb.core.config import ConfigError, config_to_dict, load_config, make_config
from dml_nb.experiments.cli import main
from dml_nb.data.formats import (
    DatasetFormatError,
    DatasetSizeWarning,
    read_cars196,
    read_cub200,
    read_index,
    read_inshop,
    read_sop,
    read_vehicleid,
)
from dml_nb.data.checks import write_fake_dataset
from dml_nb.training.checkpoint import load_checkpoint
from dml_nb.evaluation.metrics import map_at_r, recall_at_k

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}

TINY = {
    "data": {"name": "shapes", "images_per_class": 4, "size": 32},
    "model": {"backbone": "small_cnn", "options": {"width": 4, "feature_dim": 16}},
    "method": {"name": "baseline", "embedding_dim": 8, "loss": "triplet", "miner": "semihard"},
    "train": {"epochs": 1, "batch_size": 16, "samples_per_class": 4, "batches_per_epoch": 2, "lr": 1e-3},
    "eval": {"metrics": ["recall@1"], "save_embeddings": False},
}


def snapshot(folder: Path) -> dict:
    "Every file under `folder` (hidden ones included) with its content hash: what 'nothing changed' compares."
    folder = Path(folder)
    if not folder.exists():
        return {}
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def cli(capsys, *argv) -> tuple[int, str, str]:
    "dml-train in this process: (exit status, stdout, stderr)."
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def one_line_error(err: str) -> str:
    assert err.startswith("dml-train: error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    return err


@pytest.fixture
def params(tmp_path) -> Path:
    p = tmp_path / "tiny.yaml"
    p.write_text(yaml.safe_dump(TINY))
    return p


@pytest.fixture(autouse=True)
def image_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg-cache"))
    monkeypatch.delenv("DML_DATA", raising=False)


# 1. damaged index files ---------------------------------------------------------------------------------------------


def cub(tmp_path, n_classes=6, per_class=3) -> Path:
    return write_fake_dataset("cub200", tmp_path / "cub", n_classes=n_classes, per_class=per_class) / "CUB_200_2011"


def test_cub_images_txt_cut_in_half_is_an_error_not_a_moved_split(tmp_path):
    root = cub(tmp_path)
    lines = (root / "images.txt").read_text().splitlines(keepends=True)
    (root / "images.txt").write_text("".join(lines[:9]))
    before = snapshot(root)
    with pytest.raises(
        DatasetFormatError,
        match=r"images.txt and .*image_class_labels.txt must list the same image ids: "
        r"9 id\(s\) of image_class_labels.txt are not in images.txt",
    ):
        read_cub200(root, "train")
    assert snapshot(root) == before
    # both files cut the same way (a deliberate subset): the split still comes from classes.txt (1-3 train), it does
    # not move to the first half of the classes that are left (class 1 only, as before)
    labels = (root / "image_class_labels.txt").read_text().splitlines(keepends=True)
    (root / "image_class_labels.txt").write_text("".join(labels[:9]))
    paths, raw = read_cub200(root, "train")
    assert sorted(set(raw.tolist())) == [1, 2, 3] and len(paths) == 9
    with pytest.raises(DatasetFormatError, match="split 'test' lists no images"):
        read_index("cub200", root.parent, "test")


def test_garbled_images_txt_names_file_line_and_expectation(tmp_path):
    root = cub(tmp_path)
    text = (root / "images.txt").read_text()
    (root / "images.txt").write_text(text.replace("5 002.Bird_2/Bird_2_0001.jpg", "5 002.Bird_2/Bird_2_0001.jpg 7 x"))
    with pytest.raises(
        DatasetFormatError,
        match=r"images.txt, line 5: expected 2 fields '<image_id> <image_name>', "
        r"got '5 002.Bird_2/Bird_2_0001.jpg 7 x'",
    ):
        read_cub200(root, "train")
    (root / "images.txt").write_bytes(b"\xff\xfe\x00garbage\x80\x81")
    with pytest.raises(DatasetFormatError, match="images.txt is not a text file"):
        read_cub200(root, "train")


def test_missing_lines_in_image_class_labels_name_both_files(tmp_path):
    root = cub(tmp_path, n_classes=20, per_class=3)
    lines = (root / "image_class_labels.txt").read_text().splitlines(keepends=True)
    (root / "image_class_labels.txt").write_text("".join(lines[:43] + lines[50:]))  # ids 44-50 gone (was KeyError: 44)
    with pytest.raises(
        DatasetFormatError,
        match=r"7 id\(s\) of images.txt have no line in image_class_labels.txt "
        r"\(first: image 44, images.txt line 44\)",
    ):
        read_cub200(root, "test")


def test_empty_ebay_train_names_the_file(tmp_path):
    root = write_fake_dataset("sop", tmp_path / "sop", n_classes=4, per_class=2)
    (root / "Ebay_train.txt").write_text("")  # was IndexError
    with pytest.raises(
        DatasetFormatError,
        match=r"Ebay_train.txt is empty; expected the header "
        r"'image_id class_id super_class_id path'",
    ):
        read_sop(root, "train")
    (root / "Ebay_train.txt").write_text("image_id class_id super_class_id path\n")
    with pytest.raises(DatasetFormatError, match="Ebay_train.txt has a header but no images"):
        read_sop(root, "test")


def test_index_files_are_checked_against_each_other(tmp_path):
    root = cub(tmp_path)
    labels = (root / "image_class_labels.txt").read_text()
    (root / "image_class_labels.txt").write_text(labels.replace("\n4 2\n", "\n4 5\n"))
    with pytest.raises(
        DatasetFormatError,
        match=r"images.txt, line 4: image 4 lies in folder '002.Bird_2', but "
        r"image_class_labels.txt \(line 4\) gives class 5",
    ):
        read_cub200(root, "train")
    sop = write_fake_dataset("sop", tmp_path / "sop", n_classes=4, per_class=2)
    test = (sop / "Ebay_test.txt").read_text()
    (sop / "Ebay_test.txt").write_text(test.replace(" 3 1 ", " 2 1 ", 1))
    with pytest.raises(DatasetFormatError, match="class 2 is in both .*Ebay_train.txt .* and .*Ebay_test.txt"):
        read_sop(sop, "train")
    shop = write_fake_dataset("inshop", tmp_path / "shop", n_classes=4, per_class=2)
    f = shop / "Eval/list_eval_partition.txt"
    f.write_text(f.read_text().replace("id_00000001  train", "id_00000003  train", 1))
    with pytest.raises(DatasetFormatError, match="item id_00000003 is a training item .* and a query item"):
        read_inshop(shop, "gallery")
    veh = write_fake_dataset("vehicleid", tmp_path / "veh", n_classes=8, per_class=2)
    f = veh / "train_test_split/test_list_800.txt"
    f.write_text(f.read_text() + "00000001 1\n")
    with pytest.raises(
        DatasetFormatError,
        match="test_list_800.txt, line 5: image name '00000001' appears again|vehicle 1 is also in train_list.txt",
    ):
        read_vehicleid(veh, "test800")


def size_warnings(fn, *args) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fn(*args)
    return [str(w.message) for w in caught if w.category is DatasetSizeWarning]


def test_full_releases_are_checked_against_the_official_sizes(tmp_path):
    assert size_warnings(read_cub200, cub(tmp_path), "train") == []  # a small tree is not a full release
    full = write_fake_dataset("cub200", tmp_path / "full", n_classes=200, per_class=1, size=8)
    assert [m[:120] for m in size_warnings(read_cub200, full, "test")] == [
        f"CUB-200-2011 at {full / 'CUB_200_2011'}: the number of images in images.txt is 200 but the official release "
        "has 11,788"[:120]
    ]
    # SOP: the two files use the 12 super-classes of the release
    sop = write_fake_dataset("sop", tmp_path / "sop", n_classes=12, per_class=1)
    for name in ("Ebay_train.txt", "Ebay_test.txt"):
        rows = (sop / name).read_text().splitlines()
        (sop / name).write_text(
            "\n".join([rows[0]] + [f"{r.split()[0]} {r.split()[1]} {r.split()[1]} {r.split()[3]}" for r in rows[1:]])
            + "\n"
        )
    msgs = size_warnings(read_sop, sop, "train")
    assert any("Ebay_train.txt is 6 but the official release has 59,551" in m for m in msgs), msgs
    assert any("classes in Ebay_test.txt is 6 but the official release has 11,316" in m for m in msgs), msgs
    # In-Shop: the first line declares the release's count
    shop = write_fake_dataset("inshop", tmp_path / "shop", n_classes=4, per_class=2)
    f = shop / "Eval/list_eval_partition.txt"
    f.write_text("52712" + f.read_text()[f.read_text().index("\n") :])
    msgs = size_warnings(read_inshop, shop, "train")
    assert any("declares 52,712 images but 8 are listed" in m for m in msgs)
    assert any("the number of query images is 2 but the official release has 14,218" in m for m in msgs)
    # CARS196: the 196 class names of the release
    cars = write_fake_dataset("cars196", tmp_path / "cars", n_classes=196, per_class=1, size=8)
    assert any(
        "annotations in cars_annos.mat is 196 but the official release has 16,185" in m
        for m in size_warnings(read_cars196, cars, "train")
    )
    # VehicleID: a train list of a release's size; the test lists hold 800 / 1,600 / 2,400 vehicles
    veh = write_fake_dataset("vehicleid", tmp_path / "veh", n_classes=8, per_class=2)
    (veh / "train_test_split/train_list.txt").write_text("".join(f"t{i:07d} {100 + i}\n" for i in range(13_000)))
    assert any(
        "vehicles in test_list_1600.txt is 4 but the official release has 1,600" in m
        for m in size_warnings(read_vehicleid, veh, "test1600")
    )


# 2. (runs that learn nothing: tests/test_experiment.py and tests/test_learner.py) -------------------------------------

# 3. one writer per run directory -------------------------------------------------------------------------------------


def hold_lock(run_dir: Path, seconds: float) -> subprocess.Popen:
    "Another process holding the run directory's lock, as a dml-train in progress does."
    code = (
        f"import time\nfrom dml_nb.core.base import lock_dir\nwith lock_dir({str(run_dir)!r}):\n"
        f"    print('locked', flush=True); time.sleep({seconds})"
    )
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=ENV)
    assert p.stdout.readline().strip() == "locked"
    return p


def test_a_second_process_on_the_same_run_directory_stops_and_names_the_holder(tmp_path, params, capsys):
    run_dir = tmp_path / "run"
    holder = hold_lock(run_dir, 60)
    try:
        before = snapshot(run_dir)
        code, _, err = cli(capsys, params, "-o", run_dir, "--no-progress")
        assert code == 2
        one_line_error(err)
        assert f"{run_dir} is in use by pid {holder.pid} on host {os.uname().nodename} since 20" in err
        assert "--wait" in err
        assert snapshot(run_dir) == before  # nothing written beside the holder
        with pytest.raises(RunLockedError, match=f"pid {holder.pid}"):
            run(TINY, run_dir=run_dir, progress=False)
    finally:
        holder.kill()
        holder.wait()


def test_wait_waits_for_the_holder_then_trains(tmp_path, params, capsys):
    run_dir = tmp_path / "run"
    holder = hold_lock(run_dir, 3)
    t0 = time.time()
    code, out, err = cli(capsys, params, "-o", run_dir, "--wait")
    assert code == 0 and time.time() - t0 > 1 and "waiting for it" in err, err
    assert (run_dir / "done").exists()
    holder.wait()


def test_a_lock_left_by_a_killed_process_is_taken_over(tmp_path, params, capsys):
    run_dir = tmp_path / "run"
    holder = hold_lock(run_dir, 60)
    with pytest.raises(RunLockedError):
        run(TINY, run_dir=run_dir, progress=False)
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    code, _, _ = cli(capsys, params, "-o", run_dir, "--no-progress")  # no lock to clear by hand
    assert code == 0 and (run_dir / "done").exists()


def test_the_reproduction_harness_waits_for_the_lock(tmp_path):
    from dml_nb.reproduction.repro import run_one

    run_dir = run_dir_for(make_config(TINY), tmp_path)
    holder = hold_lock(run_dir, 3)
    t0 = time.time()
    res = run_one(TINY, tmp_path, progress=False)
    assert time.time() - t0 > 1 and res.run_dir == run_dir and (run_dir / "done").exists()
    holder.wait()


# 4. unreadable images ------------------------------------------------------------------------------------------------


@pytest.fixture
def sop_with_a_bad_image(tmp_path):
    root = write_fake_dataset("sop", tmp_path / "sop", n_classes=4, per_class=3)
    bad = sorted((root / "bicycle_final").glob("*.JPG"))[4]
    bad.write_bytes(bad.read_bytes()[:150])  # a JPEG cut short
    return root, bad


def test_check_data_lists_unreadable_images_once_and_caches_the_verdict(
    sop_with_a_bad_image, params, capsys, monkeypatch
):
    root, bad = sop_with_a_bad_image
    args = [params, "--set", "data.name=sop", "--set", f"data.root={root}", "--check-data", "--no-progress"]
    before = snapshot(root)
    code, out, _ = cli(capsys, *args)
    assert code == 2 and f"unreadable: {bad} (" in out and "--set data.on_unreadable=skip" in out, out
    assert "sop at " in out and "train 6 images / 2 classes, test 6 images / 2 classes" in out
    import dml_nb.data.checks as F

    monkeypatch.setattr(F, "_decode", lambda p: pytest.fail("decoded again"))  # the verdict comes from the cache
    code, out2, _ = cli(capsys, *args)
    assert code == 2 and out2 == out
    code, out, _ = cli(capsys, *args, "--set", "data.on_unreadable=skip")
    assert code == 0 and "training leaves them out" in out
    assert snapshot(root) == before


def test_an_unreadable_image_stops_the_run_at_the_start_with_the_cli_fix(
    sop_with_a_bad_image, params, tmp_path, capsys
):
    root, bad = sop_with_a_bad_image
    base = [
        params,
        "--set",
        "data.name=sop",
        "--set",
        f"data.root={root}",
        "--set",
        "model.backbone=small_cnn",
        "--set",
        "data.preset=small",
        "--set",
        "data.size=32",
        "--set",
        "train.batch_size=4",
        "--set",
        "train.samples_per_class=2",
        "--runs-dir",
        tmp_path / "runs",
        "--no-progress",
    ]
    code, _, err = cli(capsys, *base)
    assert code == 2 and "1 of 6 images of sop train cannot be read" in one_line_error(err) and bad.name in err
    assert "--set data.on_unreadable=skip" in err and "skip_unreadable" not in err
    assert not (tmp_path / "runs").exists()  # found before anything was written
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        code, _, err = cli(capsys, *base, "--set", "data.on_unreadable=skip")
    assert code == 0, err


# 5. errors early, in one line, before anything is written ------------------------------------------------------------


def test_unknown_loss_or_miner_is_refused_before_anything_is_written_and_the_fix_then_runs(tmp_path, params, capsys):
    run_dir = tmp_path / "run"
    code, _, err = cli(capsys, params, "-o", run_dir, "--set", "method.loss=tripplet")
    assert code == 2 and "unknown loss (method.loss) 'tripplet'. Did you mean 'triplet'" in one_line_error(err)
    code, _, err = cli(capsys, params, "-o", run_dir, "--set", "method.miner=semi_hard")
    assert code == 2 and "Did you mean 'semihard'" in one_line_error(err)
    code, _, err = cli(capsys, params, "-o", run_dir, "--set", "method.loss_options={margn: 0.1}")
    assert code == 2 and "loss 'triplet' has no option 'margn'. Did you mean 'margin'" in one_line_error(err)
    assert not run_dir.exists()
    run_dir.mkdir()  # what a failed start used to leave:
    (run_dir / "config.yaml").write_text(
        yaml.safe_dump(config_to_dict(make_config({**TINY, "seed": 99})))
    )  # (a whole config)
    code, _, err = cli(capsys, params, "-o", run_dir, "--no-progress")
    assert code == 0, err  # was "holds a run of a different config"


def test_a_run_of_another_config_is_refused_and_left_untouched(tmp_path, params, capsys):
    run_dir = tmp_path / "run"
    assert cli(capsys, params, "-o", run_dir, "--no-progress")[0] == 0
    before = snapshot(run_dir)
    code, _, err = cli(capsys, params, "-o", run_dir, "--set", "seed=3")
    assert code == 2 and "holds a finished run of a different config" in one_line_error(err)
    assert snapshot(run_dir) == before


def test_numbers_in_any_yaml_notation(tmp_path):
    cfg = load_config(overrides=["train.lr=1e-5", "train.weight_decay=4E-4", "train.epochs=1e1"])  # '1e-5' was a str
    assert (cfg.train.lr, cfg.train.weight_decay, cfg.train.epochs) == (1e-5, 4e-4, 10)
    (tmp_path / "p.yaml").write_text("train: {lr: 1e-5, channels_last: off}\n")
    assert load_config(tmp_path / "p.yaml").train.channels_last == "off"  # YAML 1.1 read `off` as False


def test_base_lists_yaml_errors_duplicate_keys_and_zero_epochs(tmp_path):
    (tmp_path / "a.yaml").write_text("train: {epochs: 5, lr: 0.01}\n")
    (tmp_path / "b.yaml").write_text("train: {epochs: 7}\nseed: 2\n")
    (tmp_path / "c.yaml").write_text("base: [a.yaml, b.yaml]\nseed: 3\n")  # was a TypeError
    cfg = load_config(tmp_path / "c.yaml")
    assert (cfg.train.epochs, cfg.train.lr, cfg.seed) == (7, 0.01, 3)
    (tmp_path / "d.yaml").write_text("base: {file: a.yaml}\n")
    with pytest.raises(ConfigError, match=r"d.yaml: 'base:' must be a file name or a list of file names"):
        load_config(tmp_path / "d.yaml")
    (tmp_path / "e.yaml").write_text("seed: 1\ntrain:\n  epochs: [1, 2\n")
    with pytest.raises(ConfigError, match=r"e.yaml, line 4, column 1: while parsing a flow sequence"):
        load_config(tmp_path / "e.yaml")
    (tmp_path / "f.yaml").write_text("train:\n  lr: 0.1\n  epochs: 2\n  lr: 0.5\n")  # silently kept 0.5
    with pytest.raises(
        ConfigError,
        match=r"f.yaml, line 4, column 3: key 'lr' appears twice in one mapping "
        r"\(first on line 2\)",
    ):
        load_config(tmp_path / "f.yaml")
    with pytest.raises(ConfigError, match=r"train.epochs: 0; expected a positive integer"):  # was accepted
        make_config({"train": {"epochs": 0}})


def test_missing_dataset_and_bad_values_are_one_line_for_the_cli_and_leave_no_run_directory(tmp_path, params, capsys):
    runs = tmp_path / "runs"
    code, _, err = cli(capsys, params, "--set", "data.name=cub200", "--runs-dir", runs)
    assert code == 2 and "--set data.root=/path/to/cub200" in one_line_error(err) and "DML_DATA" in err
    code, _, err = cli(
        capsys, params, "--set", "data.name=cub200", "--set", f"data.root={tmp_path / 'nowhere'}", "--runs-dir", runs
    )
    assert code == 2 and "dataset 'cub200' not found at" in one_line_error(err)
    assert "--set data.root=/path/to/cub200" in err and "pass root=" not in err
    code, _, err = cli(capsys, params, "--set", "method.embedding_dim=0", "--runs-dir", runs)
    assert code == 2 and one_line_error(err).startswith("dml-train: error: method 'baseline': ")
    assert not runs.exists()  # was a stray runs/<hash>/config.yaml
    with pytest.raises(ConfigError, match="method 'baseline'"):
        main([str(params), "--set", "method.embedding_dim=0", "--runs-dir", str(runs), "--debug"])


def test_help_and_config_errors_answer_without_importing_torch(tmp_path):
    "`import dml_nb.experiments.experiment` took 21 s on the project's loaded machine, most of it torch, torchvision, sklearn."
    (tmp_path / "bad.yaml").write_text("train: {epochs: 3\nseed: 1\n")
    shapes = ROOT / "params/train/shapes_baseline.yaml"
    code = (
        "import sys, time\nt = time.time()\nfrom dml_nb.experiments.cli import main\n"
        "try: rc = main(sys.argv[1:])\nexcept SystemExit as e: rc = e.code\n"
        "heavy = [m for m in ('torch', 'torchvision', 'sklearn', 'faiss', 'pandas') if m in sys.modules]\n"
        "print('RESULT', rc, heavy, file=sys.stderr)"
    )
    cases = {
        "--help": ["--help"],
        "yaml error": [tmp_path / "bad.yaml"],
        "unknown loss": [shapes, "--set", "method.loss=tripplet", "-o", tmp_path / "r"],
        "epochs 0": [shapes, "--set", "train.epochs=0", "-o", tmp_path / "r"],
        "missing dataset": [shapes, "--set", "data.name=sop", "-o", tmp_path / "r"],
    }
    for name, argv in cases.items():
        t0 = time.time()
        r = subprocess.run([sys.executable, "-c", code, *map(str, argv)], capture_output=True, text=True, env=ENV)
        wall = time.time() - t0
        result = [l for l in r.stderr.splitlines() if l.startswith("RESULT")][-1]
        print(f"{name}: {wall:.2f} s, {result}")
        assert result == f"RESULT {0 if name == '--help' else 2} []", f"{name}: {r.stderr}"
        assert wall < 15, f"{name}: {wall:.1f} s"
    assert not (tmp_path / "r").exists()


def test_disk_full_and_read_only_are_one_line(tmp_path, params, capsys, monkeypatch):
    run_dir = tmp_path / "run"
    assert cli(capsys, params, "-o", run_dir, "--set", "train.epochs=1", "--no-progress")[0] == 0
    more = [params, "-o", run_dir, "--set", "train.epochs=1", "--no-progress"]
    # finish a run whose last writes were lost (its checkpoint proves the config): its first write finds the disk full
    # (resuming it under another config, train.epochs=2, is refused since issue 35)
    (run_dir / "done").unlink()
    (run_dir / "metrics.json").unlink()
    before = snapshot(run_dir)
    import dml_nb.core.base as core

    real = os.fsync

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(core.os, "fsync", full)
    code, _, err = cli(capsys, *more)
    assert code == 1 and "no space left on device (free space there: " in one_line_error(err), err
    assert "cannot write " in err and "enforce fail" not in err
    assert snapshot(run_dir) == before and not [p for p in run_dir.iterdir() if p.name.endswith(".tmp")]

    def read_only(*a, **k):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(core.os, "fsync", real)
    monkeypatch.setattr(core.tempfile, "mkstemp", read_only)
    code, _, err = cli(capsys, *more)
    assert code == 1 and "read-only file system" in one_line_error(err)
    assert snapshot(run_dir) == before


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs needs root")
def test_a_really_full_disk(tmp_path, params, capsys):
    "The same on a real 2 MB file system that fills up during the first checkpoint (torch.save's RuntimeError)."
    mnt = tmp_path / "small"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        (mnt / "filler").write_bytes(b"\0" * (2 * 2**20 - 64 * 1024))
        code, _, err = cli(capsys, params, "-o", mnt / "run", "--set", "model.options.width=16", "--no-progress")
        assert code == 1 and "no space left on device" in one_line_error(err), err
        assert not [p for p in (mnt / "run").iterdir() if p.name.endswith(".tmp")]
    finally:
        subprocess.run(["umount", str(mnt)])


def test_a_diverged_run_stops_and_keeps_a_sane_checkpoint(tmp_path, params, capsys):
    "Adam at lr 1e8 used to finish as a success with infinite weights; the kept checkpoint of a NaN stop held 1e28."
    run_dir = tmp_path / "run"
    code, _, err = cli(
        capsys,
        params,
        "-o",
        run_dir,
        "--set",
        "train.lr=100000000.0",
        "--set",
        "train.epochs=3",
        "--set",
        "method.loss=margin",
        "--set",
        "method.miner=distance_weighted",
        "--no-progress",
    )
    assert code == 1 and "training stopped: the run diverged" in one_line_error(err)
    assert "above the bound 1e+06" in err or "non-finite" in err
    assert not (run_dir / "done").exists()
    if (run_dir / "checkpoint.pt").exists():
        ck = load_checkpoint(run_dir / "checkpoint.pt")
        assert all(
            torch.isfinite(v).all() and v.abs().max() <= 1e6
            for k, v in ck["method"].items()
            if v.is_floating_point() and v.numel() and "running" not in k
        )


# 6. orphan temporary files ---------------------------------------------------------------------------------------------


def test_orphan_temporary_files_are_removed_at_the_next_start(tmp_path, params, capsys):
    run_dir = tmp_path / "run"
    assert cli(capsys, params, "-o", run_dir, "--set", "train.epochs=1", "--no-progress")[0] == 0
    (run_dir / "done").unlink()
    # what a SIGKILL in the middle of atomic_write leaves: an old-style and a new-style temporary
    (run_dir / ".checkpoint.pt.k3j2h1.tmp").write_bytes(b"half a checkpoint")
    (run_dir / f".metrics.json.{os.uname().nodename}-999999.x1y2z3.tmp").write_bytes(b"{")
    assert cli(capsys, params, "-o", run_dir, "--set", "train.epochs=1", "--no-progress")[0] == 0
    assert not [p for p in run_dir.iterdir() if p.name.endswith(".tmp")]


def test_a_write_killed_midway_leaves_a_temporary_that_the_next_start_removes(tmp_path):
    "A real SIGKILL during atomic_write."
    target = tmp_path / "run" / "big.bin"
    code = (
        f"from dml_nb.core.base import atomic_write\nimport time\n"
        f"def slow(f):\n    f.write(b'x' * 1000); f.flush(); print('writing', flush=True); time.sleep(60)\n"
        f"atomic_write({str(target)!r}, slow)"
    )
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=ENV)
    assert p.stdout.readline().strip() == "writing"
    p.send_signal(signal.SIGKILL)
    p.wait()
    left = [q for q in target.parent.iterdir() if q.name.endswith(".tmp")]
    assert len(left) == 1
    from dml_nb.core.base import remove_temp_files

    assert remove_temp_files(target.parent) == left  # a dead process's, without the lock


# 7. Recall@k ties ----------------------------------------------------------------------------------------------------


def test_recall_does_not_depend_on_which_ks_are_asked_for():
    "Exact duplicate embeddings with different labels: R@1 was 0.5067 with ks=(1,) and 0.46 with ks=(1, 2, 4, 8)."
    g = torch.Generator().manual_seed(0)
    x = torch.nn.functional.normalize(torch.randn(50, 16, generator=g), dim=1).repeat_interleave(3, 0)
    y = torch.arange(150) // 3
    y[torch.randperm(150, generator=g)[:50]] += 1000
    first = torch.tensor([min(j for j in range(3 * (i // 3), 3 * (i // 3) + 3) if j != i) for i in range(150)])
    want = (y[first] == y).double().mean().item()  # the tied neighbour with the smaller index
    got = {(b, ks): recall_at_k(x, y, ks=ks, backend=b)[1] for b in ("torch", "faiss") for ks in [(1,), (1, 2, 4, 8)]}
    assert all(v == pytest.approx(want, abs=1e-12) for v in got.values()), got
    assert map_at_r(x, y, backend="torch") == pytest.approx(map_at_r(x, y, backend="faiss"), abs=1e-12)


# the fast config checks read the registries from source: they must agree with the imported classes -------------------


def test_registry_names_and_options_read_from_source_match_the_imported_classes():
    for reg in (LOSSES, MINERS, METHODS, BACKBONES):
        static = _static_registrations(reg._modules, reg.symbol)
        assert static is not None, f"{reg.kind}: the source reading gave up"
        reg._load()
        assert sorted(static) == reg.names(), reg.kind
        for name, spec in static.items():
            if spec is None:  # only a recipe that passes **options on may need importing (e.g. `mic`)
                import inspect

                init = inspect.signature(reg.get(name).__init__).parameters.values()
                assert any(p.kind == p.VAR_KEYWORD for p in init), f"{reg.kind} {name!r}: not readable from source"
                continue
            live = reg.spec(name)
            assert (spec["options"], spec["var_kw"]) == (live["options"], live["var_kw"]), (reg.kind, name)
            for opt, value in spec["defaults"].items():
                if isinstance(value, (str, int, float, bool, type(None))):
                    assert live["defaults"][opt] == value, (reg.kind, name, opt)
    for name in LOSSES.names():
        assert _static_registrations(LOSSES._modules, "LOSSES")[name]["attrs"].get("default_miner") == getattr(
            LOSSES.get(name), "default_miner", None
        ), name
