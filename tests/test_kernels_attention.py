"""The kernels' attention (csrc/kernels/attn*.c): ggml's FLASH_ATTN_EXT against a float64 reference
and ggml-cpu's own, every instruction set this CPU runs, 1 or 2 threads, any tile; a row's result
bit-identical whatever the rows beside it and however far the KV view reaches past its cells; and
in a context: taken for contexts the package drives (every row count in exact mode), left to ggml
elsewhere without turning llama.cpp's "auto" flash attention off."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import llama_cpp
import numpy as np
import pytest
from llama_cpp import _logger

from llama_dflash import _native
from llama_dflash.core import exact, kernels

from models import TargetSpec, write_target

ffi, lib = _native.ffi, _native.lib


def isas() -> list[str]:
    q = np.zeros((1, 1, 16), np.float32)
    kv = np.zeros((1, 1, 16), np.float16)
    out = np.zeros_like(q)
    return [name for name in ("avx512vnni", "avx2")
            if attention(name, q, kv, kv, None, None, out=out, check=False) != -2]


def _p(a, t):
    return ffi.NULL if a is None else ffi.cast(t, ffi.from_buffer(a))


def attention(isa: str | None, q, k, v, mask, sinks, scale=0.25, softcap=0.0, tile=0, threads=2, out=None, check=True):
    """out [n_q][n_head][d] by the kernels (isa) or by ggml-cpu (None); q [n_q][n_head][d] f32,
    k, v [n_kv][n_head_kv][d] f16, mask [n_q][n_kv] f16 or None, sinks [n_head] or None."""
    n_q, n_head, d = q.shape
    n_kv, n_head_kv, _ = k.shape
    out = np.full((n_q, n_head, d), np.nan, np.float32) if out is None else out
    args = (_p(q, "float *"), _p(k.view(np.uint16), "uint16_t *"), _p(v.view(np.uint16), "uint16_t *"),
            _p(None if mask is None else mask.view(np.uint16), "uint16_t *"), _p(sinks, "float *"), _p(out, "float *"),
            d, n_q, n_head, n_kv, n_head_kv, scale, softcap)
    rc = (lib.dflash_kernels_attn(isa.encode(), *args, tile, threads) if isa is not None
          else lib.dflash_kernels_attn_ggml(*args, threads))
    if not check:
        return rc
    assert rc == 0, f"attention not taken: rc {rc}"
    return out


def reference(q, k, v, mask, sinks, scale=0.25, softcap=0.0) -> np.ndarray:
    n_q, n_head, d = q.shape
    g = n_head // k.shape[1]
    K, V = k.astype(np.float64), v.astype(np.float64)
    out = np.zeros((n_q, n_head, d))
    for i in range(n_q):
        for h in range(n_head):
            s = K[:, h // g] @ q[i, h].astype(np.float64) * scale
            if softcap:
                s = softcap * np.tanh(s / softcap)
            if mask is not None:
                s = s + mask[i].astype(np.float64)
            m = max(s.max(), sinks[h] if sinks is not None else -np.inf)
            if m == -np.inf:
                continue
            p = np.exp(s - m)
            total = p.sum() + (np.exp(sinks[h] - m) if sinks is not None else 0.0)
            out[i, h] = p @ V[:, h // g] / total
    return out


@dataclass
class Case:
    d: int
    n_head: int
    n_head_kv: int
    n_q: int
    n_kv: int
    mask: str = "causal"    # causal | two-sequences (cells interleaved) | none | hidden (one row sees nothing)
    sinks: bool = False
    softcap: float = 0.0


CASES = [Case(64, 9, 3, 4, 100), Case(128, 12, 2, 16, 300), Case(256, 4, 1, 1, 37), Case(16, 4, 2, 7, 513),
         Case(64, 8, 8, 5, 64, "two-sequences"), Case(32, 6, 2, 3, 29, "none"), Case(64, 4, 2, 6, 90, sinks=True),
         Case(128, 4, 4, 3, 200, softcap=30.0), Case(64, 4, 2, 4, 40, "hidden", sinks=True)]


def make(c: Case, rng: np.random.Generator):
    q = (rng.standard_normal((c.n_q, c.n_head, c.d)) * 2).astype(np.float32)
    k = rng.standard_normal((c.n_kv, c.n_head_kv, c.d)).astype(np.float16)
    v = rng.standard_normal((c.n_kv, c.n_head_kv, c.d)).astype(np.float16)
    mask = None if c.mask == "none" else np.zeros((c.n_q, c.n_kv), np.float16)
    vis = []  # the cells each row sees: a row's one-row decode spans just past its last one
    for i in range(c.n_q):
        pos = c.n_kv - c.n_q + i  # the row's own cell
        seen = np.arange(c.n_kv) <= pos
        if c.mask == "two-sequences":
            seen &= np.arange(c.n_kv) % 2 == pos % 2
        if c.mask == "hidden" and i == 1:
            seen[:] = False
        if mask is not None:
            mask[i, ~seen] = -np.inf
        vis.append(seen)
    sinks = rng.standard_normal(c.n_head).astype(np.float32) * 2 if c.sinks else None
    return q, k, v, mask, sinks, vis


@pytest.mark.parametrize("c", CASES, ids=lambda c: f"d{c.d}-h{c.n_head}/{c.n_head_kv}-q{c.n_q}-kv{c.n_kv}-{c.mask}"
                         + ("-sinks" if c.sinks else "") + ("-softcap" if c.softcap else ""))
def test_attention_matches_float64_and_is_batch_invariant(c):
    assert isas(), "no instruction set of the kernels on this CPU"
    rng = np.random.default_rng(c.d + c.n_kv)
    q, k, v, mask, sinks, vis = make(c, rng)
    ref = reference(q, k, v, mask, sinks, softcap=c.softcap)
    ggml = attention(None, q, k, v, mask, sinks, softcap=c.softcap) if not c.sinks or c.mask != "hidden" else None
    for isa in isas():
        ours = attention(isa, q, k, v, mask, sinks, softcap=c.softcap)
        err = np.abs(ours - ref).max()
        assert err < 2e-6 * max(1.0, np.abs(ref).max()), (isa, err)  # f32 arithmetic throughout
        if ggml is not None:  # (ggml converts q to f16 and sums V in f16: far coarser)
            assert err <= np.abs(ggml - ref).max() + 1e-7, (isa, err, np.abs(ggml - ref).max())
        for threads in (1, 2):
            for tile in (1, 3, 16):
                again = attention(isa, q, k, v, mask, sinks, softcap=c.softcap, tile=tile, threads=threads)
                assert np.array_equal(again, ours), (isa, threads, tile)
        if mask is None:
            continue
        for i in range(c.n_q):  # the row alone, its view cut after its last cell or padded past it
            last = int(np.nonzero(vis[i])[0].max()) + 1 if vis[i].any() else 1
            for end in {last, min(c.n_kv, last + 17)}:
                m = mask[i:i + 1, :end].copy()
                m[0, ~vis[i][:end]] = -np.inf
                alone = attention(isa, q[i:i + 1], k[:end], v[:end], m, sinks, softcap=c.softcap, threads=1)
                assert np.array_equal(alone[0], ours[i]), (isa, i, end, np.abs(alone[0] - ours[i]).max())


def test_attention_not_taken_is_refused():
    q = np.zeros((1, 2, 40), np.float32)
    kv = np.zeros((3, 1, 40), np.float16)
    assert attention("", q, kv, kv, None, None, check=False) == -1  # head size not a multiple of 16
    big_q, big_kv = np.zeros((1, 1, 272), np.float32), np.zeros((2, 1, 272), np.float16)
    assert attention("", big_q, big_kv, big_kv, None, None, check=False) == -1  # nor above 256
    q, kv = q[:, :, :32], kv[:, :, :32]
    assert attention("", np.ascontiguousarray(q), np.ascontiguousarray(kv[:, :1]),
                     np.ascontiguousarray(kv[:, :1]), None, None, check=False) == 0
    assert attention("sse9", np.ascontiguousarray(q), np.ascontiguousarray(kv), np.ascontiguousarray(kv), None, None,
                     check=False) == -2


TINY = TargetSpec(n_layer=3, matrix_type="q8_0", output_type="q8_0", tied=False, seed=4)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = write_target(str(tmp_path_factory.mktemp("attn") / "tiny.gguf"), TINY)
    model = _native.load_model(path, llama_cpp.llama_model_default_params())
    yield model
    llama_cpp.llama_model_free(model)


def _context_params(flash_attn: int = llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED):
    cp = llama_cpp.llama_context_default_params()
    cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_threads, cp.n_threads_batch = 1024, 512, 512, 2, 2
    cp.flash_attn_type = flash_attn
    cp.no_perf = True
    return cp


def _raw_context(model, flash_attn: int, log: list):
    """A context created as llama-cpp-python creates one (not through the package), its log kept."""
    cp = _context_params(flash_attn)

    @llama_cpp.llama_log_callback
    def capture(level, text, user_data):
        log.append(text.decode(errors="replace"))
    llama_cpp.llama_log_set(capture, ctypes.c_void_p(0))
    try:
        return llama_cpp.llama_init_from_model(model, cp)
    finally:
        llama_cpp.llama_log_set(_logger.llama_log_callback, ctypes.c_void_p(0))


def _decode(ctx, n: int, pos0: int = 0) -> int:
    """Decode n tokens from pos0; the attentions the kernels computed meanwhile."""
    before = kernels.stats().attention
    exact._decode(ctx, [(7 * i + 3) % 200 + 10 for i in range(pos0, pos0 + n)], pos0,
                  llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(llama_cpp.llama_get_model(ctx))),
                  False)
    return kernels.stats().attention - before


def test_attention_goes_to_kernels_in_the_packages_contexts(tiny):
    """A context the package creates: a verify-sized batch's attention (one a layer) goes to the
    kernels, a prefill's stays with ggml; in exact mode (reference kernels) every batch's goes."""
    ctx = _native.new_context(tiny, _context_params())
    try:
        assert _decode(ctx, 40) == 0
        assert _decode(ctx, 1, 40) == TINY.n_layer
        assert _decode(ctx, 16, 41) == TINY.n_layer
        assert exact.reference_kernels(ctx) == 1
        assert _decode(ctx, 40, 57) == TINY.n_layer
        exact.reference_kernels(ctx, False)  # (from the next graph split: a new batch size)
        assert _decode(ctx, 33, 97) == 0
        kernels.set_enabled(False)
        try:
            assert _decode(ctx, 4, 130) == 0
        finally:
            kernels.set_enabled(True)
    finally:
        llama_cpp.llama_free(ctx)


def _verify_batch_logits(model, flash_attn: int) -> list:
    """A 4-row batch's logits after a 40-token prefix, in a context the package creates and in one
    created as llama-cpp-python creates it, each with the attentions and row-wise ops the kernels
    took meanwhile."""
    toks = [(13 * i + 7) % 200 + 10 for i in range(44)]
    n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))
    out = []
    for make in (_native.new_context, llama_cpp.llama_init_from_model):
        ctx = make(model, _context_params(flash_attn))
        try:
            exact._decode(ctx, toks[:40], 0, n_vocab, False)
            before = kernels.stats()
            out.append(exact._decode(ctx, toks[40:], 40, n_vocab, False))
            after = kernels.stats()
            out.append((after.attention - before.attention, after.rowwise - before.rowwise,
                        after.ggml_ops - before.ggml_ops))
        finally:
            llama_cpp.llama_free(ctx)
    return out


def test_package_contexts_compute_what_ggml_computes(tmp_path):
    """What a package context hands the kernels beyond the products, on a target whose f32 matrices
    stay with ggml: the row-wise ops between products (norms, norm weights, residual adds) round as
    ggml-cpu's, bit for bit, and so do RoPE, the KV writes and SwiGLU, which ggml-cpu computes inside
    the kernels' split; the attention computes ggml's to rounding (ggml sums in f16)."""
    spec = TargetSpec(n_layer=3, seed=4)
    model = _native.load_model(write_target(str(tmp_path / "f32.gguf"), spec), llama_cpp.llama_model_default_params())
    try:
        ours, taken, ggml, untaken = _verify_batch_logits(model, llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED)
        # row-wise: a layer's two norms, two norm weights, two residual adds, the output norm and its
        # weight; ggml-cpu's inside the split: a layer's two RoPEs, two KV writes, its SwiGLU
        assert taken == (0, 6 * spec.n_layer + 2, 5 * spec.n_layer) and untaken == (0, 0, 0), (taken, untaken)
        assert np.array_equal(ours, ggml), np.abs(ours - ggml).max()
        ours, taken, ggml, untaken = _verify_batch_logits(model, llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED)
        assert taken == (spec.n_layer, 6 * spec.n_layer + 2, 5 * spec.n_layer) and untaken == (0, 0, 0), \
            (taken, untaken)
        assert not np.array_equal(ours, ggml)
        np.testing.assert_allclose(ours, ggml, atol=5e-3 * np.abs(ggml).max())
    finally:
        llama_cpp.llama_model_free(model)


def test_other_contexts_keep_ggmls_attention_and_auto_flash_attention(tiny):
    """A context llama-dflash did not create keeps ggml's attention; with flash attention "auto",
    llama.cpp still finds it on its layers' device and keeps it on."""
    log: list[str] = []
    ctx = _raw_context(tiny, llama_cpp.LLAMA_FLASH_ATTN_TYPE_AUTO, log)
    try:
        assert any("Flash Attention enabled" in line for line in log), "".join(log)[-2000:]
        assert _decode(ctx, 4) == 0
    finally:
        llama_cpp.llama_free(ctx)


def test_exact_batches_are_bit_identical_to_one_token_decodes(tiny):
    """Exact mode's rounding with the kernels' attention at every row count: a prompt decoded in
    batches of 1..40 rows, past 512 cells, gives every token the logits of its one-token decode."""
    ctx = _native.new_context(tiny, _context_params())
    try:
        assert exact.reference_kernels(ctx) == 1
        n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(tiny))
        toks = [(11 * i + 5) % 200 + 10 for i in range(560)]
        rows = []
        for split in ([1] * 560, [40, 3, 16, 1, 200, 7, 5, 288]):
            llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(ctx), True)
            out, pos = [], 0
            for n in split:
                out.append(exact._decode(ctx, toks[pos:pos + n], pos, n_vocab, False))
                pos += n
            rows.append(np.concatenate(out))
        assert np.array_equal(rows[0], rows[1]), np.abs(rows[0] - rows[1]).max()
    finally:
        exact.reference_kernels(ctx, False)
        llama_cpp.llama_free(ctx)
