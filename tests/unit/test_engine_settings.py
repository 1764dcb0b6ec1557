"""The engine's dtype on CPUs: bfloat16 only where the CPU computes it natively; a compiled CPU
engine needs a C++ compiler, said before vLLM starts."""

from __future__ import annotations

import pytest

from deployments.engine import AOT_COMPILE_ENV, compiler_problem, cpu_compile_env, cpu_dtype


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


def _found() -> str:
    return "/usr/bin/g++"


def _none() -> str:
    raise RuntimeError("No working C++ compiler found in torch._inductor.config.cpp.cxx: (None, 'g++')")


@pytest.mark.parametrize(("eager", "on_cpu", "find", "refused"), [
    (False, True, _found, False),  # compiled on a CPU with g++: starts
    (False, True, _none, True),  # compiled on a CPU without one: said at once
    (True, True, _none, False),  # eager needs no compiler
    (False, False, _none, False),  # on a GPU, not asked here
])
def test_a_compiled_cpu_engine_needs_a_cpp_compiler(eager: bool, on_cpu: bool, find, refused: bool) -> None:
    problem = compiler_problem(eager, on_cpu, find)
    assert (problem is not None) is refused
    if refused:
        assert "model.enforce_eager=false" in problem and "No working C++ compiler" in problem
        assert "model.enforce_eager: true" in problem


@pytest.mark.parametrize(("on_cpu", "eager", "env"), [
    (True, False, {AOT_COMPILE_ENV: "0"}),  # compiled on a CPU: the cache that loads back
    (True, True, {}),  # eager compiles nothing
    (False, False, {}),  # on a GPU vLLM's AOT cache loads: its default stays
])
def test_a_compiled_cpu_engine_uses_the_compile_cache_that_loads(on_cpu: bool, eager: bool, env: dict) -> None:
    assert cpu_compile_env(on_cpu, eager) == env
