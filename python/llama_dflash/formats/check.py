"""A drafter file checked by the C loader's own validation, alone or against its target."""

from __future__ import annotations

import os

from .. import _native
from .._native import ffi, lib
from ..errors import DFlashError, check_file
from .config import DrafterConfig, from_info


def check_drafter(path: str | os.PathLike, target=None) -> DrafterConfig:
    """Hyper-parameters of a drafter file that the loader accepts (keys, tensor names, shapes,
    types, its tokenizer, the d2t map); DFlashError with the loader's reason if not.

    target: None (the file alone), a target GGUF path (its vocabulary and hyper-parameters are
    read, not its weights) or a loaded ``llama_model`` pointer -- then also every check the
    loader makes against it (the same tokenizer, hidden size, taps inside it)."""
    p = check_file(path, "drafter")
    if isinstance(target, (str, bytes, os.PathLike)):
        check_file(target, "target model")
        with _native.Tokenizer(target) as tok:  # a vocab-only load: no weights read
            return _check(p, tok.model)
    return _check(p, target)


def _check(p: bytes, model) -> DrafterConfig:
    info = ffi.new("struct dflash_drafter_info *")
    err = _native.err_buf()
    m = ffi.NULL if model is None else _native.ptr("struct llama_model *", model)
    if lib.dflash_drafter_check(p, m, info, err, _native.ERR_LEN) != 0:
        raise DFlashError(_native.err_str(err))
    return from_info(info)
