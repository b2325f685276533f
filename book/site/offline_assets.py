"""Sphinx extension: the site serves every browser library it uses, so no page needs the network.

Three libraries would otherwise come from a CDN:

- plotly.js: taken from the installed ``plotly`` package (so it matches the Python side),
  written once to ``_static/`` and loaded only by pages that draw a figure, before
  require.js (plotly.js registers as an AMD module instead of ``window.Plotly`` when
  require.js is already on the page).
- the ipywidgets HTML manager and require.js, which render widgets' saved state
  (``nb_ipywidgets_js`` in ``_config.yml`` points at the copies made here).
- MathJax 3 (``mathjax_path`` in ``_config.yml``); it loads its fonts and TeX extensions
  relative to its own script, so its whole ``es5/`` folder is copied.

The last two come from ``node_modules/``, pinned by ``package.json`` and
``package-lock.json`` and installed by ``npm ci`` (``make book`` does it).

The extension also points the build's kernels at ``plotly_renderer.py`` (beside this
file) through an ``IPYTHONDIR`` inside the build folder, so notebooks executed by the
build emit figures the site can show, while readers' kernels and nbval are untouched.

Per page it adds what that page needs and nothing else: plotly.js where a figure is
drawn; where widgets are, a require.js configuration that tells the widget manager where
its icon fonts are; where widgets and math meet, ``static/widgets-mathjax3.js``. It also
drops inline scripts that Sphinx 7.4 lists twice. Every page gets ``static/outputs.css``,
which lets a code cell's long lines scroll instead of being cut off at the page's edge.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from sphinx.application import Sphinx
from sphinx.errors import ExtensionError

HERE = Path(__file__).resolve().parent
NODE_MODULES = HERE.parents[1] / "node_modules"  # npm ci in the repository root
WIDGET_MANAGER = "@jupyter-widgets/html-manager/dist"
# node_modules/<source>  ->  _static/<destination>
NPM_ASSETS = {
    "requirejs/require.js": "widgets/require.js",
    f"{WIDGET_MANAGER}/embed-amd.js": "widgets/embed-amd.js",
    "mathjax/es5": "mathjax",
}
# The widget manager's icon fonts (Font Awesome, hashed names) sit beside embed-amd.js.
FONT_SUFFIXES = (".woff2", ".woff", ".ttf", ".eot", ".svg")
# Script priorities (Sphinx loads lower first; myst-nb adds require.js and the widget
# manager at 500). plotly.js must come before require.js: with require.js on the page it
# registers as an AMD module instead of defining window.Plotly.
PLOTLY_PRIORITY = 400
REQUIRE_CONFIG_PRIORITY = 450
MATHJAX_SHIM_PRIORITY = 510


def plotly_js_name() -> str:
    from plotly.offline import get_plotlyjs_version

    return f"plotly-{get_plotlyjs_version()}.min.js"


def point_kernels_at_startup_file(app: Sphinx) -> None:
    ipython_dir = Path(app.outdir).parent / "ipython"
    startup = ipython_dir / "profile_default" / "startup"
    startup.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(HERE / "plotly_renderer.py", startup / "00-plotly-renderer.py")
    # Kernels started by the build (myst-nb / jupyter-cache) inherit this environment.
    os.environ["IPYTHONDIR"] = str(ipython_dir)


def copy_assets(app: Sphinx) -> None:
    if app.builder.format != "html":
        return
    static = Path(app.outdir) / "_static"
    for source, destination in NPM_ASSETS.items():
        path = NODE_MODULES / source
        if not path.exists():
            raise ExtensionError(
                f"{path} is missing: install the site's browser libraries with `npm ci` "
                "in the repository root (`make book` does it)"
            )
        target = static / destination
        target.parent.mkdir(parents=True, exist_ok=True)
        if path.is_dir():
            shutil.copytree(path, target, dirs_exist_ok=True)
        else:
            shutil.copy2(path, target)
    for font in (NODE_MODULES / WIDGET_MANAGER).iterdir():
        if font.suffix in FONT_SUFFIXES:
            shutil.copy2(font, static / "widgets" / font.name)

    from plotly.offline import get_plotlyjs

    (static / plotly_js_name()).write_text(get_plotlyjs(), encoding="utf-8")


def finish_page_scripts(app: Sphinx, pagename, templatename, context, doctree) -> None:
    """Runs after myst-nb and the MathJax extension have added this page's scripts."""
    scripts = context.get("script_files")
    if scripts is None:
        return
    drop_repeated_inline_scripts(scripts)
    loaded = {js.filename for js in scripts if js.filename}
    widgets = any(name.endswith("widgets/embed-amd.js") for name in loaded)
    math = any(name.endswith(app.config.mathjax_path) for name in loaded)
    if "plotly-graph-div" in context.get("body", ""):
        app.add_js_file(plotly_js_name(), priority=PLOTLY_PRIORITY)
    if widgets:
        # A `require` object defined before require.js is its configuration. The manager
        # finds its fonts relative to where require.js thinks its module lives.
        here = context["pathto"]("_static/widgets", 1)
        config = json.dumps({"paths": {WIDGET_MANAGER: here}})
        app.add_js_file(None, body=f"var require = {config};", priority=REQUIRE_CONFIG_PRIORITY)
    if widgets and math:
        app.add_js_file("widgets-mathjax3.js", priority=MATHJAX_SHIM_PRIORITY)


def drop_repeated_inline_scripts(scripts: list) -> None:
    """Sphinx 7.4 registers an extension's inline script twice (once as filename None, once
    as ''), so sphinx-thebe's `const THEBE_JS_URL = ...` runs twice and throws."""
    seen = set()
    for js in list(scripts):
        key = (js.filename or "", js.priority, tuple(sorted(js.attributes.items())))
        if key in seen:
            scripts.remove(js)
        seen.add(key)


def add_static_folder(app: Sphinx, config) -> None:
    config.html_static_path.append(str(HERE / "static"))


def setup(app: Sphinx) -> dict:
    app.connect("config-inited", add_static_folder)
    app.add_css_file("outputs.css")  # static/outputs.css: long output lines scroll, not clip
    app.connect("builder-inited", point_kernels_at_startup_file)
    app.connect("builder-inited", copy_assets)
    # After myst-nb (widget scripts) and sphinx.ext.mathjax, which run at the default 500.
    app.connect("html-page-context", finish_page_scripts, priority=600)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
