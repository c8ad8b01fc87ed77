"""The per-user cache folder (requantized models, assembled targets, exact-mode verdicts)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """$LLAMA_DFLASH_CACHE, else $XDG_CACHE_HOME/llama-dflash (default ~/.cache/llama-dflash)."""
    d = Path(os.environ.get("LLAMA_DFLASH_CACHE") or
             Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "llama-dflash")
    d.mkdir(parents=True, exist_ok=True)
    return d
