"""Installation: one copy of libllama / libggml in the process whatever is imported first, and
`pip install .` the standard way in fresh virtualenvs.

The venv installs are checked both with build isolation (pip installs the pinned
llama-cpp-python into the build environment from the wheel cache that scripts/setup.sh fills)
and without (the venv's own llama-cpp-python, as setup.sh installs it); the installed package
then loads its C core, reads its shipped drafter through the C reader and answers the CLI.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from llama_dflash.cache import files_dir

SCRIPT = r"""
import json, os, sys
order = sys.argv[1]
if order == "llama_cpp_first":
    import llama_cpp  # noqa
from llama_dflash import SpeculativeGenerator
import llama_cpp
g = SpeculativeGenerator(sys.argv[2], sys.argv[3], n_ctx=128)
r = g.generate("hello", 8)
libs = {}
for line in open("/proc/self/maps"):
    parts = line.split()
    if len(parts) >= 6 and "/lib" in parts[5]:
        base = os.path.basename(parts[5])
        for name in ("libllama", "libggml-base", "libggml-cpu", "libggml.", "libdflash"):
            if base.startswith(name):
                libs.setdefault(name, set()).add(os.path.realpath(parts[5]))
print(json.dumps({"libs": {k: sorted(v) for k, v in libs.items()}, "n": len(r.tokens),
                  "llama_cpp_lib": os.path.join(os.path.dirname(llama_cpp.__file__), "lib")}))
"""


@pytest.mark.parametrize("order", ["llama_dflash_first", "llama_cpp_first"])
def test_single_copy_of_native_libraries(artifacts, order):
    a = artifacts["llama"]
    out = subprocess.run([sys.executable, "-c", SCRIPT, order, a["target"], a["drafter"]],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["n"] == 8
    libdir = os.path.realpath(res["llama_cpp_lib"])
    for name in ("libllama", "libggml-base", "libggml-cpu", "libggml.", "libdflash"):
        paths = res["libs"].get(name, [])
        assert len(paths) == 1, f"{name}: mapped from {paths}"
        if name != "libdflash":
            assert os.path.dirname(paths[0]) == libdir, f"{name} not from llama_cpp/lib: {paths}"


ROOT = Path(__file__).resolve().parents[1]
WHEELS = files_dir() / "wheels"  # (scripts/setup.sh's wheel cache)


def _run(*cmd, cwd=None, env=None):
    r = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, f"{cmd} failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
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
    wheels = sorted(WHEELS.rglob("llama_cpp_python-0.3.36-*.whl"))  # (any of setup.sh's builds)
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
