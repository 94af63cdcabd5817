"""benchmarks/readme_timings.py, the script every time in the README and the results report (REPORT.md, with the
machines) comes from: each `--only` either cites is one of its commands, and the whole-set row quotes set_cost's
measured and estimated lines, not its table."""

import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("readme_timings", ROOT / "benchmarks" / "readme_timings.py")
rt = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(rt)


def test_every_cited_timing_is_a_command_of_the_script(tmp_path):
    cmds = rt.commands(tmp_path)
    for doc in ("README.md", "REPORT.md"):
        cited = set(re.findall(r"readme_timings\.py --only ([\w-]+)", (ROOT / doc).read_text()))
        assert cited, f"{doc} cites no timing of benchmarks/readme_timings.py"
        assert cited <= set(cmds), (doc, cited - set(cmds))
    for name, (what, shown, argv, env) in cmds.items():
        assert what and shown and argv and isinstance(env, dict), name


def test_whole_set_recorded_quotes_the_summary_lines_only():
    out = """                          runs  trained  hours
repro_table3                35       30    9.4
415 distinct runs, 405 trained, 0 pending, 5 stopped by design (a `stopped` record; no training)
measured: the 405 trained runs took 18.3 h of wall time summed (mean 2.7 min a run; threads per run: 1)
trained on: AMD EPYC (AVX2|fma): 108 runs; not recorded: 297 runs
estimate: about 9.1 h of wall clock, 2 runs at a time (the sum over 2; each run's wall time was measured with others beside it)
"""
    lines = rt.quoted("whole-set-recorded", out)
    assert [l.split()[0] for l in lines] == ["415", "measured:", "trained", "estimate:"]
    assert rt.quoted("flagship", out) == []
    assert not any("|" in l for l in lines)  # a quoted line goes into the Markdown table as one cell
