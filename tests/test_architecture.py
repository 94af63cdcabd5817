"""The package's shape: the layers as folders, every import running down their order (function-level imports
included), no import circle between modules, no private name imported across modules. Read from the sources with
`ast`, nothing is imported."""

import ast
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "dml_nb"
# the layers, lowest first: a module imports only from its own layer and the layers before it (README, "Where to read next")
LAYERS = ("core", "data", "blocks", "evaluation", "training", "methods", "experiments", "sweeps", "reproduction")


def _modules() -> dict[str, Path]:
    return {
        ".".join(p.relative_to(ROOT).with_suffix("").parts): p
        for p in sorted(PKG.rglob("*.py"))
        if p.name not in ("__init__.py", "_modidx.py")
    }


def _resolve(module: str, node: ast.ImportFrom) -> str:
    "The absolute module an `ImportFrom` names (relative imports resolved against `module`)."
    if not node.level:
        return node.module or ""
    base = module.split(".")[: -node.level]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(module: str, path: Path, known: set[str]) -> list[tuple[str, list[str], int]]:
    "(imported module, names, line) for every import of a dml_nb module in `path`, at any depth."
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            target = _resolve(module, node)
            names = [a.name for a in node.names]
            subs = [f"{target}.{n}" for n in names if f"{target}.{n}" in known]
            if subs:
                out += [(s, [], node.lineno) for s in subs]
            elif target in known:
                out.append((target, names, node.lineno))
        elif isinstance(node, ast.Import):
            out += [(a.name, [], node.lineno) for a in node.names if a.name in known]
    return out


def _graph() -> dict[str, dict[str, int]]:
    mods = _modules()
    known = set(mods)
    return {m: {t: line for t, _, line in _imports(m, p, known) if t != m} for m, p in mods.items()}


def _cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    "Strongly connected components with more than one module (Tarjan)."
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_the_walker_sees_function_level_imports(tmp_path):
    "The check is only worth something if an import inside a function counts: a two-module circle is found."
    src = {"a": "from .b import f\n", "b": "def f():\n    from .a import g\n    return g\n"}
    graph = {
        f"p.{m}": {t: line for t, _, line in _imports(f"p.{m}", _write(tmp_path, m, s), {"p.a", "p.b"})}
        for m, s in src.items()
    }
    assert _cycles(graph) == [["p.a", "p.b"]]


def _write(tmp_path, name, text):
    p = tmp_path / f"{name}.py"
    p.write_text(text)
    return p


def test_no_import_circle():
    cycles = _cycles(_graph())
    assert not cycles, f"import circles between modules (function-level imports count): {cycles}"


def test_no_private_name_crosses_a_module():
    mods = _modules()
    known = set(mods)
    bad = [
        f"{m}:{line} imports {n} from {t}"
        for m, p in mods.items()
        for t, names, line in _imports(m, p, known)
        for n in names
        if n.startswith("_") and not n.startswith("__")
    ]
    assert not bad, "private names used across modules (make them public or move them):\n" + "\n".join(bad)


def _layer(module: str) -> int:
    "The place of `module`'s layer in `LAYERS`; -1 for the package root `dml_nb` (which every import runs first)."
    parts = module.split(".")
    if parts == ["dml_nb"]:
        return -1
    assert parts[0] == "dml_nb" and len(parts) > 1 and parts[1] in LAYERS, f"{module} is in no layer of {LAYERS}"
    return LAYERS.index(parts[1])


