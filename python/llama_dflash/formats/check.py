"""A drafter file checked by the C loader's own reader, without a target."""

from __future__ import annotations

import os

from .. import _native
from .._native import ffi, lib
from ..errors import DFlashError, check_file
from .config import DrafterConfig, from_info


def check_drafter(path: str | os.PathLike) -> DrafterConfig:
    """Hyper-parameters of a drafter file that the loader accepts (keys, tensor names, shapes,
    types, the d2t map against the file's vocabulary); DFlashError with the loader's reason if not."""
    p = check_file(path, "drafter")
    info = ffi.new("struct dflash_drafter_info *")
    err = _native.err_buf()
    if lib.dflash_drafter_check(p, info, err, _native.ERR_LEN) != 0:
        raise DFlashError(_native.err_str(err))
    return from_info(info)
