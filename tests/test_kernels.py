"""The small-batch kernels (csrc/kernels): every weight type against a float64 reference and ggml's
own product, odd shapes, negative scales, 1..16 rows, 1 to 3 threads, every instruction set this CPU runs (an
AVX512 machine runs the AVX2 kernels too), bit-identical rows whatever the batch; and the backend in
a real context: which products it takes, what it leaves to ggml, and greedy decoding through it.
MUL_MAT_ID (a MoE layer's experts) likewise: one node through ggml's own API against ggml-cpu's and
float64, and a tiny qwen3moe target's logits (batches against one-token decodes, repacked experts)."""

from __future__ import annotations

import contextlib
import ctypes
from dataclasses import replace

import llama_cpp
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize
from llama_cpp import _logger

from llama_dflash import _native
from llama_dflash.core import exact, kernels

from models import TargetSpec, write_target

ffi, lib = _native.ffi, _native.lib

# values a block, bytes a block, byte ranges of the fp16 scales (d, dmin) in it
BLOCKS = {Q.Q4_0: (32, 18, [(0, 2)]), Q.Q8_0: (32, 34, [(0, 2)]), Q.Q4_K: (256, 144, [(0, 2), (2, 4)]),
          Q.Q5_K: (256, 176, [(0, 2), (2, 4)]), Q.Q6_K: (256, 210, [(208, 210)]), Q.Q5_0: (32, 22, [(0, 2)]),
          Q.Q4_1: (32, 20, [(0, 2), (2, 4)])}
SHAPES = [(256, 40), (576, 64), (512, 7), (1536, 33), (96, 5)]  # (values a row, rows)


def isas() -> list[str]:
    return [name for name in ("avx512vnni", "avx2")
            if lib.dflash_kernels_mul(name.encode(), int(Q.Q8_0), ffi.NULL, 32, 1, ffi.NULL, 0, ffi.NULL, 1) != -2]


