"""Host-time helpers shared by the benchmarks (`step.py`, `step_census.py`): process CPU time of a call, the best of
repeats, and two calls timed in alternation (so that a shared machine's load falls on both alike)."""

from __future__ import annotations
import statistics
import time


def cpu_time(fn) -> float:
    "Process CPU time (all threads) of one `fn()`, in seconds."
    t = time.process_time()
    fn()
    return time.process_time() - t


def cpu(fn, repeats: int, warm: bool = False) -> float:
    "Best process CPU time of `fn()` over `repeats` runs (after one untimed run when `warm`)."
    if warm:
        fn()
    return min(cpu_time(fn) for _ in range(repeats))


def paired(a, b, repeats: int) -> dict:
    """`a()` and `b()` timed in alternation, `repeats` pairs after one untimed run of each, the order swapped every
    pair: {'a_s', 'b_s': the median of each one's times; 'a_best_s', 'b_best_s': the best of each; 'ratio': the
    median of the pairs' a / b; 'ratio_range': (lowest, highest) of those ratios}. A pair's two runs see nearly the
    same load, so the median of the ratios follows the load less than a ratio of medians."""
    a(), b()
    ta, tb = [], []
    for k in range(repeats):
        if k % 2:
            tb.append(cpu_time(b))
            ta.append(cpu_time(a))
        else:
            ta.append(cpu_time(a))
            tb.append(cpu_time(b))
    ratios = [x / y for x, y in zip(ta, tb) if y > 0]
    return {
        "a_s": statistics.median(ta),
        "b_s": statistics.median(tb),
        "a_best_s": min(ta),
        "b_best_s": min(tb),
        "ratio": statistics.median(ratios) if ratios else None,
        "ratio_range": (min(ratios), max(ratios)) if ratios else None,
    }
