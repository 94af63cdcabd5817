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
import pandas as pd
import pytest
import torch
import yaml

from dml_nb.core.config import ConfigError, RANGES, _numeric_fields, load_config, make_config

from test_reliability import TINY, cli, cub, one_line_error, snapshot  # noqa: F401 (fixtures below)
from test_reliability import image_cache, params  # noqa: F401


# 1. -o into a folder that is not a run folder -------------------------------------------------------------------------


def test_o_into_a_users_folder_is_refused_and_nothing_is_changed(tmp_path, params, capsys):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "config.yaml").write_text("my: own notes\n")
    (mine / "notes.txt").write_text("do not touch\n")
    before = snapshot(mine)
    code, _, err = cli(capsys, params, "-o", mine, "--no-progress")
    assert code == 2 and "is not empty and not a dml_nb run folder (it holds notes.txt" in one_line_error(err)
    assert snapshot(mine) == before
    # results-like files and a temporary the run did not write: none replaced, none deleted
    other = tmp_path / "other"
    other.mkdir()
    (other / "history.csv").write_text("epoch\n1\n")
    (other / "metrics.json").write_text("{}")
    (other / ".scratch.tmp").write_text("mine")
    before = snapshot(other)
    code, _, err = cli(capsys, params, "-o", other, "--no-progress")
    assert code == 2 and ".scratch.tmp" in one_line_error(err) and snapshot(other) == before
    # a config.yaml alone that dml-train did not write is not taken over either
    alone = tmp_path / "alone"
    alone.mkdir()
    (alone / "config.yaml").write_text("seed: 99\n")
    code, _, err = cli(capsys, params, "-o", alone, "--no-progress")
    assert code == 2 and "holds a config.yaml that dml-train did not write" in one_line_error(err)
    assert (alone / "config.yaml").read_text() == "seed: 99\n"
    # an empty folder is used
    empty = tmp_path / "empty"
    empty.mkdir()
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
    (a / "config.yaml").write_bytes((b / "config.yaml").read_bytes())  # B's config.yaml planted in A's folder
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


@pytest.mark.parametrize(
    "override,expected",
    [
        ("train.lr=-1", "train.lr: -1.0; expected a finite number > 0"),
        ("train.lr=.nan", "train.lr: nan; expected a finite number > 0"),
        ("train.lr=.inf", "train.lr: inf; expected a finite number > 0"),
        ("train.weight_decay=-1", "train.weight_decay: -1.0; expected a finite number >= 0"),
        ("train.grad_clip=-.inf", "train.grad_clip: -inf"),
        ("seed=-1", "seed: -1; expected an integer from 0 to 4294967295"),
        ("seed=100000000000000000000000", "seed: 100000000000000000000000; expected an integer from 0"),
        ("eval.batch_size=0", "eval.batch_size: 0; expected a positive integer"),
    ],
)
def test_out_of_range_values_are_one_line_and_write_nothing(tmp_path, params, capsys, override, expected):
    run_dir = tmp_path / "run"
    code, _, err = cli(capsys, params, "-o", run_dir, "--set", override, "--no-progress")
    assert code == 2 and f"bad value for {expected}" in one_line_error(err)
    assert not run_dir.exists()


def test_every_numeric_option_has_its_range_in_the_schema():
    assert set(_numeric_fields()) - set(RANGES) == set()
    for key, kind in _numeric_fields().items():  # and no float passes as nan or inf
        sec, _, k = key.rpartition(".")
        for bad in (math.nan, math.inf):
            with pytest.raises(ConfigError, match=f"bad value for {key}"):
                make_config({sec: {k: bad}} if sec else {k: bad})


# 7. tracebacks where one line and exit 2 are promised ------------------------------------------------------------------


