"""Build the documentation site into _docs/ from the notebooks of nbs/, without executing them.

    python tools/build_docs.py            # needs the docs extra: pip install -c constraints.txt -e ".[docs]"

A page per notebook, in the notebooks' order (index first, then by file name, as nbdev orders them), each with the
outputs saved in its notebook; the API of every public function and class a notebook exports, with its signature
and docstring (read from the exported source; a Sphinx py:function or py:class, the docstring as Markdown) where
the `#| export` cell stands, as nbdev places its `show_doc`; math by a bundled
MathJax (no CDN); search. Sphinx with myst-nb and sphinx-book-theme (a pydata-sphinx-theme); the configuration is
docs/conf.py. Sphinx's warnings fail the build (a broken link between notebooks, a broken cross-reference, an output or
a cell that does not render), and so does a notebook without a `# Title` first cell.

The notebooks are staged into build/docs/src with nbdev's directives applied (`#| hide`, `#| export`,
`#| default_exp`, `#| exporti` and `#| include: false` cells left out; `#| echo: false`, `#| output: false` and
`#| exports` honoured; directive lines dropped), Sphinx builds build/docs/html and the result replaces _docs/
(settings.ini's doc_path, the folder nbdev_docs writes where Quarto is installed). A reproduction notebook's
`defaults` cell (the long defaults of its parameters, which must follow the `parameters` cell) is collapsed behind
myst-nb's "Show code cell source" toggle, so that its page opens on its claim, its result and its parameters.
"""

from __future__ import annotations

import argparse
import ast
import configparser
import importlib
import json
import re
import shutil
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_DIRECTIVE = re.compile(r"^\s*#\s*\|\s*(.*?)\s*$")
_TITLE = re.compile(r"^#\s+(\S.*?)\s*$")
_HIDE_LINE = re.compile(r"#\s*\|\s*hide_line\s*$")
# a toctree caption for a run of notebooks that share a number decade: by the package most of them export to
_PACKAGES = {
    "core": "Core",
    "data": "Data",
    "blocks": "Building blocks",
    "evaluation": "Evaluation",
    "training": "Training",
    "methods": "Methods",
    "experiments": "Experiments",
    "sweeps": "sweeps",
    "reproduction": "reproduction",
}


def fail(msg: str, code: int = 2):
    print(f"build_docs: {msg}", file=sys.stderr)
    raise SystemExit(code)


def cut(s, n: int = 200) -> str:
    s = str(s)
    return s if len(s) <= n else s[: n - 3] + "..."


def settings() -> configparser.SectionProxy:
    cp = configparser.ConfigParser()
    if not cp.read(ROOT / "settings.ini"):
        fail(f"settings.ini not found in {ROOT}")
    return cp["DEFAULT"]


def notebook_order(nbs: Path) -> list[Path]:
    "nbdev's order: index.ipynb first, then by file name."
    files = [p for p in nbs.glob("*.ipynb") if not p.name.startswith((".", "_"))]
    return sorted(files, key=lambda p: (p.stem != "index", p.name))


def directives(source: str) -> tuple[dict[str, str], str]:
    "The leading `#|` lines of a code cell as {name: argument}, and the source without them (nbdev's rule)."
    lines = source.splitlines(True)
    found, i = {}, 0
    while i < len(lines) and (not lines[i].strip() or _DIRECTIVE.match(lines[i])):
        m = _DIRECTIVE.match(lines[i])
        if m and m.group(1):
            mm = re.match(r"([\w-]+)\s*:?\s*(.*)$", m.group(1))
            if mm:
                found[mm.group(1)] = mm.group(2)
        i += 1
    body = "".join(line for line in lines[i:] if not _HIDE_LINE.search(line))
    return found, body.rstrip("\n")


def module_name(lib: str, exp: str) -> str:
    exp = exp.strip()
    if exp in ("", "__init__"):
        return lib
    return f"{lib}.{exp.removesuffix('.__init__')}"


def falsy(v: str | None) -> bool:
    return v is not None and v.strip().lower() in ("false", "no", "0")


def _md(text: str) -> dict:
    return {"cell_type": "markdown", "metadata": {}, "source": text}


