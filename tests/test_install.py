"""`pip install .` the standard way, in a fresh virtualenv that has llama-cpp-python 0.3.36.

Both builds are checked: with build isolation (pip installs the pinned llama-cpp-python into
the build environment from the wheel cache that scripts/setup.sh fills) and without (the
venv's own llama-cpp-python, as setup.sh installs it).  The installed package then loads its
C core, reads its shipped drafter through the C reader and answers the CLI.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
WHEELS = Path(os.environ.get("LLAMA_DFLASH_CACHE", Path.home() / ".cache" / "llama-dflash")) / "wheels"


def _run(*cmd, cwd=None, env=None):
    r = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, f"{' '.join(map(str, cmd))} failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """The repository's files (no build tree, no git), as a fresh checkout would have them."""
    dst = tmp_path_factory.mktemp("src") / "llama-dflash"
    shutil.copytree(ROOT, dst, ignore=shutil.ignore_patterns("build", ".git", "__pycache__", "*.egg-info",
                                                             ".pytest_cache", ".ruff_cache"))
    return dst


def _venv(path: Path) -> tuple[Path, dict]:
    _run(sys.executable, "-m", "venv", path)
    env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_ROOT_USER_ACTION": "ignore"}
    env.pop("PYTHONPATH", None)
    py = path / "bin" / "python"
    wheels = sorted(WHEELS.glob("llama_cpp_python-0.3.36-*.whl"))
    assert wheels, f"no llama-cpp-python 0.3.36 wheel in {WHEELS}: run scripts/setup.sh first"
    _run(py, "-m", "pip", "install", "-q", "--find-links", WHEELS, wheels[0], env=env)
    return py, env


def _smoke(py: Path, env: dict) -> None:
    code = ("import llama_dflash, llama_cpp\n"
            "from llama_dflash.api.models import shipped_drafter\n"
            "from llama_dflash.formats.gguf import read_drafter_config\n"
            "c = read_drafter_config(shipped_drafter())\n"
            "assert c.version == 2 and c.n_embd == 576, c\n"
            "print('ok', llama_dflash.__file__)")
    r = _run(py, "-c", code, env=env, cwd="/")
    assert r.stdout.startswith("ok ") and str(py.parents[1]) in r.stdout  # the venv's copy, not the source tree
    cli = py.parent / "llama-dflash"
    r = _run(cli, "inspect", "--json", _run(py, "-c", "from llama_dflash.api.models import shipped_drafter;"
                                                      "print(shipped_drafter())", env=env, cwd="/").stdout.strip(),
             env=env, cwd="/")
    assert '"version": 2' in r.stdout


def test_pip_install_with_build_isolation(source, tmp_path):
    py, env = _venv(tmp_path / "venv")
    _run(py, "-m", "pip", "install", "-q", "--find-links", WHEELS, source, env=env)
    _smoke(py, env)


def test_pip_install_without_build_isolation(source, tmp_path):
    py, env = _venv(tmp_path / "venv")
    _run(py, "-m", "pip", "install", "-q", "scikit-build-core>=0.10", env=env)
    _run(py, "-m", "pip", "install", "-q", "--no-build-isolation", source, env=env)
    _smoke(py, env)