def random_weights(t: Q, k: int, ncol: int, rng: np.random.Generator) -> np.ndarray:
    """Random blocks of type t with sane fp16 scales: every bit pattern of the values is exercised."""
    bv, bb, scales = BLOCKS[t]
    raw = rng.integers(0, 256, (ncol, k // bv, bb), dtype=np.uint8)
    for a, b in scales:
        d = (rng.uniform(0.001, 0.02, (ncol, k // bv)) * rng.choice([-1.0, 1.0], (ncol, k // bv))).astype(np.float16)
        raw[:, :, a:b] = np.frombuffer(d.tobytes(), np.uint8).reshape(ncol, k // bv, 2)
    return raw.reshape(ncol, -1)


def product(fn, t: Q, raw: np.ndarray, x: np.ndarray, threads: int, isa: str | None = "") -> np.ndarray:
    n, k = x.shape
    y = np.full((n, raw.shape[0]), np.nan, np.float32)
    args = (int(t), ffi.from_buffer(raw), k, raw.shape[0], ffi.cast("float *", ffi.from_buffer(x)), n,
            ffi.cast("float *", ffi.from_buffer(y)), threads)
    rc = fn(isa.encode(), *args) if isa is not None else fn(*args)
    assert rc == 0, f"product not taken: rc {rc}"
    return y


@pytest.mark.parametrize("t", list(BLOCKS), ids=lambda t: t.name)
def test_products_match_ggml_and_are_batch_invariant(t):
    assert isas(), "no instruction set of the kernels on this CPU"
    rng = np.random.default_rng(int(t))
    for isa in isas():
        for k, ncol in SHAPES:
            if k % BLOCKS[t][0] or (isa == "avx512vnni" and k % 64):
                continue
            raw = random_weights(t, k, ncol, rng)
            w = dequantize(raw, t).reshape(ncol, k).astype(np.float64)
            x = (rng.standard_normal((16, k)) * rng.uniform(0.1, 3.0, (16, 1))).astype(np.float32)
            x[3, :7] *= 40.0  # an outlier block
            x[:, rng.choice(k, 3, replace=False)] *= 30.0  # outlier dimensions, as LLM hidden states have
            ref = x.astype(np.float64) @ w.T
            ours = product(lib.dflash_kernels_mul, t, raw, x, 2, isa)
            ggml = product(lib.dflash_kernels_mul_ggml, t, raw, x, 2, None)
            scale = np.abs(x).max(1, keepdims=True) * np.abs(w).sum(1)[None, :]
            err_ours, err_ggml = (np.abs(ours - ref) / scale).max(), (np.abs(ggml - ref) / scale).max()
            # activations are quantized to 8 bits by both, in blocks as fine as ggml's: its error class
            assert err_ours < 1.5 * err_ggml + 1e-6, (isa, k, ncol, err_ours, err_ggml)
            for n in range(1, 17):
                for threads in (1, 2, 3):  # (3: a column split no machine here uses by default)
                    rows = product(lib.dflash_kernels_mul, t, raw, x[:n].copy(), threads, isa)
                    assert np.array_equal(rows, ours[:n]), (isa, k, ncol, n, threads)
            for i in (0, 5, 15):  # a row alone, as a one-token decode computes it
                alone = product(lib.dflash_kernels_mul, t, raw, x[i:i + 1].copy(), 1, isa)
                assert np.array_equal(alone[0], ours[i]), (isa, k, ncol, i)


def test_products_not_taken_are_refused():
    x = np.zeros((17, 64), np.float32)
    y = np.zeros((17, 4), np.float32)
    w = random_weights(Q.Q8_0, 64, 4, np.random.default_rng(0))
    call = lambda t, n, k=64: lib.dflash_kernels_mul(b"", int(t), ffi.from_buffer(w), k, 4,  # noqa: E731
                                                      ffi.cast("float *", ffi.from_buffer(x)), n,
                                                      ffi.cast("float *", ffi.from_buffer(y)), 1)
    assert call(Q.Q8_0, 17) == -1      # more rows than a verify batch
    assert call(Q.Q8_0, 0) == -1
    assert call(Q.F16, 2) == -1        # a type the kernels leave to ggml
    assert call(Q.Q8_0, 2, k=48) == -1  # not whole blocks
    assert lib.dflash_kernels_mul(b"sse9", int(Q.Q8_0), ffi.from_buffer(w), 64, 4,
                                  ffi.cast("float *", ffi.from_buffer(x)), 2,
                                  ffi.cast("float *", ffi.from_buffer(y)), 1) == -2


def test_registered_at_import():
    s = kernels.stats()
    assert s.registered and s.enabled, s.status
    assert s.status.startswith("kernels on ("), s.status


def _scale_min(q: np.ndarray, j: int) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's 6-bit (scale, min) of sub-block j from its 12 packed bytes (last axis)."""
    q = q.astype(np.int32)
    if j < 4:
        return q[..., j] & 63, q[..., j + 4] & 63
    return (q[..., j + 4] & 15) | ((q[..., j - 4] >> 6) << 4), (q[..., j + 4] >> 4) | ((q[..., j] >> 6) << 4)


def _pack_scales(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """Eight (scale, min) pairs (last axis) packed as a Q4_K's 12 bytes."""
    out = np.zeros(sc.shape[:-1] + (12,), np.int32)
    for j in range(4):
        out[..., j] = (sc[..., j] & 63) | ((sc[..., j + 4] >> 4) << 6)
        out[..., j + 4] = (m[..., j] & 63) | ((m[..., j + 4] >> 4) << 6)
        out[..., j + 8] = (sc[..., j + 4] & 15) | ((m[..., j + 4] & 15) << 4)
    return out.astype(np.uint8)


def repack(t: Q, raw: np.ndarray) -> np.ndarray:
    """ggml-cpu's 8-row interleaved layout of Q4_0 / Q4_K rows (what its CPU_REPACK buffers hold on
    x86), written here from its description: the kernels must read it as the rows it came from."""
    ncol = raw.shape[0]
    bv, bb, _ = BLOCKS[t]
    blocks = raw.reshape(ncol // 8, 8, -1, bb).transpose(0, 2, 1, 3)  # [group][block][row][bytes]
    g, nb = blocks.shape[:2]
    if t == Q.Q4_0:
        qs = (blocks[..., 2:] ^ 0x88).reshape(g, nb, 8, 2, 8).transpose(0, 1, 3, 2, 4).reshape(g, nb, 128)
        out = np.concatenate([blocks[..., :2].reshape(g, nb, 16), qs], axis=-1)
    else:
        sm = [_scale_min(blocks[..., 4:16], j) for j in range(8)]
        scales = np.stack([_pack_scales(sc, m) for sc, m in sm], axis=2)  # [g][nb][sub-block j][12]
        qs = blocks[..., 16:].reshape(g, nb, 8, 16, 8).transpose(0, 1, 3, 2, 4).reshape(g, nb, 1024)
        out = np.concatenate([blocks[..., 0:2].reshape(g, nb, 16), blocks[..., 2:4].reshape(g, nb, 16),
                              scales.reshape(g, nb, 96), qs], axis=-1)
    return np.ascontiguousarray(out.reshape(ncol, -1).astype(np.uint8))


@pytest.mark.parametrize("t", [Q.Q4_0, Q.Q4_K], ids=lambda t: t.name)
def test_repacked_layout_reads_as_its_rows(t):
    """The repacked layout gives its rows' products (AVX512 takes Q4_0's 8 rows at once, in another
    order of sums: within float rounding of the standard layout's, and batch-invariant itself)."""
    rng = np.random.default_rng(7)
    for isa in isas():
        for k, ncol in [(256, 16), (512, 40), (1536, 8)]:
            raw = random_weights(t, k, ncol, rng)
            x = rng.standard_normal((16, k)).astype(np.float32)
            plain = product(lib.dflash_kernels_mul, t, raw, x, 2, isa)
            t_x8, packed = int(t) + lib.DFLASH_KERNELS_REPACKED, repack(t, raw)
            got = product(lib.dflash_kernels_mul, t_x8, packed, x, 2, isa)
            assert np.abs(got - plain).max() <= 1e-5 * np.abs(plain).max(), (isa, t.name, k, ncol)
            for n in (1, 3, 8, 13):
                for threads in (1, 2, 3):  # (3: a column split no machine here uses by default)
                    rows = product(lib.dflash_kernels_mul, t_x8, packed, x[:n].copy(), threads, isa)
                    assert np.array_equal(rows, got[:n]), (isa, t.name, k, ncol, n, threads)


# ---- MUL_MAT_ID: a MoE target's expert products -------------------------------------------------

class _Ggml:
    """ggml's own API (ctypes on the libggml llama_cpp loaded): one MUL_MAT_ID node computed by a
    backend, ours (the registered DFLASH device) or ggml-cpu."""

    class InitParams(ctypes.Structure):
        _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", ctypes.c_void_p), ("no_alloc", ctypes.c_bool)]

    def __init__(self):
        # the copies already mapped (their .so.0 names): another path would map a second registry
        base, gg, cpu = (ctypes.CDLL(n) for n in ("libggml-base.so.0", "libggml.so.0", "libggml-cpu.so.0"))
        P, i64, sz = ctypes.c_void_p, ctypes.c_int64, ctypes.c_size_t
        for lib_, name, res, args in [
                (base, "ggml_init", P, [self.InitParams]), (base, "ggml_free", None, [P]),
                (base, "ggml_new_tensor_3d", P, [P, ctypes.c_int, i64, i64, i64]),
                (base, "ggml_mul_mat_id", P, [P, P, P, P]), (base, "ggml_new_graph", P, [P]),
                (base, "ggml_build_forward_expand", None, [P, P]), (base, "ggml_tensor_overhead", sz, []),
                (base, "ggml_graph_overhead", sz, []), (base, "ggml_nbytes", sz, [P]),
                (base, "ggml_backend_alloc_ctx_tensors", P, [P, P]), (base, "ggml_backend_buffer_free", None, [P]),
                (base, "ggml_backend_tensor_set", None, [P, P, sz, sz]),
                (base, "ggml_backend_tensor_get", None, [P, P, sz, sz]),
                (base, "ggml_backend_graph_compute", ctypes.c_int, [P, P]),
                (base, "ggml_backend_supports_op", ctypes.c_bool, [P, P]),
                (base, "ggml_backend_free", None, [P]), (base, "ggml_backend_dev_backend_reg", P, [P]),
                (base, "ggml_backend_reg_get_proc_address", P, [P, ctypes.c_char_p]),
                (gg, "ggml_backend_dev_by_name", P, [ctypes.c_char_p]),
                (gg, "ggml_backend_dev_init", P, [P, ctypes.c_char_p]), (cpu, "ggml_backend_cpu_init", P, [])]:
            fn = getattr(lib_, name)
            fn.restype, fn.argtypes = res, args
            setattr(self, name, fn)
        dev = self.ggml_backend_dev_by_name(b"DFLASH")
        assert dev, "the kernels' device is not registered"
        self.ours, self.cpu = self.ggml_backend_dev_init(dev, None), self.ggml_backend_cpu_init()
        set_threads = self.ggml_backend_reg_get_proc_address(self.ggml_backend_dev_backend_reg(dev),
                                                             b"ggml_backend_set_n_threads")
        self.set_threads = ctypes.CFUNCTYPE(None, P, ctypes.c_int)(set_threads)

    def close(self):
        self.ggml_backend_free(self.ours)
        self.ggml_backend_free(self.cpu)

    def mul_mat_id(self, backend, t: Q, raw: np.ndarray, k: int, ncol: int, x: np.ndarray, ids: np.ndarray):
        """dst [n_tok][n_used][ncol] for weights raw [n_expert][ncol][bytes], x [n_tok][ne11][k] and
        ids [n_tok][n_used]; None where the backend does not take the node."""
        ctx = self.ggml_init(self.InitParams(self.ggml_tensor_overhead() * 8 + self.ggml_graph_overhead(), None, True))
        try:
            w = self.ggml_new_tensor_3d(ctx, int(t), k, ncol, raw.shape[0])
            xt = self.ggml_new_tensor_3d(ctx, 0, k, x.shape[1], x.shape[0])  # F32
            it = self.ggml_new_tensor_3d(ctx, 26, ids.shape[1], ids.shape[0], 1)  # I32
            y = self.ggml_mul_mat_id(ctx, w, xt, it)
            g = self.ggml_new_graph(ctx)
            self.ggml_build_forward_expand(g, y)
            buf = self.ggml_backend_alloc_ctx_tensors(ctx, backend)
            try:
                for tensor, a in ((w, raw), (xt, x), (it, ids)):
                    a = np.ascontiguousarray(a)
                    assert a.nbytes == self.ggml_nbytes(tensor)
                    self.ggml_backend_tensor_set(tensor, a.ctypes.data, 0, a.nbytes)
                if not self.ggml_backend_supports_op(backend, y):
                    return None
                assert self.ggml_backend_graph_compute(backend, g) == 0
                out = np.full((ids.shape[0], ids.shape[1], ncol), np.nan, np.float32)
                self.ggml_backend_tensor_get(y, out.ctypes.data, 0, out.nbytes)
                return out
            finally:
                self.ggml_backend_buffer_free(buf)
        finally:
            self.ggml_free(ctx)


@pytest.fixture(scope="module")
def ggml_api():
    api = _Ggml()
    yield api
    api.close()


@pytest.mark.parametrize("t", list(BLOCKS), ids=lambda t: t.name)
def test_moe_mul_mat_id_matches_ggml_and_is_batch_invariant(ggml_api, t):
    """The backend's MUL_MAT_ID: dst[:, e, t] = W_ids[e,t] . x[:, e % ne11, t], within 1.5x ggml's own
    error of the float64 product (as MUL_MAT's); a token's rows bit-identical alone, in any batch of
    1..16 tokens, on 1 or 2 threads; an expert twice in a token's list is two rows like any others."""
    rng = np.random.default_rng(100 + int(t))
    k, ncol, n_exp, n_used = 256, 72, 8, 3
    raw = np.stack([random_weights(t, k, ncol, rng) for _ in range(n_exp)])
    w = dequantize(raw.reshape(n_exp * ncol, -1), t).reshape(n_exp, ncol, k).astype(np.float64)
    for ne11 in (1, n_used):  # gate / up (one row a token, broadcast) and down (a row per slot)
        x = (rng.standard_normal((16, ne11, k)) * rng.uniform(0.1, 3.0, (16, ne11, 1))).astype(np.float32)
        x[:, :, rng.choice(k, 3, replace=False)] *= 30.0  # outlier dimensions
        ids = np.stack([rng.choice(n_exp, n_used, replace=False) for _ in range(16)]).astype(np.int32)
        ids[5] = [2, 2, 6]
        src = x[:, np.arange(n_used) % ne11]  # [tok][slot][k]
        ref = np.einsum("tsnk,tsk->tsn", w[ids], src.astype(np.float64))
        ggml_api.set_threads(ggml_api.ours, 2)
        ours = ggml_api.mul_mat_id(ggml_api.ours, t, raw, k, ncol, x, ids)
        ggml = ggml_api.mul_mat_id(ggml_api.cpu, t, raw, k, ncol, x, ids)
        assert ours is not None, "MUL_MAT_ID not taken"
        scale = np.abs(src).max(-1, keepdims=True) * np.abs(w[ids]).sum(-1)
        err_ours, err_ggml = (np.abs(ours - ref) / scale).max(), (np.abs(ggml - ref) / scale).max()
        assert err_ours < 1.5 * err_ggml + 1e-6, (ne11, err_ours, err_ggml)
        for threads in (1, 2, 3):  # (3: a column split no machine here uses by default)
            ggml_api.set_threads(ggml_api.ours, threads)
            for n in range(1, 17):
                part = ggml_api.mul_mat_id(ggml_api.ours, t, raw, k, ncol, x[:n].copy(), ids[:n].copy())
                assert np.array_equal(part, ours[:n]), (ne11, n, threads)
            for i in (0, 5, 15):
                alone = ggml_api.mul_mat_id(ggml_api.ours, t, raw, k, ncol, x[i:i + 1].copy(), ids[i:i + 1].copy())
                assert np.array_equal(alone[0], ours[i]), (ne11, i, threads)


def test_moe_mul_mat_id_not_taken_is_refused(ggml_api):
    rng = np.random.default_rng(0)
    raw = np.stack([random_weights(Q.Q8_0, 64, 8, rng) for _ in range(4)])
    x, ids = np.zeros((17, 1, 64), np.float32), np.zeros((17, 2), np.int32)
    assert ggml_api.mul_mat_id(ggml_api.ours, Q.Q8_0, raw, 64, 8, x, ids) is None  # more tokens than a verify
    assert ggml_api.mul_mat_id(ggml_api.ours, Q.Q8_0, raw, 64, 8, x[:16], ids[:16]) is not None
    f16 = np.zeros((4, 8, 128), np.uint8)
    assert ggml_api.mul_mat_id(ggml_api.ours, Q.F16, f16, 64, 8, x[:2], ids[:2]) is None  # a type left to ggml


# Every matrix quantized, the router too (converted models keep it f32): ggml-cpu's f32 products take
# another path for 2 rows than for 1, and only a target whose every product the kernels take can be
# bit-identical between a batch and its one-token decodes.
MOE = TargetSpec(arch="qwen3moe", n_layer=3, tied=False, output_type="q8_0", matrix_type="q8_0", router_type="q8_0",
                 seed=3)


@pytest.fixture(scope="module")
def moe_targets(tmp_path_factory):
    """The tiny qwen3moe target with Q8_0 experts, its twin with the same values in f32 (no 8-bit
    activations: the reference), the target with Q4_0 experts (which ggml-cpu repacks), and the latter
    with one layer (its routing then the same for any rounding of the experts' products)."""
    d = tmp_path_factory.mktemp("moe")
    q4 = replace(MOE, expert_type="q4_0")
    specs = {"q8_0": MOE, "f32": replace(MOE, dequantized=True), "q4_0": q4, "q4_0-1": replace(q4, n_layer=1),
             "router-f32": replace(MOE, router_type="f32")}
    return {name: write_target(str(d / f"qwen3moe-{name}.gguf"), spec) for name, spec in specs.items()}


def _stats():
    s = ffi.new("struct dflash_kernel_stats *")
    lib.dflash_kernels_get_stats(s)
    return s


@contextlib.contextmanager
def _moe_context(path: str, repacked: bool = False, kernels_on: bool = True, log: list | None = None, threads: int = 2):
    """A context on the MoE target as exact mode runs one (flash attention, ggml's reference kernels,
    every product of the weights to our kernels), the kernels switched on or off for its graphs."""
    if log is not None:
        @llama_cpp.llama_log_callback
        def capture(level, text, user_data):
            log.append(text.decode(errors="replace"))
        llama_cpp.llama_log_set(capture, ctypes.c_void_p(0))
    mp = llama_cpp.llama_model_default_params()
    mp.use_extra_bufts = repacked
    try:
        model = llama_cpp.llama_model_load_from_file(path.encode(), mp)
    finally:
        if log is not None:
            llama_cpp.llama_log_set(_logger.llama_log_callback, ctypes.c_void_p(0))
    assert model, path
    cp = llama_cpp.llama_context_default_params()
    cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_threads, cp.n_threads_batch = 256, 64, 64, threads, threads
    cp.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED
    cp.no_perf = True
    kernels.set_enabled(kernels_on)
    ctx = llama_cpp.llama_init_from_model(model, cp)
    try:
        assert ctx
        assert exact.reference_kernels(ctx) == 1
        yield ctx, llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))
    finally:
        kernels.set_enabled(True)
        if ctx:
            exact.reference_kernels(ctx, False)
            llama_cpp.llama_free(ctx)
        llama_cpp.llama_model_free(model)


def _logits(ctx, n_vocab: int, toks: list[int], split: list[int]) -> np.ndarray:
    """Every token's logits, decoded from position 0 in batches of the sizes in split."""
    llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(ctx), True)
    out, pos = [], 0
    for n in split:
        out.append(exact._decode(ctx, toks[pos:pos + n], pos, n_vocab, False))
        pos += n
    assert pos == len(toks)
    return np.concatenate(out)


def test_moe_target_expert_products_go_to_kernels(moe_targets):
    """Every MUL_MAT_ID of the MoE target (3 a layer) goes to the kernels while they are on, none when
    off; and the logits are as far from the f32 twin's as ggml's own."""
    toks = [int(t) for t in np.random.default_rng(0).integers(3, 1000, 24)]
    split = [8, 1, 1, 4, 1, 7, 2]  # a prefill, decodes, verify-sized batches
    with _moe_context(moe_targets["q8_0"]) as (ctx, n_vocab):
        before = _stats()
        ours = _logits(ctx, n_vocab, toks, split)
        after = _stats()
        assert after.products_id - before.products_id == 3 * MOE.n_layer * len(split)
        assert after.products - before.products > after.products_id - before.products_id  # the rest too
    with _moe_context(moe_targets["q8_0"], kernels_on=False) as (ctx, n_vocab):
        id0 = _stats().products_id
        ggml = _logits(ctx, n_vocab, toks, split)
        assert _stats().products_id == id0
    with _moe_context(moe_targets["f32"]) as (ctx, n_vocab):
        ref = _logits(ctx, n_vocab, toks, split)
    assert np.unique(ref.argmax(1)).size > 3, "degenerate target"
    # Both round activations to 8 bits (ggml its scales to fp16 too), which this random target amplifies
    # (a few % of the logits' scale after three layers, by either); a wrong expert or row would be ~1.
    err_ours, err_ggml = (np.abs(y - ref).max(1) / np.abs(ref).max() for y in (ours, ggml))
    assert err_ours.mean() < 1.25 * err_ggml.mean(), (err_ours.mean(), err_ggml.mean())
    assert err_ours.max() < 1.25 * err_ggml.max(), (err_ours.max(), err_ggml.max())
    assert np.abs(ours - ggml).max() / np.abs(ref).max() < 2 * err_ggml.max()


@pytest.mark.parametrize("t", ["q8_0", "q4_0", "router-f32"])
def test_moe_batches_are_bit_identical_to_one_token_decodes(moe_targets, t):
    """A k-row batch after a prefix, and the tokens after it, give the logits of k one-token decodes
    bit for bit (k = 2..8): the experts' rows do not see the other tokens or experts of the batch."""
    rng = np.random.default_rng(1)
    with _moe_context(moe_targets[t]) as (ctx, n_vocab):
        id0 = _stats().products_id
        for k in range(2, 9):
            toks = [int(x) for x in rng.integers(3, 1000, 8 + k + 2)]
            batch = _logits(ctx, n_vocab, toks, [8, k, 1, 1])
            single = _logits(ctx, n_vocab, toks, [8] + [1] * (k + 2))
            assert np.array_equal(batch, single), (t, k, np.abs(batch - single).max())
        assert _stats().products_id > id0


def test_moe_repacked_experts_read_as_their_rows(moe_targets):
    """Q4_0 experts that ggml-cpu repacked (3D tensors: each expert's rows in groups of 8) give, through
    the kernels, the logits of the same experts in the plain layout (within float rounding: AVX512 sums
    a repacked group's products in another order)."""
    toks = [int(t) for t in np.random.default_rng(2).integers(3, 1000, 16)]
    out, log = {}, []
    for repacked in (False, True):
        with _moe_context(moe_targets["q4_0-1"], repacked=repacked, log=log if repacked else None) as (ctx, n_vocab):
            id0 = _stats().products_id
            out[repacked] = _logits(ctx, n_vocab, toks, [8, 5, 1, 2])
            assert _stats().products_id - id0 == 3 * 4
    assert any("CPU_REPACK" in line and "buffer size" in line for line in log), "experts not repacked"
    err = np.abs(out[True] - out[False]).max() / np.abs(out[False]).max()
    assert err < 1e-5, err


def test_router_f32_product_is_batch_invariant():
    """A MoE router's f32 product (the only f32 weights the kernels take): each row the same bits in
    a batch of 1..16 as alone, within float rounding of float64."""
    rng = np.random.default_rng(5)
    for k, ncol in ((64, 8), (2048, 128), (2880, 32), (37, 5)):
        w = (rng.standard_normal((ncol, k)) / np.sqrt(k)).astype(np.float32)
        x = rng.standard_normal((16, k)).astype(np.float32)
        y16 = product(lib.dflash_kernels_mul, Q.F32, w, x, 1)
        ref = x.astype(np.float64) @ w.T.astype(np.float64)
        assert np.abs(y16 - ref).max() < 1e-5 * np.abs(x).max() * np.abs(w).sum(1).max(), (k, ncol)
        for n in range(1, 17):
            assert np.array_equal(product(lib.dflash_kernels_mul, Q.F32, w, x[:n], 2), y16[:n]), (k, ncol, n)


def test_moe_f32_router_goes_to_kernels(moe_targets):
    """The f32 router of each MoE layer is the kernels' product: the f32-router target gives the kernels
    as many products as its twin with a Q8_0 router (which they always took), the experts' included.
    (ggml's f32 product of the router is what made exact mode refuse MoE targets, issue 47: with it a
    tiny qwen3moe / gpt-oss target's 2-row batch differed by 2.9e-06, with a Q8_0 router by nothing.)"""
    toks = [int(x) for x in np.random.default_rng(4).integers(3, 1000, 8 + 6 + 2)]
    counts = {}
    for t in ("router-f32", "q8_0"):
        with _moe_context(moe_targets[t]) as (ctx, n_vocab):
            before = _stats()
            _logits(ctx, n_vocab, toks, [8, 6, 1, 1])
            after = _stats()
            counts[t] = (after.products - before.products, after.products_id - before.products_id)
    assert counts["router-f32"] == counts["q8_0"], counts
    assert counts["q8_0"][1] == 3 * MOE.n_layer * 4
