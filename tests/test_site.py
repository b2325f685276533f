"""The website in a real browser, offline.

A build of the book is served on 127.0.0.1 and every page of its table of contents is
opened in headless Chromium (Debian's ``/usr/bin/chromium``, driven by Playwright), with
every request that leaves localhost blocked and counted. On every page: no request leaves
the site, no console error, no failed request, and the page's own bytes (its HTML, which
carries the figures' data, and its images) stay under 1 MB; the libraries under
``_static/`` (plotly.js, MathJax, the widget manager, the theme) are shared by the whole
site. On every page whose notebook the build executed: every plotly figure has drawn its
SVG, moving each slider and each dropdown changes the figure, every widget shows its
saved state, all math is typeset, and a chapter offers its ``.ipynb`` for download.

Which builds:

- ``tests/site_fixture/``, a one-page book built with the book's own ``_config.yml``: each
  thing the site must render offline, whatever chapters exist.
- the book. With ``LABKIT_SITE=_build/html`` (``make book-check``), the site ``make book``
  built, every chapter checked in full. Otherwise (``make test``, CI) the test builds the
  book into a temporary folder executing a representative subset: the first chapter and
  the notebooks under ``book/`` (``LABKIT_SITE_EXECUTE=id,id`` picks others); the other
  chapters get the page checks only. That build is then rebuilt to show that the
  execution cache spares unchanged notebooks.

Screenshots of every page land in ``_build/site-screenshots/``.
"""

from __future__ import annotations

import functools
import http.server
import json
import os
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml

from labkit import book

REPO = book.REPO_ROOT
FIXTURE = REPO / "tests" / "site_fixture"
SCREENSHOTS = REPO / "_build" / "site-screenshots"
CHROMIUM = Path(os.environ.get("CHROMIUM", "/usr/bin/chromium"))
# Chromium as root in a container, with nothing that phones home.
CHROMIUM_ARGS = [
    "--no-sandbox", "--disable-gpu", "--disable-background-networking",
    "--disable-component-update", "--disable-sync", "--no-first-run",
]
LOCAL_HOSTS = {"127.0.0.1", "localhost"}
PAGE_BYTES_LIMIT = 1_000_000
FIGURE_TIMEOUT_MS = 30_000


@dataclass
class Site:
    html: Path  # the built site's root
    toc: Path
    executed: frozenset[str]  # docnames whose notebooks this build executed
    log: str = ""


def docnames(toc: Path) -> list[str]:
    """Every page of a table of contents whose source exists, in reading order."""
    return [entry for _, entry in book.toc_entries(toc) if book.resolve(entry, toc.parent)]


def notebook_docnames(toc: Path) -> list[str]:
    return [d for d in docnames(toc) if book.resolve(d, toc.parent).suffix == ".ipynb"]


def build(source: Path, out: Path, *, execute: list[str]) -> str:
    """Build ``source`` with the book's ``_config.yml``, executing only the ``execute`` notebooks."""
    config = yaml.safe_load((REPO / "_config.yml").read_text())
    skipped = [f"{d}.ipynb" for d in notebook_docnames(source / "_toc.yml") if d not in execute]
    config.setdefault("execute", {})["exclude_patterns"] = skipped
    # The config file moves to `out`; its paths must keep pointing into the repository.
    config["sphinx"]["local_extensions"] = {
        name: str(REPO / path) for name, path in config["sphinx"]["local_extensions"].items()
    }
    config["bibtex_bibfiles"] = [str(REPO / path) for path in config.get("bibtex_bibfiles", [])]
    out.mkdir(parents=True, exist_ok=True)
    (out / "_config.yml").write_text(yaml.safe_dump(config, sort_keys=False))
    jupyter_book = Path(sys.executable).parent / "jupyter-book"
    result = subprocess.run(
        [str(jupyter_book), "build", str(source), "--config", str(out / "_config.yml"),
         "--path-output", str(out), "--warningiserror", "--keep-going"],
        capture_output=True, text=True, timeout=1500,
    )
    log = result.stdout + result.stderr
    warnings = "\n".join(line for line in log.splitlines() if "WARNING:" in line or "rror" in line)
    assert result.returncode == 0, f"the build of {source} failed:\n{warnings}\n...\n{log[-3000:]}"
    return log


# ---------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def chromium() -> Path:
    if not CHROMIUM.exists():
        reason = f"{CHROMIUM} is not installed (`make browser` installs Debian's chromium as root)"
        if os.environ.get("CI"):
            pytest.fail(reason + "; on CI the browser test must run")
        pytest.skip(reason)
    return CHROMIUM


@pytest.fixture(scope="module")
def browser(chromium):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        # Playwright gives every launch a fresh, temporary --user-data-dir.
        browser = playwright.chromium.launch(executable_path=str(chromium), args=CHROMIUM_ARGS)
        yield browser
        browser.close()


