#!/usr/bin/env python
"""Make regime v3 a reproduction notebook's default run, and keep its regime v2 run as a parameter file.

    python tools/regime_defaults.py repro_dnc_table6 repro_dnc_fig8    # switch these notebooks
    python tools/regime_defaults.py --list                             # each notebook's regime

For each notebook it (1) writes its regime v2 run (`dataset: finegrained_novel` and the method-spec parameters of its
defaults) to `params/regime_v2/<notebook>.yaml`, so that `papermill nbs/<notebook>.ipynb out.ipynb -f
params/regime_v2/<notebook>.yaml` trains the same configs (and reads the same runs in `results/`) as before; (2) copies
its committed v2 claims and table (`figures/<notebook>_claims.*`, `figures/<notebook>.{md,csv}`) to
`figures/regime_v2/`; (3) rewrites the notebook's `parameters` and `defaults` cells: `dataset` becomes
`finegrained_premise` and every method-spec parameter the value `transferred_parameters(notebook, 12)` gives (the paper
file's rows, their epoch-based settings scaled to v3's 12 epochs by the rule of `nbs/67b_transfer.ipynb`). A
parameter the notebook leaves at None takes the `DEFAULT_...` of its defaults cell: that value is replaced.
`tests/test_regime_defaults.py` pins both. A setting beside the rows that v3 changes with them is edited by hand,
its v2 value added to the v2 file (Sharing Fig. 6's `config: {train: {epochs: 10}}`, D&C Fig. 8's `num_clusters: 4`);
the test checks that each such key is one whose default changed. Then run `ruff format` on the notebooks,
`nbdev_clean`, and `dml-reproduce <notebooks> --force --write-committed --write-notebooks`; the run-hash fixtures
(`tests/fixtures/run_hashes.json`, `smoke_hashes.json`) keep the v2 cases and take the new `<notebook>@v3` ones.
"""

import argparse
import ast
import json
import pprint
import shutil
import sys
from pathlib import Path

import yaml

from dml_nb.reproduction.notebook import notebook_defaults
from dml_nb.reproduction.repro import base_config
from dml_nb.reproduction.transfer import regime_of, regime_v2_file, stems_of, transferred_parameters

ROOT = Path(__file__).resolve().parents[1]
V3 = "finegrained_premise"
V2 = "finegrained_novel"


def _tagged(cells: list, tag: str) -> dict | None:
    return next((c for c in cells if tag in c.get("metadata", {}).get("tags", [])), None)


def _span(source: str, node: ast.AST) -> tuple[int, int]:
    "Character offsets of `node` in `source` (ast's columns count UTF-8 bytes)."
    lines = source.splitlines(keepends=True)
    start = sum(len(x) for x in lines[: node.lineno - 1])
    end = sum(len(x) for x in lines[: node.end_lineno - 1])
    col = len(lines[node.lineno - 1].encode()[: node.col_offset].decode())
    end_col = len(lines[node.end_lineno - 1].encode()[: node.end_col_offset].decode())
    return start + col, end + end_col


def _assigned(source: str, name: str):
    "The value node of the assignment to `name` in `source`, or None."
    for st in ast.parse(source).body:
        targets = st.targets if isinstance(st, ast.Assign) else [st.target] if isinstance(st, ast.AnnAssign) else []
        if any(isinstance(t, ast.Name) and t.id == name for t in targets):
            return st.value
    return None


def _replace(source: str, node, value) -> str:
    a, b = _span(source, node)
    return source[:a] + pprint.pformat(value, width=110, sort_dicts=False) + source[b:]


