"""CuTe's layout algebra, in a few lines of Python, to explain tiles and swizzles.

A CuTe *layout* is a pair of (possibly nested) tuples, a shape and a stride, and it is a
function from coordinates to offsets: coordinate ``(i, j)`` of a ``(4, 8) : (8, 1)``
layout lands at ``8 i + j`` (row-major), of ``(4, 8) : (1, 4)`` at ``i + 4 j`` (column-
major). An integer index is read *colexicographically* (the first mode varies fastest), so
every layout is also a function of one integer. CUTLASS 3 builds every tensor, every
thread-to-data assignment of a tiled copy or MMA, and every shared-memory arrangement
out of layouts and four operations on them:

- :func:`coalesce`: the same function with as few modes as possible;
- :func:`composition` ``A o B``: ``i -> A(B(i))``, itself a layout (B picks which
  coordinates of A, A says where they live);
- :func:`complement` of ``A`` in ``M``: the layout that, paired with ``A``, covers
  ``0 .. M-1`` once: "the rest" of a tile;
- :func:`logical_divide` ``A / B``: ``A o (B, complement(B))``: A's elements regrouped as
  (one tile of shape B, which tile), the tiling every kernel does.

A :class:`Swizzle` is the one function on offsets that is not a layout: it XORs some bits
of an offset into lower bits, so that the rows of a tile land in different shared-memory
banks. Hopper's TMA and wgmma use the 32, 64 and 128-byte swizzles it describes.

This follows the definitions in CuTe's documentation (``cute/01_layout.md``,
``02_layout_algebra.md``); it handles the cases those pages work through, not every
corner CuTe's C++ does.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod


def _flatten(t) -> tuple[int, ...]:
    if isinstance(t, int):
        return (t,)
    return tuple(x for mode in t for x in _flatten(mode))


def _same_profile(shape, stride) -> bool:
    if isinstance(shape, int) or isinstance(stride, int):
        return isinstance(shape, int) and isinstance(stride, int)
    return len(shape) == len(stride) and all(_same_profile(a, b) for a, b in zip(shape, stride))


def _size(shape) -> int:
    return prod(_flatten(shape))


@dataclass(frozen=True)
class Layout:
    """``shape : stride``, a function from coordinates (or one colexicographic index) to offsets."""

    shape: int | tuple
    stride: int | tuple

    def __post_init__(self) -> None:
        if not _same_profile(self.shape, self.stride):
            raise ValueError(f"shape and stride must have the same profile (nesting), got shape "
                             f"{self.shape} and stride {self.stride}")

    @property
    def size(self) -> int:
        """How many coordinates: the product of the shape."""
        return _size(self.shape)

    @property
    def cosize(self) -> int:
        """One past the largest offset: the memory the layout spans."""
        return self(self.size - 1) + 1

    def modes(self) -> list[Layout]:
        """The top-level modes, each a layout of its own."""
        if isinstance(self.shape, int):
            return [self]
        return [Layout(s, d) for s, d in zip(self.shape, self.stride)]

    def __call__(self, coord) -> int:
        if isinstance(coord, int):
            if not 0 <= coord < self.size:
                raise ValueError(f"index {coord} is out of range for a layout of size {self.size}")
            offset = 0
            for s, d in zip(_flatten(self.shape), _flatten(self.stride)):  # colexicographic
                offset += (coord % s) * d
                coord //= s
            return offset
        modes = self.modes()
        if len(coord) != len(modes):
            raise ValueError(f"coordinate {coord} has {len(coord)} modes, the layout {self} has {len(modes)}")
        return sum(mode(c) for mode, c in zip(modes, coord))

    def __str__(self) -> str:
        return f"{self.shape}:{self.stride}"


def _flat_modes(layout: Layout) -> list[tuple[int, int]]:
    return list(zip(_flatten(layout.shape), _flatten(layout.stride)))


def _from_modes(modes: list[tuple[int, int]]) -> Layout:
    if not modes:
        return Layout(1, 0)
    if len(modes) == 1:
        return Layout(*modes[0])
    return Layout(tuple(s for s, _ in modes), tuple(d for _, d in modes))


def coalesce(layout: Layout) -> Layout:
    """The same function with the fewest modes: size-1 modes dropped, and a mode merged into
    the one before whenever it continues it (``stride == previous shape * previous stride``)."""
    merged: list[tuple[int, int]] = []
    for s, d in _flat_modes(layout):
        if s == 1:
            continue
        if merged and d == merged[-1][0] * merged[-1][1]:
            merged[-1] = (merged[-1][0] * s, merged[-1][1])
        else:
            merged.append((s, d))
    return _from_modes(merged)


def _compose_mode(a: Layout, shape: int, stride: int) -> Layout:
    """``A o (shape : stride)``: skip the first ``stride`` elements' worth of A's modes (divide),
    then keep the first ``shape`` (modulo); CuTe's rule, for strides and shapes that divide."""
    modes = _flat_modes(coalesce(a))
    rest = stride
    divided = []
    for s, d in modes:  # A / stride
        if rest == 1:
            divided.append((s, d))
        elif rest % s == 0:
            rest //= s
        elif s % rest == 0:
            divided.append((s // rest, d * rest))
            rest = 1
        else:
            raise ValueError(f"stride {stride} does not divide the shape of {a}")
    if rest != 1:  # past A's end: the last mode extends
        last_s, last_d = modes[-1]
        divided = [(1, last_d * last_s * rest)]
    kept, left = [], shape
    for s, d in divided:  # ... % shape
        if left == 1:
            break
        if left >= s and left % s == 0:
            kept.append((s, d))
            left //= s
        elif s % left == 0:
            kept.append((left, d))
            left = 1
        else:
            raise ValueError(f"shape {shape} does not divide the modes of {a}")
    if left != 1:
        s, d = divided[-1]
        kept.append((left, d * s))
    return coalesce(_from_modes(kept))


def composition(a: Layout, b: Layout) -> Layout:
    """``A o B``: the layout ``i -> A(B(i))``, with B's shape (mode by mode)."""
    if isinstance(b.shape, int):
        return _compose_mode(a, b.shape, b.stride)
    parts = [composition(a, mode) for mode in b.modes()]
    return Layout(tuple(p.shape for p in parts), tuple(p.stride for p in parts))


def complement(layout: Layout, size: int) -> Layout:
    """The layout ``C`` such that ``(layout, C)`` maps ``0 .. size-1`` onto ``0 .. size-1``
    once each: the strides the layout skips, in order, then copies of it up to ``size``."""
    modes = sorted((d, s) for s, d in _flat_modes(layout) if s != 1 and d != 0)
    result, covered = [], 1
    for d, s in modes:
        if d % covered:
            raise ValueError(f"{layout} overlaps itself; it has no complement")
        result.append((d // covered, covered))
        covered = d * s
    result.append((-(-size // covered), covered))
    return coalesce(_from_modes(result))


def logical_divide(layout: Layout, tile: Layout) -> Layout:
    """``layout`` regrouped as ``(one tile, which tile)``: ``layout o (tile, complement(tile))``."""
    rest = complement(tile, layout.size)
    return composition(layout, Layout((tile.shape, rest.shape), (tile.stride, rest.stride)))


@dataclass(frozen=True)
class Swizzle:
    """CuTe's ``Swizzle<B, M, S>``: XOR the ``B`` bits at ``M + S`` into the ``B`` bits at ``M``.

    On byte offsets, ``Swizzle(3, 4, 3)`` is the 128-byte swizzle: within each 1024-byte
    block (8 rows of 128 bytes), the 16-byte chunk index (bits 4-6) is XORed with the row
    (bits 7-9), so a column of 16-byte chunks spreads over all eight chunk positions and
    thus over all 32 banks.
    """

    bits: int
    base: int
    shift: int

    def __call__(self, offset: int) -> int:
        mask = ((1 << self.bits) - 1) << (self.base + self.shift)
        return offset ^ ((offset & mask) >> self.shift)


def table(layout: Layout) -> list[list[int]]:
    """A rank-2 layout's offsets as rows x columns (for figures)."""
    rows, cols = (_size(m.shape) for m in layout.modes())
    return [[layout((i, j)) for j in range(cols)] for i in range(rows)]


def bank_conflicts(offsets_bytes: list[int], bank_bytes: int = 4, banks: int = 32) -> int:
    """The most accesses any one bank serves when these byte offsets are read at once (1: no
    conflict). Offsets in the same 4-byte word are one access."""
    words = {o // bank_bytes for o in offsets_bytes}
    per_bank = [0] * banks
    for w in words:
        per_bank[w % banks] += 1
    return max(per_bank)


__all__ = ["Layout", "Swizzle", "bank_conflicts", "coalesce", "complement", "composition", "logical_divide",
           "table"]
