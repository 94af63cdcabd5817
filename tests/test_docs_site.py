"""The documentation site in a real browser: `python tools/build_docs.py` builds _docs/ from the notebooks, a thread
serves it on 127.0.0.1, a crawler follows every internal link (none broken, anchors included; external links are
listed, never fetched, and no page loads a script, style sheet or image from outside), and headless Chromium
(Debian's `chromium`) renders the index, 51_diva and repro_table3: each shows its title, a rendered equation or
table and all its images, its screenshot is not blank, and the browser asked the server for nothing it lacks (the
MathJax fonts and extensions included).

These are slow (a minute or more: the build), and skipped where chromium or the docs extra is missing; the staging
checks at the end are fast and need neither:

    apt-get install -y chromium && pip install -c constraints.txt -e ".[docs]"
    DML_DOCS_SHOTS=/tmp/docs_shots pytest tests/test_docs_site.py -m slow -s   # keeps the screenshots there

DML_DOCS_NO_BUILD=1 checks the _docs/ of the last build instead of building it again.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from html.parser import HTMLParser
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.error import HTTPError
from urllib.parse import urljoin, urlsplit
from urllib.request import urlopen

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "_docs"
STAGED = ROOT / "build" / "docs" / "src"
PAGES = ["index", "51_diva", "repro_table3"]
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DOCS_EXTRA = ("sphinx", "myst_nb", "sphinx_book_theme", "sphinx-mathjax-offline")
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
    "--virtual-time-budget=15000",  # let MathJax and the search run before the dump or the screenshot
]


def _missing() -> str | None:
    if CHROMIUM is None:
        return "chromium is not installed (Debian: apt-get update && apt-get install -y chromium)"
    lacking = [m for m in DOCS_EXTRA if importlib.util.find_spec(m) is None]
    if lacking:
        return f'the docs extra is not installed ({", ".join(lacking)}): pip install -c constraints.txt -e ".[docs]"'
    return None


browser = pytest.mark.skipif(_missing() is not None, reason=_missing() or "")  # with slow: the build and Chromium

# A page asked for with ?dom-probe gets this script: once the page and MathJax are done it writes on <html> how many
# images the page has and how many of them loaded, which --dump-dom then shows.
PROBE = """<script>
window.addEventListener("load", function () {
  var finish = function () {
    var imgs = Array.prototype.slice.call(document.images);
    var ok = imgs.filter(function (i) { return i.complete && i.naturalWidth > 0; });
    var h = document.documentElement;
    h.setAttribute("data-probe-img-total", imgs.length);
    h.setAttribute("data-probe-img-loaded", ok.length);
    h.setAttribute("data-probe-done", "1");
  };
  var mj = window.MathJax && window.MathJax.startup && window.MathJax.startup.promise;
  if (mj) { mj.then(finish, finish); } else { finish(); }
});
</script>"""


class _Handler(SimpleHTTPRequestHandler):
    requests: list[tuple[str, int]]

    def log_message(self, *args):  # quiet; the statuses are kept in `requests`
        pass

    def send_response(self, code, message=None):
        self.requests.append((self.path, code))
        super().send_response(code, message)

    def do_GET(self):
        parts = urlsplit(self.path)
        if "dom-probe" in parts.query and parts.path.endswith(".html"):
            f = Path(self.translate_path(parts.path))
            if f.is_file():
                body = f.read_text(encoding="utf-8").replace("</body>", PROBE + "</body>").encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/html; charset=utf-8")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
                return
        super().do_GET()


@pytest.fixture(scope="module")
def site():
    if os.environ.get("DML_DOCS_NO_BUILD") == "1" and (DOCS / "index.html").is_file():
        print("\nDML_DOCS_NO_BUILD=1: checking the _docs/ of the last python tools/build_docs.py")
    else:
        t0 = time.time()
        cmd = [sys.executable, "tools/build_docs.py"]
        r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1800)
        assert r.returncode == 0, f"the docs build failed:\n{r.stdout[-4000:]}\n{r.stderr[-8000:]}"
        print(f"\nbuild: {time.time() - t0:.0f} s; {r.stdout.strip().splitlines()[-1]}")
    requests: list[tuple[str, int]] = []
    handler = type("Handler", (_Handler,), {"requests": requests})
    server = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(handler, directory=str(DOCS)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/", requests
    finally:
        server.shutdown()
        server.server_close()


class _Links(HTMLParser):
    def __init__(self):
        super().__init__()
        self.links, self.resources, self.ids = [], [], set()

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        for k in ("id", "name"):
            if a.get(k):
                self.ids.add(a[k])
        if tag == "a" and a.get("href"):
            self.links.append(a["href"])
        elif tag == "link" and a.get("href"):
            self.resources.append(a["href"])
        elif tag in ("script", "img", "iframe", "source", "video", "audio") and a.get("src"):
            self.resources.append(a["src"])


def _get(url: str) -> tuple[int, bytes, str]:
    try:
        with urlopen(url, timeout=30) as r:
            return r.status, r.read(), r.headers.get("Content-Type", "")
    except HTTPError as e:
        return e.code, b"", ""


@pytest.mark.slow
@browser
def test_every_internal_link_resolves_and_nothing_loads_from_outside(site):
    base, _ = site
    host = urlsplit(base).netloc
    pages, queue, seen = {}, [base + "index.html"], set()
    broken, outside, external, anchors = [], [], set(), []  # type: ignore[var-annotated]
    while queue:
        url = queue.pop()
        if url in seen:
            continue
        seen.add(url)
        status, body, ctype = _get(url)
        if status != 200:
            broken.append(f"{url} ({status})")
            continue
        if "text/html" not in ctype:
            continue
        p = _Links()
        p.feed(body.decode("utf-8", "replace"))
        pages[url] = p
        for ref, is_resource in [(h, False) for h in p.links] + [(s, True) for s in p.resources]:
            if ref.startswith(("mailto:", "javascript:", "data:")):
                continue
            full = urljoin(url, ref)
            parts = urlsplit(full)
            if parts.netloc != host:
                if is_resource:
                    outside.append(f"{url}: {ref}")
                else:
                    external.add(full)
                continue
            target = full.split("#")[0]
            if parts.fragment:
                anchors.append((url, target, parts.fragment))
            if target not in seen:
                queue.append(target)
    for src, target, frag in anchors:  # an anchor names an id (or a name) on its page
        if target in pages and frag not in pages[target].ids:
            broken.append(f"{src} -> {target}#{frag} (no such anchor)")
    n_html = sum(1 for _ in DOCS.glob("*.html"))
    print(
        f"\ncrawled {len(pages)} pages ({n_html} in _docs/), {len(seen)} URLs; {len(external)} external links (not fetched):"
    )
    for e in sorted(external):
        print("  ", e)
    assert not broken, f"{len(broken)} broken internal links: " + "; ".join(broken[:20])
    assert not outside, "a page loads from outside the site (the site must work offline): " + "; ".join(outside[:10])
    notebooks = sorted(p.stem for p in (ROOT / "nbs").glob("*.ipynb"))
    unreached = [n for n in notebooks if f"{base}{n}.html" not in pages]
    assert not unreached, f"notebook pages the crawl from index.html does not reach: {unreached}"
    fonts = list((DOCS / "_static" / "mathjax" / "output" / "chtml" / "fonts" / "woff-v2").glob("*.woff"))
    assert fonts, "MathJax's fonts are not in _docs/_static/mathjax"


def _title(stem: str) -> str:
    first = json.loads((ROOT / "nbs" / f"{stem}.ipynb").read_text())["cells"][0]
    line = "".join(first["source"]).strip().splitlines()[0]
    return re.sub(r"[`*]", "", line.lstrip("#").strip())


def _chromium(args: list[str], timeout: int = 120) -> subprocess.CompletedProcess:
    with tempfile.TemporaryDirectory(prefix="chromium-") as profile:
        return subprocess.run(
            [CHROMIUM, *FLAGS, f"--user-data-dir={profile}", *args], capture_output=True, text=True, timeout=timeout
        )


def _text(html: str) -> str:
    return " ".join(re.sub(r"<[^>]+>", " ", html).split())


@pytest.mark.slow
@browser
@pytest.mark.parametrize("stem", PAGES)
def test_page_renders_in_chromium(site, stem, tmp_path):
    from PIL import Image, ImageStat

    base, requests = site
    shots = Path(os.environ.get("DML_DOCS_SHOTS") or tmp_path)
    shots.mkdir(parents=True, exist_ok=True)
    url = f"{base}{stem}.html"
    static = (DOCS / f"{stem}.html").read_text(encoding="utf-8")
    n_math = len(re.findall(r'class="math[ "]', static))  # myst's math spans and blocks, before MathJax
    nb = json.loads((STAGED / f"{stem}.ipynb").read_text())
    n_images = sum(
        1
        for c in nb["cells"]
        if "remove-output" not in c.get("metadata", {}).get("tags", [])
        for o in c.get("outputs", [])
        if any(k.startswith("image/") for k in o.get("data", {}))
    )
    before = len(requests)
    # the screenshot first: it is kept for a person to look at even when a check below fails
    png = shots / f"{stem}.png"
    shot = _chromium([f"--screenshot={png}", "--window-size=1280,2000", url])
    assert shot.returncode == 0 and png.is_file(), f"chromium --screenshot {url}: {shot.stderr[-2000:]}"
    img = Image.open(png).convert("RGB")
    assert img.size == (1280, 2000), img.size
    stat = ImageStat.Stat(img.convert("L"))
    colours = len(img.getcolors(maxcolors=1 << 20) or [])
    assert stat.stddev[0] > 10 and colours > 50, f"{stem}: the screenshot looks blank ({png})"
    dom = _chromium(["--dump-dom", url + "?dom-probe"])
    assert dom.returncode == 0, f"chromium --dump-dom {url}: {dom.stderr[-2000:]}"
    html = dom.stdout
    assert 'data-probe-done="1"' in html, f"{stem}: the page's scripts did not finish (MathJax?)"
    h1 = re.search(r"<h1[^>]*>(.*?)</h1>", html.split("<article", 1)[-1], re.S)  # the article's, not the theme's
    title = _title(stem)
    assert h1 and title in _text(h1.group(1)), f"{stem}: the first <h1> is not the notebook's title {title!r}"
    n_mjx = html.count("<mjx-container")
    n_tables = len(re.findall(r"<table[\s>]", html))
    assert n_mjx or n_tables, f"{stem}: the page shows no rendered equation and no table"
    assert n_mjx >= n_math, f"{stem}: MathJax rendered {n_mjx} of the page's {n_math} equations"
    assert "<mjx-merror" not in html, f"{stem}: MathJax reports a TeX error on the page"
    total = int(re.search(r'data-probe-img-total="(\d+)"', html).group(1))
    loaded = int(re.search(r'data-probe-img-loaded="(\d+)"', html).group(1))
    assert total >= n_images, f"{stem}: {total} <img> on the page for the notebook's {n_images} saved images"
    assert loaded == total, f"{stem}: {total - loaded} of the page's {total} images did not load"
    if stem.startswith("repro_"):  # its long defaults collapsed: the page opens on its claim, result and parameters
        d = re.search(r'<div class="cell tag_defaults[^"]*">\s*<details([^>]*)>', html)
        assert d and " open" not in d.group(1), f"{stem}: the defaults cell is not collapsed on the page"
    failed = [(p, s) for p, s in requests[before:] if s >= 400 and p != "/favicon.ico"]  # the browser's own ask
    assert not failed, f"{stem}: the browser asked for files the site lacks: {failed[:10]}"

    print(f"\n{stem}: title {title!r}, {n_mjx} equations, {n_tables} tables, {loaded}/{total} images; {png}")


@pytest.mark.slow
@browser
def test_search_finds_a_page(site):
    base, _ = site
    dom = _chromium(["--dump-dom", f"{base}search.html?q=DaNCE"])
    assert dom.returncode == 0, dom.stderr[-2000:]
    hits = re.findall(r'<li[^>]*>\s*<a[^>]*href="([^"]+)"', dom.stdout.split('id="search-results"', 1)[-1])
    assert any("51_diva.html" in h for h in hits), f"searching 'DaNCE' does not list 51_diva: {hits[:10]}"


# --- the staging (fast: no Sphinx, no browser) ----------------------------------------------------------------------


@functools.cache
def _build_docs():
    spec = importlib.util.spec_from_file_location("build_docs", ROOT / "tools" / "build_docs.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _tagged(cells: list, tag: str) -> list[int]:
    return [i for i, c in enumerate(cells) if tag in c.get("metadata", {}).get("tags", [])]


@pytest.mark.parametrize("stem", sorted(p.stem for p in (ROOT / "nbs").glob("repro_*.ipynb")))
def test_a_reproduction_page_opens_on_its_claim_result_and_parameters(stem):
    """The long `defaults` cell that follows a reproduction's `parameters` cell is staged collapsed (myst-nb's
    `hide-input`), its source whole, so the page shows the title, the claim, the result line and the parameters, then
    a one-line toggle; no other code cell is collapsed."""
    bd = _build_docs()
    lib = "dml_nb"
    nb_path = ROOT / "nbs" / f"{stem}.ipynb"
    staged, _, _ = bd.stage(nb_path, bd.Api(lib), lib, ("https://github.com/o/r", "main"))
    cells = staged["cells"]
    (k,) = _tagged(cells, "parameters")
    defaults = _tagged(cells, "defaults")
    assert _tagged(cells, "hide-input") == defaults, f"{stem}: collapsed cells {_tagged(cells, 'hide-input')}"
    if not defaults:
        return
    assert defaults == [k + 1], f"{stem}: its defaults cell does not follow the parameters cell"
    source = next(c for c in json.loads(nb_path.read_text())["cells"] if "defaults" in c["metadata"].get("tags", []))
    assert cells[k + 1]["source"] == "".join(source["source"]).rstrip("\n"), f"{stem}: the defaults cell's source"
    intro = "\n".join(c["source"] for c in cells[:k] if c["cell_type"] == "markdown")
    assert "**The result** of the committed default run" in intro, stem