def test_o_at_a_file_or_below_one_is_one_line(tmp_path, params, capsys):
    f = tmp_path / "afile"
    f.write_text("mine\n")
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
    ck.write_bytes(whole[: len(whole) // 2])  # truncated
    before = snapshot(run_dir)
    code, _, err = cli(capsys, params, "-o", run_dir, "--no-progress")
    assert code == 2 and "cannot read checkpoint" in one_line_error(err)
    assert "delete it to start the run over, or train into a new folder (-o)" in err and "resume=False" not in err
    assert snapshot(run_dir) == before
    torch.save({"format": 1, "anything": torch.zeros(2)}, ck)  # crafted: a checkpoint of no config
    before = snapshot(run_dir)
    code, _, err = cli(capsys, params, "-o", run_dir, "--no-progress")
    assert code == 2 and "is not a whole learner checkpoint (it has no epoch, step" in one_line_error(err)
    assert snapshot(run_dir) == before


# 2, 8, 9. the reproduction notebooks ------------------------------------------------------------------------------------

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def project(tmp_path, monkeypatch):
    "A project folder with repro_table3's notebook, outside the test mode (as a user's papermill run sees it)."
    import dml_nb.reproduction.notebook as N
    import dml_nb.reproduction.repro as R

    (tmp_path / "settings.ini").write_text("[DEFAULT]\nlib_name = dml_nb\n")
    (tmp_path / "nbs").mkdir()
    (tmp_path / "nbs" / "repro_table3.ipynb").write_bytes((ROOT / "nbs" / "repro_table3.ipynb").read_bytes())
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(R, "in_test", lambda: False)
    monkeypatch.setattr(N, "in_test", lambda: False)
    import tqdm.auto

    monkeypatch.setattr(tqdm.auto, "tqdm", tqdm.auto.tqdm)  # restored after a test that sets text bars
    return tmp_path


def table3_params(**changes) -> dict:
    from dml_nb.reproduction.notebook import notebook_defaults

    return {**notebook_defaults("repro_table3"), "output": {"progress": False}, **changes}


def test_a_users_reproduction_run_never_writes_the_committed_figures(project):
    from dml_nb.reproduction.notebook import setup

    nb = setup("repro_table3", table3_params(config={"train": {"epochs": 1}}, seeds=[0]))
    assert nb.figures == project / "figures" / "local-config-train_epochs_1-seeds-0"  # was figures/ itself
    assert setup("repro_table3", table3_params()).figures == project / "figures" / "local"  # the README's command
    assert setup("repro_table3", table3_params(rows={"M": {"name": "baseline"}})).figures.name.startswith("local-rows-")
    given = project / "elsewhere"
    assert setup("repro_table3", table3_params(output={"figures_dir": str(given)})).figures == given
    assert not list((project / "figures").glob("*.*"))  # nothing in figures/ itself


def test_dml_reproduce_alone_names_figures(project, monkeypatch):
    import papermill
    from dml_nb.reproduction.reproduce import reproduce

    seen = []
    monkeypatch.setattr(papermill, "execute_notebook", lambda nb, out, parameters, **kw: seen.append(parameters))
    reproduce(["repro_table3"], root=project, progress=False, write_committed=True)
    assert seen == [
        {"output": {"progress": False, "results": False, "figures_dir": str(project / "figures")}}
    ]  # restored by dml-reproduce itself
    reproduce(["repro_table3"], root=project, progress=False, force=True)  # without --write-committed
    assert seen[1] == {"output": {"progress": False, "results": False}}  # the notebook's own figures/local/


@pytest.mark.parametrize(
    "change,expected",
    [
        (
            {"seeds": "abc"},
            "the parameter 'seeds' must be a non-empty list of integers from 0 to 4294967295, e.g. [0, 1, 2]; got 'abc'",
        ),
        ({"seeds": []}, "the parameter 'seeds' must be a non-empty list of integers"),
        ({"seeds": [0, -1]}, "got [0, -1]"),
        ({"seed": [1]}, "unknown parameter(s) 'seed'; the parameters of repro_table3 are: dataset, config, seeds,"),
    ],
)
def test_reproduction_parameters_are_checked_in_setup(project, capfd, change, expected):
    from dml_nb.reproduction.notebook import setup

    with pytest.raises(ValueError) as e:
        setup("repro_table3", table3_params(**change))
    assert expected in str(e.value)
    err = capfd.readouterr().err
    assert err.startswith("repro_table3: error: ") and err.count("\n") == 1 and expected in err
    assert not (project / "figures").exists() and not (project / "runs").exists()


def test_a_figures_dir_that_cannot_be_written_stops_in_setup(project, tmp_path):
    from dml_nb.reproduction.notebook import setup

    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    target = "/proc" if os.geteuid() == 0 else str(locked)  # root writes anywhere but /proc
    with pytest.raises(ValueError, match=f"cannot write to {target}"):
        setup("repro_table3", table3_params(output={"figures_dir": target}))


def test_a_paper_scale_run_without_its_data_stops_before_training(project, capfd):
    from dml_nb.reproduction.notebook import setup

    raw = yaml.safe_load((ROOT / "params" / "repro_table3" / "cub200.yaml").read_text())
    with pytest.raises(
        ConfigError, match=r"data.name is 'cub200', a dataset on disk, but neither data.root nor \$DML_DATA"
    ):
        setup("repro_table3", table3_params(**raw))
    err = capfd.readouterr().err
    assert err.startswith("repro_table3: error: data.name is 'cub200'") and err.count("\n") == 1
    assert not (project / "figures").exists() and not (project / "runs").exists()  # was an empty table and figure


def test_progress_of_a_papermill_run_reaches_the_terminal_not_the_notebook(tmp_path):
    import nbformat
    import subprocess
    import sys

    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_code_cell(
            "import tqdm.auto\nfrom dml_nb.reproduction.notebook import terminal_bars\nbefore = tqdm.auto.tqdm\n"
            "with terminal_bars():\n    for i in tqdm.auto.tqdm(range(3), desc='runs'): pass\n"
            "    bar = tqdm.auto.tqdm(total=0); bar.close()\nassert tqdm.auto.tqdm is before  # restored after the run"
        ),
    ]  # the learner's bar starts at total=0
    nbformat.write(nb, tmp_path / "in.ipynb")
    env = {k: v for k, v in os.environ.items() if k not in ("JPY_SESSION_NAME", "VSCODE_PID", "PYTEST_CURRENT_TEST")}
    env["PYTHONPATH"] = str(ROOT)
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "papermill",
            "--no-progress-bar",
            "-k",
            "python3",
            str(tmp_path / "in.ipynb"),
            str(tmp_path / "out.ipynb"),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr
    assert "runs: 100%|" in p.stderr and "3/3" in p.stderr
    outputs = [o for c in nbformat.read(tmp_path / "out.ipynb", 4).cells for o in c.get("outputs", [])]
    assert not [o for o in outputs if "it/s" in json.dumps(o) or "it [" in json.dumps(o)], outputs


# 5. an image damaged in place; a decode failure during training --------------------------------------------------------


def sop(tmp_path):
    from dml_nb.data.checks import write_fake_dataset

    return write_fake_dataset("sop", tmp_path / "sop", n_classes=4, per_class=3)


def damage_in_place(path: Path) -> None:
    "Rewrite `path` with garbage of the same size and set its modification time back, as the issue's probe did."
    st = path.stat()
    path.write_bytes(b"\0" * st.st_size)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert path.stat().st_size == st.st_size and path.stat().st_mtime_ns == st.st_mtime_ns


def test_check_data_finds_an_image_damaged_in_place_with_its_size_and_mtime_kept(tmp_path, params, capsys):
    root = sop(tmp_path)
    args = [params, "--set", "data.name=sop", "--set", f"data.root={root}", "--check-data", "--no-progress"]
    code, out, _ = cli(capsys, *args)
    assert code == 0 and "every image decodes" in out
    bad = sorted((root / "bicycle_final").glob("*.JPG"))[2]
    damage_in_place(bad)
    code, out, _ = cli(capsys, *args)
    assert code == 2 and f"unreadable: {bad} (" in out, out  # was "every image decodes" (the cache)


SOP_RUN = [
    "--set",
    "data.name=sop",
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
    "--set",
    "eval.metrics=[recall@1]",
    "--no-progress",
]


def test_an_image_that_stops_decoding_after_the_check_follows_on_unreadable(tmp_path, params, capsys, monkeypatch):
    root = sop(tmp_path)
    bad = sorted((root / "bicycle_final").glob("*.JPG"))[1]  # a training image (class 1)
    bad.write_bytes(bad.read_bytes()[:150])
    import dml_nb.data.datasets

    monkeypatch.setattr(
        dml_nb.data.datasets, "check_images", lambda *a, **k: []
    )  # damaged after the check at the start
    base = [params, "--set", f"data.root={root}", *SOP_RUN]
    code, _, err = cli(capsys, *base, "-o", tmp_path / "a")
    assert code == 2 and "1 of 6 images of sop train cannot be read: " in one_line_error(err)  # was a traceback
    assert str(bad) in err and "--set data.on_unreadable=skip" in err
    with pytest.warns(UserWarning, match=f"sop train: {bad} cannot be read .*left out \\(data.on_unreadable: skip\\)"):
        code, _, err = cli(capsys, *base, "-o", tmp_path / "b", "--set", "data.on_unreadable=skip")
    assert code == 0, err  # was the same traceback


# 6. dataset paths stay inside their root; 7. an index file that is a folder ----------------------------------------------


def outside(tmp_path) -> Path:
    f = tmp_path / "elsewhere" / "x.jpg"
    f.parent.mkdir()
    from PIL import Image

    Image.new("RGB", (24, 24)).save(f)
    return f


def test_an_index_line_leading_outside_the_root_is_refused_naming_file_and_line(tmp_path):
    from dml_nb.data.checks import write_fake_dataset
    from dml_nb.data.formats import DatasetFormatError, read_index

    x = outside(tmp_path)
    root = write_fake_dataset("cub200", tmp_path / "cub", n_classes=4, per_class=2) / "CUB_200_2011"
    f = root / "images.txt"
    f.write_text(f.read_text().replace("1 001.Bird_1/Bird_1_0000.jpg", "1 001.Bird_1/../../../../elsewhere/x.jpg"))
    assert (root / "images" / "001.Bird_1/../../../../elsewhere/x.jpg").resolve() == x.resolve()
    with pytest.raises(
        DatasetFormatError,
        match=rf"images.txt, line 1: image path 'images/001.Bird_1/\.\./\.\./\.\./\.\./"
        rf"elsewhere/x.jpg' leads outside the dataset root {root}",
    ):
        read_index("cub200", root.parent, "train")
    cases = {
        "sop": ("Ebay_train.txt", "bicycle_final/100001_0.JPG", "../elsewhere/x.jpg", "line 2"),
        "inshop": ("Eval/list_eval_partition.txt", "img/WOMEN/Dresses/id_00000001/00_1_front.jpg", str(x), "line 3"),
        "vehicleid": ("train_test_split/train_list.txt", "00000001 1", "../../elsewhere/x 1", "line 1"),
    }
    for name, (index, good, evil, line) in cases.items():
        root = write_fake_dataset(name, tmp_path / name, n_classes=4, per_class=2)
        (root / index).write_text((root / index).read_text().replace(good, evil, 1))
        with pytest.raises(DatasetFormatError, match=f"{index}, {line}: image path .* leads outside the dataset root"):
            read_index(name, root, "train")


def test_an_outside_path_in_cars_annos_is_refused(tmp_path):
    from scipy.io import loadmat, savemat
    from dml_nb.data.checks import write_fake_dataset
    from dml_nb.data.formats import DatasetFormatError, read_index

    root = write_fake_dataset("cars196", tmp_path / "cars", n_classes=4, per_class=2)
    mat = loadmat(root / "cars_annos.mat")
    mat["annotations"][0, 0]["relative_im_path"] = np.array(["/etc/passwd"])
    savemat(root / "cars_annos.mat", {k: v for k, v in mat.items() if not k.startswith("__")})
    with pytest.raises(
        DatasetFormatError, match="annotation 1: image path '/etc/passwd' leads outside the dataset root"
    ):
        read_index("cars196", root, "train" if int(mat["annotations"][0, 0]["class"].item()) <= 2 else "test")


def test_a_cub_classes_txt_that_is_a_folder_is_one_line(tmp_path, params, capsys):
    root = cub(tmp_path)
    (root / "classes.txt").unlink()
    (root / "classes.txt").mkdir()
    code, _, err = cli(
        capsys,
        params,
        "--set",
        "data.name=cub200",
        "--set",
        f"data.root={root.parent}",
        "-o",
        tmp_path / "run",
        "--no-progress",
    )
    assert code == 2 and "classes.txt is a folder, not a file; expected" in one_line_error(err)  # was IsADirectoryError
    assert not (tmp_path / "run").exists()


# 8. weak spots -------------------------------------------------------------------------------------------------------

BOMB = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{b}: &{b} [{', '.join([f'*{a}'] * 9)}]\n" for a, b in zip("abcdefgh", "bcdefghi")
)


