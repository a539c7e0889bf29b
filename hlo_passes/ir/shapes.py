"""HLO shapes: arrays (dtype, dims, layout), tuples, token and opaque."""

from __future__ import annotations

import math
import re

__all__ = ["Shape", "parse_shape", "DTYPE_BITS"]

DTYPE_BITS: dict[str, int] = {
    "pred": 8, "s1": 1, "s2": 2, "s4": 4, "s8": 8, "s16": 16, "s32": 32, "s64": 64,
    "u1": 1, "u2": 2, "u4": 4, "u8": 8, "u16": 16, "u32": 32, "u64": 64,
    "f16": 16, "bf16": 16, "f32": 32, "f64": 64, "c64": 64, "c128": 128,
    "f4e2m1fn": 4, "f8e3m4": 8, "f8e4m3": 8, "f8e4m3fn": 8, "f8e4m3b11fnuz": 8,
    "f8e4m3fnuz": 8, "f8e5m2": 8, "f8e5m2fnuz": 8, "f8e8m0fnu": 8,
    "token": 0, "opaque": 0,
}
"""Storage bits per element of every HLO primitive type (pred is one byte)."""

_ARRAY_RE = re.compile(r"([a-z][a-z0-9]*)\[([^\]\n]*)\](?:\{([^{}\n]*)\})?")
_DIMS_RE = re.compile(r"\d+(?:,\d+)*\Z")
_TUPLE_SEP_RE = re.compile(r"\s*(?:/\*[^*]*\*/\s*)?")
_PAREN_RE = re.compile(r"[()\n]")


class ShapeSyntaxError(ValueError):
    """Internal: malformed shape text at ``pos`` (the parser adds the line)."""

    def __init__(self, pos: int, expected: str):
        super().__init__(f"expected {expected} at offset {pos}")
        self.pos = pos
        self.expected = expected


class Shape:
    """An immutable HLO shape.

    An array shape has a ``dtype`` (``"f32"``, ``"bf16"``, ``"pred"``, ...), ``dims``
    (a tuple of ints; ``-1`` for an unbounded dynamic dimension ``?``), ``dynamic``
    (None, or a tuple of bools marking bounded-dynamic ``<=N`` dimensions) and
    ``layout``: the text between the braces, kept verbatim (``"1,0"``,
    ``"1,0:T(8,128)S(1)"``) or None when the text had no layout. ``token[]`` and
    ``opaque[]`` are arrays of dtype ``token``/``opaque`` and rank 0. A tuple shape
    has dtype ``"tuple"`` and ``elements`` (a tuple of Shapes, possibly nested).

    Shapes compare and hash by their printed text, so layouts matter; use
    :meth:`without_layout` to compare modulo layout.
    """

    __slots__ = ("dtype", "dims", "dynamic", "layout", "elements", "_text")

    def __init__(self, dtype: str, dims=(), layout: str | None = None,
                 elements=None, dynamic=None):
        self.dtype = dtype
        self.dims = tuple(dims)
        self.layout = layout
        self.elements = None if elements is None else tuple(elements)
        self.dynamic = None if dynamic is None or not any(dynamic) else tuple(dynamic)
        self._text = None

    # -- constructors -----------------------------------------------------------
    @classmethod
    def array(cls, dtype: str, dims=(), layout: str | None = None) -> Shape:
        """An array shape; ``layout`` defaults to the descending (row-major) one."""
        if layout is None and dims:
            layout = ",".join(str(i) for i in reversed(range(len(dims))))
        return cls(dtype, dims, layout)

    @classmethod
    def tuple_of(cls, elements) -> Shape:
        """A tuple shape of the given element shapes."""
        return cls("tuple", (), None, elements)

    @classmethod
    def token(cls) -> Shape:
        """The token shape ``token[]``."""
        return cls("token")

    # -- predicates and sizes ---------------------------------------------------
    @property
    def is_tuple(self) -> bool:
        return self.elements is not None

    @property
    def is_array(self) -> bool:
        return self.elements is None and self.dtype not in ("token", "opaque")

    @property
    def is_token(self) -> bool:
        return self.dtype == "token"

    @property
    def is_opaque(self) -> bool:
        return self.dtype == "opaque"

    @property
    def rank(self) -> int:
        return len(self.dims)

    @property
    def num_elements(self) -> int:
        """Number of array elements (upper bound for dynamic dims; 0 for tuples)."""
        if self.elements is not None:
            return 0
        return math.prod(self.dims) if -1 not in self.dims else 0

    @property
    def byte_size(self) -> int:
        """Bytes of the data: array elements, or the sum over tuple leaves."""
        if self.elements is not None:
            return sum(e.byte_size for e in self.elements)
        return (self.num_elements * DTYPE_BITS.get(self.dtype, 32) + 7) // 8

    @property
    def minor_to_major(self) -> tuple[int, ...] | None:
        """The layout's dimension order, or None when there is no layout."""
        if self.layout is None:
            return None
        head = self.layout.split(":", 1)[0]
        return tuple(int(d) for d in head.split(",")) if head else ()

    def leaves(self) -> list[Shape]:
        """The non-tuple shapes in depth-first order."""
        if self.elements is None:
            return [self]
        return [leaf for e in self.elements for leaf in e.leaves()]

    def without_layout(self) -> Shape:
        """This shape with every layout removed (what signatures print)."""
        if self.elements is not None:
            return Shape.tuple_of(e.without_layout() for e in self.elements)
        if self.layout is None:
            return self
        return Shape(self.dtype, self.dims, None, None, self.dynamic)

    def with_layout(self, layout: str | None) -> Shape:
        """An array shape with the given verbatim layout text."""
        assert self.elements is None, "tuples have no layout of their own"
        return Shape(self.dtype, self.dims, layout, None, self.dynamic)

    def compatible(self, other: Shape) -> bool:
        """Equal modulo layouts."""
        return str(self.without_layout()) == str(other.without_layout())

    # -- printing -----------------------------------------------------------------
    def __str__(self) -> str:
        text = self._text
        if text is None:
            text = self._text = self._render()
        return text

    def _render(self) -> str:
        if self.elements is not None:
            parts = []
            for i, e in enumerate(self.elements):
                if i == 0:
                    parts.append(str(e))
                elif i % 5 == 0:
                    parts.append(f", /*index={i}*/{e}")
                else:
                    parts.append(f", {e}")
            return "(" + "".join(parts) + ")"
        if self.dynamic is None:
            dims = ",".join("?" if d == -1 else str(d) for d in self.dims)
        else:
            dims = ",".join(
                "?" if d == -1 else (f"<={d}" if dyn else str(d))
                for d, dyn in zip(self.dims, self.dynamic, strict=True))
        text = f"{self.dtype}[{dims}]"
        if self.layout is not None:
            text += "{" + self.layout + "}"
        return text

    def __repr__(self) -> str:
        return f"Shape({self})"

    def __eq__(self, other) -> bool:
        return isinstance(other, Shape) and str(self) == str(other)

    def __hash__(self) -> int:
        return hash(str(self))


