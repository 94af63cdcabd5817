"""The notebooks follow nbdev's documentation conventions, so that nbdev's processing (`nbdev_proc_nbs`, the pass
`nbdev_docs` renders) keeps what a reader needs. Static checks, from the committed notebooks, without running them:

- the first cell is `# Title` and one `> description` line, nothing else: nbdev turns that cell into the page's
  title and description and drops the rest of it, so the introduction stands in a cell of its own;
- page names are unique once nbdev drops the number prefix (`70_api_losses.ipynb` -> `api_losses.html`), and so are
  the titles the sidebar shows;
- where nbdev's API pass runs a cell to render the `show_doc`s (a cell with an import, in a notebook with exported
  or documented names), the cell holds only imports: nbdev's own test (`_do_eval` and its warning) decides, so the
  pass never re-runs a demo or a training out of context;
- no prose refers to things a reader cannot follow (an issue number, a numbered point of a list kept elsewhere);
- an inline-math span is one pandoc reads as math (no space inside its dollars, no digit after the closing one)."""

import json
import re
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NBS = ROOT / "nbs"


def notebooks() -> list[Path]:
    return sorted(NBS.glob("*.ipynb"))


def _cells(path: Path) -> list[dict]:
    return json.loads(path.read_text(encoding="utf-8"))["cells"]


def _src(cell: dict) -> str:
    return "".join(cell["source"])


# --- the first cell ---------------------------------------------------------------------------------------------


def first_cell_problem(cells: list[dict]) -> str | None:
    "Why the first cell is not `# Title` + one `> description` line (None: it is)."
    if not cells or cells[0]["cell_type"] != "markdown":
        return "the first cell is not a markdown cell"
    lines = [ln for ln in _src(cells[0]).splitlines() if ln.strip()]
    if len(lines) < 2 or not re.match(r"#\s+\S", lines[0]) or not re.match(r">\s+\S", lines[1]):
        return "the first cell does not start with a `# Title` line and a `> description` line"
    if len(lines) > 2:
        return f"the first cell holds {len(lines) - 2} more line(s) (nbdev drops them): move them to the next cell"
    return None


def title(cells: list[dict]) -> str:
    return re.match(r"#\s+(.*\S)", _src(cells[0]).strip()).group(1)


def test_first_cell_is_a_title_and_a_description():
    bad = {p.name: why for p in notebooks() if (why := first_cell_problem(_cells(p)))}
    assert not bad, f"first cells that nbdev would cut: {bad}"


def test_first_cell_problem_catches_an_introduction():
    def md(s):
        return [{"cell_type": "markdown", "source": [s]}]

    assert first_cell_problem(md("# t\n\n> d")) is None
    assert "more line" in first_cell_problem(md("# t\n\n> d\n\nThe introduction."))
    assert "does not start" in first_cell_problem(md("# t\n\nno description"))
    assert "not a markdown" in first_cell_problem([{"cell_type": "code", "source": ["1"]}])


# --- page names and titles --------------------------------------------------------------------------------------


def page_name(path: Path) -> str:
    "The page nbdev writes for a notebook (nbdev.doclinks._nbpath2html)."
    from nbdev.doclinks import _nbpath2html

    return _nbpath2html(Path(path.name)).name


def _repeated(pairs) -> dict:
    seen = {}
    for name, key in pairs:
        seen.setdefault(key, []).append(name)
    return {k: v for k, v in seen.items() if len(v) > 1}


def test_page_names_are_unique():
    assert page_name(Path("70_api_losses.ipynb")) == "api_losses.html"
    same = _repeated((p.name, page_name(p)) for p in notebooks())
    assert not same, f"notebooks that nbdev renders to the same page (rename one): {same}"


def test_titles_are_unique():
    same = _repeated((p.name, title(_cells(p))) for p in notebooks())
    assert not same, f"notebooks whose sidebar titles repeat: {same}"


# --- imports alone where nbdev's API pass runs them ---------------------------------------------------------------


def mixed_import_cells(path: Path) -> list[int]:
    """The cells of `path` that nbdev's API pass runs (`exec_show_docs`: nbdev's `_do_eval`) for their imports and
    that hold anything else: nbdev warns on some ("Found cells containing imports and other code"), and runs a cell
    of imports, loops and asserts without a word. Indexes of the notebook's own cells; none where the notebook
    documents nothing (the pass then runs no cell)."""
    import ast

    from nbdev.process import NBProcessor
    from nbdev.processors import _do_eval, _show_docs, _want_doc

    nb = NBProcessor(path, procs=[]).nb  # parses the directives; runs nothing
    # add_show_docs's `has_docs_`: an exported or documented name (parsing only the cells that can hold a show_doc)
    if not any(_want_doc(c) for c in nb.cells) and not any(
        c.cell_type == "code" and "show_doc" in c.source and _show_docs(c.parsed_() or []) for c in nb.cells
    ):
        return []
    out = []
    for cell in nb.cells:
        if cell.cell_type != "code" or "import" not in cell.source:  # no import, no warning: skip the parse
            continue
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            runs = _do_eval(cell)
        warned = any("imports and other code" in str(w.message) for w in caught)
        body = cell.parsed_() or []
        for_imports = runs and not set(cell.directives_) & {"export", "exports", "exporti", "exec_doc"}
        if warned or for_imports and not all(isinstance(n, (ast.Import, ast.ImportFrom)) for n in body):
            out.append(cell.idx_)
    return out


