"""Bytes as a polynomial in the batch size B (and the sequence length S): the only module that imports sympy.

Saved tensors carry the batch axis, so a node's saved bytes are ``per_sample * B + fixed``. A few
graphs have higher powers (a B x B similarity matrix); those keep their extra coefficients in
``higher`` instead of being truncated. When the sequence length is a symbol too (an input written
``B,S``), terms in S (attention scores bring ``B*S^2``) are kept in ``seq_terms``.
See Note [Why B=1 is measured on its own] in account.py.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

import sympy

from fxmem.errors import NonLinearBatchError

__all__ = ["ByteExpr", "DataDependentBytes", "fit_linear", "label_dim", "to_byte_expr"]


class DataDependentBytes(ValueError):
    """Bytes that depend on tensor values (a size from nonzero or a boolean mask): no pass can fix them."""


@dataclass(frozen=True)
class ByteExpr:
    """``per_sample * B + fixed (+ higher[0] * B**2 + ...) (+ sum of c * B**i * S**j)`` bytes, exact integers.

    >>> ByteExpr(per_sample=64, fixed=4).at(8)
    516
    >>> ByteExpr(seq_terms=((1, 2, 4),)).at(2, seq=16)   # 4*B*S^2
    2048
    """

    per_sample: int = 0
    fixed: int = 0
    higher: tuple[int, ...] = ()
    seq_terms: tuple[tuple[int, int, int], ...] = ()
    """(power of B, power of S >= 1, coefficient), sorted; empty unless S is symbolic."""

    def __repr__(self) -> str:
        extra = "".join(f", {k}={v!r}" for k, v in (("higher", self.higher), ("seq_terms", self.seq_terms)) if v)
        return f"ByteExpr(per_sample={self.per_sample}, fixed={self.fixed}{extra})"

    def __add__(self, other: ByteExpr) -> ByteExpr:
        if not (self.higher or other.higher or self.seq_terms or other.seq_terms):  # a*B + c, the common case
            return ByteExpr(self.per_sample + other.per_sample, self.fixed + other.fixed)
        n = max(len(self.higher), len(other.higher))
        pad = lambda h: h + (0,) * (n - len(h))
        higher = tuple(a + b for a, b in zip(pad(self.higher), pad(other.higher)))
        seq: dict[tuple[int, int], int] = defaultdict(int)
        for i, j, c in (*self.seq_terms, *other.seq_terms):
            seq[(i, j)] += c
        seq_terms = tuple(sorted((i, j, c) for (i, j), c in seq.items() if c))
        return ByteExpr(self.per_sample + other.per_sample, self.fixed + other.fixed, _trim(higher), seq_terms)

    def __neg__(self) -> ByteExpr:
        return ByteExpr(-self.per_sample, -self.fixed, tuple(-c for c in self.higher), tuple((i, j, -c) for i, j, c in self.seq_terms))

    def __sub__(self, other: ByteExpr) -> ByteExpr:
        return self + -other

    def __mul__(self, count: int) -> ByteExpr:
        """``count`` copies of these bytes (a whole number: blocks, devices, ...)."""
        return ByteExpr(
            self.per_sample * count,
            self.fixed * count,
            _trim(tuple(c * count for c in self.higher)),
            tuple((i, j, c * count) for i, j, c in self.seq_terms if c * count),
        )

    def at(self, batch: int, seq: int | None = None) -> int:
        """The bytes at one batch size (and sequence length, where S is symbolic)."""
        if not (self.higher or self.seq_terms):  # a*B + c, the common case: a report evaluates tens of thousands
            return self.per_sample * batch + self.fixed
        if self.seq_terms and seq is None:
            raise ValueError(f"bytes {self.polynomial()} depend on the sequence length S; pass seq=")
        powers = sum(c * batch ** (k + 2) for k, c in enumerate(self.higher))
        seq_part = sum(c * batch**i * seq**j for i, j, c in self.seq_terms) if seq is not None else 0
        return self.per_sample * batch + self.fixed + powers + seq_part

    @property
    def is_linear(self) -> bool:
        """True for a*B + c; with S symbolic, also when every term is linear in B (c*S*B is)."""
        return not self.higher and all(i <= 1 for i, _j, _c in self.seq_terms)

    @property
    def is_zero(self) -> bool:
        return self.per_sample == 0 and self.fixed == 0 and not self.higher and not self.seq_terms

    def require_linear(self, what: str) -> ByteExpr:
        """Return self, or raise when a caller needs a*B + c and the bytes grow faster."""
        if not self.is_linear:
            raise NonLinearBatchError(
                f"{what}: saved bytes are {self.polynomial()}, not linear in the batch size B; "
                "evaluate them at a batch size with .at(B) instead of reading per_sample/fixed."
            )
        return self

    def polynomial(self) -> str:
        """Human-readable polynomial, highest powers first: ``'8*B^2 + 64*B + 4'``, ``'4*B*S^2 + 128*B*S'``."""
        terms = [(i, j, c) for i, j, c in self.seq_terms]
        terms += [(k + 2, 0, c) for k, c in enumerate(self.higher)] + [(1, 0, self.per_sample), (0, 0, self.fixed)]
        parts = [_term(c, i, j) for i, j, c in sorted(terms, key=lambda t: (-(t[0] + t[1]), -t[0])) if c]
        return " + ".join(parts) if parts else "0"

    @staticmethod
    def total(items: Iterable[ByteExpr]) -> ByteExpr:
        out = ByteExpr()
        for item in items:
            out = out + item
        return out


def _term(coef: int, b_power: int, s_power: int) -> str:
    factors = [f"{name}^{p}" if p > 1 else name for name, p in (("B", b_power), ("S", s_power)) if p]
    return "*".join([str(coef), *factors])


def _trim(higher: tuple[int, ...]) -> tuple[int, ...]:
    while higher and higher[-1] == 0:
        higher = higher[:-1]
    return higher


def _expr(value: object) -> sympy.Expr:
    return sympy.sympify(getattr(getattr(value, "node", None), "expr", value))


def to_byte_expr(value: object, batch_symbol: sympy.Symbol | None, seq_symbol: sympy.Symbol | None = None) -> ByteExpr:
    """Convert an int or a SymInt's sympy expression in B (and S) into a ByteExpr.

    Raises ValueError when the expression is not a polynomial with integer coefficients (a ``floor``
    or ``Max`` of B, say): the caller then falls back to concrete passes.
    """
    expr = _expr(value)
    gens = [s for s in (batch_symbol, seq_symbol) if s is not None and s in expr.free_symbols]
    if expr.free_symbols - set(gens):
        raise DataDependentBytes(f"{expr} bytes, a size that depends on the data")
    if not gens:
        return ByteExpr(fixed=int(expr))
    try:
        poly = sympy.Poly(sympy.expand(expr), *gens)
    except sympy.PolynomialError as e:
        raise ValueError(f"bytes are not a polynomial in B and S: {expr}") from e
    return _from_terms(poly, [batch_symbol in gens, seq_symbol in gens], expr)


def _from_terms(poly: sympy.Poly, present: list[bool], expr: sympy.Expr) -> ByteExpr:
    by_power: dict[tuple[int, int], int] = {}
    for monom, coef in poly.terms():
        if not coef.is_Integer:
            raise ValueError(f"bytes are not an integer polynomial: {expr}")
        powers = iter(monom)
        b = next(powers) if present[0] else 0
        s = next(powers) if present[1] else 0
        by_power[(b, s)] = int(coef)
    top = max((b for b, s in by_power if s == 0), default=1)
    higher = tuple(by_power.get((k, 0), 0) for k in range(2, top + 1))
    seq_terms = tuple(sorted((b, s, c) for (b, s), c in by_power.items() if s and c))
    return ByteExpr(by_power.get((1, 0), 0), by_power.get((0, 0), 0), _trim(higher), seq_terms)


def fit_linear(samples: dict[int, int]) -> ByteExpr:
    """Fit a*B + c exactly through the first two (batch, bytes) samples; the caller verifies the rest."""
    (b0, y0), (b1, y1) = sorted(samples.items())[:2]
    slope, rem = divmod(y1 - y0, b1 - b0)
    if rem:
        raise ValueError(f"bytes at B={b0} and B={b1} ({y0}, {y1}) do not lie on an integer line")
    return ByteExpr(per_sample=slope, fixed=y0 - slope * b0)


def label_dim(dim: object, batch_symbol: sympy.Symbol | None, seq_symbol: sympy.Symbol | None = None) -> int | str:
    """A dimension for display: an int, or its expression with the symbols written ``B`` and ``S``."""
    expr = getattr(getattr(dim, "node", None), "expr", None)
    if expr is None:
        return int(dim)  # type: ignore[call-overload]
    names = {s: sympy.Symbol(n) for s, n in ((batch_symbol, "B"), (seq_symbol, "S")) if s is not None}
    expr = expr.subs(names)
    return int(expr) if expr.is_Integer else str(expr)