def test_a_yaml_alias_bomb_is_refused_at_once(tmp_path, params, capsys):
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(BOMB)
    assert len(BOMB) < 600  # the was 572 bytes; 9**9 values
    code, _, err = cli(capsys, params, bomb, "-o", tmp_path / "run")
    assert code == 2 and "its aliases (*name) expand to more than 100,000 values" in one_line_error(err)  # was a hang
    assert not (tmp_path / "run").exists()
    a = tmp_path / "a.yaml"
    a.write_text("train: &t {epochs: 1, lr: 0.01}\n")  # anchors that stay small still read
    assert load_config(a).train.epochs == 1
    with pytest.raises(ConfigError, match="aliases"):
        from dml_nb.core.config import parse_yaml

        parse_yaml(BOMB, "bomb")


def test_an_empty_parameter_file_is_an_error_not_every_default(tmp_path, params, capsys):
    empty = tmp_path / "empty.yaml"
    empty.write_text("# my settings\n\n")
    code, _, err = cli(capsys, empty, "-o", tmp_path / "run")
    assert (
        code == 2
        and "empty.yaml is empty (no option is set): write the options to change, or '{}'" in one_line_error(err)
    )
    assert not (tmp_path / "run").exists()
    (tmp_path / "all.yaml").write_text("{}\n")
    assert load_config(tmp_path / "all.yaml") == make_config({})  # every default, said so


