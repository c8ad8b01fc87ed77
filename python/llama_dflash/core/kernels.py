"""The small-batch kernels (csrc/kernels, docs/architecture.md §13): a ggml backend of our own that
takes the target's matrix products and attention of 1..16 rows, registered once per process before any model
loads.  ``LLAMA_DFLASH_KERNELS=0`` in the environment keeps it unregistered (ggml's kernels
everywhere, for A/B runs); :func:`set_enabled` switches it off and on for contexts' next graphs."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from llama_cpp import _logger

from .. import _native

ENV = "LLAMA_DFLASH_KERNELS"
_ON = "kernels on ("  # the C core's status line when the kernels run: "kernels on (<isa>)"


def _env_off() -> bool:
    return os.environ.get(ENV, "1").strip().lower() in ("0", "off", "false", "no")


@dataclass
class KernelStats:
    """Whether the kernels run, why not, and what they computed in this process."""

    registered: bool
    enabled: bool
    status: str
    products: int = 0
    rows: int = 0
    by_rows: dict[int, int] = field(default_factory=dict)  # products by activation rows
    attention: int = 0       # attentions (FLASH_ATTN_EXT) computed
    attention_rows: int = 0  # query rows (tokens) in them
    rowwise: int = 0         # row-wise ops between products (norms, norm weights, residual adds)
    ggml_ops: int = 0        # ggml-cpu's ops run inside the kernels' splits (RoPE, KV writes, SwiGLU)

    @property
    def isa(self) -> str:
        """The instruction set the kernels run ("avx512vnni", "avx2"), "" when they are off."""
        return self.status[len(_ON):-1] if self.enabled and self.status.startswith(_ON) else ""

    @property
    def backend(self) -> str:
        """Which backend runs the target's small products: "dflash" or "ggml"."""
        return "dflash" if self.enabled else "ggml"


def register() -> KernelStats:
    """Register the backend unless the environment says no (idempotent); a CPU or libggml it cannot
    serve is logged in one line, and everything runs on ggml's kernels."""
    if _env_off():
        return stats()
    err = _native.err_buf()
    if _native.lib.dflash_kernels_register(err, _native.ERR_LEN) != 0:
        _logger.logger.info("llama-dflash: %s", _native.err_str(err))
    return stats()


def set_enabled(on: bool) -> None:
    """Process-wide: products go to ggml-cpu (False) or to the kernels (True) from the next graph a
    context splits on; a context reusing its last graph keeps that graph's assignment."""
    _native.lib.dflash_kernels_set_enabled(bool(on))


def stats() -> KernelStats:
    s = _native.ffi.new("struct dflash_kernel_stats *")
    _native.lib.dflash_kernels_get_stats(s)
    status = _native.ffi.string(s.status).decode()
    if not s.registered and _env_off():
        status = f"kernels off ({ENV}=0)"
    return KernelStats(bool(s.registered), bool(s.enabled), status, int(s.products), int(s.rows),
                       {n: int(s.by_rows[n]) for n in range(1, 17) if s.by_rows[n]}, int(s.attention),
                       int(s.attention_rows), int(s.rowwise), int(s.ggml_ops))


def describe() -> str:
    """One line for stats and reports: which backend runs the target's small matrix products."""
    s = stats()
    return f"dflash ({s.isa})" if s.enabled else f"ggml: {s.status}"
