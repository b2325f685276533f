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


def _render(blocks: list[tuple[str, str]], lexer) -> "HTML":
    from IPython.display import HTML
    from pygments import highlight
    from pygments.formatters import HtmlFormatter

    formatter = HtmlFormatter(nowrap=False, cssclass="labkit-source")
    parts = [f"<style>{formatter.get_style_defs('.labkit-source')}</style>"]
    for header, code in blocks:
        parts.append(f"<div style='font-size:0.8em;color:#666'>{header}</div>")
        parts.append(highlight(code, lexer, formatter))
    return HTML("\n".join(parts))


def show_source(*objs: object):
    """Render the source of each object, highlighted, for display in a notebook cell."""
    from pygments.lexers import PythonLexer

    if not objs:
        raise ValueError("show_source needs at least one object")
    return _render([source_of(obj) for obj in objs], PythonLexer())


def show_code(header: str, code: str, language: str = "cpp"):
    """Render ``code`` in another language (C++ or CUDA kept as text in a labkit module),
    highlighted, under ``header`` (say which constant it is)."""
    from pygments.lexers import get_lexer_by_name

    if not isinstance(code, str) or not code.strip():
        raise ValueError("show_code needs non-empty source text")
    return _render([(header, code.strip("\n") + "\n")], get_lexer_by_name(language))
