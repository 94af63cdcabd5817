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


def test_readme_is_a_short_guide():
    """The README is the user guide: at most 150 lines and 1,800 words, no machine names or dates (those, with the
    claim table, are in the results report REPORT.md, which it links once), and the CI's test command in place."""
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 150 and len(readme.split()) <= 1800, (
        len(readme.splitlines()),
        len(readme.split()),
    )
    assert not re.findall(r"Xeon|EPYC|Intel|\bAMD\b|\b20\d\d-\d\d-\d\d\b", readme)
    assert readme.count("](REPORT.md)") == 1 and "<!-- claims -->" not in readme
    assert "<!-- claims -->" in (ROOT / "REPORT.md").read_text()
    assert re.search(r"<!-- test-command -->\n```bash\n.+\n```", readme)
    assert re.search(r"<!-- docs-command -->\n```bash\n.+\n```", readme)


def _slug(heading: str) -> str:
    "GitHub's anchor of a Markdown heading."
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_relative_links_of_the_guide_and_the_report_resolve():
    "Every relative link of README.md, REPORT.md and figures/README.md names a file or folder here, or a heading."
    broken = []
    for doc in (ROOT / "README.md", ROOT / "REPORT.md", ROOT / "figures" / "README.md"):
        text = re.sub(r"```.*?```", "", doc.read_text(), flags=re.S)
        anchors = {_slug(h) for h in re.findall(r"^#+ (.*)$", text, flags=re.M)}
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            if (path and not (doc.parent / path).exists()) or (not path and anchor not in anchors):
                broken.append(f"{doc.relative_to(ROOT)}: {target}")
    assert not broken, broken