@pytest.fixture(scope="module")
def fixture_site(chromium, tmp_path_factory) -> Site:
    out = tmp_path_factory.mktemp("fixture-site")
    toc = FIXTURE / "_toc.yml"
    log = build(FIXTURE, out, execute=notebook_docnames(toc))
    return Site(out / "_build" / "html", toc, frozenset(notebook_docnames(toc)), log)


def representative(toc: Path) -> list[str]:
    chosen = os.environ.get("LABKIT_SITE_EXECUTE")
    if chosen:
        return [c.path.relative_to(REPO).with_suffix("").as_posix() for c in book.select(chosen.split(","))]
    first = [c.path.relative_to(REPO).with_suffix("").as_posix() for c in book.chapters(toc)[:1]]
    return first + [d for d in notebook_docnames(toc) if d.startswith("book/")]


@pytest.fixture(scope="module")
def book_site(chromium, tmp_path_factory) -> Site:
    toc = REPO / "_toc.yml"
    built = os.environ.get("LABKIT_SITE")
    if built:
        html = (REPO / built).resolve()
        assert (html / "index.html").exists(), f"{html} holds no site: run `make book` first"
        return Site(html, toc, frozenset(notebook_docnames(toc)))
    out = tmp_path_factory.mktemp("book-site")
    executed = representative(toc)
    log = build(REPO, out, execute=executed)
    return Site(out / "_build" / "html", toc, frozenset(executed), log)


def serve(directory: Path):
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(directory)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.fixture(scope="module")
def sites(request):
    """``{"fixture": (Site, base URL), "book": ...}``, each served while the module runs."""
    servers, served = [], {}

    def get(name: str):
        if name not in served:
            site = request.getfixturevalue(f"{name}_site")
            server = serve(site.html)
            servers.append(server)
            served[name] = (site, f"http://127.0.0.1:{server.server_port}/")
        return served[name]

    yield get
    for server in servers:
        server.shutdown()


# ------------------------------------------------------------------------- one visit


@dataclass
class Visit:
    """One page load, with everything the browser saw go wrong."""

    page: object
    outside: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    page_bytes: dict[str, int] = field(default_factory=dict)


def open_page(browser, url: str) -> Visit:
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    page = context.new_page()
    visit = Visit(page)

    def route(route):
        if urlsplit(route.request.url).hostname in LOCAL_HOSTS:
            route.continue_()
        else:
            visit.outside.append(route.request.url)
            route.abort()

    def response(resp):
        path = urlsplit(resp.url).path
        if resp.status >= 400:
            visit.errors.append(f"HTTP {resp.status} for {resp.url}")
        elif "/_static/" not in path and urlsplit(resp.url).hostname in LOCAL_HOSTS:
            # The local server always sends Content-Length; reading bodies from an event
            # handler races with navigation.
            visit.page_bytes[resp.url] = int(resp.headers.get("content-length", 0))

    context.route("**/*", route)
    page.on("console", lambda m: m.type == "error" and visit.errors.append(f"console: {m.text}"))
    page.on("pageerror", lambda e: visit.errors.append(f"page error: {e}"))
    page.on("requestfailed", lambda r: urlsplit(r.url).hostname in LOCAL_HOSTS
            and visit.errors.append(f"request failed: {r.url} ({r.failure})"))
    page.on("response", response)
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    pending: set[str] = set()
    page.on("request", lambda r: pending.add(r.url))
    page.on("requestfinished", lambda r: pending.discard(r.url))
    page.on("requestfailed", lambda r: pending.discard(r.url))
    page.goto(url, wait_until="load")
    try:
        page.wait_for_load_state("networkidle", timeout=15_000)
    except PlaywrightTimeout:
        # Chromium sometimes never reports idle on a page whose requests have all ended
        # (seen on the Results appendix); what matters is that none is still in flight.
        page.wait_for_timeout(1_000)
        assert not pending, f"requests still in flight after load: {sorted(pending)}"
    return visit


def close(visit: Visit) -> None:
    visit.page.context.close()


# JS: what a figure draws, less its own controls and the names plotly gives each trace
# (toggling between two traces that draw the same thing changes those names only), so
# moving a control counts only if the plot itself looks different.
DRAWING = """gd => {
  const svgs = [...gd.querySelectorAll('.main-svg')].map(s => s.cloneNode(true));
  for (const s of svgs) {
    s.querySelectorAll('defs, .slider-container, .updatemenu-container, .hoverlayer, .zoomlayer').forEach(n => n.remove());
    for (const n of [s, ...s.querySelectorAll('*')]) ['class', 'id', 'clip-path'].forEach(a => n.removeAttribute(a));
  }
  return svgs.map(s => s.outerHTML).join('');
}"""


