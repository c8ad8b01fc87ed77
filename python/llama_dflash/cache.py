"""The per-user cache folder (exact-mode verdicts, cost models; by default also the files: requantized
models, assembled targets) and the small JSON stores in it, keyed by what decides their contents."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any


def cache_dir() -> Path:
    """$LLAMA_DFLASH_CACHE, else $XDG_CACHE_HOME/llama-dflash (default ~/.cache/llama-dflash)."""
    d = Path(os.environ.get("LLAMA_DFLASH_CACHE") or
             Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "llama-dflash")
    d.mkdir(parents=True, exist_ok=True)
    return d


def files_dir() -> Path:
    """Downloaded and derived files (assembled and requantized models, rpc-server, wheels): each
    keyed by its sources or checked against a hash, so any run may share them.  $LLAMA_DFLASH_FILES,
    else the cache folder (the test suite keeps its verdicts and cost models apart, not these)."""
    env = os.environ.get("LLAMA_DFLASH_FILES")
    if not env:
        return cache_dir()
    d = Path(env)
    d.mkdir(parents=True, exist_ok=True)
    return d


def file_id(path: str | os.PathLike) -> list:
    """A file as a cache key sees it: where it is, its size and modification time."""
    st = os.stat(path)
    return [os.path.realpath(path), st.st_size, st.st_mtime_ns]


def build_id() -> list:
    """The builds the kernels come from: llama-cpp-python's version and its libllama, our libdflash,
    and which backend runs the target's small products now (measured costs and exactness verdicts
    hold for that combination only)."""
    import llama_cpp

    from . import _native
    from .core import kernels

    lib = Path(llama_cpp.__file__).parent / "lib" / "libllama.so"
    ours = Path(_native.lib_path)
    return [llama_cpp.__version__, *(file_id(lib)[1:] if lib.exists() else [0, 0]),
            *(file_id(ours)[1:] if ours.exists() else [0, 0]), kernels.describe()]


def key_of(*parts: Any) -> str:
    # (surrogateescape: a path that is not UTF-8 is still a key)
    return hashlib.sha256("|".join(map(str, parts)).encode("utf-8", "surrogateescape")).hexdigest()[:24]


class JsonStore:
    """One JSON file of entries under the cache folder; a damaged file reads as empty."""

    def __init__(self, name: str) -> None:
        self.path = cache_dir() / name

    def _read(self) -> dict:
        try:
            d = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        return d if isinstance(d, dict) else {}

    def get(self, key: str) -> Any | None:
        return self._read().get(key)

    def put(self, key: str, value: Any) -> None:
        d = self._read()
        d[key] = value
        tmp = self.path.with_suffix(f".{os.getpid()}.tmp")  # two processes never share a temporary file
        tmp.write_text(json.dumps(d, indent=1))
        tmp.replace(self.path)
