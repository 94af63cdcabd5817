"""The project's scripts under `tools/` as modules, for the tests that call their functions directly."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def tool(name: str):
    "The module of `tools/<name>.py`, loaded from its file (the folder is no package)."
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
