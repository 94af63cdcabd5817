"""The prepared GPU check rehearses on the CPU: `benchmarks/gpu_check.sh --device cpu --tiny` runs every section at
toy size (ResNet50 with random weights at 32 px, a few steps, gloo for the process group) and ends with one table,
the profiler traces and `gpu_results.json` (in the rehearsal's own folder: never benchmarks/), so that its first run
on a GPU machine cannot fail on a typo. The time budget is raised here (a shared CI machine)."""

import gzip
import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SECTIONS = (
    "environment",
    "training",
    "profile",
    "evaluation pass",
    "data path",
    "gpu tests",
    "evaluation",
    "torchrun",
    "resume",
)
METHODS = ("baseline", "diva", "dnc", "sharing", "bspml")
RESULT_KEYS = (
    "card",
    "date",
    "torch",
    "bare_img_s",
    "bare_eval_bn_img_s",
    "bare_eval_bn_zeros_wd_img_s",
    "bare_bf16_img_s",
    *(f"{m}_img_s" for m in METHODS),
    *(f"{m}_bf16_img_s" for m in METHODS),
    *(f"{m}_bf16_fused_img_s" for m in ("baseline", "diva")),  # torch's fused Adam (train.fused_optimizer)
    "baseline_bf16_fused_overhead",
    "diva_bf16_fused_overhead",
    "eval_embed_img_s",
    "eval_embed_bf16_img_s",
    "diva_cub200_200_epochs_min",
    "diva_cub200_350_epochs_eval_h",
)


def test_a_cpu_rehearsal_never_writes_the_gpu_results_file(capsys):
    "benchmarks/gpu_results.json holds a GPU's figures: a CPU run asked to write there stops first (exit 2)."
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu_check.py")
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    target = ROOT / "benchmarks" / "gpu_results.json"
    before = target.read_bytes() if target.exists() else None
    with pytest.raises(SystemExit) as e:
        gpu_check.main(["--device", "cpu", "--tiny", "--results", str(target)])
    assert e.value.code == 2 and "benchmarks/gpu_results.json holds a GPU's figures" in capsys.readouterr().err
    assert (target.read_bytes() if target.exists() else None) == before


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
    for m in METHODS:
        for amp in ("paper", "bf16"):
            assert any(
                row[1].startswith(m + " ") and amp in row[1] and row[2].endswith("img/s")
                for row in by_section["training"]
            ), (m, amp)
    for m in ("baseline", "diva"):  # and with torch's fused Adam
        assert any(row[1] == f"{m} (params/train/cub200_{m}.yaml, bf16_fused)" for row in by_section["training"]), m
    assert sum(row[1].startswith("bare torchvision ResNet50") for row in by_section["training"]) == 4
    assert any(row[2] == "equal" for row in by_section["resume"])
    assert any(row[2].startswith("OK gloo 1") for row in by_section["torchrun"])
    res = json.loads((tmp_path / "gpu_results.json").read_text())  # beside --out, not in benchmarks/
    assert not [k for k in RESULT_KEYS if k not in res], [k for k in RESULT_KEYS if k not in res]
    assert res["card"] == "cpu (rehearsal)" and all(res[f"{m}_img_s"] > 0 for m in METHODS)
    for m in ("baseline", "diva"):
        trace = json.loads(gzip.open(tmp_path / "gpu_check_traces" / f"trace_{m}.json.gz", "rt").read())
        assert sum(str(e.get("name", "")).startswith("ProfilerStep#") for e in trace["traceEvents"]) == 3, m
        p = res["profile"][m]
        assert p["steps"] == 3 and 0 < p["busy_ms_per_step"] <= p["wall_ms_per_step"] and p["top_kernels"], p