def _signature(fn: ast.FunctionDef | ast.AsyncFunctionDef, drop_first: bool) -> str:
    "The signature as the source writes it (annotations and defaults unevaluated, as nbdev's show_doc shows them)."
    args = fn.args
    if drop_first:
        pos = list(args.posonlyargs) + list(args.args)
        if pos:
            if args.posonlyargs:
                args = ast.arguments(
                    args.posonlyargs[1:],
                    args.args,
                    args.vararg,
                    args.kwonlyargs,
                    args.kw_defaults,
                    args.kwarg,
                    args.defaults,
                )
            else:
                args = ast.arguments(
                    args.posonlyargs,
                    args.args[1:],
                    args.vararg,
                    args.kwonlyargs,
                    args.kw_defaults,
                    args.kwarg,
                    args.defaults,
                )
            n_pos = len(args.posonlyargs) + len(args.args)
            if len(args.defaults) > n_pos:  # the dropped argument had a default
                args.defaults = args.defaults[len(args.defaults) - n_pos :]
    sig = "(" + ast.unparse(args) + ")"
    if fn.returns is not None:
        sig += " -> " + ast.unparse(fn.returns)
    return " ".join(sig.split())


def _decorators(node) -> set[str]:
    return {ast.unparse(d).split("(")[0].split(".")[-1] for d in node.decorator_list}


def _class_signature(node: ast.ClassDef) -> str:
    init = next((n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"), None)
    if init is not None:
        return _signature(init, drop_first=True)
    if "dataclass" in _decorators(node):
        fields = []
        for n in node.body:
            if (
                isinstance(n, ast.AnnAssign)
                and isinstance(n.target, ast.Name)
                and "ClassVar" not in ast.unparse(n.annotation)
            ):
                f = f"{n.target.id}: {ast.unparse(n.annotation)}"
                fields.append(f + (f" = {ast.unparse(n.value)}" if n.value is not None else ""))
        return " ".join(("(" + ", ".join(fields) + ")").split())
    return ""


def _doc(node) -> str:
    return (ast.get_docstring(node) or "").strip()


def _fence(kind: str, colons: int, head: str, options: list[str], body: str) -> str:
    fence = ":" * colons
    opts = "".join(f":{o}\n" for o in options)
    return f"{fence}{{{kind}}} {head}\n{opts}\n{body}\n{fence}" if body else f"{fence}{{{kind}}} {head}\n{opts}{fence}"


class Api:
    """The API of the exported cells of all notebooks: a py:function or py:class (with its public methods) for each
    public function and class, its docstring rendered as Markdown (nbdev's docstrings are Markdown). Each object and
    module is described once."""

    def __init__(self, lib: str):
        self.lib, self.modules, self.objects = lib, set(), set()
        self.reexports: list[tuple[dict, str, list[tuple[str, str]]]] = []  # (cell, module, [(name, source)])
        self.imported: dict[str, str] = {}  # the current notebook's exported imports: name -> source

    def notebook(self):
        self.imported = {}

    def cell(self, module: str, code: str) -> dict | None:
        try:
            tree = ast.parse(code)
        except SyntaxError:
            return None  # a cell with IPython syntax: nothing to document
        blocks, reexp = [], []
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and not node.name.startswith(
                "_"
            ):
                full = f"{module}.{node.name}"
                if full in self.objects:
                    continue
                self.objects.add(full)
                if isinstance(node, ast.ClassDef):
                    members = []
                    for n in node.body:
                        if not isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) or n.name.startswith("_"):
                            continue
                        if not _doc(n):
                            continue
                        dec = _decorators(n)
                        if "property" in dec or "cached_property" in dec:
                            members.append(_fence("py:property", 3, n.name, [], _doc(n)))
                            continue
                        opts = (
                            ["staticmethod:"]
                            if "staticmethod" in dec
                            else ["classmethod:"]
                            if "classmethod" in dec
                            else []
                        )
                        if isinstance(n, ast.AsyncFunctionDef):
                            opts.append("async:")
                        sig = _signature(n, drop_first="staticmethod" not in dec)
                        members.append(_fence("py:method", 3, n.name + sig, opts, _doc(n)))
                    bases = ", ".join(ast.unparse(b) for b in node.bases)
                    body = "\n\n".join(filter(None, [f"Bases: `{bases}`" if bases else "", _doc(node), *members]))
                    blocks.append(
                        _fence("py:class", 4, node.name + _class_signature(node), [f"module: {module}"], body)
                    )
                else:
                    opts = [f"module: {module}"] + (["async:"] if isinstance(node, ast.AsyncFunctionDef) else [])
                    blocks.append(_fence("py:function", 4, node.name + _signature(node, False), opts, _doc(node)))
            elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == self.lib:
                self.imported.update(
                    {a.asname or a.name: f"{node.module}.{a.name}" for a in node.names if a.name != "*"}
                )
            elif isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "_all_" for t in node.targets
            ):
                # nbdev's `_all_`: imported names the module exports (a facade's re-exports)
                if isinstance(node.value, (ast.List, ast.Tuple)):
                    for e in node.value.elts:
                        name = e.id if isinstance(e, ast.Name) else e.value if isinstance(e, ast.Constant) else None
                        if isinstance(name, str) and name in self.imported:
                            reexp.append((name, self.imported[name]))
        if blocks and module not in self.modules:
            self.modules.add(module)
            blocks.insert(0, f"::::{{py:module}} {module}\n::::")
        if reexp:
            cell = _md("")
            self.reexports.append((cell, module, [r for r in reexp if not r[0].startswith("_")]))
            if not blocks:
                return cell
        if not blocks:
            return None
        return _md("\n\n".join(blocks))

    def resolve_reexports(self):
        "Each re-exported name links to where its object is described (plain code where it is not)."
        for cell, module, names in self.reexports:
            items = []
            for name, src in names:
                target = src
                if target not in self.objects:
                    try:  # a package that re-exports in turn: the object's home module
                        obj = getattr(importlib.import_module(src.rsplit(".", 1)[0]), src.rsplit(".", 1)[1])
                        target = f"{obj.__module__}.{obj.__qualname__}"
                    except Exception:  # noqa: BLE001 - a constant, or a module that does not import here: not linked
                        pass
                items.append(f"{{py:obj}}`{name} <{target}>`" if target in self.objects else f"`{name}`")
            cell["source"] = f"`{module}` exports: " + ", ".join(items) + "." if items else ""