def test_imports_stand_alone_where_nbdevs_api_pass_runs_them():
    bad = {p.name: idx for p in notebooks() if (idx := mixed_import_cells(p))}
    assert not bad, (
        "cells that nbdev's API pass would run and that mix imports with other code (split the imports into a cell "
        f"of their own, above): {bad}"
    )


def test_mixed_import_cells_follows_nbdev(tmp_path):
    def nb(*cells):
        p = tmp_path / "x.ipynb"
        p.write_text(
            json.dumps(
                {
                    "cells": [
                        {"cell_type": "code", "metadata": {}, "outputs": [], "execution_count": None, "source": [s]}
                        for s in cells
                    ],
                    "metadata": {"kernelspec": {"language": "python", "name": "python3", "display_name": "python3"}},
                    "nbformat": 4,
                    "nbformat_minor": 5,
                }
            )
        )
        return p

    assert mixed_import_cells(nb("#| export\ndef f(): pass", "import os\nx = os.sep", "import os")) == [1]
    assert mixed_import_cells(nb("#| export\nimport os\nx = os.sep", "import os, sys\nfrom json import dumps")) == []
    assert mixed_import_cells(nb("import os\nx = os.sep")) == []  # nothing documented: the pass runs no cell
    assert mixed_import_cells(nb("#| export\ndef f(): pass", "#| eval: false\nimport os\nos.sep")) == []
    assert mixed_import_cells(nb("#| export\ndef f(): pass", "import os\nassert os.sep")) == [1]  # run, no warning
    assert mixed_import_cells(nb("#| export\ndef f(): pass", "show_doc(f)", "for x in (1,):\n    import os")) == [2]


# --- references a reader can follow -----------------------------------------------------------------------------

ISSUE_REF = re.compile(
    r"\bissues?/\d+|\bissues?\s+#?\d+|(?<![\w&#])#\d{1,3}\b(?![\w-])|\b[Pp]oints?\s+\d+\b|\bthe issue\b", re.I
)


def issue_references(text: str) -> list[str]:
    return [text[max(0, m.start() - 30) : m.end() + 10].replace("\n", " ") for m in ISSUE_REF.finditer(text)]


def test_no_references_to_issues_or_numbered_points():
    found = {}
    for p in notebooks():
        for i, c in enumerate(_cells(p)):
            if refs := issue_references(_src(c)):
                found[f"{p.name}[{i}]"] = refs
    assert not found, f"references a reader cannot follow (say what is true now): {found}"


def test_issue_references_are_caught():
    for s in (
        "see issues/11",
        "issue #37",
        "(issue 15's measurement)",
        "Point 14: DaNCE",
        "points 1-3",
        "regime (#17)",
    ):
        assert issue_references(s), s
    for s in ("a point farthest from its centroid", "5.5 points of R@1", "colour #1f77b4", "1 point"):
        assert not issue_references(s), s


# --- inline math that pandoc reads as math ------------------------------------------------------------------------


def bad_inline_math(markdown: str) -> list[str]:
    "Inline `$...$` spans that pandoc shows as text: a space after the opening or before the closing dollar, or a digit after it."
    s = re.sub(r"```.*?```", "", markdown, flags=re.S)
    s = re.sub(r"`[^`\n]*`", "", s)
    s = re.sub(r"\$\$.*?\$\$", "", s, flags=re.S)
    out = []
    for m in re.finditer(r"(?<![\\$])\$(?!\$)(.+?)(?<![\\$])\$(?!\$)", s, flags=re.S):
        body, after = m.group(1), s[m.end() : m.end() + 1]
        if body[0].isspace() or body[-1].isspace() or after.isdigit():
            out.append(s[max(0, m.start() - 20) : m.end() + 10])
    return out


def test_inline_math_renders():
    bad = {
        f"{p.name}[{i}]": spans
        for p in notebooks()
        for i, c in enumerate(_cells(p))
        if c["cell_type"] == "markdown" and (spans := bad_inline_math(_src(c)))
    }
    assert not bad, f"inline math that renders as text (no space inside the dollars): {bad}"


@pytest.mark.parametrize(
    "text, n", [("with $R > $ `max_r`", 1), ("$\\gamma = $ `s` $/(1 + t)$", 1), ("$a$ and $b$, $$c$$", 0)]
)
def test_bad_inline_math_is_caught(text, n):
    assert len(bad_inline_math(text)) == n


# --- the public modules list what they hold ------------------------------------------------------------------------

