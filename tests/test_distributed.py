"Multi-process training on CPU: torchrun with the gloo backend, 2 processes, a tiny config, through dml-train."
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

TINY = {"data": {"images_per_class": 6}, "model": {"options": {"width": 8}},
        "method": {"name": "baseline", "embedding_dim": 16},
        "train": {"epochs": 1, "batch_size": 16, "samples_per_class": 4},
        "eval": {"metrics": ["recall@1"], "save_embeddings": False}}


def _torchrun():
    exe = Path(sys.executable).with_name("torchrun")
    return str(exe) if exe.exists() else shutil.which("torchrun")


@pytest.mark.skipif(_torchrun() is None or shutil.which("dml-train") is None and not
                    Path(sys.executable).with_name("dml-train").exists(), reason="torchrun / dml-train not installed")
def test_dml_train_under_torchrun_gloo(tmp_path):
    params = tmp_path / "tiny.yaml"
    params.write_text(yaml.safe_dump(TINY))
    dml_train = str(Path(sys.executable).with_name("dml-train"))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    res = subprocess.run([_torchrun(), "--standalone", "--nproc_per_node", "2", "--no-python", dml_train,
                          str(params), "-o", str(tmp_path / "run"), "--no-progress"],
                         capture_output=True, text=True, timeout=300, env=env)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert 0 <= metrics["metrics"]["test/recall@1"] <= 1
    assert (tmp_path / "run" / "done").exists()
    # a finished run is not trained again
    again = subprocess.run([dml_train, str(params), "-o", str(tmp_path / "run"), "--no-progress"],
                           capture_output=True, text=True, timeout=120)
    assert again.returncode == 0 and "run directory" in again.stdout


def test_dml_train_rejects_bad_params(tmp_path):
    params = tmp_path / "bad.yaml"
    params.write_text("train: {epochz: 1}\n")
    dml_train = str(Path(sys.executable).with_name("dml-train"))
    res = subprocess.run([dml_train, str(params)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "Did you mean 'epochs'" in res.stderr
