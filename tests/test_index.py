"`nbs/index.ipynb` is the readable entry point and README.md mirrors it: every cell of the notebook stands in the README."

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _cells():
    nb = json.loads((ROOT / "nbs" / "index.ipynb").read_text())
    return [(c["cell_type"], "".join(c["source"]).strip()) for c in nb["cells"]]


def _as_in_readme(text: str) -> str:
    "The notebook links its siblings (`51_diva.ipynb`); the README links them under `nbs/`."
    return re.sub(r"\]\(([0-9a-z_]+\.ipynb)\)", r"](nbs/\1)", text)


def test_index_has_a_title_and_runs_something():
    cells = _cells()
    assert cells[0][0] == "markdown" and cells[0][1].startswith("# dml_nb")
    assert any(kind == "code" for kind, _ in cells)


def test_readme_mirrors_every_markdown_cell():
    readme = (ROOT / "README.md").read_text()
    missing = [t[:60] for kind, t in _cells() if kind == "markdown" and _as_in_readme(t) not in readme]
    assert not missing, f"README.md lacks these cells of nbs/index.ipynb (copy them over): {missing}"


def test_readme_shows_the_quick_start_code_in_order():
    readme = (ROOT / "README.md").read_text()
    code = "\n\n".join(t for kind, t in _cells() if kind == "code")
    assert f"```python\n{code}\n```" in readme, (
        "README.md's quick-start block differs from the code cells of nbs/index.ipynb"
    )
