"""The code stays readable in pieces: no module of the package over 800 lines and no function
(kernel bodies included) over 150, so every kernel reads as named stages (load, mma, softmax,
epilogue) and every host step as one screen."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "cute_flash"
MAX_MODULE_LINES = 800
MAX_FUNCTION_LINES = 150


def _modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_no_module_is_longer_than_800_lines() -> None:
    long = [f"{p.relative_to(PACKAGE)}: {n}" for p in _modules()
            if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES]
    assert not long, f"modules over {MAX_MODULE_LINES} lines: {long}"


def test_no_function_is_longer_than_150_lines() -> None:
    long = []
    for p in _modules():
        for node in ast.walk(ast.parse(p.read_text(), filename=str(p))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long.append(f"{p.relative_to(PACKAGE)}:{node.lineno} {node.name}: {n}")
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"
