"""PyTorch reference of the DFlash / DFlash2 drafter forward (docs/architecture.md §2).

The oracle for the C graph and the model that training uses.  Weights use the
HF / z-lab parameter names; ``from_gguf`` maps a GGUF drafter onto them.
"""

from __future__ import annotations

import math
import os

import numpy as np
import torch
from torch import nn

from ..formats.config import DrafterConfig
from ..formats.gguf import read_drafter_config, read_tensors
from ..formats.table import table


class RMSNorm(nn.Module):
    def __init__(self, n: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


def rope_neox(x: torch.Tensor, pos: torch.Tensor, cfg: DrafterConfig,
              freq_factors: torch.Tensor | None = None) -> torch.Tensor:
    """Rotate-half RoPE over the first cfg.rope_dims dims of each head (the rest pass), with linear or
    YaRN scaling and per-dimension frequency factors. x: [T, heads, d], pos: [T].

    As ggml_rope_ext computes it: frequency i is theta^(-2i/n) / freq_factors[i] (llama3 scaling, or
    a HF YaRN the converter turned into factors); YaRN ramps per frequency between the interpolated
    angle (pos * freq / factor) and the original one over the band set by beta_fast / beta_slow and
    the original context length, with a magnitude factor 1 + 0.1 ln(factor); cos / sin are scaled by
    yarn_attn_factor in every mode.
    """
    n = cfg.rope_dims
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, n, 2, dtype=torch.float64) / n))
    if freq_factors is not None:
        inv = inv / freq_factors[: n // 2].to(torch.float64)
    ang = pos.to(torch.float64)[:, None] * inv[None, :]
    mscale = cfg.yarn_attn_factor
    if cfg.rope_scaling in ("linear", "yarn"):
        interp = ang / cfg.rope_factor
        if cfg.rope_scaling == "yarn":
            def corr_dim(n_rot: float) -> float:
                return n * math.log(cfg.rope_orig_ctx / (n_rot * 2 * math.pi)) / (2 * math.log(cfg.rope_theta))

            lo = max(0.0, math.floor(corr_dim(cfg.yarn_beta_fast)))
            hi = min(n - 1.0, math.ceil(corr_dim(cfg.yarn_beta_slow)))
            i = torch.arange(n // 2, dtype=torch.float64)
            ramp = (1.0 - torch.clamp((i - lo) / max(0.001, hi - lo), 0.0, 1.0)) * cfg.yarn_ext_factor
            ang = interp * (1 - ramp) + ang * ramp
            mscale *= 1.0 + 0.1 * math.log(cfg.rope_factor)
        else:
            ang = interp
    cos = (torch.cat([ang.cos(), ang.cos()], -1) * mscale).to(x.dtype)[:, None, :]
    sin = (torch.cat([ang.sin(), ang.sin()], -1) * mscale).to(x.dtype)[:, None, :]
    xr, rest = x[..., :n], x[..., n:]
    x1, x2 = xr[..., : n // 2], xr[..., n // 2 :]
    return torch.cat([xr * cos + torch.cat([-x2, x1], -1) * sin, rest], -1)


class Attention(nn.Module):
    def __init__(self, cfg: DrafterConfig, bias: bool = False, rope_freqs: torch.Tensor | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.rope_freqs = rope_freqs
        E, d = cfg.n_embd, cfg.head_dim
        self.q_proj = nn.Linear(E, cfg.n_head * d, bias=bias)
        self.k_proj = nn.Linear(E, cfg.n_head_kv * d, bias=bias)
        self.v_proj = nn.Linear(E, cfg.n_head_kv * d, bias=bias)
        self.o_proj = nn.Linear(cfg.n_head * d, E, bias=bias)
        self.q_norm = RMSNorm(d, cfg.rms_eps)
        self.k_norm = RMSNorm(d, cfg.rms_eps)

    def kv(self, x: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.cfg
        k = self.k_norm(self.k_proj(x).view(-1, c.n_head_kv, c.head_dim))
        return rope_neox(k, pos, c, self.rope_freqs), self.v_proj(x).view(-1, c.n_head_kv, c.head_dim)

    def forward(self, u: torch.Tensor, ctx: torch.Tensor, ctx_pos: torch.Tensor, pos: torch.Tensor,
                mask: torch.Tensor | None) -> torch.Tensor:
        c = self.cfg
        q = rope_neox(self.q_norm(self.q_proj(u).view(-1, c.n_head, c.head_dim)), pos, c, self.rope_freqs)
        kc, vc = self.kv(ctx, ctx_pos)
        kb, vb = self.kv(u, pos)
        k = torch.cat([kc, kb], 0).repeat_interleave(c.n_head // c.n_head_kv, dim=1)
        v = torch.cat([vc, vb], 0).repeat_interleave(c.n_head // c.n_head_kv, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / c.head_dim**0.5
        if mask is not None:
            scores = scores + mask
        out = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v) * c.value_scale  # (scaling V)
        return self.o_proj(out.reshape(-1, c.n_head * c.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.n_embd, cfg.n_ff, bias=False)
        self.up_proj = nn.Linear(cfg.n_embd, cfg.n_ff, bias=False)
        self.down_proj = nn.Linear(cfg.n_ff, cfg.n_embd, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class GroupedDynamicConv(nn.Module):
    """DFlash2 two-sided grouped dynamic depthwise convolution over the block (docs/architecture.md §3.1).

    Taps never reach across the block start; the context is never convolved.
    """

    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        self.k, self.g = cfg.conv_kernel_size, cfg.conv_group_size
        self.n_groups = cfg.n_embd // self.g
        base = torch.zeros(2, self.k, cfg.n_embd)
        base[:, 0, :] = 1.0  # identity init
        self.base_kernel = nn.Parameter(base)
        self.kernel_projection = nn.Linear(cfg.n_embd, 2 * self.k * self.n_groups, bias=False)
        nn.init.zeros_(self.kernel_projection.weight)

    def taps(self, u: torch.Tensor) -> torch.Tensor:
        """Dynamic taps of every slot from the normed sub-layer input: [B, 2, K, G]."""
        return self.kernel_projection(u).view(u.shape[0], 2, self.k, self.n_groups)

    def apply(self, x: torch.Tensor, taps: torch.Tensor, side: int, block: int | None = None) -> torch.Tensor:
        """x: [n_blocks * block, H] (blocks laid out contiguously; default: one block)."""
        block = block or x.shape[0]
        xb = x.view(-1, block, x.shape[-1])
        out = torch.zeros_like(xb)
        for t in range(min(self.k, block)):
            kern = self.base_kernel[side, t] + taps[:, side, t].repeat_interleave(self.g, dim=-1)
            shifted = torch.zeros_like(xb)
            shifted[:, t:] = xb[:, : block - t]
            out = out + kern.view_as(xb) * shifted
        return out.view_as(x)


class Layer(nn.Module):
    def __init__(self, cfg: DrafterConfig, bias: bool = False, rope_freqs: torch.Tensor | None = None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.n_embd, cfg.rms_eps)
        self.self_attn = Attention(cfg, bias, rope_freqs)
        self.post_attention_layernorm = RMSNorm(cfg.n_embd, cfg.rms_eps)
        self.mlp = MLP(cfg)
        if cfg.is_v2:
            self.attention_conv = GroupedDynamicConv(cfg)
            self.mlp_conv = GroupedDynamicConv(cfg)

    def forward(self, h, ctx, ctx_pos, pos, mask, block: int | None = None):
        u = self.input_layernorm(h)
        if hasattr(self, "attention_conv"):
            ac, mc = self.attention_conv, self.mlp_conv
            ta = ac.taps(u)
            a = self.self_attn(ac.apply(u, ta, 0, block), ctx, ctx_pos, pos, mask)
            h = h + ac.apply(a, ta, 1, block)
            v = self.post_attention_layernorm(h)
            tm = mc.taps(v)
            return h + mc.apply(self.mlp(mc.apply(v, tm, 0, block)), tm, 1, block)
        h = h + self.self_attn(u, ctx, ctx_pos, pos, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class CandidateSelector(nn.Module):
    """DFlash2 candidate-path selector (docs/architecture.md §3.2): top-K per slot, low-rank edge scores, walk."""

    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        self.top_k = cfg.selector_top_k
        self.predecessor_codebook = nn.Parameter(torch.zeros(cfg.n_vocab, cfg.selector_rank))
        self.successor_codebook = nn.Parameter(torch.zeros(cfg.n_vocab, cfg.selector_rank))
        self.hidden_projection = nn.Linear(cfg.n_embd, cfg.selector_rank, bias=False)

    def lattice(self, z: torch.Tensor, unary: torch.Tensor, anchor: int) -> tuple[torch.Tensor, torch.Tensor]:
        """z [n, H] final-normed slot states, unary [n, V] -> (cand [n, K], scores [n, K_pred, K]).

        scores[k, a, b] = Score_k(pred = candidate a of slot k-1, succ = candidate b of slot k);
        slot 0's only predecessor is the anchor, broadcast over a.
        """
        vals, cand = unary.topk(self.top_k, dim=-1)
        gate = self.hidden_projection(z)                       # [n, r]
        succ = self.successor_codebook[cand]                   # [n, K, r]
        pred = self.predecessor_codebook[cand]                 # [n, K, r]
        prev = torch.cat([self.predecessor_codebook[anchor].expand(1, self.top_k, -1), pred[:-1]], 0)
        scores = torch.einsum("nar,nr,nbr->nab", prev, gate, succ) + vals[:, None, :]
        return cand, scores

    @staticmethod
    def walk(cand: torch.Tensor, scores: torch.Tensor, temperature: float = 0.0,
             generator: torch.Generator | None = None) -> tuple[list[int], torch.Tensor]:
        """Greedy (T = 0) or sampled walk from the anchor; returns tokens and q [n, K]."""
        prev, toks, qs = 0, [], []
        for k in range(cand.shape[0]):
            row = scores[k, prev]
            if temperature <= 0:
                j = int(torch.argmax(row))
                q = torch.zeros_like(row)
                q[j] = 1.0
            else:
                q = torch.softmax(row / temperature, -1)
                j = int(torch.multinomial(q, 1, generator=generator))
            toks.append(int(cand[k, j]))
            qs.append(q)
            prev = j
        return toks, torch.stack(qs)


class DFlashReference(nn.Module):
    """fc + hidden_norm -> L x [pre-norm, KV-injected block attention, SwiGLU] -> norm -> target head."""

    def __init__(self, cfg: DrafterConfig, attention_bias: bool = False,
                 rope_freqs: torch.Tensor | None = None) -> None:
        """attention_bias: q/k/v/o biases in every layer (gpt-oss drafters); rope_freqs: the file's
        per-frequency RoPE factors (rope_freqs.weight), a buffer shared by the layers."""
        super().__init__()
        self.cfg = cfg
        self.rope_freqs = None if rope_freqs is None else torch.tensor(np.array(rope_freqs), dtype=torch.float32)
        self.fc = nn.Linear(cfg.n_embd * len(cfg.target_layers), cfg.n_embd, bias=False)
        self.hidden_norm = RMSNorm(cfg.n_embd, cfg.rms_eps)
        self.layers = nn.ModuleList(Layer(cfg, attention_bias, self.rope_freqs) for _ in range(cfg.n_layer))
        self.norm = RMSNorm(cfg.n_embd, cfg.rms_eps)
        if cfg.is_v2:
            self.candidate_selector = CandidateSelector(cfg)

    def _mask(self, n_ctx: int, n_block: int, il: int) -> torch.Tensor | None:
        c = self.cfg
        swa, causal = c.is_swa(il), c.is_causal(il)
        if not causal and not swa:
            return None
        qp = torch.arange(n_ctx, n_ctx + n_block)[:, None]
        kp = torch.arange(n_ctx + n_block)[None, :]
        vis = torch.ones(n_block, n_ctx + n_block, dtype=torch.bool)
        if causal:
            vis &= kp <= qp
        if swa:
            vis &= (qp - kp).abs() < c.n_swa
        return torch.zeros(vis.shape).masked_fill(~vis, float("-inf"))

    def hidden(self, features: torch.Tensor, block_tokens: torch.Tensor, embed: torch.Tensor) -> torch.Tensor:
        """Final-normed states of the predicting slots: 1..B-1 ([B-1, H]), or all B with
        sample_from_anchor."""
        c = self.cfg
        n_ctx, n_block = features.shape[0], block_tokens.shape[0]
        ctx = self.hidden_norm(self.fc(features))
        ctx_pos = torch.arange(n_ctx)
        pos = torch.arange(n_ctx, n_ctx + n_block)
        h = embed[block_tokens] * c.embedding_scale
        for il, layer in enumerate(self.layers):
            h = layer(h, ctx, ctx_pos, pos, self._mask(n_ctx, n_block, il))
        return self.norm(h if c.sample_from_anchor else h[1:])

    draft_head: torch.Tensor | None = None  # reduced vocabulary: own head rows [V_draft, H] ...
    d2t: torch.Tensor | None = None         # ... and their target ids [V_draft]

    def logits(self, z: torch.Tensor, head: torch.Tensor) -> torch.Tensor:
        """Target-vocabulary logits of the slot states z; with a reduced vocabulary the drafter's
        own head rows are scattered to their ids and every other token gets -inf."""
        c = self.cfg
        w = head if self.draft_head is None else self.draft_head
        logits = z @ w.T * c.logit_scale
        if c.softcap > 0:
            logits = c.softcap * torch.tanh(logits / c.softcap)
        if self.d2t is not None:
            full = torch.full((z.shape[0], head.shape[0]), float("-inf"), dtype=logits.dtype)
            full[:, self.d2t] = logits
            logits = full
        return logits

    def forward(self, features: torch.Tensor, block_tokens: torch.Tensor, embed: torch.Tensor,
                head: torch.Tensor) -> torch.Tensor:
        """features [N, n_taps*H] of positions 0..N-1; block_tokens [B] at positions N..N+B-1.

        Returns the logits [B-1, V] of slots 1..B-1 ([B, V] with sample_from_anchor; after logit
        scale / softcap).
        """
        return self.logits(self.hidden(features, block_tokens, embed), head)

    @classmethod
    def from_gguf(cls, path: str | os.PathLike, n_vocab: int | None = None) -> DFlashReference:
        cfg = read_drafter_config(path)
        tensors = read_tensors(path)
        if cfg.is_v2:
            cfg.n_vocab = tensors["selector_predecessor.weight"].shape[0]
        freqs = tensors.pop("rope_freqs.weight", None)
        model = cls(cfg, attention_bias="blk.0.attn_q.bias" in tensors, rope_freqs=freqs)
        head, d2t = tensors.pop("output.weight", None), tensors.pop("d2t", None)
        model.load_state_dict(gguf_to_hf(tensors), strict=True)
        if head is not None:
            model.draft_head = torch.tensor(head, dtype=torch.float32)
        if d2t is not None:
            model.d2t = torch.as_tensor(d2t, dtype=torch.int64)
        return model


def gguf_to_hf(tensors: dict) -> dict[str, torch.Tensor]:
    """GGUF tensor names -> HF/z-lab parameter names (same [out, in] layout), by the format table."""
    T = table()
    return {T.to_hf(name): torch.from_numpy(arr.copy()) for name, arr in tensors.items() if T.to_hf(name)}


def hf_to_reference(tensors: dict) -> dict[str, torch.Tensor]:
    """HF checkpoint names (any published variant) -> reference parameter names."""
    T = table()
    out = {}
    for name, arr in tensors.items():
        g = T.from_hf(name)
        n = T.to_hf(g) if g else name.removeprefix("model.")
        out[n] = torch.as_tensor(arr).float().clone()
    return out