def test_samples_per_class_above_a_class_size_warns_naming_the_classes(tmp_path):
    from dml_nb.data.checks import write_fake_dataset
    from dml_nb.training.build import build_learner

    root = write_fake_dataset("sop", tmp_path / "sop", n_classes=4, per_class=3)
    f = root / "Ebay_train.txt"
    f.write_text(
        "\n".join(l for l in f.read_text().splitlines() if not l.startswith("2 1 ")) + "\n"
    )  # class 1: 2 images
    cfg = {
        **TINY,
        "data": {"name": "sop", "root": str(root), "size": 32, "preset": "small"},
        "train": {**TINY["train"], "batch_size": 6, "samples_per_class": 3},
    }
    with pytest.warns(
        UserWarning,
        match=r"train.samples_per_class is 3, but 1 of 2 training classes have fewer "
        r"images: 1 \(2\) \(class id \(images\)\)",
    ):
        build_learner(make_config(cfg), progress=False)


@pytest.mark.parametrize("scale", [1e18, 1e20, 1e30, 1e-30])
def test_recall_at_k_of_huge_or_tiny_embeddings_is_that_of_the_same_directions(scale):
    from dml_nb.evaluation.metrics import map_at_r, recall_at_k

    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(300, 512, generator=g), torch.arange(300) % 30
    assert recall_at_k(x * scale, y, (1, 2, 4)) == recall_at_k(x, y, (1, 2, 4))  # 1e18 in 512 dims overflowed float32
    assert map_at_r(x * scale, y) == map_at_r(x, y)
    q = torch.randn(40, 512, generator=g)
    assert recall_at_k(q * scale, y[:40], (1,), x * scale, y) == recall_at_k(q, y[:40], (1,), x, y)


