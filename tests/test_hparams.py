"""One source of truth for the papers' settings: every paper-scale parameter file (params/train/*.yaml and every
row of params/repro_*/*.yaml) agrees with the paper's table in params/hparams/<paper>.csv."""

from __future__ import annotations
import dataclasses
import inspect
import math
from pathlib import Path

import pandas as pd
import pytest
import yaml

from dml_nb.core.registry import METHODS
from dml_nb.core.config import (
    make_config,
    method_option_default,
    method_options_class,
    read_yaml,
    stored_options,
)
from dml_nb.reproduction.notebook import params_base
from dml_nb.reproduction.repro import Row

ROOT = Path(__file__).resolve().parents[1]
HPARAMS = ROOT / "params" / "hparams"
PAPERS = ("diva", "sharing", "dnc", "bspml")
EMBEDDED = ("shapes", "digits")
COLUMNS = ["method", "dataset", "backbone", "key", "value", "reading", "source", "note"]
# Settings a reproduction row varies on purpose (the swept or ablated variable, or a paper's own different protocol
# for that table), as {"<notebook>/<row name glob>": {key or key prefix, ...}}. Everything else is checked.
ABLATED: dict[str, set[str]] = {
    # D&C: the baselines are the code's single-learner runs; Table 3 compares losses; Table 6 / Fig. 1 are 80-epoch
    # ablations (the flags kept literally, see params/repro_dnc_table6/sop.yaml)
    "repro_dnc_*/*aseline*": {"method.options.num_learners"},
    "repro_dnc_table3/*": {"method.options.loss", "method.options.miner", "method.options.loss_options"},
    "repro_dnc_table6/*": {"method.options.grouping", "train.epochs"},
    # DiVA: Table 2 / Table 4 / Fig. 4 are ablations without a schedule at 200 (SOP 150) epochs (DiVA Sec. 4);
    # the code's head weightings depend on the number of tasks, which one shared section cannot follow
    "repro_diva_table2/*": {"train.epochs", "train.schedule", "method.options.embed_weights"},
    "repro_diva_table4/*": {"train.epochs", "train.schedule"},
    "repro_diva_fig4_left/*": {"train.epochs", "train.schedule", "method.options.embed_weights"},
    "repro_diva_fig4_right/*": {"train.epochs", "train.schedule", "method.options.embed_weights"},
    # Sharing: Tables 6 and 7 switch the architecture, Table 4 the loss (and its batch shape), Table 8 the shared
    # triplets; the TPAMI tables 1-3 report MIC's T^G run on the concatenation [phi, phi*]
    "repro_sharing_table6/*": {"method.options.architecture"},
    "repro_sharing_table7/*": {"method.options.architecture", "method.options.gamma"},
    "repro_sharing_figs2_7_8/*": {"method.options.architecture"},
    "repro_sharing_table4/*": {
        "method.options.loss",
        "method.options.miner",
        "method.options.shared_sampler",
        "train.samples_per_class",
    },
    "repro_sharing_table8/*": {"method.options.shared_sampling", "method.options.shared_sampler"},
    "repro_sharing_tables1_3/Ours (T^G)*": {"method.options.embed"},
    # BSPML: the multi-similarity rows train without SPL weights (no age schedule); Figs. 3-4 sweep the age and mu
    # on the paper's absolute axis
    "repro_bspml_*/MS*": {
        "method.options.c",
        "method.options.lambda_init",
        "method.options.lambda_inf",
        "method.options.mu",
        "method.options.lambda_unit",
        "method.options.solver",
        "method.options.xi_scope",
    },
    "repro_bspml_figs3_4/*": {
        "method.options.c",
        "method.options.lambda_init",
        "method.options.lambda_inf",
        "method.options.mu",
        "method.options.lambda_unit",
    },
}


def exempt(path: Path, row: str, key: str) -> bool:
    "Whether `key` is an intended difference of row `row` of the reproduction file `path`."
    from fnmatch import fnmatchcase

    where = f"{path.parent.name}/{row}"
    return any(
        fnmatchcase(where, pat) and any(key == k or key.startswith(k + ".") for k in keys)
        for pat, keys in ABLATED.items()
    )


def table(paper: str) -> pd.DataFrame:
    path = HPARAMS / f"{paper}.csv"
    if not path.exists():
        return pd.DataFrame(columns=COLUMNS)
    df = pd.read_csv(path, comment="#", dtype=str, keep_default_na=False)
    return df


