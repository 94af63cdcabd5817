"""One home per setting: the config sections hold every training and evaluation default, the `Learner`, `Evaluator`
and `metrics.evaluate` read them, and the run hash of every committed config is what it was before (an unchanged
config keeps its run folder)."""
import json
from pathlib import Path

import pytest
import yaml

from dml_nb.training.config import config_to_dict, load_config, make_config
from dml_nb.reproduction.experiment import run_dir_for, run_key
from dml_nb.reproduction.repro import smoke

ROOT = Path(__file__).resolve().parents[1]
RUN_HASHES = ROOT / "tests" / "fixtures" / "run_hashes.json"


def committed_configs() -> dict:
    """{case: raw config} of every committed config: params/train/*.yaml, and every method spec of the reproduction
    parameter files and notebook defaults (the cases `test_repro` checks `smoke` on), at full size and smoke size."""
    from test_repro import _smoke_cases
    out = {f"train/{p.name}": p for p in sorted((ROOT / "params" / "train").glob("*.yaml"))}
    for case, raw in _smoke_cases().items():
        out[case], out[f"{case}:smoke"] = raw, smoke(raw, force=True)
    return out


def run_hashes() -> dict:
    "{case: '<run folder name> <run_key>'} of every committed config."
    out = {}
    for case, raw in committed_configs().items():
        cfg = load_config(raw) if isinstance(raw, Path) else make_config(raw)
        out[case] = f"{run_dir_for(cfg).name} {run_key(config_to_dict(cfg))}"
    return out


def test_committed_configs_keep_their_run_folders():
    "The run folder and run key of every committed config are those recorded before the settings moved to one home."
    want = json.loads(RUN_HASHES.read_text())
    got = run_hashes()
    assert sorted(got) == sorted(want), f"cases added or gone: {sorted(set(got) ^ set(want))[:5]}"
    changed = sorted(k for k in want if got[k] != want[k])
    assert not changed, f"{len(changed)} committed configs changed their run hash, e.g. {changed[:3]}"


def _fields(cls, prefix=""):
    import dataclasses, typing
    for f in dataclasses.fields(cls):
        yield prefix + f.name, f
        tp = typing.get_type_hints(cls)[f.name]
        if dataclasses.is_dataclass(tp): yield from _fields(tp, f"{prefix}{f.name}.")


def test_every_field_says_how_it_enters_the_run_hash():
    "A field declared without `hashed` or `added_later` fails here (and `config_to_dict` refuses it)."
    from dml_nb.training.config import Config, HASH_RULES
    undeclared = [name for name, f in _fields(Config) if f.metadata.get("hash") not in HASH_RULES]
    assert not undeclared, f"fields without a run-hash rule (declare them with added_later(default)): {undeclared}"


def test_added_later_fields_at_their_default_leave_the_dict_unchanged():
    "The fields that were once the `_OMITTED_AT_DEFAULT` table (and the ones added since) are out of the dict at their defaults."
    from dml_nb.training.config import Config
    d = config_to_dict(make_config({}))
    later = [name for name, f in _fields(Config) if f.metadata.get("hash") == "omit_at_default"]
    assert {"data.cache", "data.decode", "train.compile", "train.zero_grad", "eval.nmi_average", "eval.self_match"} <= set(later)
    for name in later:
        sec, key = name.split(".")
        assert key not in d[sec], name