def check_figures(visit: Visit, *, chapter: bool) -> list[str]:
    """Every figure drawn, every control moves it; a chapter must have a figure with a control."""
    page, problems = visit.page, []
    figures = page.locator(".plotly-graph-div")
    count = figures.count()
    if count == 0:
        return ["no plotly figure on the page"] if chapter else []
    try:
        page.wait_for_function(
            "() => [...document.querySelectorAll('.plotly-graph-div')].every(gd => gd.querySelector('svg.main-svg'))",
            timeout=FIGURE_TIMEOUT_MS,
        )
    except Exception:
        drawn = page.locator(".plotly-graph-div svg.main-svg").count()
        return [f"plotly figures without an SVG after {FIGURE_TIMEOUT_MS} ms ({count} figures, {drawn} SVGs)"]
    controls = 0
    for i in range(count):
        gd = figures.nth(i)
        for kind, target in (("slider", ".slider-rail-touch-rect"), ("dropdown", ".updatemenu-header")):
            handle = gd.locator(target)
            if handle.count() == 0:
                continue
            controls += 1
            before = gd.evaluate(DRAWING)
            if kind == "slider":  # click the far end of the rail, then the near end
                box = handle.first.bounding_box()
                for x in (box["width"] - 2, 2):
                    handle.first.click(position={"x": x, "y": box["height"] / 2})
                    page.wait_for_timeout(300)
                    if gd.evaluate(DRAWING) != before:
                        break
            else:  # open the menu, pick the last option
                handle.first.click()
                gd.locator(".updatemenu-dropdown-button").last.click()
                page.wait_for_timeout(300)
            if gd.evaluate(DRAWING) == before:
                problems.append(f"figure {i + 1}: moving its {kind} did not change the figure")
    if controls == 0 and chapter:
        problems.append("no figure has a slider or dropdown")
    return problems


# JS: for every widget view, whether it rendered, and the text it shows.
WIDGET_VIEWS = """() => {
  return [...document.querySelectorAll('script[type="application/vnd.jupyter.widget-view+json"]')].map(s => {
    const area = s.previousElementSibling;
    const rendered = area && area.querySelector('.jupyter-widgets');
    return {model: JSON.parse(s.textContent).model_id, rendered: !!rendered,
            text: rendered ? area.innerText : '',
            readouts: rendered ? [...area.querySelectorAll('.widget-readout')].map(r => r.innerText.trim()) : [],
            math: rendered ? area.querySelectorAll('mjx-container').length : 0};
  });
}"""


def saved_state(page) -> dict[str, dict]:
    raw = page.evaluate(
        "() => document.querySelector('script[type=\"application/vnd.jupyter.widget-state+json\"]')?.textContent"
    )
    return {k: v["state"] for k, v in json.loads(raw)["state"].items()} if raw else {}


def descendants(state: dict[str, dict], model_id: str) -> list[dict]:
    model = state.get(model_id)
    if model is None:
        return []
    found = [model]
    for child in model.get("children", []):
        found += descendants(state, child.removeprefix("IPY_MODEL_"))
    return found


def expected_readout(model: dict) -> str | None:
    if not model.get("_model_name", "").endswith("SliderModel") or not model.get("readout", True):
        return None
    if model["_model_name"] == "FloatLogSliderModel":
        return None  # the readout shows the value snapped to base**(min + k*step), not the saved value
    value = model.get("value")
    if not isinstance(value, (int, float)):
        return None
    return format(value, model.get("readout_format", "d").lstrip(","))


def check_widgets(visit: Visit) -> list[str]:
    views = visit.page.evaluate(WIDGET_VIEWS)
    if not views:
        return []
    state, problems = saved_state(visit.page), []
    for view in views:
        if not view["rendered"]:
            problems.append(f"widget {view['model']} did not render")
            continue
        for model in descendants(state, view["model"]):
            readout = expected_readout(model)
            shown = [r.replace("\u2212", "-") for r in view["readouts"]]  # widgets print U+2212 for minus
            if readout is not None and readout not in shown:
                problems.append(f"a {model['_model_name']} shows {view['readouts']}, saved value {readout}")
            for output in model.get("outputs", []):
                text = output.get("text") or output.get("data", {}).get("text/plain", "")
                if text and text.strip() not in view["text"]:
                    problems.append(f"widget output {text.strip()!r} is not shown")
            description = model.get("description", "")
            if "$" in description and not view["math"]:
                problems.append(f"widget label {description!r} was not typeset")
            elif description and "$" not in description and description not in view["text"]:
                problems.append(f"widget label {description!r} is not shown")
    return problems


