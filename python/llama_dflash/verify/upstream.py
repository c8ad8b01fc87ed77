"""Upstream llama.cpp's own `dflash` graph (inside libllama): cross-check oracle and speed baseline.

As llama.cpp itself drives it: a drafter context with ctx_other = the
target context; an embd batch injects context features, a token batch
[anchor, mask x n] drafts, and the noise block is removed afterwards.
"""

from __future__ import annotations

import ctypes

import llama_cpp
import numpy as np

from .. import _native


class UpstreamDrafter:
    """Runs a drafter GGUF through libllama's `dflash` architecture.

    exact=True uses an f32 cache and no flash attention, so that its logits
    match our graph to float rounding; exact=False keeps llama.cpp's defaults
    (the configuration upstream users run, for speed comparisons).
    """

    def __init__(self, drafter_path: str, target_model, n_ctx: int = 512, n_threads: int = 2,
                 exact: bool = True) -> None:
        cp = llama_cpp.llama_context_default_params()
        cp.n_ctx = n_ctx
        cp.n_batch = n_ctx
        cp.n_ubatch = n_ctx
        cp.n_threads = cp.n_threads_batch = n_threads
        self.tctx = _native.new_context(target_model, cp)
        self.model = _native.load_model(drafter_path, what="drafter (upstream libllama's dflash)")
        dp = llama_cpp.llama_context_default_params()
        dp.n_ctx = n_ctx
        dp.n_batch = n_ctx
        dp.n_ubatch = n_ctx
        dp.n_threads = dp.n_threads_batch = n_threads
        dp.ctx_other = self.tctx
        if exact:
            # f32 cache like ours: the default f16 cache alone moves logits by ~1e-2.
            dp.type_k = dp.type_v = llama_cpp.GGML_TYPE_F32
            dp.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
        self.ctx = _native.new_context(self.model, dp)
        # upstream's common code: non-causal unless the file says dflash.attention.causal
        llama_cpp.llama_set_causal_attn(self.ctx, self._meta("dflash.attention.causal") == "true")
        # DFlash v1: upstream leaves logit scale / softcap to the sampler; apply them here
        # so that the logits compare with ours (they never change the argmax).
        self.logit_scale = float(self._meta("dflash.logit_scale") or 1.0)
        self.softcap = float(self._meta("dflash.final_logit_softcapping") or 0.0)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(self.model))
        self.n_past = 0
        # DFlash2: upstream returns the candidate lattice through the nextn embeddings
        self.top_k = int(self._meta("dflash.selector_top_k") or 0)
        self.n_embd = llama_cpp.llama_model_n_embd(self.model)
        if self.top_k:
            from llama_cpp import llama_cpp_ext

            llama_cpp_ext.llama_set_embeddings_nextn(self.ctx, True, False)
            self._ext = llama_cpp_ext

    def _meta(self, key: str) -> str | None:
        buf = ctypes.create_string_buffer(128)
        n = llama_cpp.llama_model_meta_val_str(self.model, key.encode(), buf, len(buf))
        return buf.value.decode() if n >= 0 else None

    def _decode(self, n: int, embd_width: int, token_at, logits: bool) -> None:
        b = llama_cpp.llama_batch_init(n, embd_width, 1)
        b.n_tokens = n
        if token_at is None:
            ctypes.memmove(b.embd, self._embd.ctypes.data, self._embd.nbytes)
        for i in range(n):
            if token_at is not None:
                b.token[i] = token_at(i)
            b.pos[i] = self.n_past + i
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = 0
            b.logits[i] = logits
        rc = llama_cpp.llama_decode(self.ctx, b)
        llama_cpp.llama_batch_free(b)
        assert rc == 0, rc

    def push(self, feats: np.ndarray) -> None:
        """Inject context features (an embd batch at the next positions)."""
        self._embd = np.ascontiguousarray(feats, dtype=np.float32)
        self._decode(feats.shape[0], feats.shape[1], None, False)
        self.n_past += feats.shape[0]

    def draft(self, anchor: int, mask_id: int, n: int, return_logits: bool = True) -> np.ndarray | None:
        """Run the block [anchor, mask x n]; the logits of slots 1..n (then drop the block)."""
        self._decode(n + 1, 0, lambda i: anchor if i == 0 else mask_id, True)
        out = None
        if return_logits:
            out = np.stack([np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(self.ctx, i), (self.n_vocab,))
                            .copy() for i in range(1, n + 1)]) * self.logit_scale
            if self.softcap > 0:
                out = self.softcap * np.tanh(out / self.softcap)
        # The noise block must not stay in the drafter's cache.
        llama_cpp.llama_memory_seq_rm(llama_cpp.llama_get_memory(self.ctx), 0, self.n_past, -1)
        return out

    def lattice(self, anchor: int, mask_id: int, n: int) -> tuple[np.ndarray, np.ndarray, list[int]]:
        """DFlash2: (cand [n, K], scores [n, K, K], greedy walk) from upstream's graph.

        Row p of upstream's output is [K candidate ids as float][K x K scores, predecessor-major];
        slot 1's scores are the anchor row broadcast.
        """
        assert self.top_k
        self.draft(anchor, mask_id, n, return_logits=False)
        K = self.top_k
        rows = np.ctypeslib.as_array(self._ext.llama_get_embeddings_nextn(self.ctx), (n + 1, self.n_embd)).copy()
        cand = rows[1:, :K].astype(np.int32)
        scores = rows[1:, K:K + K * K].reshape(n, K, K)
        prev, toks = 0, []
        for k in range(n):
            j = int(np.argmax(scores[k, prev]))
            toks.append(int(cand[k, j]))
            prev = j
        return cand, scores, toks

    def close(self) -> None:
        llama_cpp.llama_free(self.ctx)
        llama_cpp.llama_model_free(self.model)
        llama_cpp.llama_free(self.tctx)
