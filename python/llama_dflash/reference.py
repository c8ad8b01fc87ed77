"""PyTorch reference of the DFlash (v1) drafter forward (docs: dflash-architecture §2).

The oracle for the C graph and the model that training uses.  Weights use the
HF / z-lab parameter names; ``from_gguf`` maps a GGUF drafter onto them.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from .gguf_io import DrafterConfig, read_drafter_config, read_tensors


class RMSNorm(nn.Module):
    def __init__(self, n: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


def rope_neox(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate-half RoPE over the full head dim. x: [T, heads, d], pos: [T]."""
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    ang = pos.to(torch.float64)[:, None] * inv[None, :]
    cos = torch.cat([ang.cos(), ang.cos()], -1).to(x.dtype)[:, None, :]
    sin = torch.cat([ang.sin(), ang.sin()], -1).to(x.dtype)[:, None, :]
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return x * cos + torch.cat([-x2, x1], -1) * sin


class Attention(nn.Module):
    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        self.cfg = cfg
        E, d = cfg.n_embd, cfg.head_dim
        self.q_proj = nn.Linear(E, cfg.n_head * d, bias=False)
        self.k_proj = nn.Linear(E, cfg.n_head_kv * d, bias=False)
        self.v_proj = nn.Linear(E, cfg.n_head_kv * d, bias=False)
        self.o_proj = nn.Linear(cfg.n_head * d, E, bias=False)
        self.q_norm = RMSNorm(d, cfg.rms_eps)
        self.k_norm = RMSNorm(d, cfg.rms_eps)

    def kv(self, x: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.cfg
        k = self.k_norm(self.k_proj(x).view(-1, c.n_head_kv, c.head_dim))
        return rope_neox(k, pos, c.rope_theta), self.v_proj(x).view(-1, c.n_head_kv, c.head_dim)

    def forward(self, u: torch.Tensor, ctx: torch.Tensor, ctx_pos: torch.Tensor, pos: torch.Tensor,
                mask: torch.Tensor | None) -> torch.Tensor:
        c = self.cfg
        q = rope_neox(self.q_norm(self.q_proj(u).view(-1, c.n_head, c.head_dim)), pos, c.rope_theta)
        kc, vc = self.kv(ctx, ctx_pos)
        kb, vb = self.kv(u, pos)
        k = torch.cat([kc, kb], 0).repeat_interleave(c.n_head // c.n_head_kv, dim=1)
        v = torch.cat([vc, vb], 0).repeat_interleave(c.n_head // c.n_head_kv, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / c.head_dim**0.5
        if mask is not None:
            scores = scores + mask
        out = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
        return self.o_proj(out.reshape(-1, c.n_head * c.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.n_embd, cfg.n_ff, bias=False)
        self.up_proj = nn.Linear(cfg.n_embd, cfg.n_ff, bias=False)
        self.down_proj = nn.Linear(cfg.n_ff, cfg.n_embd, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.n_embd, cfg.rms_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.n_embd, cfg.rms_eps)
        self.mlp = MLP(cfg)


class DFlashReference(nn.Module):
    """fc + hidden_norm -> L x [pre-norm, KV-injected block attention, SwiGLU] -> norm -> target head."""

    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.fc = nn.Linear(cfg.n_embd * len(cfg.target_layer_ids), cfg.n_embd, bias=False)
        self.hidden_norm = RMSNorm(cfg.n_embd, cfg.rms_eps)
        self.layers = nn.ModuleList(Layer(cfg) for _ in range(cfg.n_layer))
        self.norm = RMSNorm(cfg.n_embd, cfg.rms_eps)

    def _mask(self, n_ctx: int, n_block: int, il: int) -> torch.Tensor | None:
        c = self.cfg
        swa = c.sliding_window > 0 and (not c.swa_layers or c.swa_layers[il])
        if not c.causal and not swa:
            return None
        qp = torch.arange(n_ctx, n_ctx + n_block)[:, None]
        kp = torch.arange(n_ctx + n_block)[None, :]
        vis = torch.ones(n_block, n_ctx + n_block, dtype=torch.bool)
        if c.causal:
            vis &= kp <= qp
        if swa:
            vis &= (qp - kp).abs() < c.sliding_window
        return torch.zeros(vis.shape).masked_fill(~vis, float("-inf"))

    def forward(self, features: torch.Tensor, block_tokens: torch.Tensor, embed: torch.Tensor,
                head: torch.Tensor) -> torch.Tensor:
        """features [N, n_taps*H] of positions 0..N-1; block_tokens [B] at positions N..N+B-1.

        Returns the logits [B-1, V] of slots 1..B-1 (after logit scale / softcap).
        """
        c = self.cfg
        n_ctx, n_block = features.shape[0], block_tokens.shape[0]
        ctx = self.hidden_norm(self.fc(features))
        ctx_pos = torch.arange(n_ctx)
        pos = torch.arange(n_ctx, n_ctx + n_block)
        h = embed[block_tokens] * c.embedding_scale
        for il, layer in enumerate(self.layers):
            h = h + layer.self_attn(layer.input_layernorm(h), ctx, ctx_pos, pos, self._mask(n_ctx, n_block, il))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        logits = self.norm(h[1:]) @ head.T * c.logit_scale
        if c.softcap > 0:
            logits = c.softcap * torch.tanh(logits / c.softcap)
        return logits

    @classmethod
    def from_gguf(cls, path: str | os.PathLike) -> DFlashReference:
        cfg = read_drafter_config(path)
        model = cls(cfg)
        model.load_state_dict(gguf_to_hf(read_tensors(path)), strict=True)
        return model


_GGUF_TO_HF = {
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}


def gguf_to_hf(tensors: dict) -> dict[str, torch.Tensor]:
    """GGUF tensor names -> HF/z-lab parameter names (same [out, in] layout)."""
    out = {}
    for name, arr in tensors.items():
        t = torch.from_numpy(arr.copy())
        if name == "fc.weight":
            out["fc.weight"] = t
        elif name == "enc.output_norm.weight":
            out["hidden_norm.weight"] = t
        elif name == "output_norm.weight":
            out["norm.weight"] = t
        elif name.startswith("blk."):
            _, il, kind, _ = name.split(".")
            out[f"layers.{il}.{_GGUF_TO_HF[kind]}.weight"] = t
    return out


def hf_to_reference(tensors: dict) -> dict[str, torch.Tensor]:
    """HF checkpoint names (any published variant) -> reference parameter names (DFlash v1 part)."""
    out = {}
    for name, arr in tensors.items():
        n = name.removeprefix("model.")
        n = {"encoder.fc.weight": "fc.weight", "encoder.output_norm_enc.weight": "hidden_norm.weight"}.get(n, n)
        if n.startswith(("fc.", "hidden_norm.", "norm.")) or (n.startswith("layers.") and "_conv." not in n):
            out[n] = torch.as_tensor(arr).float().clone()
    return out
