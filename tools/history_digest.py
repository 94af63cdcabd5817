#!/usr/bin/env python
"""Digests of five tiny training runs (one per recipe), to show that a refactoring changed no bit of training.

    python tools/history_digest.py --save before.json      # on the old code
    python tools/history_digest.py --compare before.json   # on the new code: exits 1 on any difference

Each run is `dml-train params/train/shapes_<method>.yaml` with 8 images per class, 2 epochs and 1 thread, in a fresh
temporary run cache, so no stored result stands in for the training. The digest covers `history.csv` (without its
time column), `metrics.json` (without times, dates, the device and versions) and every tensor of `embeddings.pt`.
Bit-identity holds on one machine at one thread count; another CPU kind gives other last bits (README, "What is
reproducible"). About 2 minutes on 2 cores.
"""

import argparse
import hashlib
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
METHODS = ("baseline", "diva", "sharing", "dnc", "bspml")
VOLATILE = ("time", "sec", "elapsed", "when", "host", "version", "finished", "device")


def _bytes(x) -> bytes:
    if torch.is_tensor(x):
        return x.numpy().tobytes()
    if isinstance(x, dict):
        return b"".join(k.encode() + _bytes(v) for k, v in sorted(x.items()))
    if isinstance(x, (list, tuple)):
        return b"".join(_bytes(v) for v in x)
    return repr(x).encode()


def digest(run: Path) -> dict:
    "Short SHA-1 digests of a finished run's history, metrics and embeddings."
    rows = [r.split(",") for r in (run / "history.csv").read_text().splitlines()]
    keep = [i for i, c in enumerate(rows[0]) if not any(s in c for s in ("time", "sec"))]
    history = "\n".join(",".join(r[i] for i in keep if i < len(r)) for r in rows)
    metrics = {
        k: v for k, v in json.loads((run / "metrics.json").read_text()).items() if not any(s in k for s in VOLATILE)
    }
    emb = torch.load(run / "embeddings.pt", weights_only=False)
    sha = lambda b: hashlib.sha1(b).hexdigest()[:16]
    return {
        "history": sha(history.encode()),
        "metrics": sha(json.dumps(metrics, sort_keys=True, default=str).encode()),
        "embeddings": sha(_bytes(emb)),
        "run": run.name,
    }


def train(method: str, runs: Path) -> Path:
    "Train one tiny run of `method` into `runs`; its run folder (from `dml-train`'s headline line)."
    cmd = [sys.executable, "-c", "import sys; from dml_nb.experiments.cli import main; sys.exit(main())"]
    cmd += [f"params/train/shapes_{method}.yaml", "--set", "data.images_per_class=8", "--set", "train.epochs=2"]
    cmd += ["--threads", "1", "--runs-dir", str(runs), "--no-progress"]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if p.returncode:
        sys.exit(f"dml-train failed for {method}:\n{p.stdout}{p.stderr}")
    return Path(p.stdout.strip().splitlines()[-1].split(" in ", 1)[1].split(";")[0])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--save", type=Path, help="write the digests to this JSON file")
    ap.add_argument("--compare", type=Path, help="compare with the digests of this JSON file (exit 1 on a difference)")
    args = ap.parse_args(argv)
    out = {}
    with tempfile.TemporaryDirectory(prefix="dml_nb_digest_") as d:
        for m in METHODS:
            out[m] = digest(train(m, Path(d)))
            print(m, out[m], flush=True)
    if args.save:
        args.save.write_text(json.dumps(out, indent=1) + "\n")
    if args.compare:
        want = json.loads(args.compare.read_text())
        bad = {k: {"before": want[k], "now": out.get(k)} for k in want if want[k] != out.get(k)}
        print(("different: " + json.dumps(bad, indent=1)) if bad else "all identical")
        return 1 if bad else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
