"""The project's text says what the code is and why, not when or in which round of work it came
about: no working-log vocabulary (numbered work periods and measurement rounds, tracker numbers,
dates, the removed notes file) in the README, docs, code, scripts, benchmarks, tests or CI. A hit
is reported as ``path:line: text`` so it can be rewritten where it stands."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCANNED = ("README.md", "docs", "cute_flash", "scripts", "benchmarks", "tests", "pyproject.toml", ".ci")
# (The flagged words are split across string pieces so that this file passes its own scan.)
HISTORY = re.compile(r"(?i)\bsess" r"ions?\b|\br" r"un\s+\d+\b|\br" r"uns?\s+[0-9]+\s*/"
                     r"|\biss" r"ue\s*#?\s*\d+|\b20[0-9]{2}-[0-9]{2}-[0-9]{2}\b|docs/notes\.md")
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


# The examples spell the flagged words through placeholders, so this file passes its own scan.
WORDS = dict(S="sess" + "ion", R="r" + "un", I="iss" + "ue")


@pytest.mark.parametrize("text,hit", [
    ("measured in {S} 18", True), ("{S}s of tuning", True), ("see {R} 3", True),
    ("{R}s 2 / 3 agree", True), ("({I} 5)", True), ("fixes {I} #12", True), ("on 2024" + "-03-01", True),
    ("docs/notes" + ".md says", True), ("one {R}, 3 rounds", False), ("a training {R}", False),
    ("the {I} is the lock", False), ("2 {R}s", False), ("request.node", False), ("v2024", False)])
def test_the_pattern_catches_history_and_leaves_prose_alone(text: str, hit: bool) -> None:
    assert bool(HISTORY.search(text.format(**WORDS))) == hit


def test_no_development_history_in_the_project() -> None:
    hits = []
    for path in _files():
        text = _text(path)
        if text is None:
            continue
        for number, line in enumerate(text.splitlines(), 1):
            if HISTORY.search(line):
                hits.append(f"{path.relative_to(REPO).as_posix()}:{number}: {line.strip()[:160]}")
    assert not hits, f"{len(hits)} lines speak of the project's history:\n" + "\n".join(hits)
