"The pretraining stage: bit-identical regeneration at a tiny size, and the shipped weights' checks."

from dataclasses import replace

import pytest
import torch

from dml_nb.blocks.models import build_backbone
from dml_nb.blocks.pretrain import WEIGHTS_DIR, PretrainRecipe, _files, _sha256, pretrain, save_weights, shipped_weights

TINY = PretrainRecipe(
    num_classes=5, images_per_class=4, heldout_per_class=2, width=4, feature_dim=8, epochs=2, batch_size=8, threads=1
)


def test_two_runs_write_identical_bytes(tmp_path):
    threads, det = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    files = [
        save_weights(pretrain(r, progress=False)[0], r, 0.0, tmp_path / n)
        for n, r in (("a", TINY), ("b", TINY), ("c", replace(TINY, seed=1)))
    ]
    a, b, c = (f.read_bytes() for f in files)
    assert a == b and a != c
    assert (torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()) == (threads, det)  # restored
    sd = torch.load(files[0], weights_only=True)
    assert set(sd) == set(build_backbone("small_cnn", width=4, feature_dim=8).state_dict())


def test_checks_name_the_fix(tmp_path):
    pt = save_weights(pretrain(TINY, progress=False)[0], TINY, 0.5, tmp_path)
    assert shipped_weights(4, 8, folder=tmp_path) == pt
    with pytest.raises(ValueError, match="width: 4, feature_dim: 8"):
        shipped_weights(32, 256, folder=tmp_path)
    pt.write_bytes(pt.read_bytes()[:-1] + b"x")
    with pytest.raises(ValueError, match="does not match its checksum.*python -m dml_nb.experiments.pretrain"):
        shipped_weights(4, 8, folder=tmp_path)
    with pytest.raises(FileNotFoundError, match="python -m dml_nb.experiments.pretrain"):
        shipped_weights(folder=tmp_path / "none")


def test_shipped_weights_load_offline_and_refuse_other_options():
    pt, sha, _ = _files(WEIGHTS_DIR, "fgpool")
    assert sha.read_text().split()[0] == _sha256(pt) and pt.stat().st_size < 4 * 2**20
    net = build_backbone("small_cnn", pretrained=True)
    ref = torch.load(pt, weights_only=True)
    torch.testing.assert_close(net.state_dict()["body.0.weight"], ref["body.0.weight"])
    with pytest.raises(ValueError, match="model.options: {width: 32, feature_dim: 256}"):
        build_backbone("small_cnn", pretrained=True, width=16)


def test_reproductions_see_the_shipped_weights():
    "`repro.availability` asks the backbone (`weights_for`): small_cnn + pretrained: true is runnable, a width the weights do not fit is not."
    from dml_nb.reproduction.repro import availability

    assert availability({"model": {"backbone": "small_cnn", "pretrained": True}}) is None
    why = availability({"model": {"backbone": "small_cnn", "pretrained": True, "options": {"width": 16}}})
    assert why is not None and "width: 32" in why


def test_the_shipped_weights_checksum_is_part_of_the_run_hash(monkeypatch):
    from dml_nb.core.config import make_config
    from dml_nb.experiments.experiment import run_dir_for

    raw = {
        "data": {"name": "finegrained", "images_per_class": 4},
        "model": {"backbone": "small_cnn", "pretrained": True},
    }
    scratch = {**raw, "model": {"backbone": "small_cnn"}}  # random init: no checksum
    before, scratch_before = run_dir_for(make_config(raw)), run_dir_for(make_config(scratch))
    monkeypatch.setattr("dml_nb.blocks.pretrain.shipped_checksum", lambda *a, **k: "0" * 64)  # regenerated weights
    assert run_dir_for(make_config(raw)) != before
    assert run_dir_for(make_config(scratch)) == scratch_before


def test_novelpool_ships_loads_offline_and_differs_from_fgpool():
    "`finegrained_novel`'s weights: small_cnn's option `weights` picks them, checked and loaded with weights_only."
    from dml_nb.blocks.pretrain import RECIPES

    assert RECIPES["novelpool"].layout == "novel" and RECIPES["fgpool"] == PretrainRecipe()  # fgpool's recipe unchanged
    pt, sha, meta = _files(WEIGHTS_DIR, "novelpool")
    assert sha.read_text().split()[0] == _sha256(pt) and pt.stat().st_size < 4 * 2**20
    assert shipped_weights(tag="novelpool") == pt
    net = build_backbone("small_cnn", pretrained=True, weights="novelpool")
    ref, old = torch.load(pt, weights_only=True), build_backbone("small_cnn", pretrained=True).state_dict()
    torch.testing.assert_close(net.state_dict()["body.0.weight"], ref["body.0.weight"])
    assert not torch.equal(ref["body.0.weight"], old["body.0.weight"])
    with pytest.raises(ValueError, match="fgpool, novelpool"):
        build_backbone("small_cnn", pretrained=True, weights="imagenet")


def test_each_shipped_file_has_its_own_run_hash():
    from dml_nb.core.config import make_config
    from dml_nb.experiments.experiment import run_dir_for

    raw = {
        "data": {"name": "finegrained_novel", "images_per_class": 4},
        "model": {"backbone": "small_cnn", "pretrained": True},
    }
    novel = {**raw, "model": {**raw["model"], "options": {"weights": "novelpool"}}}
    assert run_dir_for(make_config(raw)) != run_dir_for(make_config(novel))


def test_a_novel_layout_recipe_pretrains_on_the_novel_pool(tmp_path):
    "A tiny recipe of the novel layout is deterministic and differs from the shared layout's (another pool)."
    novel = replace(TINY, layout="novel")
    a, b, c = (
        save_weights(pretrain(r, progress=False)[0], r, 0.0, tmp_path / n).read_bytes()
        for n, r in (("a", novel), ("b", novel), ("c", TINY))
    )
    assert a == b and a != c


def test_the_dml_pretrain_command_is_where_pyproject_points(capsys):
    "The console script and `python -m` reach the command (in reproduction, above the metrics its check reads)."
    import importlib
    import subprocess
    import sys
    from pathlib import Path

    try:
        import tomllib
    except ImportError:  # Python 3.10
        tomllib = pytest.importorskip("tomli")

    root = Path(__file__).resolve().parents[1]
    target = tomllib.loads((root / "pyproject.toml").read_text())["project"]["scripts"]["dml-pretrain"]
    module, _, name = target.partition(":")
    assert module == "dml_nb.experiments.pretrain"
    main = getattr(importlib.import_module(module), name)
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0 and "--check" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:  # nothing to compare with: refused before minutes of pretraining
        main(["--check", "--out", str(root / "no-such-folder")])
    assert e.value.code == 2 and "no small_cnn_fgpool.pt.sha256" in capsys.readouterr().err
    out = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, cwd=root)
    assert out.returncode == 0 and "dml-pretrain" in out.stdout
