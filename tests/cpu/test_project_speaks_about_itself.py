"""The project's text says what the code is and why, not when or in which round of work it came
about: no working-log vocabulary (work sessions, numbered runs, issue numbers, dates, the removed
notes file) in the README, docs, code, scripts, benchmarks, tests or CI. A hit is reported as
``path:line: text`` so it can be rewritten where it stands."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCANNED = ("README.md", "docs", "cute_flash", "scripts", "benchmarks", "tests", "pyproject.toml", ".ci")
HISTORY = re.compile(r"(?i)\bsessions?\b|\brun\s+\d+\b|\bruns?\s+[0-9]+\s*/|\bissue\s*#?\s*\d+"
                     r"|\b20[0-9]{2}-[0-9]{2}-[0-9]{2}\b|docs/notes\.md")
# Data, not prose: images, recorded digests and measurements, compiled artefacts.
BINARY_SUFFIXES = {".png", ".jpg", ".jpeg", ".gif", ".svg", ".pdf", ".json", ".csv", ".npz", ".npy", ".pt",
                   ".cubin", ".ptx", ".sass", ".so", ".pyc", ".whl", ".gz", ".zip"}


def _files() -> list[Path]:
    """The scanned paths' files: those git tracks or would track (ignored ones left out), or,
    outside a git checkout, every file but caches."""
    roots = [REPO / name for name in SCANNED if (REPO / name).exists()]
    try:
        out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard", "--",
                              *(str(r.relative_to(REPO)) for r in roots)],
                             cwd=REPO, capture_output=True, check=True, timeout=60).stdout
        files = [REPO / name for name in out.decode().split("\0") if name]
    except (OSError, subprocess.SubprocessError):
        files = [f for r in roots for f in ([r] if r.is_file() else r.rglob("*"))
                 if f.is_file() and "__pycache__" not in f.parts]
    return sorted({f for f in files if f.is_file()})


def _text(path: Path) -> str | None:
    if path.suffix.lower() in BINARY_SUFFIXES:
        return None
    data = path.read_bytes()
    if b"\0" in data:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def test_the_scan_sees_the_project() -> None:
    files = _files()
    names = {f.relative_to(REPO).as_posix() for f in files}
    assert "README.md" in names and "pyproject.toml" in names and "cute_flash/api.py" in names
    assert Path(__file__).resolve() in files


@pytest.mark.parametrize("text,hit", [
    ("measured in session 18", True), ("Sessions of tuning", True), ("see run 3", True),
    ("runs 2 / 3 agree", True), ("(issue 5)", True), ("fixes issue #12", True), ("on 2024-03-01", True),
    ("docs/notes.md says", True), ("one run, 3 rounds", False), ("a training run", False),
    ("the issue is the lock", False), ("2 runs", False), ("request.node", False), ("v2024", False)])
def test_the_pattern_catches_history_and_leaves_prose_alone(text: str, hit: bool) -> None:
    assert bool(HISTORY.search(text)) == hit


def test_no_development_history_in_the_project() -> None:
    me = Path(__file__).resolve()
    hits = []
    for path in _files():
        if path == me:
            continue
        text = _text(path)
        if text is None:
            continue
        for number, line in enumerate(text.splitlines(), 1):
            if HISTORY.search(line):
                hits.append(f"{path.relative_to(REPO).as_posix()}:{number}: {line.strip()[:160]}")
    assert not hits, f"{len(hits)} lines speak of the project's history:\n" + "\n".join(hits)
