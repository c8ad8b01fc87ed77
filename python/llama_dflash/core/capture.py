"""Feature capture on a target context: the one Python owner of a ``dflash_capture``.

The engine core, the engine group's context and the batched data generator each capture the
tapped layers' outputs of their own context through this class.  Layer inputs where the
architecture's graph records them; else a cb_eval callback, which must be in the params the
context is created with (``install``) before the context exists (``attach``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .. import _native
from .._native import ffi, lib
from ..errors import DFlashError

# enum dflash_capture_mode (csrc/dflash.h) by name; 0 lets the core choose
MODES = {"auto": 0, "layer_inp": lib.DFLASH_CAPTURE_LAYER_INP, "cb_eval": lib.DFLASH_CAPTURE_CB_EVAL}
MODE_NAMES = {v: k for k, v in MODES.items() if v}


class Capture(_native.Resource):
    """Capture of target layers `taps` (HF ids) for up to `max_rows` rows per decode.

    model: the target's ``llama_model *`` (ctypes).  mode: "auto" (from the architecture),
    "layer_inp" or "cb_eval".  Use: ``install(cparams)``, create the context, ``attach(ctx)``;
    then ``begin()`` before each decode and ``rows(n)`` after it.
    """

    def __init__(self, model, taps: Sequence[int], max_rows: int, mode: str = "auto") -> None:
        self._c = None
        if mode not in MODES:
            raise ValueError(f"capture must be one of {sorted(MODES)}, got {mode!r}")
        taps = [int(t) for t in taps]
        err = _native.err_buf()
        c = lib.dflash_capture_new(_native.ptr("struct llama_model *", model), ffi.new("int32_t[]", taps),
                                   len(taps), int(max_rows), MODES[mode], err, _native.ERR_LEN)
        if c == ffi.NULL:
            raise DFlashError(_native.err_str(err))
        self._c = c
        self.taps = taps
        self.mode = MODE_NAMES[lib.dflash_capture_mode(c)]
        self.width = int(lib.dflash_capture_row_width(c))  # values per row: n_taps * n_embd

    @property
    def handle(self):
        """The ``dflash_capture *`` for the C engine (NULL once closed)."""
        return self._c or ffi.NULL

    def install(self, cparams) -> None:
        """Put the cb_eval callback (if this capture uses one) into ``llama_context_params``."""
        lib.dflash_capture_install(self._c, _native.ptr("void *", cparams))

    def attach(self, ctx) -> None:
        """Bind to the context (``llama_context *``), after its creation, before its first decode."""
        err = _native.err_buf()
        if lib.dflash_capture_attach(self._c, _native.ptr("struct llama_context *", ctx), err, _native.ERR_LEN) != 0:
            raise DFlashError(_native.err_str(err))

    def begin(self) -> None:
        """Call before each decode on the context."""
        lib.dflash_capture_begin(self._c)

    def rows(self, n: int) -> np.ndarray:
        """The last decode's n rows (in the order llama.cpp computed them: ubatch order), copied:
        float32 [n, width]."""
        p = lib.dflash_capture_rows(self._c, int(n))
        if p == ffi.NULL:
            raise DFlashError(f"the capture holds no complete features for {n} rows")
        return np.frombuffer(ffi.buffer(p, 4 * n * self.width), np.float32).reshape(n, self.width).copy()

    def close(self) -> None:
        if getattr(self, "_c", None):
            lib.dflash_capture_free(self._c)
        self._c = None