_LINK = re.compile(r"(\]\(|href=\")([^)\s\"]+)")


def repo_links(text: str, nb_path: Path, repo_url: str, branch: str) -> str:
    """Links from a notebook to files of the repository outside nbs/ (`../figures/x.md`) point to the repository's
    web page of the file (the site holds the notebooks only); a link to a file that does not exist fails the build."""

    def swap(m):
        target = m.group(2)
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I) or target.startswith(("#", "/")):
            return m.group(0)
        path, _, anchor = target.partition("#")
        dest = (nb_path.parent / path).resolve()
        if nb_path.parent.resolve() in (dest, *dest.parents):
            return m.group(0)  # a notebook or a file of nbs/: Sphinx resolves it (and warns if it is missing)
        if ROOT.resolve() not in dest.parents or not dest.exists():
            fail(f"{nb_path.name}: the link {cut(target)} points to no file of the repository; fix the link")
        kind = "tree" if dest.is_dir() else "blob"
        url = f"{repo_url.rstrip('/')}/{kind}/{branch}/{dest.relative_to(ROOT.resolve()).as_posix()}"
        return m.group(1) + url + (f"#{anchor}" if anchor else "")

    return _LINK.sub(swap, text)


def stage(nb_path: Path, api: Api, lib: str, repo: tuple[str, str]) -> tuple[dict, str, str | None]:
    "The notebook as the site shows it, its title and its module (`#| default_exp`)."
    try:
        nb = json.loads(nb_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        fail(f"{nb_path.name}: not a readable notebook ({cut(e)}); fix or remove the file")
    cells = nb.get("cells", [])
    first = cells[0] if cells else None
    title = None
    if first and first.get("cell_type") == "markdown":
        lines = "".join(first["source"]).strip().splitlines()
        m = _TITLE.match(lines[0]) if lines else None
        title = m.group(1) if m else None
    if title is None:
        fail(
            f"{nb_path.name}: the first cell is not a markdown cell starting with '# Title' (nbdev's page title); add one"
        )
    module, out = None, []
    api.notebook()
    for cell in cells:
        src = "".join(cell.get("source", ""))
        if cell.get("cell_type") != "code":
            if cell.get("cell_type") in ("markdown", "raw"):
                text = repo_links(src, nb_path, *repo) if cell["cell_type"] == "markdown" else src
                out.append(dict(cell, source=text))
            continue
        d, body = directives(src)
        if "default_exp" in d:
            module = module_name(lib, d["default_exp"])
        exported = next((k for k in ("export", "exports", "exporti") if k in d), None)
        if exported:
            mod = module_name(lib, d[exported].split()[0]) if d[exported].split() else module
            if mod is None:
                fail(
                    f"{nb_path.name}: an '#| {exported}' cell before any '#| default_exp'; add the default_exp cell first"
                )
            doc = api.cell(mod, body) if exported != "exporti" else None
            if exported == "exports":
                out.append(_code(cell, body, d))
            if doc is not None:
                out.append(doc)
            continue
        if "default_exp" in d or "hide" in d or falsy(d.get("include")):
            continue
        if not body.strip() and not cell.get("outputs"):
            continue
        out.append(_code(cell, body, d))
    seen = set()
    for i, c in enumerate(out):  # nbformat 4.5: every cell has an id, unique in its notebook
        if not c.get("id") or c["id"] in seen:
            c["id"] = f"docs-{i}"
        seen.add(c["id"])
    staged = dict(nb, cells=out, nbformat=4, nbformat_minor=max(5, nb.get("nbformat_minor", 5)))
    staged.setdefault("metadata", {}).setdefault(
        "kernelspec", {"display_name": "python3", "language": "python", "name": "python3"}
    )
    staged["metadata"].setdefault("language_info", {"name": "python"})
    return staged, title, module


def _code(cell: dict, body: str, d: dict) -> dict:
    tags = list(cell.get("metadata", {}).get("tags", []))
    if "defaults" in tags:  # a reproduction's long defaults: collapsed, so its page opens on claim, result, parameters
        tags.append("hide-input")
    if falsy(d.get("echo")) or not body.strip():
        tags.append("remove-input")
    if falsy(d.get("output")):
        tags.append("remove-output")
    meta = {"tags": tags} if tags else {}
    return {
        "cell_type": "code",
        "id": cell.get("id"),
        "execution_count": None,
        "metadata": meta,
        "source": body,
        "outputs": cell.get("outputs", []),
    }


def caption(stems: list[str], modules: dict[str, str | None], lib: str) -> str:
    if all(s.startswith("repro_") for s in stems):
        return "Paper reproductions"
    pkgs = Counter()
    for s in stems:
        m = modules.get(s)
        if m and m != lib:
            parts = m.split(".")
            pkgs[parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in _PACKAGES) else "<top>"] += 1
    if pkgs:
        pkg = pkgs.most_common(1)[0][0]
        if pkg == "<top>":
            return f"Public API ({lib}.*)"
        layers = [
            p for p in _PACKAGES if p in pkgs
        ]  # a decade may hold several layers (60-69: a run, sweeps, reproductions)
        if len(layers) > 1:
            names = [_PACKAGES[p] for p in layers]
            return f"{', '.join(names[:-1])} and {names[-1]} ({', '.join(f'{lib}.{p}' for p in layers)})"
        if pkg in _PACKAGES:
            return f"{_PACKAGES[pkg]} ({lib}.{pkg})"
        return f"{lib}.{pkg}"
    return f"Notebooks {stems[0]} to {stems[-1]}"