def _all_imports(path: Path, module: str, package: bool, root: Path = ROOT) -> list[tuple[str, int]]:
    """(imported dml_nb module, line) of every import in `path` at any depth (module level, in functions, under
    `if TYPE_CHECKING`): `import dml_nb.x.y`, `from dml_nb.x import y`, `from ..x import y`, `from . import y` (a
    submodule `y` counts as the module it names). `package`: `path` is `module`'s `__init__.py`; `root` holds dml_nb/."""
    here = module.split(".") if package else module.split(".")[:-1]
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names if a.name.split(".")[0] == "dml_nb"]
        elif isinstance(node, ast.ImportFrom):
            base = here[: len(here) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            if target.split(".")[0] != "dml_nb":
                continue
            subs = [f"{target}.{a.name}" for a in node.names if _is_module(f"{target}.{a.name}", root)]
            out += [(t, node.lineno) for t in subs or [target]]
    return out


def _is_module(name: str, root: Path = ROOT) -> bool:
    p = root.joinpath(*name.split("."))
    return p.with_suffix(".py").is_file() or (p / "__init__.py").is_file()


def _upward_imports(root: Path = ROOT) -> list[str]:
    "'module:line imports target (layer a -> higher layer b)' for every import into a layer above the importer's."
    bad = []
    for p in sorted((root / "dml_nb").rglob("*.py")):
        if p.name == "_modidx.py" or p.parent == root / "dml_nb":
            continue  # nbdev's index; the package root (no layer: it only sets the environment torch starts in)
        parts = p.relative_to(root).with_suffix("").parts
        package = parts[-1] == "__init__"
        module = ".".join(parts[:-1] if package else parts)
        for target, line in _all_imports(p, module, package, root):
            a, b = _layer(module), _layer(target)
            if b > a:
                bad.append(f"{module}:{line} imports {target} (layer {LAYERS[a]} -> higher layer {LAYERS[b]})")
    return bad


def test_the_direction_walker_sees_every_kind_of_import(tmp_path):
    "Relative and absolute, `import` and `from`, module level and in a function, a submodule named in `from . import`."
    src = (
        "import os\n"
        "from .neighbours import knn\n"  # same layer: fine
        "from ..core.base import atomic_write\n"  # lower: fine
        "import dml_nb.training.learner\n"  # 4: up
        "from dml_nb.methods import diva\n"  # 5: up (a submodule)
        "def f():\n"
        "    from ..experiments.experiment import run\n"  # 7: up, inside a function
        "    from .. import core\n"  # 8: the package dml_nb.core, lower: fine
    )
    got = [
        (t, line)
        for t, line in _all_imports(_write(tmp_path, "m", src), "dml_nb.evaluation.metrics", False)
        if _layer(t) > _layer("dml_nb.evaluation.metrics")
    ]
    assert got == [
        ("dml_nb.training.learner", 4),
        ("dml_nb.methods.diva", 5),
        ("dml_nb.experiments.experiment", 7),
    ]
    init = "def f():\n    from .formats import DATASETS\n    from ..training import learner\n"
    assert _all_imports(_write(tmp_path, "i", init), "dml_nb.data", True) == [
        ("dml_nb.data.formats", 2),
        ("dml_nb.training.learner", 3),
    ]


def test_an_upward_import_in_a_function_fails_with_its_place(tmp_path):
    "On a two-layer tree: a function-level import from core into training is reported as module:line and layers."
    files = {
        "__init__.py": "",
        "core/__init__.py": "",
        "core/a.py": "def f():\n    from ..training import b\n    return b\n",
        "training/__init__.py": "",
        "training/b.py": "from ..core.a import f\nimport dml_nb.core.a\n",
    }
    for name, text in files.items():
        (tmp_path / "dml_nb" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "dml_nb" / name).write_text(text)
    assert _upward_imports(tmp_path) == [
        "dml_nb.core.a:2 imports dml_nb.training.b (layer core -> higher layer training)"
    ]


def test_every_import_runs_down_the_layers():
    bad = _upward_imports()
    assert not bad, f"imports that run up the layers {' < '.join(LAYERS)}:\n" + "\n".join(bad)


def test_the_layers_are_the_folders():
    "The layers are the package's folders; beside them at the top, only the public modules."
    assert sorted(p.name for p in PKG.iterdir() if p.is_dir() and (p / "__init__.py").exists()) == sorted(LAYERS)
    top = sorted(p.stem for p in PKG.glob("*.py") if p.name not in ("__init__.py", "_modidx.py"))
    assert top == sorted(PUBLIC_MODULES), (
        f"the top of the package holds only the public modules {PUBLIC_MODULES}, not {sorted(set(top) - set(PUBLIC_MODULES))}"
    )


# The public namespace (`from dml_nb import losses, methods`; 03_threads): modules at the top of the package that only
# re-export names of the layers (70_api_losses to 73_api_models), and layer packages whose `__init__` re-exports its
# layer's names on first use (18_data, 46_training, 35_evaluation, 58_api_methods, 74_api_experiments). They are for users: no module of the
# library imports one.
PUBLIC_MODULES = ("losses", "miners", "distances", "models")
PUBLIC_PACKAGES = ("data", "training", "evaluation", "methods", "experiments")


def _all_names(tree: ast.Module) -> list[str]:
    "The literal `__all__` of a module."
    return next(
        ast.literal_eval(n.value)
        for n in tree.body
        if isinstance(n, ast.Assign) and [getattr(t, "id", None) for t in n.targets] == ["__all__"]
    )


def test_the_package_names_the_public_namespace():
    "`dml_nb.__all__` is the public modules and packages, which `import dml_nb` gives on first use."
    assert sorted(_all_names(ast.parse((PKG / "__init__.py").read_text()))) == sorted(PUBLIC_MODULES + PUBLIC_PACKAGES)
    assert set(PUBLIC_PACKAGES) <= set(LAYERS)


def test_the_public_modules_only_re_export():
    "A public module is a docstring, imports of public names from the layers, and the `__all__` that lists them."
    for name in PUBLIC_MODULES:
        module, tree = f"dml_nb.{name}", ast.parse((PKG / f"{name}.py").read_text())
        imported = []
        for node in tree.body:
            if isinstance(node, ast.ImportFrom):
                target = _resolve(module, node)
                assert target.startswith("dml_nb.") and target.split(".")[1] in LAYERS, f"{module} imports {target}"
                imported += [a.asname or a.name for a in node.names]
            else:
                targets = [getattr(t, "id", None) for t in node.targets] if isinstance(node, ast.Assign) else []
                docstring = isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
                assert docstring or targets in (["__all__"], ["_all_"]), (
                    f"{module}:{node.lineno} does more than re-export ({type(node).__name__}): define it in a layer"
                )
        assert not [n for n in imported if n.startswith("_")], f"{module} re-exports private names"
        assert sorted(_all_names(tree)) == sorted(imported), f"{module}: __all__ differs from what it imports"


def test_the_public_packages_import_on_first_use():
    "A public layer package imports nothing when imported: its names come through a module `__getattr__`."
    for name in PUBLIC_PACKAGES:
        tree = ast.parse((PKG / name / "__init__.py").read_text())
        eager = [n.lineno for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
        assert not eager, f"dml_nb.{name} imports at lines {eager}: import its names inside __getattr__"
        assert "__getattr__" in [n.name for n in tree.body if isinstance(n, ast.FunctionDef)]


def test_no_module_imports_the_public_namespace():
    "A module of the library imports from the layers: importing a public module or package closes a circle through it."
    mods = _modules()
    public = {f"dml_nb.{n}" for n in PUBLIC_MODULES + PUBLIC_PACKAGES}
    bad = [
        f"{m}:{line} imports {t}"
        for m, p in mods.items()
        if m not in public
        for t, _, line in _imports(m, p, set(mods) | public)
        if t in public
    ]
    assert not bad, "modules importing the public namespace (import from the defining module instead):\n" + "\n".join(
        bad
    )


def test_importing_the_package_loads_no_torch():
    "`import dml_nb` and its public packages load no torch; `from dml_nb import losses` gives the layers' objects."
    import subprocess
    import sys

    code = (
        "import sys, dml_nb, dml_nb.data, dml_nb.training, dml_nb.evaluation, dml_nb.methods\n"
        "assert 'torch' not in sys.modules, 'import dml_nb loaded torch'\n"
        "from dml_nb import losses, miners, methods\n"
        "from dml_nb.blocks.losses import MarginLoss\nfrom dml_nb.methods.diva import DiVA\n"
        "assert losses.MarginLoss is MarginLoss and methods.DiVA is DiVA and dml_nb.miners is miners"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


# Size limits that reward structure: a function (a method, a nested function) at most 60 lines, a class at most 300,
# counted on the formatted package (ruff format on the notebooks, then nbdev_export) from the first decorator to the
# last line. A module may grow: split it where a concept ends, not to meet a number.
FUNCTION_LIMIT, CLASS_LIMIT = 60, 300
# the definitions over their limit when the limits came in, with the size they must not grow past. The list only
# shrinks: shorten or split one, then lower its number or drop it (test_the_oversized_list_only_shrinks says which).
OVERSIZED: dict[str, int] = {}


def _definitions(source: str, module: str) -> dict[str, tuple[int, int]]:
    "{qualified name: (lines, limit)} of every def and class in `source`, nested ones included."
    out = {}

    def visit(node, qual):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name, start = f"{qual}.{child.name}", min([child.lineno] + [d.lineno for d in child.decorator_list])
                limit = CLASS_LIMIT if isinstance(child, ast.ClassDef) else FUNCTION_LIMIT
                # a name bound twice (in the branches of an `if`): the longer one
                out[name] = max(out.get(name, (0, limit)), (child.end_lineno - start + 1, limit))
                visit(child, name)
            else:
                visit(child, qual)

    visit(ast.parse(source), module)
    return out


def _sizes() -> dict[str, tuple[int, int]]:
    out = {}
    for p in sorted(PKG.rglob("*.py")):
        if p.name != "_modidx.py":
            parts = p.relative_to(ROOT).with_suffix("").parts
            out.update(_definitions(p.read_text(), ".".join(parts[:-1] if parts[-1] == "__init__" else parts)))
    return out


def test_the_size_walker_counts_methods_nested_functions_and_decorators():
    src = "class A:\n    @staticmethod\n    def f():\n        def g():\n            pass\n\n        return g\n\n\ndef h(): pass\n"
    assert _definitions(src, "m") == {
        "m.A": (7, CLASS_LIMIT),
        "m.A.f": (6, FUNCTION_LIMIT),
        "m.A.f.g": (2, FUNCTION_LIMIT),
        "m.h": (1, FUNCTION_LIMIT),
    }


def test_no_function_or_class_over_the_size_limit():
    big = {name: n for name, (n, limit) in _sizes().items() if n > OVERSIZED.get(name, limit)}
    assert not big, (
        f"functions over {FUNCTION_LIMIT} lines or classes over {CLASS_LIMIT} (or past their recorded size): {big}"
    )


def test_the_oversized_list_only_shrinks():
    sizes = _sizes()
    stale = {
        name: sizes[name][0] if name in sizes else None
        for name, n in OVERSIZED.items()
        if name not in sizes or sizes[name][0] < n
    }
    assert not stale, (
        f"lower these OVERSIZED entries to their current size, or drop them (within the limit or gone: None): {stale}"
    )


def test_the_data_contract_name_is_a_lazy_re_export():
    "`from dml_nb.data import load_dataset` works; importing the package loads no torch; no module imports the package."
    import subprocess
    import sys

    code = (
        "import sys, dml_nb.data; assert 'torch' not in sys.modules, 'import dml_nb.data loaded torch'\n"
        "from dml_nb.data import load_dataset\nfrom dml_nb.data.datasets import load_dataset as direct\n"
        "assert load_dataset is direct"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
    known = set(_modules())
    into_package = [
        f"{m}:{line}"
        for m, p in _modules().items()
        for t, names, line in _imports(m, p, known | {"dml_nb.data"})
        if t == "dml_nb.data"
    ]
    assert not into_package, (
        f"modules importing the dml_nb.data package itself (a circle through its re-export): {into_package}"
    )


def _lines(paths) -> int:
    return sum(len(p.read_text().splitlines()) for p in paths)


def test_no_folder_holds_more_than_a_quarter_of_the_package():
    "A layer that grows past a quarter of the package's lines mixes trades: split it along its seams."
    code = [p for p in PKG.rglob("*.py") if p.name != "_modidx.py"]
    total = _lines(code)
    share = {layer: _lines((PKG / layer).rglob("*.py")) / total for layer in LAYERS}
    big = {layer: f"{s:.0%}" for layer, s in share.items() if s > 0.25}
    assert not big, f"folders over 25 % of dml_nb/'s {total} lines: {big}"


# a run's data: defined in the data layer (data/build.py, behind `dml_nb.data`), composed by the run, never built there
DATA_BUILDING = (
    "build_data",
    "build_datasets",
    "eval_dataset",
    "check_data",
    "config_data_root",
    "LabelNoise",
    "tolerate_unreadable",
    "check_metric_sizes",
    "warn_small_classes",
)


def test_the_run_defines_no_data_building():
    tree = ast.parse((PKG / "experiments" / "experiment.py").read_text())
    defined = {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    assert not defined & set(DATA_BUILDING), f"experiments/experiment.py defines {sorted(defined & set(DATA_BUILDING))}"
    loads = [
        n.lineno for n in ast.walk(tree) if isinstance(n, ast.Name | ast.Attribute) and "load_dataset" in ast.unparse(n)
    ]
    assert not loads, f"experiments/experiment.py reads datasets itself (lines {loads}): go through dml_nb.data.build"
    home = ast.parse((PKG / "data" / "build.py").read_text())
    assert set(DATA_BUILDING) <= {n.name for n in home.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