_ARRAY_CACHE: dict[str, Shape] = {}
_TUPLE_CACHE: dict[str, Shape] = {}


def _parse_dims(text: str, pos: int):
    if not text:
        return (), None
    if _DIMS_RE.match(text):
        return tuple(int(d) for d in text.split(",")), None
    dims, dynamic = [], []
    for part in text.split(","):
        part = part.strip()
        if part == "?":
            dims.append(-1)
            dynamic.append(True)
        elif part.startswith("<=") and part[2:].isdigit():
            dims.append(int(part[2:]))
            dynamic.append(True)
        elif part.isdigit():
            dims.append(int(part))
            dynamic.append(False)
        else:
            raise ShapeSyntaxError(pos, "a dimension (N, <=N or ?)")
    return tuple(dims), tuple(dynamic)


def parse_shape_at(text: str, pos: int) -> tuple[Shape, int]:
    """Parses the shape starting at ``text[pos]``.

    Returns:
      The shape and the offset just past it.

    Raises:
      ShapeSyntaxError: the text there is not a shape.
    """
    if text.startswith("(", pos):
        # Find the matching parenthesis to use the whole text as a cache key.
        depth = 0
        for m in _PAREN_RE.finditer(text, pos):
            c = m.group()
            if c == "\n":
                break
            depth += 1 if c == "(" else -1
            if depth == 0:
                end = m.end()
                key = text[pos:end]
                shape = _TUPLE_CACHE.get(key)
                if shape is None:
                    shape = _parse_tuple(text, pos)
                    _TUPLE_CACHE[key] = shape
                return shape, end
        raise ShapeSyntaxError(pos, "')' closing this tuple shape")
    m = _ARRAY_RE.match(text, pos)
    if m is None:
        raise ShapeSyntaxError(pos, "a shape such as f32[4,8]{1,0} or (s32[], f32[2])")
    key = m.group()
    shape = _ARRAY_CACHE.get(key)
    if shape is None:
        dims, dynamic = _parse_dims(m.group(2), m.start(2))
        shape = Shape(m.group(1), dims, m.group(3), None, dynamic)
        _ARRAY_CACHE[key] = shape
    return shape, m.end()


def _parse_tuple(text: str, pos: int) -> Shape:
    pos += 1
    elements = []
    pos = _TUPLE_SEP_RE.match(text, pos).end()
    if text.startswith(")", pos):
        return Shape.tuple_of(())
    while True:
        pos = _TUPLE_SEP_RE.match(text, pos).end()
        shape, pos = parse_shape_at(text, pos)
        elements.append(shape)
        pos = _TUPLE_SEP_RE.match(text, pos).end()
        if text.startswith(",", pos):
            pos += 1
            continue
        if text.startswith(")", pos):
            return Shape.tuple_of(elements)
        raise ShapeSyntaxError(pos, "',' or ')' in a tuple shape")


def parse_shape(text: str) -> Shape:
    """Parses a whole string as one shape, e.g. ``"(f32[4]{0}, s32[])"``.

    Raises:
      ValueError: the string is not exactly one shape.
    """
    text = text.strip()
    shape, end = parse_shape_at(text, 0)
    if end != len(text):
        raise ShapeSyntaxError(end, "end of shape")
    return shape