def group(stems: list[str]) -> list[list[str]]:
    "Runs of notebooks with the same number decade (00-09, 10-19, ...), then the ones without a number prefix."
    groups, key = [], object()
    for s in stems:
        m = re.match(r"(\d)\d", s)
        k = m.group(1) if m else ("repro" if s.startswith("repro_") else s)
        if k != key:
            groups.append([])
            key = k
        groups[-1].append(s)
    return groups


def write_if_changed(path: Path, text: str):
    if not path.exists() or path.read_text(encoding="utf-8") != text:
        path.write_text(text, encoding="utf-8")


def main(argv=None) -> int:
    cfg = settings()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nbs", default=cfg.get("nbs_path", "nbs"), help="the notebooks folder (settings.ini's nbs_path)")
    ap.add_argument("--out", default=cfg.get("doc_path", "_docs"), help="the site's folder (settings.ini's doc_path)")
    ap.add_argument("--build", default="build/docs", help="the staging and Sphinx work folder")
    ap.add_argument("-j", "--jobs", default="1", help="Sphinx's parallel jobs (a number or 'auto')")
    ap.add_argument("-v", "--verbose", action="store_true", help="Sphinx's progress lines too")
    args = ap.parse_args(argv)
    nbs, out, work = (ROOT / args.nbs), (ROOT / args.out), (ROOT / args.build)
    if not nbs.is_dir():
        fail(f"--nbs {cut(args.nbs)}: no such folder; give the folder that holds the notebooks")
    if not (args.jobs == "auto" or args.jobs.isdigit() and int(args.jobs) > 0):
        fail(f"--jobs {cut(args.jobs)}: not a positive number or 'auto'")
    if out.resolve() in (ROOT, nbs.resolve()) or ROOT.resolve() not in (out.resolve(), *out.resolve().parents):
        fail(f"--out {cut(args.out)}: must be a folder inside the repository other than its root or the notebooks")
    try:
        import myst_nb  # noqa: F401
        import sphinx_book_theme  # noqa: F401
        from sphinx.cmd.build import build_main
    except ImportError as e:
        fail(f'{e.name} is not installed; install the docs extra: pip install -c constraints.txt -e ".[docs]"')
    lib = cfg.get("lib_name", "dml_nb")
    # the re-exports are resolved by importing the package: this tree's, not one installed from another checkout
    sys.path.insert(0, str(ROOT))
    files = notebook_order(nbs)
    if not files:
        fail(f"--nbs {cut(args.nbs)}: no notebooks in it")
    t0 = time.time()
    src = work / "src"
    src.mkdir(parents=True, exist_ok=True)
    api, staged, modules = Api(lib), {}, {}
    for f in files:
        staged[f.stem], _, modules[f.stem] = stage(f, api, lib, (cfg.get("git_url", ""), cfg.get("branch", "main")))
    api.resolve_reexports()
    stems = [s for s in staged if s != "index"]
    if "index" not in staged:
        fail(f"{cut(args.nbs)}/index.ipynb is missing: the home page (settings.ini's readme_nb)")
    trees = []
    for g in group(stems):
        trees.append("```{toctree}\n:hidden:\n:caption: " + caption(g, modules, lib) + "\n\n" + "\n".join(g) + "\n```")
    trees.append("```{toctree}\n:hidden:\n:caption: Index\n\ngenindex\nmodindex\n```")
    staged["index"]["cells"].append(dict(_md("\n\n".join(trees)), id="docs-toctree"))
    for stem, nb in staged.items():
        write_if_changed(src / f"{stem}.ipynb", json.dumps(nb, indent=1, ensure_ascii=False) + "\n")
    for old in src.glob("*.ipynb"):
        if old.stem not in staged:
            old.unlink()
    html = work / "html"
    opts = ["-b", "html", "-E", "-a", "-W", "--keep-going", "-j", args.jobs] + ([] if args.verbose else ["-q"])
    opts += ["-c", str(ROOT / "docs"), "-d", str(work / "doctrees"), str(src), str(html)]
    rc = build_main(opts)
    if rc != 0:
        fail("Sphinx reported the warnings or errors above; the site was not written", code=1)
    missing = [s for s in staged if not (html / f"{s}.html").is_file()]
    if missing:
        fail(f"no page for {cut(', '.join(missing))}", code=1)
    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(html, out, ignore=shutil.ignore_patterns(".buildinfo", ".doctrees"))
    (out / ".nojekyll").touch()  # GitHub Pages: serve _static/ and _images/ as they are
    print(
        f"build_docs: {len(staged)} pages in {out.relative_to(ROOT)}/ ({time.time() - t0:.0f} s); open {out.relative_to(ROOT)}/index.html"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
