"""The host code's import layers hold: ``lint-imports`` keeps every contract of pyproject.toml's
``[tool.importlinter]`` (public API -> ops -> launch -> dispatch -> ... -> jit, one way; kernels
never import a config, a plan or a launcher), and no module of ``cute_flash`` imports, through any
chain, a module that imports it back (lazy imports inside functions included)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import cute_flash

# The checkout the package is imported from: its pyproject.toml holds the contracts.
PACKAGE_ROOT = Path(cute_flash.__file__).resolve().parent.parent


def test_lint_imports_keeps_every_contract() -> None:
    pytest.importorskip("importlinter", reason="import-linter is not installed (the dev extra)")
    config = PACKAGE_ROOT / "pyproject.toml"
    if not config.is_file():
        pytest.skip(f"cute_flash is not imported from a checkout ({PACKAGE_ROOT})")
    # The linter of this interpreter, on the package of this checkout; no cache written.
    run = ("import sys; from importlinter.cli import lint_imports_command; "
           "sys.exit(lint_imports_command())")
    proc = subprocess.run([sys.executable, "-c", run, "--config", str(config), "--no-cache"],
                          cwd=PACKAGE_ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(PACKAGE_ROOT)})
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert "broken" in proc.stdout and " 0 broken" in proc.stdout, proc.stdout[-3000:]


def test_no_import_cycles_among_the_modules() -> None:
    grimp = pytest.importorskip("grimp", reason="grimp (installed with import-linter) is not installed")
    graph = grimp.build_graph("cute_flash", cache_dir=None)
    assert {"cute_flash.api", "cute_flash.launch", "cute_flash.dispatch", "cute_flash.jit"} <= graph.modules
    cycles = []
    for module in sorted(graph.modules):
        for imported in sorted(graph.find_modules_directly_imported_by(module)):
            back = graph.find_shortest_chain(importer=imported, imported=module)
            if back:
                cycles.append(" -> ".join((module, *back)))
    assert not cycles, "import cycles:\n" + "\n".join(cycles)
