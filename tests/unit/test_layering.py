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


def _string_literals(path: Path) -> set[str]:
    """Every string constant in the code, docstrings excluded (docs may name features)."""
    tree = ast.parse(path.read_text(), str(path))
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)
    }
    return {n.value for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docstrings}


def test_no_product_file_names_an_optional_feature_outside_its_module() -> None:
    """Adding a feature is its module plus a registry line: the pipeline, the ingress, the policy
    core and the builder never branch on a particular feature's name."""
    from policies.features import REGISTRY, optional_names

    names = set(optional_names())
    own = {Path(spec.impl.partition(":")[0].replace(".", "/") + ".py") for spec in REGISTRY.values() if spec.impl}
    allowed = own | {Path("policies/features.py"), Path("deployments/enrichments/registry.py")}
    checked = 0
    for package in ("serve_app", "deployments", "policies"):
        for path in (ROOT / package).rglob("*.py"):
            rel = path.relative_to(ROOT)
            if rel in allowed:
                continue
            checked += 1
            named = _string_literals(path) & names
            assert not named, f"{rel} names optional feature(s) {sorted(named)}"
    assert checked >= 15 and len(names) >= 10
