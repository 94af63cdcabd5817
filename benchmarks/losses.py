"""Forward + backward time per batch of dml_nb's losses with their miners, beside pytorch-metric-learning (PML).

Batch: 112 x 512 L2-normalised embeddings (requires_grad), 56 classes x 2 samples, with a weak class signal (as
early in training) so that the miners find tuples (a well-separated batch gives the MS miner nothing, and PML then
skips the loss). Each step = mine + loss + backward on a fresh leaf tensor. Ours and PML's steps are
interleaved so that CPU load from other processes hits both alike; the table shows the median over the repeats after a warm-up, and ours/PML.

    python benchmarks/losses.py [--repeats 200] [--threads 2]

DaNCE (no PML equivalent) is timed as DiVA runs it: 112 x 128 queries against a 3,360-key queue.
"""

from __future__ import annotations
import argparse
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from dml_nb.core.registry import LOSSES, MINERS


@dataclass
class Case:
    name: str
    ours: Callable  # step(embeddings, labels) -> scalar loss
    pml: Callable | None  # the same with PML, or None when PML has no equivalent
    dim: int = 512  # embedding dimension of the batch


def make_batch(n_classes: int = 56, per_class: int = 2, dim: int = 512, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    labels = torch.arange(n_classes).repeat_interleave(per_class)
    centres = torch.randn(n_classes, dim, generator=g)
    emb = F.normalize(0.25 * centres[labels] + torch.randn(len(labels), dim, generator=g), dim=1)
    return emb, labels


def pair(miner, loss, **call_kw):
    "A step function: mine, then the loss on the mined tuples."

    def step(emb, labels):
        return loss(emb, labels, miner(emb, labels, **call_kw))

    return step


def core_cases(n_classes: int) -> list[Case]:
    from pytorch_metric_learning import losses as pl, miners as pm

    gen = torch.Generator().manual_seed(0)
    return [
        Case(
            "multi-similarity + MS miner",
            pair(MINERS.build("multi_similarity"), LOSSES.build("multi_similarity")),
            pair(pm.MultiSimilarityMiner(epsilon=0.1), pl.MultiSimilarityLoss(alpha=2, beta=50, base=0.5)),
        ),
        Case(
            "margin + distance-weighted",
            pair(MINERS.build("distance_weighted", generator=gen), LOSSES.build("margin", num_classes=n_classes)),
            pair(
                pm.DistanceWeightedMiner(cutoff=0.5, nonzero_loss_cutoff=1.4),
                pl.MarginLoss(margin=0.2, beta=1.2, learn_beta=True, num_classes=n_classes),
            ),
        ),
        Case(
            "triplet + semi-hard (all, = PML's)",
            pair(MINERS.build("semihard", mode="all"), LOSSES.build("triplet", margin=0.2)),
            pair(pm.TripletMarginMiner(margin=0.2, type_of_triplets="semihard"), pl.TripletMarginLoss(margin=0.2)),
        ),
        Case(
            "triplet + semi-hard (sample, default)",
            pair(MINERS.build("semihard", generator=gen), LOSSES.build("triplet", margin=0.2)),
            pair(pm.TripletMarginMiner(margin=0.2, type_of_triplets="semihard"), pl.TripletMarginLoss(margin=0.2)),
        ),
    ]


def dance_case() -> Case:
    "DaNCE as DiVA runs it: 112 queries of one 128-d head against a 3,360-key queue (30 batches); no PML equivalent."
    import dml_nb.blocks.proxy_nce  # noqa: F401  (registers DaNCE into LOSSES)

    dance = LOSSES.build("dance")
    g = torch.Generator().manual_seed(1)
    keys = F.normalize(torch.randn(112, 128, generator=g), dim=1)
    queue = F.normalize(torch.randn(3360, 128, generator=g), dim=1)
    return Case(
        "DaNCE, 112 x 128, queue of 3,360 keys",
        lambda emb, labels: dance(emb, labels, keys=keys, queue=queue),
        None,
        dim=128,
    )


def time_step(step, emb, labels) -> float:
    x = emb.detach().clone().requires_grad_()
    t0 = time.perf_counter()
    loss = step(x, labels)
    loss.backward()
    return time.perf_counter() - t0


def run(repeats: int = 200, warmup: int = 20, threads: int = 2) -> list[tuple[str, float, float | None]]:
    torch.set_num_threads(threads)
    n_classes = 56
    rows = []
    for case in core_cases(n_classes) + [dance_case()]:
        emb, labels = make_batch(n_classes, dim=case.dim)
        for _ in range(warmup):
            time_step(case.ours, emb, labels)
            if case.pml:
                time_step(case.pml, emb, labels)
        ours, theirs = [], []
        for _ in range(repeats):
            ours.append(time_step(case.ours, emb, labels))
            if case.pml:
                theirs.append(time_step(case.pml, emb, labels))
        rows.append((case.name, 1e3 * statistics.median(ours), 1e3 * statistics.median(theirs) if theirs else None))
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    rows = run(args.repeats, args.warmup, args.threads)
    print("| case | ours ms/batch | PML ms/batch | ours/PML |\n| --- | ---: | ---: | ---: |")
    for name, ours, theirs in rows:
        pml_s, ratio = ("-", "-") if theirs is None else (f"{theirs:.2f}", f"{ours / theirs:.2f}x")
        print(f"| {name} | {ours:.2f} | {pml_s} | {ratio} |")


if __name__ == "__main__":
    main()
