"""The book's table of contents as data: which chapters exist, in which part.

``_toc.yml`` is the single list of chapters. The recorder, the tests and the Results
appendix read it through here rather than globbing folders, so a notebook that is not
in the book is not recorded, tested as a chapter, or shown.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import yaml

from .results import REPO_ROOT

TOC_PATH = REPO_ROOT / "_toc.yml"


@dataclass(frozen=True)
class Chapter:
    part: str  # the part's folder under chapters/, e.g. "1-silicon"
    part_caption: str
    path: Path  # the notebook

    @property
    def id(self) -> str:
        """The chapter's id: its notebook's stem, which benchmarks name as their chapter."""
        return self.path.stem


def toc_entries(toc_path: Path = TOC_PATH) -> list[tuple[str, str]]:
    """``(part caption, file)`` for every entry of ``_toc.yml``, the root included."""
    toc = yaml.safe_load(toc_path.read_text())
    entries = [("", toc["root"])]

    def walk(caption: str, items: list[dict]) -> None:
        for item in items:
            if "file" in item:
                entries.append((caption, item["file"]))
            walk(caption, item.get("sections", []))

    for part in toc.get("parts", []):
        walk(part.get("caption", ""), part.get("chapters", []))
    return entries


def resolve(entry: str, root: Path = REPO_ROOT) -> Path | None:
    """The file a toc entry names (entries omit the suffix), or None if it does not exist."""
    for suffix in (".ipynb", ".md"):
        candidate = root / f"{entry}{suffix}"
        if candidate.exists():
            return candidate
    return None


def chapters(toc_path: Path = TOC_PATH) -> list[Chapter]:
    """Every chapter notebook listed in the book, in reading order."""
    found = []
    for caption, entry in toc_entries(toc_path):
        path = resolve(entry, toc_path.parent)
        if path is not None and path.suffix == ".ipynb" and path.parts[-3] == "chapters":
            found.append(Chapter(part=path.parent.name, part_caption=caption, path=path))
    return found


def select(keys: list[str] | None) -> list[Chapter]:
    """Chapters by id (``triton-softmax``), part folder (``1-silicon``) or part number (``1``)."""
    every = chapters()
    if not keys:
        return every
    chosen: list[Chapter] = []
    for key in keys:
        hits = [c for c in every if key in (c.id, c.part, c.part.split("-", 1)[0])]
        if not hits:
            known = ", ".join(sorted({c.id for c in every} | {c.part for c in every}))
            raise KeyError(f"{key!r} names no chapter or part; known: {known}")
        chosen.extend(c for c in hits if c not in chosen)
    return chosen