def _set_default(cells: list, name: str, value, stem: str) -> None:
    "Make `value` the default of parameter `name`: in the parameters cell, or the DEFAULT_... it takes when None."
    par, dfl = _tagged(cells, "parameters"), _tagged(cells, "defaults")
    src = "".join(par["source"])
    node = _assigned(src, name)
    if node is None:
        raise SystemExit(f"{stem}: no parameter {name!r} in the parameters cell")
    if not (isinstance(node, ast.Constant) and node.value is None):
        par["source"] = _replace(src, node, value).splitlines(keepends=True)
        return
    dsrc = "".join(dfl["source"]) if dfl else ""
    fill = _assigned(dsrc, name)  # name = DEFAULT_X if name is None else name
    if not (isinstance(fill, ast.IfExp) and isinstance(fill.body, ast.Name)):
        raise SystemExit(f"{stem}: {name!r} is None and its defaults cell gives it no `DEFAULT_... if {name} is None`")
    dnode = _assigned(dsrc, fill.body.id)
    dfl["source"] = _replace(dsrc, dnode, value).splitlines(keepends=True)


def v2_parameters(stem: str, keys) -> dict:
    "The notebook's regime v2 run: its dataset and the current defaults of the method-spec parameters `keys`."
    d = notebook_defaults(stem)
    if d.get("dataset") != V2:
        raise SystemExit(
            f"{stem}: its default dataset is {d.get('dataset')!r}, not regime v2's {V2!r}: switched already?"
        )
    return {"dataset": V2, **{k: d[k] for k in keys}}


def switch(stem: str) -> None:
    new = transferred_parameters(stem, int(base_config(V3)["train"]["epochs"]))
    keys = [k for k in new if k != "dataset"]
    old = v2_parameters(stem, keys)
    regime_v2_file(stem).parent.mkdir(parents=True, exist_ok=True)
    head = (
        f"# Regime v2 of {stem} (the premise-absent control, nbs/67_regime.ipynb): the dataset and rows its default\n"
        f"# run had before regime v3. The same configs as then, so the runs saved in results/ are read, not retrained:\n"
        f"#   papermill nbs/{stem}.ipynb out.ipynb -f params/regime_v2/{stem}.yaml\n"
        f"# Its committed claims and table of v2 are in figures/regime_v2/.\n"
    )
    regime_v2_file(stem).write_text(head + yaml.safe_dump(old, sort_keys=False, width=110))
    keep = ROOT / "figures" / "regime_v2"
    keep.mkdir(exist_ok=True)
    for f in (ROOT / "figures").glob(f"{stem}*"):
        if f.suffix in (".md", ".csv", ".json") and f.stem in (stem, f"{stem}_claims"):
            shutil.copy2(f, keep / f.name)
    path = ROOT / "nbs" / f"{stem}.ipynb"
    nb = json.loads(path.read_text())
    for k in keys:
        _set_default(nb["cells"], k, new[k], stem)
    par = _tagged(nb["cells"], "parameters")
    src = "".join(par["source"])
    was = f'"{V2}"  # {V2} (embedded, default)'
    if src.count(was) != 1:
        raise SystemExit(f"{stem}: the dataset line is not the form this tool rewrites ({was!r})")
    now = f'"{V3}"  # {V3} (embedded, regime v3, default) | {V2} (v2: -f params/regime_v2/{stem}.yaml)'
    par["source"] = src.replace(was, now).splitlines(keepends=True)
    path.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n")
    print(f"{stem}: v3 defaults written ({', '.join(keys)}); v2 in params/regime_v2/{stem}.yaml")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("notebooks", nargs="*")
    p.add_argument("--list", action="store_true", help="print each reproduction notebook's regime and stop")
    args = p.parse_args(argv)
    if args.list or not args.notebooks:
        for nb in sorted((ROOT / "nbs").glob("repro_*.ipynb")):
            print(f"{nb.stem:28} {regime_of(nb.stem)}")
        return 0
    try:
        stems_of(args.notebooks)  # every name checked before any file is written
    except ValueError as e:
        p.error(str(e))
    for stem in args.notebooks:
        switch(stem)
    return 0


if __name__ == "__main__":
    sys.exit(main())