def paper_of(method: str, source: Path) -> str | None:
    "Which paper's protocol a config follows: the method's own paper; baselines follow the file's paper."
    if method == "mic":
        return "sharing"
    if method in PAPERS:
        return method
    stem = source.parent.name
    if stem == "repro_table3" or source.parent.name == "train":
        return "diva"
    for p in PAPERS:
        if stem.startswith(f"repro_{p}_"):
            return p
    return None


def as_dict(cfg) -> dict:
    "Every field of a `Config`, the method's options spelled as the tables (and `config.yaml`) spell them."
    out = dataclasses.asdict(cfg)
    out["method"]["options"] = stored_options(cfg.method.name, out["method"]["options"])
    return out


def resolved_configs():
    "(file, row name, resolved config dict, keys the row sets itself) for every paper-scale config."
    out = []
    for f in sorted((ROOT / "params" / "train").glob("*.yaml")):
        cfg = as_dict(make_config(read_yaml(f)))
        if cfg["data"]["name"] not in EMBEDDED:
            out.append((f, "", cfg, set()))
    for f in sorted((ROOT / "params").glob("repro_*/*.yaml")):
        raw = yaml.safe_load(f.read_text()) or {}
        base = params_base(raw)
        if base["data"]["name"] in EMBEDDED:
            continue
        for name, spec in (raw.get("rows") or {}).items():
            row = Row(name, spec)
            cfg = as_dict(make_config(row.config(base)))
            out.append(
                (
                    f,
                    name,
                    cfg,
                    _flat_keys(spec if set(spec) & {"method", "train", "model", "data", "eval"} else {"method": spec}),
                )
            )
    return out


def _flat_keys(d: dict, prefix: str = "") -> set[str]:
    keys = set()
    for k, v in (d or {}).items():
        path = f"{prefix}{k}"
        if path.startswith("method.") and path.count(".") == 1 and k != "name":
            path = f"method.options.{k}"
        keys.add(path)
        if isinstance(v, dict):
            keys |= _flat_keys(v, path + ".")
    return keys


def lookup(cfg: dict, key: str):
    "The value at dotted `key`, falling back to the recipe's default for an unset method option."
    node = cfg
    for part in key.split("."):
        if isinstance(node, dict) and part in node:
            node = node[part]
        else:
            break
    else:
        return node
    parts = key.split(".")
    if parts[:2] == ["method", "options"] and len(parts) == 3:
        name = cfg["method"]["name"]
        cls = method_options_class(name)
        if cls is not None:  # the options dataclass's default (a former option name under its new one)
            default = method_option_default(name, cls.RENAMED.get(parts[2], parts[2]), KeyError)
            if default is not KeyError:
                return default
        else:
            p = inspect.signature(METHODS.get(name)).parameters.get(parts[2])
            if p is not None and p.default is not inspect.Parameter.empty:
                return p.default
    raise KeyError(key)


def same(a, b) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b if isinstance(a, bool) and isinstance(b, bool) else False
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return a == b


def matches(row, cfg: dict) -> bool:
    return (
        row["method"] == cfg["method"]["name"]
        and row["dataset"] in ("*", cfg["data"]["name"])
        and row["backbone"] in ("*", cfg["model"]["backbone"])
    )


@pytest.mark.parametrize("paper", PAPERS)
def test_hparams_table_is_well_formed(paper):
    df = table(paper)
    if df.empty:
        pytest.skip(f"params/hparams/{paper}.csv not written yet")
    assert list(df.columns[:7]) == COLUMNS[:7], f"{paper}.csv columns must start with {COLUMNS[:7]}"
    assert set(df["reading"]) <= {"paper", "code", "both", "dml_nb"}, (
        f"{paper}.csv: reading is paper, code, both or dml_nb"
    )
    assert (df["source"].str.len() > 0).all(), f"{paper}.csv: every row names its source"
    for v in df["value"]:
        yaml.safe_load(v)  # every value is a YAML literal
    dup = df[df.duplicated(["method", "dataset", "backbone", "key"], keep=False)]
    assert dup.empty, f"{paper}.csv: settings given twice:\n{dup}"


