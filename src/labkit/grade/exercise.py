"""An exercise folder, as ``exercises/README.md`` describes it, loaded and checked."""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

from .sandbox import Limits

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover  (the Gradescope image may have Python 3.10)
    import tomli as tomllib

ID_PATTERN = re.compile(r"^[a-z0-9]+(-[a-z0-9]+)*$")


def exercises_root() -> Path:
    """``exercises/`` of the checkout labkit was imported from."""
    from labkit.results import REPO_ROOT

    return REPO_ROOT / "exercises"


class ExerciseError(ValueError):
    """An exercise folder that does not follow the format."""


@dataclass(frozen=True)
class Wrong:
    """A known-wrong submission: edits to the solution, and the tests it must lose."""

    name: str
    edits: tuple[tuple[str, str], ...]
    lose: tuple[str, ...] = ()

    def apply(self, source: str) -> str:
        for old, new in self.edits:
            count = source.count(old)
            if count != 1:
                raise ExerciseError(f"wrong submission {self.name!r}: {old!r} occurs {count} times "
                                    "in the solution, not exactly once")
            source = source.replace(old, new)
        return source


@dataclass(frozen=True)
class Exercise:
    root: Path
    id: str
    title: str
    chapter: str
    notebook: Path
    functions: tuple[str, ...]
    points: dict[str, float]
    limits: Limits = field(default_factory=Limits)
    forbidden: tuple[str, ...] = ()
    kernels: tuple[str, ...] = ()
    wrong: tuple[Wrong, ...] = ()

    @property
    def public_tests(self) -> Path:
        return self.root / "tests" / "public"

    @property
    def hidden_tests(self) -> Path:
        return self.root / "tests" / "hidden"

    def test_files(self, *, hidden: bool = True) -> list[Path]:
        dirs = [self.public_tests] + ([self.hidden_tests] if hidden else [])
        return [p for d in dirs if d.is_dir() for p in sorted(d.glob("test_*.py"))]

    @property
    def max_points(self) -> float:
        return sum(self.points.values())


def load(where: str | Path) -> Exercise:
    """An exercise by id (under ``exercises/``) or by folder path."""
    root = Path(where)
    if not (root / "exercise.toml").is_file():
        if isinstance(where, str) and ID_PATTERN.match(where):
            root = exercises_root() / where
        if not (root / "exercise.toml").is_file():
            raise ExerciseError(f"no exercise {where!r}: expected {root / 'exercise.toml'}")
    try:
        meta = tomllib.loads((root / "exercise.toml").read_text())
    except tomllib.TOMLDecodeError as e:
        raise ExerciseError(f"{root / 'exercise.toml'}: {e}") from None

    def need(key: str, kind: type) -> object:
        if not isinstance(meta.get(key), kind):
            raise ExerciseError(f"{root / 'exercise.toml'}: {key!r} must be a {kind.__name__}")
        return meta[key]

    ex_id = str(need("id", str))
    if ex_id != root.name or not ID_PATTERN.match(ex_id):
        raise ExerciseError(f"exercise id {ex_id!r} must match its folder name {root.name!r} "
                            "(lower case, digits and dashes)")
    points = need("points", dict)
    if not points or not all(isinstance(v, (int, float)) and v > 0 for v in points.values()):
        raise ExerciseError(f"{ex_id}: [points] must give every test a positive number")
    limits = Limits(**meta.get("limits", {}))
    wrong = tuple(
        Wrong(str(w["name"]), tuple((str(a), str(b)) for a, b in w["edits"]), tuple(w.get("lose", ())))
        for w in meta.get("wrong", [])
    )
    kernels = tuple(str(k) for k in meta.get("kernels", ()))
    functions = tuple(need("functions", list))
    if set(kernels) - set(functions):
        raise ExerciseError(f"{ex_id}: kernels {sorted(set(kernels) - set(functions))} are not in functions")
    notebook = root / str(need("notebook", str))  # absent from the autograder, which needs only tests
    return Exercise(root=root, id=ex_id, title=str(need("title", str)), chapter=str(need("chapter", str)),
                    notebook=notebook, functions=functions, kernels=kernels,
                    points={str(k): float(v) for k, v in points.items()}, limits=limits,
                    forbidden=tuple(meta.get("forbidden", ())), wrong=wrong)


def all_exercises() -> list[Exercise]:
    root = exercises_root()
    return [load(p) for p in sorted(root.iterdir()) if (p / "exercise.toml").is_file()]
