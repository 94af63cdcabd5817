"""The prepared GPU check rehearses on the CPU: `benchmarks/gpu_check.sh --device cpu --tiny` runs every section at
toy size (ResNet50 with random weights at 32 px, a few steps, gloo for the process group) and ends with one table, so
that its first run on a GPU machine cannot fail on a typo. The time budget is raised here (a shared CI machine)."""

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SECTIONS = ("environment", "gpu tests", "training", "data path", "projection", "evaluation", "torchrun", "resume")


@pytest.mark.slow  # a minute of CI; run it before a GPU session: pytest -m slow tests/test_gpu_check.py
def test_gpu_check_rehearsal_on_the_cpu(tmp_path):
    out = tmp_path / "gpu_check.md"
    env = {**os.environ, "GPU_CHECK_TIMEOUT": "1500"}
    r = subprocess.run(
        ["bash", "benchmarks/gpu_check.sh", "--device", "cpu", "--tiny", "--budget", "1400", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1600,
        env=env,
    )
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-3000:]
    rows = [
        line.split(" | ")
        for line in out.read_text().splitlines()
        if line.startswith("| ") and not line.startswith("| ---")
    ][1:]
    by_section = {}
    for row in rows:
        by_section.setdefault(row[0].strip("| "), []).append(row)
    assert set(SECTIONS) <= set(by_section), set(SECTIONS) - set(by_section)
    bad = [
        row for row in rows if row[1] in ("FAILED", "skipped") or row[2] in ("DIFFERENT",) or row[2].startswith("rc ")
    ]
    assert not bad, bad
    for m in ("baseline", "diva", "dnc", "sharing", "bspml"):
        assert any(row[1].startswith(m + " ") and row[2].endswith("img/s") for row in by_section["training"]), m
    assert any(row[2] == "equal" for row in by_section["resume"])
    assert any(row[2].startswith("OK gloo 1") for row in by_section["torchrun"])
