"""ByteExpr arithmetic and the conversion of SymInt byte counts into a*B + c."""

from __future__ import annotations

import pytest
import sympy

from fxmem.errors import NonLinearBatchError
from fxmem.symbolic import ByteExpr, fit_linear, label_dim, to_byte_expr

B = sympy.Symbol("s0")


def test_linear_expression_becomes_per_sample_and_fixed() -> None:
    assert to_byte_expr(12288 * B + 64, B) == ByteExpr(per_sample=12288, fixed=64)
    assert to_byte_expr(864, B) == ByteExpr(fixed=864)


def test_quadratic_term_is_kept_not_truncated() -> None:
    # A B x B float32 similarity matrix: 4*B^2 bytes.
    expr = to_byte_expr(4 * B**2 + 8 * B, B)
    assert expr == ByteExpr(per_sample=8, fixed=0, higher=(4,))
    assert expr.at(10) == 4 * 100 + 8 * 10
    assert expr.polynomial() == "4*B^2 + 8*B"
    with pytest.raises(NonLinearBatchError, match="not linear"):
        expr.require_linear("node mm")


def test_non_polynomial_bytes_are_refused() -> None:
    with pytest.raises(ValueError):
        to_byte_expr(sympy.floor(B / 3) * 4, B)


def test_addition_and_evaluation() -> None:
    total = ByteExpr(10, 3) + ByteExpr(5, 1, (2,))
    assert total == ByteExpr(15, 4, (2,))
    assert total.at(2) == 15 * 2 + 4 + 2 * 4
    assert ByteExpr.total([]) == ByteExpr()


def test_fit_linear_through_two_points() -> None:
    assert fit_linear({2: 210, 3: 310}) == ByteExpr(per_sample=100, fixed=10)
    with pytest.raises(ValueError):
        fit_linear({2: 0, 4: 3})


def test_label_dim_writes_the_batch_symbol_as_B() -> None:
    assert label_dim(7, B) == 7


def test_count_times_bytes_is_repeated_addition() -> None:
    # k copies of a block's bytes, as repeated blocks add them (fxmem/step/repeats.py)
    x = ByteExpr(per_sample=3, fixed=5, higher=(2,), seq_terms=((1, 1, 4),))
    assert x * 3 == x + x + x
    assert x * 0 == ByteExpr()
