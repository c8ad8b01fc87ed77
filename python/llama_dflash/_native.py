"""Thin cffi binding of the C core (csrc/dflash.h).

``llama_cpp`` is imported before the core is opened: the core's DT_NEEDED
entries then resolve to the libllama/libggml copies that llama_cpp already
mapped, so the process holds exactly one copy of each.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re

import cffi
import llama_cpp  # (imported first: it loads the libllama the core binds to)
from llama_cpp import _logger

from ._files import find
from .errors import DFlashError, printable


def _cdef_from_header(text: str) -> str:
    """Keep declarations and numeric #defines; drop guards and C++ wrappers."""
    out: list[str] = []
    skip_cpp = False
    for line in text.splitlines():
        s = line.strip()
        if s.startswith("#ifdef __cplusplus"):
            skip_cpp = True
            continue
        if skip_cpp:
            if s.startswith("#endif"):
                skip_cpp = False
            continue
        m = re.match(r"#define\s+(\w+)\s+(\d+)\s*(/\*.*\*/)?\s*$", s)  # (a trailing comment allowed)
        if m:
            out.append(f"#define {m.group(1)} {m.group(2)}")
            continue
        if s.startswith("#"):
            continue
        out.append(line)
    return "\n".join(out)


ffi = cffi.FFI()
ffi.cdef(_cdef_from_header(find("dflash.h").read_text()))
lib_path = str(find("libdflash.so"))
lib = ffi.dlopen(lib_path)

ERR_LEN = 512


def err_buf():
    """A fresh buffer for the core's one-line error messages."""
    return ffi.new("char[]", ERR_LEN)


def err_str(buf) -> str:
    # the core's messages quote tensor names and strings from the files it reads
    return printable(ffi.string(buf).decode("utf-8", "replace")) or "unknown error"


def ptr(ctype: str, ctypes_obj) -> object:
    """Convert a ctypes pointer / struct (from llama_cpp) to a cffi pointer."""
    if isinstance(ctypes_obj, int):
        addr = ctypes_obj
    elif isinstance(ctypes_obj, ctypes.Structure):
        addr = ctypes.addressof(ctypes_obj)
    else:
        addr = ctypes.cast(ctypes_obj, ctypes.c_void_p).value
    if not addr:
        raise ValueError("null pointer")
    return ffi.cast(ctype, addr)


def default_threads() -> int:
    return max(1, len(os.sched_getaffinity(0)))


class Resource:
    """Owns native handles that ``close()`` frees (idempotently): a context manager, and closed
    when garbage-collected."""

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # at interpreter exit the bindings may be gone
            self.close()


def load_model(path: str | os.PathLike, params=None, what: str = "model"):
    """llama.cpp's ``llama_model *`` for a GGUF file (``llama_model_free`` frees it): every model
    the package loads itself comes from here.  params: ``llama_model_params`` (None: the defaults)."""
    llama_cpp.llama_backend_init()
    if params is None:
        params = llama_cpp.llama_model_default_params()
    model = llama_cpp.llama_model_load_from_file(os.fsencode(os.fspath(path)), params)
    if not model:
        raise DFlashError(f"cannot load {what} {printable(os.fspath(path))!r} (not a valid GGUF model?)")
    return model


def new_context(model, params, what: str = "a llama context"):
    """llama.cpp's ``llama_context *`` on a loaded model (``llama_free`` frees it): every context the
    package creates itself comes from here."""
    ctx = llama_cpp.llama_init_from_model(model, params)
    if not ctx:
        raise DFlashError(f"could not create {what} ({params.n_ctx} positions, {params.n_seq_max} sequences)")
    attention_kernels(ctx)
    return ctx


def attention_kernels(ctx) -> None:
    """The small-batch kernels (when on) take the context's attention and the row-wise ops between
    its products too: every target context the package drives (after llama.cpp resolved flash
    attention "auto" on its own devices)."""
    lib.dflash_context_kernels_attention(ptr("struct llama_context *", ctx), True)


def tokenize(vocab, data: bytes, add_special: bool, parse_special: bool) -> list[int]:
    """llama_tokenize into a buffer of the size it asks for."""
    n_max = len(data) + 16
    buf = (llama_cpp.llama_token * n_max)()
    n = llama_cpp.llama_tokenize(vocab, data, len(data), buf, n_max, add_special, parse_special)
    if n < 0:
        buf = (llama_cpp.llama_token * -n)()
        n = llama_cpp.llama_tokenize(vocab, data, len(data), buf, -n, add_special, parse_special)
    return list(buf[:n])


class Tokenizer(Resource):
    """A GGUF model's tokenizer alone: a vocab-only load (no weights, no context, no log noise)."""

    def __init__(self, path: str | os.PathLike, verbose: bool | None = False) -> None:
        self._model = None
        if verbose is not None:  # None: leave llama.cpp's log level as the caller set it
            _logger.set_verbose(verbose)
        params = llama_cpp.llama_model_default_params()
        params.vocab_only = True
        try:
            self._model = load_model(path, params)
        except DFlashError:
            raise ValueError(f"cannot read the vocabulary of {os.fspath(path)!r} (not a GGUF model?)") from None
        self._vocab = llama_cpp.llama_model_get_vocab(self._model)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(self._vocab)

    @property
    def model(self):
        """The vocab-only ``llama_model`` (valid until close)."""
        return self._model

    def tokenize(self, text: bytes, add_bos: bool = False, special: bool = False) -> list[int]:
        return tokenize(self._vocab, text, add_bos, special)

    def close(self) -> None:
        if self._model:
            llama_cpp.llama_model_free(self._model)
            self._model = None
