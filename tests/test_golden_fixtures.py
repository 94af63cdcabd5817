"Every golden fixture names its source (repository, commit, files, harness) and is used by a test."

import json
from pathlib import Path

import pytest

from golden import GOLDEN, check_source

FIXTURES = sorted(GOLDEN.glob("*.json"))


@pytest.mark.parametrize("path", FIXTURES, ids=[p.stem for p in FIXTURES])
def test_fixture_has_source_and_is_used(path):
    data = json.loads(path.read_text())
    check_source(data.get("source"), str(path))
    assert "outputs" in data and "inputs" in data, f"{path.name}: a fixture holds 'inputs' and 'outputs'"
    tests = Path(__file__).parent
    users = [
        t.name
        for t in tests.glob("test_*.py")
        if t.name != Path(__file__).name and (f'"{path.stem}"' in t.read_text() or f"'{path.stem}'" in t.read_text())
    ]
    assert users, f"{path.name} is not loaded by any test (load_golden({path.stem!r}))"