PUBLIC = {  # the notebooks of the public namespaces that re-export names of the layers
    "70_api_losses": "losses",
    "71_api_miners": "miners",
    "72_api_distances": "distances",
    "73_api_models": "models",
    "74_api_experiments": "experiments",
    "58_api_methods": "methods",
}


def api_table(path: Path) -> dict[str, str]:
    "{name: home module} of the table under '## What the module holds' in `path` (empty without one)."
    cell = next((_src(c) for c in _cells(path) if _src(c).startswith("## What the module holds")), "")
    return dict(re.findall(r"^\| `(\w+)` \| \w+ \| `([\w.]+)`", cell, flags=re.M))


@pytest.mark.parametrize("stem", sorted(PUBLIC))
def test_public_modules_list_their_api(stem):
    import importlib

    mod = importlib.import_module(f"dml_nb.{PUBLIC[stem]}")
    want = {n: getattr(mod, n).__module__ for n in mod.__all__}
    got = api_table(NBS / f"{stem}.ipynb")
    assert got == want, (
        f"{stem}'s table 'What the module holds' differs from dml_nb.{PUBLIC[stem]}.__all__ and the names' home "
        f"modules: missing {sorted(set(want) - set(got))}, extra {sorted(set(got) - set(want))}, "
        f"wrong home {sorted(n for n in set(got) & set(want) if got[n] != want[n])}"
    )


# --- a reproduction notebook opens with what it reproduces, its parameters and its result ---------------------------

RESULT = re.compile(
    r"\*\*The result\*\* of the committed default run, (\d+) claims?: (\d+) holds?, (\d+) fails?, (\d+) unresolved(?:, (\d+) not tested)?;"
)


def test_reproductions_open_with_their_claim_result_and_parameters():
    from collections import Counter

    bad = {}
    for p in sorted(NBS.glob("repro_*.ipynb")):
        cells = _cells(p)
        k = next(i for i, c in enumerate(cells) if "parameters" in c["metadata"].get("tags", []))
        intro = "\n".join(_src(c) for c in cells[1:k] if c["cell_type"] == "markdown")
        m = RESULT.search(intro)
        claims = json.loads((ROOT / "figures" / f"{p.stem}_claims.json").read_text())["claims"]
        n = Counter(c["verdict"] for c in claims)
        want = (len(claims), n["holds"], n["fails"], n["unresolved"], n["not tested"])
        if k != 2 or "**The paper's claim" not in intro and "**The paper's figures" not in intro:
            bad[p.name] = "the cell after the title must hold the paper's claim, and the parameters cell follow it"
        elif not m:
            bad[p.name] = "no '**The result** of the committed default run, N claims: ...' before the parameters"
        elif tuple(int(x or 0) for x in m.groups()) != want:
            bad[p.name] = f"its result line says {m.group(0)!r}; the committed claims file has {want}"
    assert not bad, bad


# --- nbdev's processing runs clean --------------------------------------------------------------------------------

PROC = """import sys
import nbdev.doclinks
import nbdev.quarto as q
from nbdev.serve import proc_nbs

if __name__ == "__main__":  # nbdev_proc_nbs without its Quarto install: the yml files, the module index, the pass
    q.refresh_quarto_yml()
    nbdev.doclinks._build_modidx()
    q.nbdev_sidebar.__wrapped__(path="nbs")
    proc_nbs("nbs", n_workers=2)
"""


@pytest.mark.slow
def test_nbdev_processing_runs_clean(tmp_path):
    """What `nbdev_proc_nbs` does (nbdev's API pass over every notebook, into `_proc/`), run in a copy of the project
    so that nothing is written into it (nbdev writes `_proc/` beside settings.ini, and nbdev.yml, _quarto.yml and
    sidebar.yml into nbs/; `nbdev_proc_nbs` itself would also try to install Quarto). About 6 minutes on 2 cores."""
    import os
    import shutil
    import subprocess
    import sys

    shutil.copy(ROOT / "settings.ini", tmp_path / "settings.ini")
    shutil.copytree(NBS, tmp_path / "nbs", ignore=shutil.ignore_patterns(".ipynb_checkpoints"))
    for d in ("dml_nb", "figures", "params", "results", "tools", "benchmarks", "tests"):  # what the executed cells read
        os.symlink(ROOT / d, tmp_path / d)
    (tmp_path / "run_proc.py").write_text(PROC)
    before = sorted(p.name for p in NBS.iterdir())
    r = subprocess.run([sys.executable, "run_proc.py"], cwd=tmp_path, capture_output=True, text=True, timeout=1800)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    assert "Found cells containing imports and other code" not in out, out[-4000:]
    made = {p.name for p in (tmp_path / "_proc").glob("*.ipynb")}
    assert {p.name for p in notebooks()} <= made, sorted({p.name for p in notebooks()} - made)
    assert sorted(p.name for p in NBS.iterdir()) == before, "nbdev's processing wrote into nbs/"
