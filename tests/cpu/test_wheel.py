"""``python -m build`` makes a wheel that installs into a fresh virtual environment and imports
there, with every subpackage and the version the package reports."""

from __future__ import annotations

import shutil
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import cute_flash

ROOT = Path(__file__).resolve().parents[2]


def test_the_wheel_installs_into_a_fresh_environment_and_imports(tmp_path: Path) -> None:
    src = tmp_path / "src"
    shutil.copytree(ROOT / "cute_flash", src / "cute_flash", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    # (No isolation: the build backend is the installed setuptools, no download.)
    build = [sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(tmp_path / "dist")]
    subprocess.run([*build, str(src)], check=True, capture_output=True, timeout=600)
    (wheel,) = (tmp_path / "dist").glob("cute_flash-*.whl")
    assert wheel.name.startswith(f"cute_flash-{cute_flash.__version__}-py3-none-any")
    names = zipfile.ZipFile(wheel).namelist()
    packages = {str(p.parent.relative_to(ROOT)) for p in (ROOT / "cute_flash").rglob("__init__.py")}
    assert packages <= {n.rsplit("/", 1)[0] for n in names}, "a subpackage is missing from the wheel"

    # The environment reuses this one's torch and DSL (site packages), not its cute_flash.
    env_dir = tmp_path / "env"
    venv.create(env_dir, system_site_packages=True, with_pip=False)
    python = env_dir / "bin" / "python"
    install = [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index"]
    subprocess.run([*install, str(wheel)], check=True, capture_output=True, timeout=600)
    probe = ("import cute_flash, cute_flash.integrations.transformers, cute_flash.tools.warmup, "
             "cute_flash.hopper.fwd, cute_flash.ampere.bwd\n"
             "print(cute_flash.__version__, cute_flash.__file__)")
    out = subprocess.run([str(python), "-c", probe], check=True, capture_output=True, text=True,
                         cwd=tmp_path, timeout=600).stdout.split()
    assert out[0] == cute_flash.__version__
    assert Path(out[1]).is_relative_to(env_dir), f"imported {out[1]}, not the installed wheel"
