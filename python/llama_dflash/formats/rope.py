"""HF RoPE parameters -> the drafter file's RoPE fields (docs/architecture.md §4.4).

ggml_rope_ext expresses linear scaling and YaRN with truncated correction bounds natively (the
``dflash.rope.scaling.*`` keys).  Everything else a published config uses -- llama3 scaling, YaRN
with ``truncate: false``, an explicit ``attention_factor``, ``mscale`` / ``mscale_all_dim`` -- is a
per-frequency change of the inverse frequencies plus one cos/sin magnitude: the converter stores the
first as ``rope_freqs.weight`` factors (ggml divides each frequency by its factor, as for llama3
targets) and the second as ``yarn_attn_factor``.  The inverse frequencies follow HF transformers'
``_compute_llama3_parameters`` / ``_compute_yarn_parameters``.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

ROPE_TYPES = ("default", "linear", "yarn", "llama3")
_COMMON = {"rope_type", "type", "rope_theta", "partial_rotary_factor"}
_KEYS = {
    "default": _COMMON,
    "linear": _COMMON | {"factor"},
    "llama3": _COMMON | {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"},
    "yarn": _COMMON | {"factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "attention_factor",
                       "truncate", "mscale", "mscale_all_dim", "extrapolation_factor"},
}


def _num(p: dict, key: str, default, fail: Callable[[str, str], None]) -> float:
    v = p.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        fail(f"rope_scaling.{key}", f"{v!r} is not a number")
    return float(v)


def base_inv_freq(theta: float, rope_dims: int) -> np.ndarray:
    return 1.0 / theta ** (np.arange(0, rope_dims, 2, dtype=np.float64) / rope_dims)


def llama3_inv_freq(p: dict, theta: float, rope_dims: int, fail) -> np.ndarray:
    inv = base_inv_freq(theta, rope_dims)
    factor = _num(p, "factor", None, fail)
    lo, hi = _num(p, "low_freq_factor", 1.0, fail), _num(p, "high_freq_factor", 4.0, fail)
    old = _num(p, "original_max_position_embeddings", 8192.0, fail)
    if not factor or factor <= 0 or hi <= lo or lo <= 0:
        fail("rope_scaling", f"llama3 scaling needs factor > 0 and high_freq_factor > low_freq_factor > 0 "
                             f"(got {factor}, {hi}, {lo})")
    wavelen = 2 * math.pi / inv
    out = np.where(wavelen > old / lo, inv / factor, inv)
    smooth = (old / wavelen - lo) / (hi - lo)
    medium = ~(wavelen < old / hi) & ~(wavelen > old / lo)
    return np.where(medium, (1 - smooth) * out / factor + smooth * out, out)


def yarn_inv_freq(p: dict, theta: float, rope_dims: int, max_pos: int, fail) -> tuple[np.ndarray, float]:
    """HF's YaRN: inverse frequencies and the attention (cos / sin magnitude) factor."""
    orig = _num(p, "original_max_position_embeddings", float(max_pos), fail)
    factor = _num(p, "factor", max_pos / orig, fail)
    if factor <= 0 or orig <= 0:
        fail("rope_scaling.factor", "yarn rope scaling needs a positive factor and original context")

    def mscale_of(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    att = p.get("attention_factor")
    if att is None:
        m, m_all = p.get("mscale"), p.get("mscale_all_dim")
        att = mscale_of(factor, m) / mscale_of(factor, m_all) if m and m_all else mscale_of(factor)
    att = _num({"attention_factor": att}, "attention_factor", 1.0, fail)
    beta_fast = p.get("beta_fast") or 32.0
    beta_slow = p.get("beta_slow") or 1.0
    truncate = p.get("truncate", True)
    if not isinstance(truncate, bool):
        fail("rope_scaling.truncate", f"{truncate!r} is not a boolean")

    def corr_dim(n_rot: float) -> float:
        return rope_dims * math.log(orig / (n_rot * 2 * math.pi)) / (2 * math.log(theta))

    lo, hi = corr_dim(beta_fast), corr_dim(beta_slow)
    if truncate:
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, rope_dims - 1)
    if lo == hi:
        hi += 0.001
    ramp = np.clip((np.arange(rope_dims // 2, dtype=np.float64) - lo) / (hi - lo), 0.0, 1.0)
    extrap = 1.0 - ramp
    pos = theta ** (np.arange(0, rope_dims, 2, dtype=np.float64) / rope_dims)
    inv = (1.0 / (factor * pos)) * (1 - extrap) + (1.0 / pos) * extrap
    return inv, float(att)


def hf_rope(p: dict, theta: float, head_dim: int, rope_dims: int, max_pos: int,
            fail: Callable[[str, str], None]) -> tuple[dict, np.ndarray | None]:
    """A config's rope parameters (``rope_scaling`` or ``rope_parameters``) -> (DrafterConfig field
    values, rope_freqs factors [head_dim / 2] or None).  Unknown types and keys are refused by name."""
    rtype = p.get("rope_type", p.get("type")) or "default"
    if rtype not in ROPE_TYPES:
        fail("rope_scaling", f"rope type {rtype!r} is not supported ({', '.join(ROPE_TYPES)})")
    for k in p:
        if k not in _KEYS[rtype]:
            fail(f"rope_scaling.{k}", f"not supported with rope type {rtype!r}")
    if rtype == "default":
        return {}, None
    if not (isinstance(p.get("factor"), (int, float)) and not isinstance(p.get("factor"), bool) and p["factor"] > 0):
        if not (rtype == "yarn" and p.get("factor") is None and p.get("original_max_position_embeddings")):
            fail("rope_scaling.factor", f"{rtype} rope scaling needs a positive factor")
    if rtype == "linear":
        return {"rope_scaling": "linear", "rope_factor": float(p["factor"])}, None
    if rtype == "llama3":
        inv = llama3_inv_freq(p, theta, rope_dims, fail)
        return {}, _factors(inv, theta, head_dim, rope_dims)
    ext = _num(p, "extrapolation_factor", 1.0, fail)
    if ext != 1.0:
        fail("rope_scaling.extrapolation_factor", f"{ext} (HF's YaRN has no extrapolation factor; only 1 is run)")
    inv, att = yarn_inv_freq(p, theta, rope_dims, max_pos, fail)
    native = (p.get("truncate", True) and p.get("attention_factor") is None and p.get("mscale") is None
              and p.get("mscale_all_dim") is None and p.get("factor") is not None and p["factor"] > 1)
    if native:  # ggml's own YaRN computes exactly this (floor / ceil bounds, 1 + 0.1 ln factor)
        orig = _num(p, "original_max_position_embeddings", float(max_pos), fail)
        return {"rope_scaling": "yarn", "rope_factor": float(p["factor"]), "rope_orig_ctx": int(orig),
                "yarn_beta_fast": float(p.get("beta_fast") or 32.0),
                "yarn_beta_slow": float(p.get("beta_slow") or 1.0)}, None
    return {"yarn_attn_factor": att}, _factors(inv, theta, head_dim, rope_dims)


def _factors(inv: np.ndarray, theta: float, head_dim: int, rope_dims: int) -> np.ndarray:
    """ggml's freq_factors (frequency i = theta^(-2i/n) / factor[i]) for target inverse frequencies,
    padded with 1 to upstream's shape [head_dim / 2]."""
    out = np.ones(head_dim // 2, np.float32)
    out[: rope_dims // 2] = (base_inv_freq(theta, rope_dims) / inv).astype(np.float32)
    return out
