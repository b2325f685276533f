"""Show a labkit function's source in a notebook, straight from the package.

Chapters never paste a copy of labkit code: the prose would drift from the code. They
call :func:`show_source`, which reads the object's current source and renders it with
a header naming the file and lines it came from.
"""

from __future__ import annotations

import inspect
from pathlib import Path

from .results import REPO_ROOT


def _unwrap(obj: object) -> object:
    # Triton's @jit returns a JITFunction (or InterpretedFunction) holding the Python function.
    for attr in ("fn", "__wrapped__"):
        inner = getattr(obj, attr, None)
        if inner is not None and callable(inner):
            return _unwrap(inner)
    return obj


def source_of(obj: object) -> tuple[str, str]:
    """``(header, source)`` for a function, class, method, module or Triton kernel."""
    target = _unwrap(obj)
    try:
        lines, start = inspect.getsourcelines(target)  # type: ignore[arg-type]
        path = Path(inspect.getsourcefile(target) or "?")  # type: ignore[arg-type]
    except (TypeError, OSError) as e:
        raise TypeError(f"cannot show the source of {obj!r}: {e}") from None
    try:
        shown = path.resolve().relative_to(REPO_ROOT)
    except ValueError:
        shown = path
    start = max(start, 1)
    header = f"{shown}, lines {start}-{start + len(lines) - 1}"
    return header, "".join(lines)


def show_source(*objs: object):
    """Render the source of each object, highlighted, for display in a notebook cell."""
    from IPython.display import HTML
    from pygments import highlight
    from pygments.formatters import HtmlFormatter
    from pygments.lexers import PythonLexer

    if not objs:
        raise ValueError("show_source needs at least one object")
    formatter = HtmlFormatter(nowrap=False, cssclass="labkit-source")
    parts = [f"<style>{formatter.get_style_defs('.labkit-source')}</style>"]
    for obj in objs:
        header, code = source_of(obj)
        parts.append(f"<div style='font-size:0.8em;color:#666'>{header}</div>")
        parts.append(highlight(code, PythonLexer(), formatter))
    return HTML("\n".join(parts))
