"""The engine's dtype on CPUs: bfloat16 only where the CPU computes it natively."""

from __future__ import annotations

import pytest

from deployments.engine import cpu_dtype


@pytest.mark.parametrize(("requested", "flags", "expected"), [
    ("auto", {"avx2", "fma"}, "float32"),  # AVX2 only: emulated bf16 would be slow
    ("auto", {"avx512f", "avx512_bf16"}, "auto"),  # native bf16: follow the model
    ("auto", {"amx_bf16", "amx_tile"}, "auto"),
    ("auto", set(), "float32"),  # flags unreadable: the safe choice
    ("bfloat16", {"avx2"}, "bfloat16"),  # an explicit dtype is the operator's
    ("float16", set(), "float16"),
])
def test_cpu_dtype(requested: str, flags: set[str], expected: str) -> None:
    assert cpu_dtype(requested, frozenset(flags)) == expected
