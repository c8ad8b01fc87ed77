"""The small-batch kernels (csrc/kernels): every weight type against a float64 reference and ggml's
own product, odd shapes, 1..16 rows, 1 or 2 threads, every instruction set this CPU runs (an
AVX512 machine runs the AVX2 kernels too), bit-identical rows whatever the batch; and the backend in
a real context: which products it takes, what it leaves to ggml, and greedy decoding through it."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize

from llama_dflash import _native
from llama_dflash.core import kernels

ffi, lib = _native.ffi, _native.lib

# values a block, bytes a block, byte ranges of the fp16 scales (d, dmin) in it
BLOCKS = {Q.Q4_0: (32, 18, [(0, 2)]), Q.Q8_0: (32, 34, [(0, 2)]), Q.Q4_K: (256, 144, [(0, 2), (2, 4)]),
          Q.Q5_K: (256, 176, [(0, 2), (2, 4)]), Q.Q6_K: (256, 210, [(208, 210)])}
SHAPES = [(256, 40), (576, 64), (512, 7), (1536, 33), (96, 5)]  # (values a row, rows)


def isas() -> list[str]:
    return [name for name in ("avx512vnni", "avx2")
            if lib.dflash_kernels_mul(name.encode(), int(Q.Q8_0), ffi.NULL, 32, 1, ffi.NULL, 0, ffi.NULL, 1) != -2]


def random_weights(t: Q, k: int, ncol: int, rng: np.random.Generator) -> np.ndarray:
    """Random blocks of type t with sane fp16 scales: every bit pattern of the values is exercised."""
    bv, bb, scales = BLOCKS[t]
    raw = rng.integers(0, 256, (ncol, k // bv, bb), dtype=np.uint8)
    for a, b in scales:
        d = rng.uniform(0.001, 0.02, (ncol, k // bv)).astype(np.float16)
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
                for threads in (1, 2):
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
                for threads in (1, 2):
                    rows = product(lib.dflash_kernels_mul, t_x8, packed, x[:n].copy(), threads, isa)
                    assert np.array_equal(rows, got[:n]), (isa, t.name, k, ncol, n, threads)