def check_math(visit: Visit) -> list[str]:
    page = visit.page
    if page.locator(".math").count() == 0:
        return []
    typeset = page.evaluate(
        "() => window.MathJax && MathJax.startup ? MathJax.startup.promise.then(() => true) : false"
    )
    if not typeset:
        return ["the page has math but MathJax did not start"]
    untypeset = page.locator(".math:not(:has(mjx-container))").count()
    problems = [f"{untypeset} math elements were not typeset"] if untypeset else []
    if page.locator("mjx-merror").count():
        problems.append("MathJax reports errors")
    return problems


def check_download(visit: Visit, docname: str) -> list[str]:
    link = visit.page.locator(f'a[href$="_sources/{docname}.ipynb"]')
    if link.count() == 0:
        return [f"no download link to {docname}.ipynb"]
    url = link.first.evaluate("a => a.href")
    resp = visit.page.request.get(url)
    if resp.status != 200 or "cells" not in resp.json():
        return [f"the notebook download {url} answered {resp.status}"]
    return []


def check_page(browser, site: Site, base: str, docname: str, label: str) -> None:
    visit = open_page(browser, f"{base}{docname}.html")
    try:
        problems: list[str] = []
        if docname in site.executed:
            chapter = docname.startswith("chapters/") or site.toc.parent == FIXTURE
            problems += check_figures(visit, chapter=chapter) + check_widgets(visit) + check_math(visit)
            if chapter:
                problems += check_download(visit, docname)
        else:
            problems += check_math(visit)
        visit.page.wait_for_timeout(200)  # late console errors from controls just moved
        visit.page.evaluate("() => { document.activeElement?.blur(); window.scrollTo(0, 0); }")
        SCREENSHOTS.mkdir(parents=True, exist_ok=True)
        visit.page.screenshot(path=str(SCREENSHOTS / f"{label}--{docname.replace('/', '--')}.png"), full_page=True)
        weight = sum(visit.page_bytes.values())
        if not visit.page_bytes.get(visit.page.url):
            problems.append("the page's own size is unknown: its response had no Content-Length")
        if weight > PAGE_BYTES_LIMIT:
            problems.append(f"the page's own bytes are {weight / 1e6:.2f} MB (limit 1 MB): {visit.page_bytes}")
        problems += visit.errors
        if visit.outside:
            problems.append(f"{len(visit.outside)} requests outside the site: {sorted(set(visit.outside))}")
        assert not problems, f"{docname}:\n  " + "\n  ".join(problems)
    finally:
        close(visit)


# ----------------------------------------------------------------------------- tests


@pytest.mark.parametrize("docname", docnames(FIXTURE / "_toc.yml"))
def test_fixture_page_renders_offline(browser, sites, docname):
    site, base = sites("fixture")
    check_page(browser, site, base, docname, "fixture")


@pytest.mark.parametrize("docname", docnames(REPO / "_toc.yml"))
def test_book_page_renders_offline(browser, sites, docname):
    site, base = sites("book")
    check_page(browser, site, base, docname, "book")


def test_sidebar_lists_every_part_and_page(browser, sites):
    site, base = sites("book")
    visit = open_page(browser, base + "index.html")
    try:
        nav = visit.page.locator("nav.bd-links")
        captions = [c.strip() for c in nav.locator("p.caption").all_inner_texts()]
        parts = [p["caption"] for p in yaml.safe_load(site.toc.read_text())["parts"]]
        assert captions == parts
        links = {a.split("#")[0] for a in nav.locator("a.reference").evaluate_all("as => as.map(a => a.href)")}
        for docname in docnames(site.toc)[1:]:
            assert any(link.endswith(f"/{docname}.html") for link in links), f"{docname} missing from the sidebar"
    finally:
        close(visit)


def test_search_finds_pages(browser, sites):
    site, base = sites("book")
    visit = open_page(browser, base + "search.html?q=Triton")
    try:
        visit.page.wait_for_selector("#search-results ul.search li", timeout=15_000)
        assert visit.page.locator("#search-results ul.search li").count() >= 1
        assert not visit.outside and not visit.errors, (visit.outside, visit.errors)
    finally:
        close(visit)


def test_rebuild_reuses_executed_notebooks(book_site, tmp_path_factory):
    """A rebuild after a notebook's file changes but its code does not executes nothing."""
    if not book_site.log:
        pytest.skip("LABKIT_SITE names a site built elsewhere; this test rebuilds the test's own build")
    executed = sorted(book_site.executed)
    assert "Executed notebook" in book_site.log or not executed
    for docname in executed:
        book.resolve(docname, REPO).touch()
    out = book_site.html.parents[1]
    log = build(REPO, out, execute=executed)
    assert "Executing notebook" not in log, log[-3000:]
    assert log.count("Using cached notebook") == len(executed), log[-3000:]
