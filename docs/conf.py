# Sphinx configuration of the documentation site. Build it with `python tools/build_docs.py` (not sphinx-build
# directly): the script stages the notebooks of nbs/ (nbdev's directives applied, the API of every `#| export` cell
# added) into build/docs/src, runs Sphinx with this folder as its configuration, and writes the site to _docs/.
# The notebooks are not executed: each page shows the outputs saved in its notebook.
import shutil
from pathlib import Path

from sphinx.util import logging

project = "dml_nb"
author = "dml_nb developers"
copyright = "2026 onwards, dml_nb developers"
root_doc = "index"

extensions = ["myst_nb", "sphinx.ext.mathjax"]

# notebooks: saved outputs only, never executed
nb_execution_mode = "off"
nb_merge_streams = True
nb_output_stderr = "show"
nb_number_source_lines = False
myst_enable_extensions = ["dollarmath", "amsmath", "colon_fence", "html_image"]
myst_dmath_double_inline = True
myst_heading_anchors = 3

# The API: tools/build_docs.py writes a py:function or py:class for every public function and class a notebook exports,
# at the export cell, with its docstring as Markdown (nbdev's docstrings are Markdown, not reStructuredText)
add_module_names = False
toc_object_entries = (
    False  # the sidebar lists pages and sections; a page's API objects would make it (and the build) heavy
)
python_display_short_literal_types = True

# math without a CDN: MathJax 3 from the sphinx-mathjax-offline wheel (PyPI), copied into _static/mathjax
mathjax_path = "mathjax/tex-chtml.js"

html_theme = "sphinx_book_theme"
html_title = "dml_nb"
html_copy_source = False
html_show_sourcelink = False
html_static_path = [str(Path(__file__).parent / "_static")]
html_css_files = ["dml_nb.css"]
html_theme_options = {
    "show_navbar_depth": 1,
    "max_navbar_depth": 1,
    "show_toc_level": 2,
    "home_page_in_toc": True,
    "use_download_button": False,
    "use_fullscreen_button": False,
    "use_repository_button": False,
}
html_last_updated_fmt = None

# Warnings fail the build (build_docs.py runs Sphinx with -W --keep-going). These categories do not: a notebook's
# headings may skip a level (H1 then H3), and a saved output may have a MIME type that has no HTML renderer.
suppress_warnings = ["myst.header", "mystnb.unknown_mime_type"]

_MATHJAX_KEEP = ("tex-chtml.js", "input", "output/chtml", "ui", "a11y", "sre", "adaptors")


def _mathjax_dir() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("sphinx-mathjax-offline")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            'MathJax not found: the package sphinx-mathjax-offline is missing; install the docs extra: pip install -c constraints.txt -e ".[docs]"'
        )
    return Path(list(spec.submodule_search_locations)[0]) / "static" / "mathjax"


def _copy_mathjax(app, exc):
    if exc is not None or app.builder.format != "html":
        return
    src, dst = _mathjax_dir(), Path(app.outdir) / "_static" / "mathjax"
    for part in _MATHJAX_KEEP:
        s, d = src / part, dst / part
        if s.is_dir():
            shutil.copytree(s, d, dirs_exist_ok=True, ignore=shutil.ignore_patterns("svg", "*-svg*.js"))
        else:
            d.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(s, d)
    logging.getLogger(__name__).info("MathJax copied to %s", dst)


def setup(app):
    _mathjax_dir()  # fail at start, not after the build, when MathJax is missing
    app.connect("build-finished", _copy_mathjax)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