def test_a_tables_note_gives_the_epochs_its_rows_ran(project, monkeypatch):
    import dml_nb.reproduction.notebook as N

    nb = N.setup("repro_table3", table3_params())
    monkeypatch.setattr(N, "run_rows", lambda *a, **k: (pd.DataFrame({"row": [], "status": []}), {}))
    nb.run(
        {
            "A": {"train": {"epochs": 100}, "method": {"name": "baseline"}},
            "B": {"train": {"epochs": 350}, "method": {"name": "baseline"}},
        }
    )
    assert nb.note().startswith(
        "Ours: finegrained_premise, small_cnn, 100-350 epochs, seeds [0, 1, 2, 3, 4]"
    )  # was "4 epochs"


def test_a_paper_file_without_its_data_is_one_line_under_papermill(tmp_path):
    "The notebook's error is one line (no kernel traceback), names the fix in papermill's terms; papermill exits 1."
    import nbformat
    import subprocess
    import sys

    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_code_cell(
            "import yaml\nfrom dml_nb.reproduction.notebook import setup\n"
            f"p = yaml.safe_load(open({str(ROOT / 'params' / 'repro_table3' / 'cub200.yaml')!r}))\n"
            'nb = setup("repro_table3", {"seeds": [0], **p})'
        )
    ]
    nbformat.write(nb, tmp_path / "in.ipynb")
    env = {k: v for k, v in os.environ.items() if k not in ("JPY_SESSION_NAME", "PYTEST_CURRENT_TEST", "DML_DATA")}
    env["PYTHONPATH"] = str(ROOT)
    cmd = [sys.executable, "-m", "papermill", "--no-progress-bar", "-k", "python3", "in.ipynb", "out.ipynb"]
    p = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 1, p.stderr
    (tb,) = [o["traceback"] for c in nbformat.read(tmp_path / "out.ipynb", 4).cells for o in c.get("outputs", [])]
    assert len(tb) == 1 and tb[0].startswith("repro_table3: error: data.name is 'cub200', a dataset on disk"), tb
    assert 'papermill -y "config: {data: {root: /path/to/cub200}}"' in tb[0] and "--set" not in tb[0], tb