def test_every_paper_file_agrees_with_its_paper_table():
    tables = {p: table(p) for p in PAPERS}
    problems, checked = [], 0
    for path, name, cfg, explicit in resolved_configs():
        paper = paper_of(cfg["method"]["name"], path)
        if paper is None or tables[paper].empty:
            continue
        for _, row in tables[paper].iterrows():
            if not matches(row, cfg) or exempt(path, name, row["key"]):
                continue
            want = yaml.safe_load(row["value"])
            try:
                got = lookup(cfg, row["key"])
            except KeyError:
                got = "<not set>"
            checked += 1
            if not same(got, want):
                where = f"{path.relative_to(ROOT)}" + (f" row {name!r}" if name else "")
                problems.append(
                    f"{where}: {row['key']} = {got!r}, params/hparams/{paper}.csv says {want!r} ({row['source']})"
                )
    if all(t.empty for t in tables.values()):
        pytest.skip("no params/hparams/*.csv yet")
    assert checked > 0, "no parameter file matched any row of the hyperparameter tables"
    assert not problems, f"{len(problems)} disagreement(s):\n" + "\n".join(problems)


def test_every_reproduction_file_base_agrees_on_paper_wide_settings():
    """The check above reads rows of `rows:` files only; the other reproduction files (DiVA's task combinations, a
    single `row:`, Sharing's loss tables, ...) build their runs in the notebook. Their shared `config` (the base every
    run starts from) must still agree with each setting the paper's table gives every method alike, on every dataset
    and backbone (the samplers, the evaluation readings, the precision)."""
    problems, checked = [], 0
    for paper in PAPERS:
        df = table(paper)
        if df.empty:
            continue
        wide = {
            key: g["value"].iloc[0]
            for key, g in df.groupby("key")
            if (g["dataset"] == "*").all()
            and (g["backbone"] == "*").all()
            and g["value"].nunique() == 1
            and key.split(".")[0] in ("train", "eval", "data")
        }
        for f in sorted((ROOT / "params").glob(f"repro_{paper}_*/*.yaml")):
            base = params_base(yaml.safe_load(f.read_text()) or {})
            if base["data"]["name"] in EMBEDDED:
                continue
            cfg = dataclasses.asdict(make_config(base))
            for key, value in wide.items():
                if exempt(f, "*", key):
                    continue
                checked += 1
                if not same(lookup(cfg, key), yaml.safe_load(value)):
                    problems.append(
                        f"{f.relative_to(ROOT)} (config): {key} = {lookup(cfg, key)!r}, params/hparams/{paper}.csv says {value!r}"
                    )
    assert checked > 0
    assert not problems, f"{len(problems)} disagreement(s):\n" + "\n".join(problems)


def _method_specs(obj, path=""):
    "Every method spec (a mapping whose `name` is a registered recipe) in a parsed parameter file, with its YAML path."
    if isinstance(obj, dict):
        if isinstance(obj.get("name"), str) and obj["name"] in METHODS:
            yield path, obj
            return
        for k, v in obj.items():
            yield from _method_specs(v, f"{path}/{k}")
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _method_specs(v, f"{path}/{i}")


def test_every_method_spec_agrees_on_the_recipe_wide_options():
    """Each method spec in every reproduction file, whatever the file's layout (the `rows:` check above covers one),
    agrees with the options its paper's table sets for that recipe on every dataset and backbone alike, unless the
    file varies the option on purpose (ABLATED)."""
    problems, checked = [], 0
    for f in sorted((ROOT / "params").glob("repro_*/*.yaml")):
        raw = yaml.safe_load(f.read_text()) or {}
        if params_base(raw)["data"]["name"] in EMBEDDED:
            continue
        for path, spec in _method_specs({k: v for k, v in raw.items() if k not in ("config", "output")}):
            paper = paper_of(spec["name"], f)
            if paper is None:
                continue
            df = table(paper)
            rows = df[(df["method"] == spec["name"]) & df["key"].str.startswith("method.options.")]
            for key, g in rows.groupby("key"):
                row = path.split("/")[2] if path.startswith("/rows/") else "*"
                if not ((g["dataset"] == "*").all() and (g["backbone"] == "*").all()) or exempt(f, row, key):
                    continue
                checked += 1
                cfg = {"method": {"name": spec["name"], "options": {k: v for k, v in spec.items() if k != "name"}}}
                got, want = lookup(cfg, key), yaml.safe_load(g["value"].iloc[0])
                if not same(got, want):
                    problems.append(
                        f"{f.relative_to(ROOT)} {path}: {key} = {got!r}, params/hparams/{paper}.csv says {want!r}"
                    )
    assert checked > 0
    assert not problems, f"{len(problems)} disagreement(s):\n" + "\n".join(problems)
