"""The test suite says what each test needs: every module of ``tests/gpu`` marks all its tests
``gpu`` (module-level ``pytestmark``), none of ``tests/cpu`` needs a GPU, and no test module sits
outside the two."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def _pytestmark(path: Path) -> str | None:
    """Source of the module-level ``pytestmark`` assignment, or None."""
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "pytestmark"
                                                for t in node.targets):
            return ast.get_source_segment(path.read_text(), node.value)
    return None


def test_every_gpu_module_marks_all_its_tests_gpu() -> None:
    modules = sorted((TESTS / "gpu").glob("test_*.py"))
    assert modules
    unmarked = [p.name for p in modules if "pytest.mark.gpu" not in (_pytestmark(p) or "")]
    assert not unmarked, f"tests/gpu modules without pytestmark = pytest.mark.gpu: {unmarked}"


def test_no_cpu_module_needs_a_gpu() -> None:
    modules = sorted((TESTS / "cpu").glob("test_*.py"))
    assert modules
    gpu = [p.name for p in modules if "mark.gpu" in p.read_text() and p != Path(__file__).resolve()]
    assert not gpu, f"tests/cpu modules with gpu-marked tests (they belong in tests/gpu): {gpu}"


def test_test_modules_live_in_cpu_or_gpu() -> None:
    stray = [p.relative_to(TESTS).as_posix() for p in TESTS.rglob("test_*.py")
             if p.parent not in (TESTS / "cpu", TESTS / "gpu")]
    assert not stray, f"test modules outside tests/cpu and tests/gpu: {stray}"
