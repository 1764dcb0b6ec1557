"""Dependency rules from ARCHITECTURE.md, checked on the source and in a fresh interpreter."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FORBIDDEN_IN_POLICIES = ("ray", "vllm", "fastapi", "starlette", "torch", "serve_app", "deployments")


def imported_roots(path: Path) -> set[str]:
    roots = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            roots.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            roots.add(node.module.split(".")[0])
    return roots


def test_policy_core_imports_no_ray_serve_vllm_or_fastapi() -> None:
    files = [p for p in (ROOT / "policies").glob("*.py") if p.name != "actor.py"]
    assert len(files) >= 5
    for path in files:
        bad = imported_roots(path) & set(FORBIDDEN_IN_POLICIES)
        assert not bad, f"{path.name} imports {sorted(bad)}"


def test_policy_core_loads_none_of_them_at_runtime() -> None:
    modules = [f"policies.{p.stem}" for p in (ROOT / "policies").glob("*.py")
               if p.stem not in ("actor", "__init__")]
    code = (
        "import sys\n"
        + "".join(f"import {m}\n" for m in modules)
        + f"bad = [m for m in sys.modules if m.split('.')[0] in {FORBIDDEN_IN_POLICIES!r}]\n"
        "print(','.join(sorted(bad)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_deployments_never_import_serve_app() -> None:
    for path in (ROOT / "deployments").rglob("*.py"):
        assert "serve_app" not in imported_roots(path), path.name


def test_enrichment_modules_import_no_ray() -> None:
    """Features are plain logic; the Serve adapter (host.py) is the one place Ray belongs."""
    files = [p for p in (ROOT / "deployments" / "enrichments").glob("*.py") if p.name != "host.py"]
    assert len(files) >= 5
    for path in files:
        assert "ray" not in imported_roots(path), path.name
