"""The committed notebooks' outputs read the same on any machine: no folder of the machine that ran them (the
project, the temporary folder, a home), and no Python reprs of paths. `dml-reproduce --write-notebooks` and
`tools/refresh_outputs.py` write them through `scrub_output`, which names those folders `<project>`, `<tmp>`, `~`."""

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MACHINE = re.compile(r"PosixPath\(|/tmp/tmp|/tmp/dml_nb|(?<![\w<])/(?:root|home|work|Users)/")


def _texts(output: dict):
    for key in ("text", "traceback"):
        value = output.get(key)
        if value:
            yield "".join(value) if isinstance(value, list) else value
    for kind, value in output.get("data", {}).items():
        if kind.startswith("text/"):
            yield "".join(value) if isinstance(value, list) else value


def test_no_machine_path_in_a_committed_output():
    found = []
    for nb in sorted((ROOT / "nbs").glob("*.ipynb")):
        cells = json.loads(nb.read_text())["cells"]
        for i, cell in enumerate(cells):
            for output in cell.get("outputs", []):
                for text in _texts(output):
                    for m in MACHINE.finditer(text):
                        found.append(f"{nb.name} cell {i}: ...{text[max(0, m.start() - 40) : m.end() + 40]!r}...")
    assert not found, (
        "committed outputs that name this machine's folders (refresh them: dml-reproduce --write-notebooks for "
        "repro_*, python tools/refresh_outputs.py for the others):\n" + "\n".join(found[:20])
    )


def test_the_pattern_finds_what_it_should():
    for bad in ("[PosixPath('<project>/figures/x.png')]", "/tmp/tmpab12/run", "/root/.cache", "at /work/main/nbs"):
        assert MACHINE.search(bad), bad
    for fine in ("<project>/figures/x.png", "<tmp>/run", "~/.cache", "$DML_DATA/cub200", "figures/local/"):
        assert not MACHINE.search(fine), fine
