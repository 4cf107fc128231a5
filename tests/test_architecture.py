"""The import contract, read from the source: layers, jax internals, private names.

* Layers: ``hlo_tools`` <- ``disco_estimator`` <- ``disco_jax`` <- ``benchmarks``; a package
  imports only from its own layer and the ones below (``lint-imports`` checks the same
  with the contract in pyproject.toml; this test needs nothing but the source).
* jax internals (``jax._src``, ``jaxlib`` beyond its version) only in
  ``hlo_tools/jax_bridge/internals.py``.
* No private name (``_x``) of one package is used by another, neither imported
  (``from disco_estimator.ops.standalone import _summarize``) nor reached through a module
  alias (``standalone._summarize``).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ("hlo_tools", "disco_estimator", "disco_jax", "benchmarks")
PACKAGES = LAYERS[:3]
JAX_INTERNALS = ROOT / "hlo_tools" / "jax_bridge" / "internals.py"


def _sources() -> list[Path]:
    return sorted(p for layer in LAYERS for p in (ROOT / layer).rglob("*.py"))


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _imports(tree: ast.AST):
    """(line, module, names) of every import; ``names`` empty for ``import module``."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name, (), {alias.asname or alias.name.split(".")[0]:
                                                    alias.name}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = tuple(a.name for a in node.names)
            bound = {a.asname or a.name: f"{node.module}.{a.name}" for a in node.names}
            yield node.lineno, node.module, names, bound


def _violations(path: Path) -> list[str]:
    here = path.relative_to(ROOT).parts[0]
    rank = LAYERS.index(here)
    tree = ast.parse(path.read_text(), str(path))
    where = path.relative_to(ROOT)
    found: list[str] = []
    foreign_aliases: set[str] = set()
    for line, module, names, bound in _imports(tree):
        top = module.split(".")[0]
        if top in LAYERS and LAYERS.index(top) > rank:
            found.append(f"{where}:{line}: {here} imports {module} (a higher layer)")
        if (module == "jax._src" or module.startswith("jax._src.")
                or (top == "jaxlib" and module != "jaxlib.version")) and path != JAX_INTERNALS:
            found.append(f"{where}:{line}: jax internals ({module}) outside jax_bridge.internals")
        if top in PACKAGES and top != here:
            parts = module.split(".") + list(names)
            bad = [p for p in parts if _private(p)]
            if bad:
                found.append(f"{where}:{line}: private name {bad[0]} of {top} used by {here}")
            foreign_aliases.update(alias for alias, full in bound.items()
                                   if not _private(full.split(".")[-1]))
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id in foreign_aliases and _private(node.attr)):
            found.append(f"{where}:{node.lineno}: private name {node.value.id}.{node.attr} "
                         f"of another package")
    return found


@pytest.mark.parametrize("path", _sources(), ids=lambda p: str(p.relative_to(ROOT)))
def test_import_contract(path: Path) -> None:
    assert _violations(path) == []


def test_the_checker_catches_each_kind_of_violation(tmp_path: Path) -> None:
    """A file breaking each rule is reported once per rule (the check can fail)."""
    bad = ROOT / "disco_estimator" / "_contract_probe.py"
    bad.write_text("from disco_jax import trace\n"
                   "from jax._src import distributed\n"
                   "from hlo_tools.baselines import _hidden\n"
                   "from hlo_tools import parser as hp\n"
                   "x = hp._KERNEL\n")
    try:
        found = _violations(bad)
    finally:
        bad.unlink()
    assert len(found) == 4, found
    assert "higher layer" in found[0] and "jax internals" in found[1]
    assert "_hidden" in found[2] and "hp._KERNEL" in found[3]


def test_the_public_api_resolves_without_importing_jax() -> None:
    """Every name of ``disco_jax.__all__`` resolves, and importing the package (and its
    eager names) leaves jax unimported: a user's ``import disco_jax`` costs nothing."""
    import subprocess
    import sys

    code = ("import sys, disco_jax\n"
            "eager = [n for n in disco_jax.__all__ if n not in ('Enactment', 'store', 'zoo')]\n"
            "assert all(getattr(disco_jax, n) is not None for n in eager)\n"
            "assert 'jax' not in sys.modules, 'importing disco_jax imported jax'\n"
            "assert all(getattr(disco_jax, n) is not None for n in disco_jax.__all__)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=str(ROOT), timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
