"""Where the package's native files are: installed beside it, or in the source tree's csrc/.
Kept apart from ``_native`` so that reading a header (formats/table.py) does not load libllama."""

from __future__ import annotations

from pathlib import Path

_HERE = Path(__file__).resolve().parent


def find(name: str) -> Path:
    for cand in (_HERE / name, _HERE.parent.parent / "csrc" / name):
        if cand.exists():
            return cand
    raise ImportError(f"llama_dflash: {name} not found next to the package; reinstall llama-dflash")
