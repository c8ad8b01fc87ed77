"""DrafterConfig: a drafter's hyper-parameters, the one Python type for them.

Its fields are the format table's fields (``dflash_format.h``), with the same names as C's
``struct dflash_drafter_info``, and their defaults come from that table; a test holds the
two together.  Layer ids are HF ids (the file stores them + 1).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from .table import evaluate, table

_T = table()


class _Derived:
    """The default of a field that the table computes from other fields (set in __post_init__)."""

    def __repr__(self) -> str:
        return "<derived>"


_DERIVED = _Derived()


def _default(name: str):
    k = _T.key(name)
    if "hp->" in k.default:
        return _DERIVED
    if k.type.startswith("ARR"):
        return field(default_factory=list)
    v = evaluate(k.default, None)
    return {"BOOL": bool, "U32": int, "F32": float}.get(k.type, lambda x: x)(v)


@dataclass
class DrafterConfig:
    """Hyper-parameters of a DFlash / DFlash2 drafter (see the format table for each key)."""

    n_layer: int
    n_embd: int
    n_ff: int
    n_head: int
    block_size: int
    target_layers: list[int]
    mask_token_id: int
    n_head_kv: int = _default("n_head_kv")
    head_dim: int = _default("head_dim")
    n_ctx_train: int = _default("n_ctx_train")
    rms_eps: float = _default("rms_eps")
    rope_theta: float = _default("rope_theta")
    # dimensions rotated, the first ones of each head (partial_rotary_factor < 1: fewer than head_dim)
    rope_dims: int = _default("rope_dims")
    # drafts for M-RoPE targets carry degenerate sections [head_dim/2, 0, 0, 0]
    rope_sections: list[int] = _default("rope_sections")
    # RoPE scaling: "none", "linear" or "yarn", keys as llama.cpp's converter writes them
    rope_scaling: str = _default("rope_scaling")
    rope_factor: float = _default("rope_factor")
    rope_orig_ctx: int = _default("rope_orig_ctx")
    yarn_ext_factor: float = _default("yarn_ext_factor")
    yarn_attn_factor: float = _default("yarn_attn_factor")
    yarn_beta_fast: float = _default("yarn_beta_fast")
    yarn_beta_slow: float = _default("yarn_beta_slow")
    causal: bool = _default("causal")
    # per-layer causality (z-lab's rule: sliding layers causal unless is_causal); empty: `causal` for all
    causal_layers: list[bool] = _default("causal_layers")
    # the attention output scaled by this (MiMo's dflash_config.attention_value_scale)
    value_scale: float = _default("value_scale")
    n_swa: int = _default("n_swa")
    swa_layers: list[bool] = _default("swa_layers")  # empty: every layer uses the window
    embedding_scale: float = _default("embedding_scale")
    logit_scale: float = _default("logit_scale")
    softcap: float = _default("softcap")
    # the anchor's slot predicts too (speculators' sample_from_anchor): block_size tokens per block
    sample_from_anchor: bool = _default("sample_from_anchor")
    # DFlash2 (0 = absent)
    conv_kernel_size: int = _default("conv_kernel_size")
    conv_group_size: int = _default("conv_group_size")
    selector_rank: int = _default("selector_rank")
    selector_top_k: int = _default("selector_top_k")
    # not in the file's hyper-parameter keys: the target's vocabulary (from the tokenizer keys)
    # and the reduced draft vocabulary (rows of a d2t map; 0 = the whole vocabulary)
    n_vocab: int = 0
    n_vocab_draft: int = 0

    def __post_init__(self) -> None:
        for k in _T.keys:  # table order: a derived default's inputs come first
            if getattr(self, k.field) is _DERIVED:
                setattr(self, k.field, evaluate(k.default, self))

    def is_swa(self, il: int) -> bool:
        """Does layer il use the sliding window (every layer when no pattern is given)?"""
        return self.n_swa > 0 and (not self.swa_layers or bool(self.swa_layers[il]))

    def is_causal(self, il: int) -> bool:
        """Is layer il's block attention causal?"""
        return bool(self.causal_layers[il]) if self.causal_layers else self.causal

    @property
    def max_draft(self) -> int:
        """Tokens one block drafts: block_size - 1, or block_size when the anchor's slot predicts."""
        return int(evaluate(_T.max_draft, self))

    @property
    def is_v2(self) -> bool:
        return self.selector_top_k > 0

    @property
    def version(self) -> int:
        return 2 if self.is_v2 else 1

    @property
    def n_taps(self) -> int:
        return len(self.target_layers)


ROPE_SCALING_NAMES = _T.rope_scalings  # C's struct holds rope_scaling as an index into these


def from_info(info) -> DrafterConfig:
    """A DrafterConfig from C's ``struct dflash_drafter_info`` (a cffi object)."""
    kw = {}
    for k in _T.keys:
        v = getattr(info, k.field)
        if k.field == "target_layers":
            v = [int(v[i]) for i in range(info.n_taps)]
        elif k.field == "rope_sections":
            v = [int(v[i]) for i in range(info.n_rope_sections)]
        elif k.field == "swa_layers":
            v = [bool(v[i]) for i in range(info.n_layer)] if info.n_swa > 0 else []
        elif k.field == "causal_layers":  # the loader expands it; uniform is written as `causal` alone
            v = [bool(v[i]) for i in range(info.n_layer)]
            v = [] if all(x == bool(info.causal) for x in v) else v
        elif k.field == "rope_scaling":
            v = ROPE_SCALING_NAMES[v]
        elif k.type == "BOOL":
            v = bool(v)
        elif k.type == "F32":
            v = float(v)
        kw[k.field] = v
    return DrafterConfig(**kw, n_vocab=info.n_vocab, n_vocab_draft=info.n_vocab_draft)


def config_fields() -> list[str]:
    return [f.name for f in fields(DrafterConfig)]
