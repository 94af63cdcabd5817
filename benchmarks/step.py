"""Where a CPU training step of the evidence regime goes, beside a bare PyTorch loop on the same model and batch.

The run is `NOVEL_BASE` (dml_nb.reproduction.repro: `finegrained_novel`, small CNN from `novelpool`, batches of 15
classes x 4 images at 32 px) with the margin baseline, built as `dml-train` builds it. Every figure is process CPU
time (all threads), per training step or per evaluation pass, the best of `--repeats` (the machine may be shared):

* `data`: loading and augmenting one batch (the loader's per-item path: seeded views, then collate; with `--cache`
  uint8 items collated, then augmented as a batch);
* `step`: one step of `Learner.fit` without evaluation (data, forward, miner and loss, backward, Adam, logging);
* `bare method`: the same model and the method's own loss on one fixed batch in a bare loop (forward, loss,
  backward, Adam): the limit for this model and loss;
* `bare net`: backbone and heads only (the method's forward), the sum of the embeddings as the loss;
* `eval`: one evaluation pass (every evaluation set, the run's metrics).

    python benchmarks/step.py [--threads 1] [--steps 20] [--channels-last] [--bf16] [--cache] [--busy 0]

`--busy N` starts N spinning processes beside the measurement (a shared machine); compare its CPU times with
`--busy 0` (idle): wasted CPU (threads that spin or oversubscribe) shows as the difference.
"""

from __future__ import annotations
import argparse
import copy
import datetime
import multiprocessing as mp
import os
import platform

import torch
from timing import cpu  # process CPU time, best of repeats (shared with step_census.py)


def spin(stop):
    "A busy process: pure Python arithmetic until told to stop."
    x = 0
    while not stop.is_set():
        for i in range(100_000):
            x += i


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=20, help="training steps per measurement")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--channels-last", action="store_true")
    ap.add_argument("--bf16", action="store_true", help="bf16 autocast on the CPU")
    ap.add_argument("--busy", type=int, default=0, help="spinning processes started beside the measurement")
    ap.add_argument("--cache", action="store_true", help="data.cache: uint8 images augmented in batches")
    ap.add_argument("--lr", type=float, default=None, help="override NOVEL_BASE's learning rate")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from dml_nb.reproduction.repro import NOVEL_BASE
    from dml_nb.training.build import build_learner
    from dml_nb.core.config import make_config
    from dml_nb.data.batches import SeededViews, to_device
    from dml_nb.data.cache import RawItems, pad_collate
    from dml_nb.core.base import stream_seed

    raw = copy.deepcopy(NOVEL_BASE)
    raw["method"] = {"name": "baseline", "embedding_dim": 128, "loss": "margin", "miner": "distance_weighted"}
    raw["train"].update(
        batches_per_epoch=args.steps,
        epochs=1,
        channels_last="on" if args.channels_last else "off",
        amp="bf16" if args.bf16 else "none",
    )
    if args.lr:
        raw["train"]["lr"] = args.lr
    raw["eval"]["save_embeddings"] = False
    if args.cache:
        raw["data"]["cache"] = True
    cfg = make_config(raw)

    stop = mp.Event()
    busy = [mp.Process(target=spin, args=(stop,), daemon=True) for _ in range(args.busy)]
    for p in busy:
        p.start()
    print(
        f"# {datetime.date.today()} {platform.node()} {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"torch {torch.__version__}, threads {args.threads}, channels_last {args.channels_last}, bf16 {args.bf16}, "
        f"cache {args.cache}, OMP_WAIT_POLICY {os.environ.get('OMP_WAIT_POLICY')}, busy processes {args.busy}, load average {os.getloadavg()[0]:.1f}"
    )
    try:
        learner = build_learner(cfg, None, progress=False)
        learner.prepare_fit()
        batches = [[int(i) for i in b] for b in learner.sampler.batches(0)][: args.steps]
        transform = learner.batch_transform  # the cache path: uint8 items, augmented in batches
        views, collate = (
            (SeededViews(learner.train_ds), torch.utils.data.default_collate)
            if transform is None
            else (RawItems(learner.train_ds), pad_collate)
        )

        def load(s, b):
            out = collate([views[(i, stream_seed(0, "sample", 0, s, j, 0))] for j, i in enumerate(b)])
            gen = None if transform is None else torch.Generator().manual_seed(s)
            return to_device(out, learner.device, args.channels_last, transform, 1, gen)

        def data():
            for s, b in enumerate(batches):
                load(s, b)

        fresh = []  # a fresh learner for each timed fit (built outside the timing): one epoch of `steps` steps
        for _ in range(args.repeats):
            fresh.append(build_learner(cfg, None, progress=False))
            fresh[-1].eval_sets = {}
        fit = lambda: fresh.pop().fit()

        method, opt_lr = learner.method, cfg.train.lr
        batch = load(0, batches[0])
        opt = torch.optim.Adam(method.parameters(), lr=opt_lr)
        ac = lambda: torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16)

        def bare_method():
            for _ in range(len(batches)):
                with ac():
                    loss = method.training_step(dict(batch))["loss"]
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()

        def bare_net():
            for _ in range(len(batches)):
                with ac():
                    loss = sum(v.float().sum() for v in method(batch["x"]).values())
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()

        n = len(batches)
        rows = {
            "data": cpu(data, args.repeats) / n,
            "step": cpu(fit, args.repeats) / n,
            "bare method": cpu(bare_method, args.repeats) / n,
            "bare net": cpu(bare_net, args.repeats) / n,
            "eval": cpu(learner.evaluate, max(1, args.repeats - 1)),
        }
        sets = ", ".join(
            f"{k} {len(v[0]) + len(v[1]) if isinstance(v, tuple) else len(v)}" for k, v in learner.eval_sets.items()
        )
    finally:
        stop.set()
        for p in busy:
            p.join(5)
    print("| what | CPU s | per step vs bare method |\n| --- | ---: | ---: |")
    for k, v in rows.items():
        ratio = f"{v / rows['bare method']:.2f}" if k != "eval" else ""
        print(f"| {k}{' (per pass: ' + sets + ' images)' if k == 'eval' else ' (per step)'} | {v:.4f} | {ratio} |")
    steps_per_epoch = -(-len(learner.train_ds) // cfg.train.batch_size)
    per_run = NOVEL_BASE["train"]["epochs"] * steps_per_epoch * rows["step"] + rows["eval"] * (
        NOVEL_BASE["train"]["epochs"] // NOVEL_BASE["eval"]["every"] + 1
    )
    print(
        f"\none NOVEL_BASE baseline run ({NOVEL_BASE['train']['epochs']} epochs x {steps_per_epoch} steps, "
        f"{NOVEL_BASE['train']['epochs'] // NOVEL_BASE['eval']['every']} evaluation(s) + the frozen one): "
        f"about {per_run:.0f} CPU s"
    )


if __name__ == "__main__":
    main()
