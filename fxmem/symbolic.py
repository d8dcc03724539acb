"""Bytes as a polynomial in the batch size B: the only module that imports sympy.

Saved tensors carry the batch axis, so a node's saved bytes are ``per_sample * B + fixed``. A few
graphs have higher powers (a B x B similarity matrix); those keep their extra coefficients in
``higher`` instead of being truncated. See Note [Why B=1 is measured on its own] in capture.py.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import sympy

from fxmem.errors import NonLinearBatchError

__all__ = ["ByteExpr", "fit_linear", "label_dim", "to_byte_expr"]


@dataclass(frozen=True)
class ByteExpr:
    """``per_sample * B + fixed (+ higher[0] * B**2 + higher[1] * B**3 ...)`` bytes, exact integers.

    >>> ByteExpr(per_sample=64, fixed=4).at(8)
    516
    """

    per_sample: int = 0
    fixed: int = 0
    higher: tuple[int, ...] = ()

    def __add__(self, other: ByteExpr) -> ByteExpr:
        n = max(len(self.higher), len(other.higher))
        pad = lambda h: h + (0,) * (n - len(h))  # noqa: E731
        higher = tuple(a + b for a, b in zip(pad(self.higher), pad(other.higher)))
        return ByteExpr(self.per_sample + other.per_sample, self.fixed + other.fixed, _trim(higher))

    def at(self, batch: int) -> int:
        """The bytes at one batch size."""
        powers = sum(c * batch ** (k + 2) for k, c in enumerate(self.higher))
        return self.per_sample * batch + self.fixed + powers

    @property
    def is_linear(self) -> bool:
        return not self.higher

    @property
    def is_zero(self) -> bool:
        return self.per_sample == 0 and self.fixed == 0 and not self.higher

    def require_linear(self, what: str) -> ByteExpr:
        """Return self, or raise when a caller needs a*B + c and the bytes grow faster."""
        if self.higher:
            raise NonLinearBatchError(
                f"{what}: saved bytes are {self.polynomial()}, not linear in the batch size B; "
                "evaluate them at a batch size with .at(B) instead of reading per_sample/fixed."
            )
        return self

    def polynomial(self) -> str:
        """Human-readable polynomial, highest power first: ``'8*B^2 + 64*B + 4'``."""
        terms = [(c, k + 2) for k, c in enumerate(self.higher)][::-1] + [(self.per_sample, 1), (self.fixed, 0)]
        parts = [_term(c, k) for c, k in terms if c]
        return " + ".join(parts) if parts else "0"

    @staticmethod
    def total(items: Iterable[ByteExpr]) -> ByteExpr:
        out = ByteExpr()
        for item in items:
            out = out + item
        return out


def _term(coef: int, power: int) -> str:
    if power == 0:
        return str(coef)
    return f"{coef}*B" + (f"^{power}" if power > 1 else "")


def _trim(higher: tuple[int, ...]) -> tuple[int, ...]:
    while higher and higher[-1] == 0:
        higher = higher[:-1]
    return higher


def to_byte_expr(value: object, batch_symbol: sympy.Symbol | None) -> ByteExpr:
    """Convert an int or a SymInt's sympy expression in the batch symbol into a ByteExpr.

    Raises ValueError when the expression is not a polynomial in B with integer coefficients (a
    ``floor`` or ``Max`` of B, say): the caller then falls back to concrete passes.
    """
    expr = sympy.sympify(getattr(getattr(value, "node", None), "expr", value))
    if batch_symbol is None or batch_symbol not in expr.free_symbols:
        if expr.free_symbols:
            raise ValueError(f"bytes depend on symbols other than the batch: {expr}")
        return ByteExpr(fixed=int(expr))
    try:
        poly = sympy.Poly(sympy.expand(expr), batch_symbol)
    except sympy.PolynomialError as e:
        raise ValueError(f"bytes are not a polynomial in B: {expr}") from e
    if not all(c.is_Integer for c in poly.all_coeffs()):
        raise ValueError(f"bytes are not an integer polynomial in B: {expr}")
    coeffs = [int(c) for c in reversed(poly.all_coeffs())]  # index = power of B
    coeffs += [0] * (2 - len(coeffs))
    return ByteExpr(per_sample=coeffs[1], fixed=coeffs[0], higher=_trim(tuple(coeffs[2:])))


def fit_linear(samples: dict[int, int]) -> ByteExpr:
    """Fit a*B + c exactly through the first two (batch, bytes) samples; the caller verifies the rest."""
    (b0, y0), (b1, y1) = sorted(samples.items())[:2]
    slope, rem = divmod(y1 - y0, b1 - b0)
    if rem:
        raise ValueError(f"bytes at B={b0} and B={b1} ({y0}, {y1}) do not lie on an integer line")
    return ByteExpr(per_sample=slope, fixed=y0 - slope * b0)


def label_dim(dim: object, batch_symbol: sympy.Symbol | None) -> int | str:
    """A dimension for display: an int, or its expression with the batch symbol written ``B``."""
    expr = getattr(getattr(dim, "node", None), "expr", None)
    if expr is None:
        return int(dim)  # type: ignore[call-overload]
    if batch_symbol is not None:
        expr = expr.subs(batch_symbol, sympy.Symbol("B"))
    return int(expr) if expr.is_Integer else str(expr)
