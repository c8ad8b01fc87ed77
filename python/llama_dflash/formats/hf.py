"""HF DFlash / DFlash2 drafter checkpoints -> GGUF drafter files (docs/architecture.md §4).

Reads every published config schema variant, takes the vocabulary, hidden size,
layer count and M-RoPE layout from the target's GGUF, checks every tensor's
presence and shape, and streams the tensors one by one into a GGUF in upstream
llama.cpp's layout (which our runtime and libllama both load).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter

from .._native import lib
from ..errors import DFlashError, printable
from .check import check_drafter
from .config import DrafterConfig
from .gguf import TensorSource, copy_tokenizer, write_drafter
from .rope import hf_rope
from .safetensors import LazyTensor, SafetensorsError, open_checkpoint
from .table import table

# (Muse-Glimmer's v1 assistant: mask / taps / block at the top level, encoder.* fusion names)
ARCHITECTURES = {"DFlashDraftModel": 1, "DFlash2DraftModel": 2, "MuseGlimmerAssistantModel": 1}


class ConvertError(ValueError):
    """A user error in a conversion: one line, naming the file and the field."""


@dataclass
class TargetInfo:
    path: Path
    arch: str
    n_embd: int
    n_layer: int
    n_vocab: int
    mrope: bool
    write_vocab: Callable[[GGUFWriter], None]  # the target's tokenizer.* keys


def read_target(path: str | os.PathLike) -> TargetInfo:
    """The target's sizes and vocabulary, from its GGUF file or its HF directory."""
    p = Path(path)
    if p.is_dir():
        return read_target_hf(p)
    if not p.is_file():
        raise ConvertError(f"{p}: target GGUF not found")
    try:
        r = GGUFReader(str(p))
        arch = r.fields["general.architecture"].contents()
        n_embd = int(r.fields[f"{arch}.embedding_length"].contents())
        n_layer = int(r.fields[f"{arch}.block_count"].contents())
        n_vocab = len(r.fields["tokenizer.ggml.tokens"].data)
    except (KeyError, ValueError, IndexError, OSError) as e:
        raise ConvertError(f"{p}: unreadable target GGUF ({e.__class__.__name__}: {e})") from None
    sec = r.fields.get(f"{arch}.rope.dimension_sections")
    mrope = sec is not None and sum(1 for x in sec.contents() if int(x) != 0) > 1
    return TargetInfo(p, arch, n_embd, n_layer, n_vocab, mrope, lambda w: copy_tokenizer(r, w))


def read_target_hf(d: Path) -> TargetInfo:
    """A HF target directory: config.json and a byte-level BPE tokenizer.json.

    The tokenizer keys are written as llama.cpp's "gpt2" model with the default
    pre-tokenizer (the drafter's own vocabulary is only checked for size and the mask
    id: drafting uses the target's token ids).
    """
    cfg_path, tok_path = d / "config.json", d / "tokenizer.json"
    for f in (cfg_path, tok_path):
        if not f.is_file():
            raise ConvertError(f"{d}: target HF directory has no {f.name}")
    cfg, tok = _read_json_object(cfg_path), _read_json_object(tok_path)
    text = cfg.get("text_config", cfg)
    if not isinstance(text, dict):
        raise ConvertError(f"{cfg_path}: text_config: not an object")
    for k in ("hidden_size", "num_hidden_layers"):
        if not isinstance(text.get(k), int):
            raise ConvertError(f"{cfg_path}: {k}: missing")
    model = tok.get("model") or {}
    if model.get("type") != "BPE" or not isinstance(model.get("vocab"), dict):
        raise ConvertError(f"{tok_path}: model.type: only byte-level BPE tokenizers are supported here "
                           f"(got {model.get('type')!r}); convert the target to GGUF and pass that instead")
    added = {t["id"]: t for t in tok.get("added_tokens", [])}
    vocab = dict(model["vocab"])
    for t in added.values():
        vocab.setdefault(t["content"], t["id"])
    n_vocab = max(int(text.get("vocab_size", 0)), max(vocab.values()) + 1)
    tokens = [f"[PAD{i}]" for i in range(n_vocab)]
    types = [5] * n_vocab  # unused slots
    for s_, i in vocab.items():
        tokens[i] = s_
        types[i] = (3 if added[i].get("special") else 4) if i in added else 1
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    tcfg_path = d / "tokenizer_config.json"
    tcfg = _read_json_object(tcfg_path) if tcfg_path.is_file() else {}

    def special_id(key: str):
        v = tcfg.get(key)
        v = v.get("content") if isinstance(v, dict) else v
        return vocab.get(v) if isinstance(v, str) else None

    def write_vocab(w: GGUFWriter) -> None:
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("default")
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.add_token_merges(merges)
        for key, add in (("bos_token", w.add_bos_token_id), ("eos_token", w.add_eos_token_id),
                         ("unk_token", w.add_unk_token_id), ("pad_token", w.add_pad_token_id)):
            i = special_id(key)
            if i is not None:
                add(i)
        if isinstance(tcfg.get("chat_template"), str):
            w.add_chat_template(tcfg["chat_template"])

    rs = (text.get("rope_scaling") or {}).get("mrope_section")
    return TargetInfo(d, str(text.get("model_type", "hf")), int(text["hidden_size"]),
                      int(text["num_hidden_layers"]), n_vocab, bool(rs), write_vocab)


def default_target_layer_ids(n_target_layers: int, n_draft_layers: int) -> list[int]:
    """z-lab's default taps: spread from layer 1 to N_T - 3 (Python round: half to even).  On a
    target too small for them to be distinct (taps must be: the loader refuses a repeated one),
    spread over every usable layer, 0 to N_T - 2, instead."""
    if n_draft_layers == 1:
        return [n_target_layers // 2]
    n = n_draft_layers
    ids = [round(1 + i * (n_target_layers - 4) / (n - 1)) for i in range(n)]
    if len(set(ids)) < n and n <= n_target_layers - 1:
        ids = [round(i * (n_target_layers - 2) / (n - 1)) for i in range(n)]
    return ids


def _read_json_object(path: Path) -> dict:
    """A JSON file whose top level must be an object (config.json, tokenizer.json)."""
    try:
        v = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConvertError(f"{path}: invalid JSON ({e})") from None
    except RecursionError:  # the json module recurses once per nesting level
        raise ConvertError(f"{path}: invalid JSON (nested too deeply)") from None
    if not isinstance(v, dict):
        got = "null" if v is None else {list: "an array", str: "a string", bool: "a boolean"}.get(type(v), "a number")
        raise ConvertError(f"{path}: expected a JSON object, got {got}")
    return v


def _read_config(d: Path) -> tuple[dict, Path]:
    """A HF checkpoint directory's config.json, parsed, and its path."""
    cfg_path = d / "config.json"
    if not cfg_path.is_file():
        raise ConvertError(f"{d}: no config.json (not a HF checkpoint directory)")
    return _read_json_object(cfg_path), cfg_path


SPECULATORS_TYPES = {"dflash": "DFlashDraftModel", "dflash2": "DFlash2DraftModel"}


def _from_speculators(cfg: dict, cfg_path: Path) -> dict:
    """A checkpoint saved by vLLM's speculators (``speculators_model_type`` dflash / dflash2: the
    draft transformer's fields nested in ``transformer_layer_config``, DFlash fields at the top,
    feature taps as hidden-state indices, 0 = the embeddings) in the z-lab schema read below."""

    def fail(field: str, msg: str):
        raise ConvertError(f"{cfg_path}: {field}: {msg}")

    kind = cfg["speculators_model_type"]
    if kind not in SPECULATORS_TYPES:
        fail("speculators_model_type", f"{kind!r} is not a DFlash drafter "
                                       f"(expected one of {sorted(SPECULATORS_TYPES)})")
    tl = cfg.get("transformer_layer_config")
    if not isinstance(tl, dict):
        fail("transformer_layer_config", "missing or not an object")
    out = {k: v for k, v in tl.items() if k not in ("architectures", "dflash_config")}
    out["architectures"] = [SPECULATORS_TYPES[kind]]
    aux = cfg.get("aux_hidden_state_layer_ids")
    if not isinstance(aux, list) or not aux or not all(isinstance(i, int) and not isinstance(i, bool) for i in aux):
        fail("aux_hidden_state_layer_ids", f"{aux!r} is not a list of hidden-state indices")
    if 0 in aux:
        fail("aux_hidden_state_layer_ids", "index 0 (the embeddings) is not a layer output the capture can tap")
    dc = {"block_size": cfg.get("block_size"), "mask_token_id": cfg.get("mask_token_id"),
          "target_layer_ids": [i - 1 for i in aux], "sample_from_anchor": cfg.get("sample_from_anchor", False)}
    for k in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"):
        if k in cfg:
            dc[k] = cfg[k]
    swa = tl.get("use_sliding_window") or "sliding_attention" in (tl.get("layer_types") or [])
    if swa and cfg.get("sliding_window_non_causal") is False:
        fail("sliding_window_non_causal", "causal sliding-window blocks are not supported")
    out["is_causal"] = False  # speculators' blocks attend both ways
    out["dflash_config"] = dc
    if cfg.get("draft_vocab_size") is not None:
        out["draft_vocab_size"] = cfg["draft_vocab_size"]
    return out


def speculators_config(c: DrafterConfig, verifier: str, verifier_architectures: list[str]) -> dict:
    """config.json of a drafter in speculators' schema (what ``DFlash2DraftModel.from_pretrained``
    reads and vLLM serves); the weights keep their names (the format table's HF names)."""
    if c.n_swa or c.causal or c.causal_layers or c.rope_scaling != "none" or c.embedding_scale != 1.0 \
            or c.logit_scale != 1.0 or c.softcap or c.rope_dims != c.head_dim or c.value_scale != 1.0 \
            or c.yarn_attn_factor != 1.0:
        raise ConvertError("speculators' DFlash models have no sliding windows, causal blocks, RoPE scaling, "
                           "partial rotary, value or logit / embedding scales: this drafter cannot be written "
                           "in its schema")
    tl = {"model_type": "qwen3", "hidden_size": c.n_embd, "num_hidden_layers": c.n_layer,
          "num_attention_heads": c.n_head, "num_key_value_heads": c.n_head_kv, "head_dim": c.head_dim,
          "intermediate_size": c.n_ff, "hidden_act": "silu", "attention_bias": False, "rms_norm_eps": c.rms_eps,
          "vocab_size": c.n_vocab, "max_position_embeddings": c.n_ctx_train,
          "rope_parameters": {"rope_theta": c.rope_theta, "rope_type": "default"},
          "layer_types": ["full_attention"] * c.n_layer, "use_sliding_window": False, "sliding_window": None,
          "tie_word_embeddings": False}
    kind = "dflash2" if c.is_v2 else "dflash"
    out = {"architectures": [SPECULATORS_TYPES[kind]], "speculators_model_type": kind,
           "transformer_layer_config": tl, "draft_vocab_size": c.n_vocab_draft or c.n_vocab,
           "block_size": c.block_size, "aux_hidden_state_layer_ids": [i + 1 for i in c.target_layers],
           "mask_token_id": c.mask_token_id, "sample_from_anchor": c.sample_from_anchor,
           "sliding_window_non_causal": True,
           "target_hidden_size": None, "tie_word_embeddings": False,
           "speculators_config": {"algorithm": kind, "default_proposal_method": "greedy",
                                  "proposal_methods": [{"proposal_type": "greedy",
                                                        "speculative_tokens": c.max_draft}],
                                  "verifier": {"name_or_path": verifier, "architectures": verifier_architectures}}}
    if c.is_v2:
        out.update(conv_kernel_size=c.conv_kernel_size, conv_group_size=c.conv_group_size,
                   selector_rank=c.selector_rank, selector_top_k=c.selector_top_k)
    return out


def write_speculators(hf_dir: str | os.PathLike, target: str | os.PathLike, out_dir: str | os.PathLike,
                      verifier: str | None = None) -> Path:
    """A HF drafter directory (any schema the converter reads) as a speculators checkpoint: its
    config in speculators' schema beside the same weights.  verifier: the name or path recorded as
    the verifier (default: the target's path)."""
    d, out = Path(hf_dir), Path(out_dir)
    raw, cfg_path = _read_config(d)
    t = read_target(target)
    extra = Parsed()
    c, _ = parse_config(raw, cfg_path, t, extra)
    if extra.attention_bias or extra.rope_freqs is not None:
        raise ConvertError(f"{cfg_path}: attention biases and llama3 / HF-YaRN RoPE factors are not written in "
                           f"speculators' schema")
    if raw.get("draft_vocab_size") not in (None, t.n_vocab):
        raise ConvertError(f"{cfg_path}: a reduced draft vocabulary is not written in speculators' schema here")
    arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
            "gemma3": "Gemma3ForCausalLM"}.get(t.arch, t.arch)
    spec = speculators_config(c, verifier or str(t.path), [arch])
    out.mkdir(parents=True, exist_ok=True)
    for f in d.iterdir():
        if f.suffix == ".safetensors" or f.name.endswith(".safetensors.index.json"):
            shutil.copyfile(f, out / f.name)
    (out / "config.json").write_text(json.dumps(spec, indent=1))
    return out


@dataclass
class Parsed:
    """What a config says beyond the file's keys: q/k/v/o biases, and the RoPE factors tensor."""

    attention_bias: bool = False
    rope_freqs: np.ndarray | None = None


# Fields of published configs that change the forward and that this runtime does not run:
# refused by name (where a value is given: the one value that is run).
_UNSUPPORTED = {
    "attention_sink_bias": False,        # MiMo: per-head sink logits (tensor names unpublished)
    "mlp_bias": False,
    "use_qk_norm": True,
    "attn_logit_softcapping": None,
    "query_pre_attn_scalar": None,
    "sliding_window_pattern": None,      # gemma-style int pattern (layer_types is what is read)
    "hidden_activation": None,           # Gemma-style drafters
    "attention_chunk_size": None,
    "no_rope_layers": None,
    "rope_local_base_freq": None,
}
_LAYER_TYPES = ("full_attention", "sliding_attention")


def parse_config(cfg: dict, cfg_path: Path, target: TargetInfo,
                 extra: Parsed | None = None) -> tuple[DrafterConfig, int]:
    """config.json (any published schema, speculators' too) -> (DrafterConfig, DFlash version).

    extra, when given, receives what the file stores as tensors (biases expected, RoPE factors)."""

    def fail(field: str, msg: str):
        raise ConvertError(f"{cfg_path}: {field}: {msg}")

    if "speculators_model_type" in cfg:
        cfg = _from_speculators(cfg, cfg_path)

    archs = cfg.get("architectures") or []
    arch = archs[0] if isinstance(archs, list) and archs else None
    if not isinstance(arch, str):
        arch = None
    if arch not in ARCHITECTURES:
        fail("architectures", f"{arch!r} is not a DFlash drafter (expected one of {sorted(ARCHITECTURES)})")
    version = ARCHITECTURES[arch]
    dc = cfg.get("dflash_config") or {}
    if not isinstance(dc, dict):
        fail("dflash_config", f"{dc!r} is not an object")

    def get(key, default=None):
        """A DFlash field, nested (dflash_config) or top-level; both present and different: refused."""
        if key in dc and key in cfg and dc[key] is not None and cfg[key] is not None and dc[key] != cfg[key]:
            fail(key, f"top level ({cfg[key]!r}) and dflash_config ({dc[key]!r}) disagree")
        v = dc.get(key)
        return cfg.get(key, default) if v is None else v

    for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size"):
        if isinstance(cfg.get(k), bool) or not isinstance(cfg.get(k), int) or cfg[k] <= 0:
            fail(k, "missing or not a positive integer")
    H, L = cfg["hidden_size"], cfg["num_hidden_layers"]
    if L > lib.DFLASH_MAX_LAYERS:  # (before anything is sized by it)
        fail("num_hidden_layers", f"{L} layers (the core supports 1..{lib.DFLASH_MAX_LAYERS})")
    for k in ("num_key_value_heads", "head_dim"):
        if cfg.get(k) is not None and (isinstance(cfg[k], bool) or not isinstance(cfg[k], int) or cfg[k] <= 0):
            fail(k, "not a positive integer")
    n_head = cfg["num_attention_heads"]
    n_kv = cfg.get("num_key_value_heads") or n_head
    head_dim = cfg.get("head_dim") or H // n_head
    if H != target.n_embd:
        fail("hidden_size", f"{H} differs from the target's hidden size {target.n_embd} ({target.path.name})")
    vocab = cfg.get("vocab_size")
    if vocab is not None and vocab != target.n_vocab:
        fail("vocab_size", f"{vocab} differs from the target's vocabulary ({target.n_vocab} tokens)")
    if cfg.get("hidden_act", "silu") != "silu":
        fail("hidden_act", f"{cfg['hidden_act']!r} is not supported (silu)")
    if cfg.get("v_head_dim") not in (None, head_dim):
        fail("v_head_dim", f"{cfg['v_head_dim']!r} differs from head_dim {head_dim} (not supported)")
    for where, d_ in (("", cfg), ("dflash_config.", dc)):
        for k, ok in _UNSUPPORTED.items():
            if k in d_ and d_[k] is not None and d_[k] != ok:
                fail(where + k, f"{d_[k]!r} is not supported by this runtime")
    bias = cfg.get("attention_bias", False)
    if not isinstance(bias, bool):
        fail("attention_bias", f"{bias!r} is not a boolean")
    if cfg.get("rope_is_neox_style") is False:
        fail("rope_is_neox_style", "interleaved rope checkpoints are not supported")

    top_bs, nested_bs = cfg.get("block_size"), dc.get("block_size")
    if top_bs is not None and nested_bs is not None and top_bs != nested_bs:
        fail("block_size", f"top level ({top_bs}) and dflash_config ({nested_bs}) disagree")
    block = nested_bs if nested_bs is not None else top_bs if top_bs is not None else 16
    if isinstance(block, bool) or not isinstance(block, int) or block < 2:
        fail("block_size", f"{block!r} is not an integer >= 2")

    mask = get("mask_token_id")
    if isinstance(mask, bool) or not isinstance(mask, int):
        fail("dflash_config.mask_token_id", "missing")
    if not 0 <= mask < target.n_vocab:
        fail("dflash_config.mask_token_id", f"{mask} lies outside the target vocabulary ({target.n_vocab} tokens)")

    ids = get("target_layer_ids")
    if ids is None:
        n_t = cfg.get("num_target_layers") or target.n_layer
        ids = default_target_layer_ids(n_t, L)
    if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        fail("dflash_config.target_layers", f"{ids!r} is not a list of layer ids")
    for i in ids:
        if not 0 <= i < target.n_layer - 1:
            fail("dflash_config.target_layers", f"layer {i} is not below the target's last layer "
                                                   f"({target.n_layer} layers; usable 0..{target.n_layer - 2})")

    def num(name: str, v, default, kind=float):
        """A number from the config (null: the default); anything else is refused by name."""
        if v is None:
            return default
        if isinstance(v, bool) or not isinstance(v, (int, float)) or (kind is int and not float(v).is_integer()):
            fail(name, f"{v!r} is not {'an integer' if kind is int else 'a number'}")
        return kind(v)

    rp = cfg.get("rope_parameters") or {}
    if not isinstance(rp, dict):
        fail("rope_parameters", f"{rp!r} is not an object")
    theta = num("rope_theta", cfg.get("rope_theta", rp.get("rope_theta", 10000.0)), 10000.0)
    scaling = cfg.get("rope_scaling") or rp
    if not isinstance(scaling, dict):
        fail("rope_scaling", f"{scaling!r} is not an object")
    prf = num("partial_rotary_factor", cfg.get("partial_rotary_factor", scaling.get("partial_rotary_factor")), 1.0)
    rope_dims = int(head_dim * prf)
    if not (0 < prf <= 1) or rope_dims < 2 or rope_dims % 2:
        fail("partial_rotary_factor", f"{prf} gives {rope_dims} rotated dimensions of {head_dim} (need an even "
                                      f"number >= 2)")
    backbone = get("backbone_rotary_base")  # (MiMo) a second RoPE base whose use is not published: run only if equal
    if backbone is not None and backbone != theta:
        fail("dflash_config.backbone_rotary_base", f"{backbone!r} differs from rope_theta {theta} (not supported)")
    n_ctx_train = num("max_position_embeddings", cfg.get("max_position_embeddings"), 32768, int)
    rope_fields, rope_freqs = hf_rope(scaling, theta, head_dim, rope_dims, n_ctx_train, fail)

    # Causality per layer, z-lab's rule: a sliding layer is causal, a full one is not, unless is_causal
    # (or dflash_config.causal) sets every layer.  Muse-Glimmer's assistant: non-causal, as z-lab's
    # adapters force it.
    layer_types = cfg.get("layer_types") or []
    if layer_types and (not isinstance(layer_types, list) or len(layer_types) != L):
        fail("layer_types", f"{len(layer_types) if isinstance(layer_types, list) else layer_types!r} entries "
                            f"for {L} layers")
    for t in layer_types:
        if t not in _LAYER_TYPES:
            fail("layer_types", f"{t!r} is not a layer type this runtime runs ({', '.join(_LAYER_TYPES)})")
    causal = cfg.get("is_causal")
    if causal is None:
        causal = dc.get("causal")
    if causal is None and arch == "MuseGlimmerAssistantModel":
        causal = False
    if causal is not None and not isinstance(causal, bool):
        fail("is_causal", f"{causal!r} is not a boolean")
    per_layer = [t == "sliding_attention" for t in layer_types] if causal is None else [causal] * L
    all_causal = bool(per_layer) and all(per_layer)
    causal_layers = [] if all_causal or not any(per_layer) else per_layer

    window = dc.get("swa_window_size") or cfg.get("sliding_window") or 0
    swa: list[bool] = []
    if dc.get("use_swa"):
        swa = [True] * L
    elif cfg.get("use_sliding_window") or "sliding_attention" in layer_types:
        swa = [t == "sliding_attention" for t in layer_types] if layer_types else [True] * L
    if swa and not any(swa):
        swa = []
    if swa and not (isinstance(window, int) and window > 0):
        fail("sliding_window", "sliding-window layers need a positive window")

    vscale = num("dflash_config.attention_value_scale", get("attention_value_scale"), 1.0)
    if vscale == 0.0:
        fail("dflash_config.attention_value_scale", "0 (upstream reads 0 as unset)")
    out = DrafterConfig(
        n_embd=H, n_layer=L, n_head=n_head, n_head_kv=n_kv, head_dim=head_dim, n_ff=cfg["intermediate_size"],
        target_layers=list(ids), block_size=block, mask_token_id=mask, rope_theta=theta, rope_dims=rope_dims,
        rms_eps=num("rms_norm_eps", cfg.get("rms_norm_eps"), 1e-6), causal=all_causal, causal_layers=causal_layers,
        value_scale=vscale, n_swa=num("sliding_window", window, 0, int) if swa else 0, swa_layers=swa,
        embedding_scale=num("input_embedding_scale", get("input_embedding_scale"), 1.0),
        logit_scale=num("output_multiplier", get("output_multiplier"), 1.0),
        softcap=num("final_logit_softcapping", get("final_logit_softcapping"), 0.0) or 0.0,
        n_ctx_train=n_ctx_train, rope_sections=[head_dim // 2, 0, 0, 0] if target.mrope else [],
        n_vocab=target.n_vocab, sample_from_anchor=bool(dc.get("sample_from_anchor", False)),
    )
    for k, v in rope_fields.items():
        setattr(out, k, v)
    if extra is not None:
        extra.attention_bias, extra.rope_freqs = bias, rope_freqs

    if version == 2:
        for k in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"):
            if not isinstance(dc.get(k), int) or dc[k] <= 0:
                fail(f"dflash_config.{k}", "missing (required for DFlash2DraftModel)")
        out.conv_kernel_size, out.conv_group_size = dc["conv_kernel_size"], dc["conv_group_size"]
        out.selector_rank, out.selector_top_k = dc["selector_rank"], dc["selector_top_k"]
        if H % out.conv_group_size:
            fail("dflash_config.conv_group_size", f"{out.conv_group_size} does not divide hidden_size {H}")
        if H < out.selector_top_k * (out.selector_top_k + 1):
            fail("dflash_config.selector_top_k", f"{out.selector_top_k} needs hidden_size >= K(K+1)")
    return out, version


def gguf_name(hf_name: str) -> str | None:
    """GGUF name of a HF checkpoint tensor (the format table's HF names), or None."""
    return table().from_hf(hf_name)


def _progress_bar(label: str):
    if not sys.stderr.isatty():
        return None

    def show(done: int, total: int) -> None:
        frac = done / total if total else 1.0
        bar = "#" * int(30 * frac)
        sys.stderr.write(f"\r{label} [{bar:<30}] {100 * frac:5.1f}% {done / 2**20:8.1f} MiB")
        if done >= total:
            sys.stderr.write("\n")
        sys.stderr.flush()
    return show


def convert_hf_to_gguf(hf_dir: str | os.PathLike, target_gguf: str | os.PathLike, outfile: str | os.PathLike,
                       outtype: str = "f16", progress: bool = False) -> dict:
    """Convert a HF drafter directory to a GGUF drafter; returns a summary dict.

    target_gguf: the target's GGUF file, or its HF directory (config.json + BPE tokenizer.json).
    """
    d = Path(hf_dir)
    cfg, cfg_path = _read_config(d)
    target = read_target(target_gguf)
    extra_cfg = Parsed()
    c, version = parse_config(cfg, cfg_path, target, extra_cfg)
    try:
        tensors = open_checkpoint(d)
    except SafetensorsError as e:
        raise ConvertError(str(e)) from None

    # Reduced draft vocabulary (speculators / EAGLE-3 style): lm_head rows of draft_vocab_size
    # tokens and d2t offsets (target id = row + d2t[row]); t2d is not used at run time.
    vmaps: dict[str, LazyTensor] = {}
    for name in list(tensors):
        base = name.removeprefix("model.")
        if base in ("d2t", "t2d", "lm_head.weight"):
            vmaps[base] = tensors.pop(name)
    n_draft = cfg.get("draft_vocab_size") or (cfg.get("dflash_config") or {}).get("draft_vocab_size") \
        or target.n_vocab
    extra = _reduced_vocab(d, cfg_path, vmaps, n_draft, c, target.n_vocab)

    mapped: dict[str, LazyTensor] = {}
    for name, t in tensors.items():
        g = gguf_name(name)
        row = table().tensor(g) if g else None
        if row is None or (row[0].need == "V2" and version == 1):
            raise ConvertError(f"{t.file}: unexpected tensor '{printable(name)}' for a {cfg['architectures'][0]}")
        if g in mapped:
            raise ConvertError(f"{t.file}: tensor '{name}' duplicates '{mapped[g].name}'")
        if g.endswith(".bias") and not extra_cfg.attention_bias:
            raise ConvertError(f"{t.file}: tensor '{printable(name)}' is a bias but config.json says "
                               f"attention_bias: false")
        mapped[g] = t
    want = table().required(c)
    if extra_cfg.attention_bias:  # q/k/v/o biases in every layer, after the layer's weights (file order)
        want = {n: s_ for n, s_ in want.items()}
        for il in range(c.n_layer):
            for t in table().layer:
                if t.name.endswith(".bias"):
                    want[t.gguf_name(il)] = t.shape(c)
    missing = [n for n in want if n not in mapped]
    if missing:
        raise ConvertError(f"{d}: missing tensors: {', '.join(missing[:6])}" + (" ..." if len(missing) > 6 else ""))
    for n, shape in want.items():
        t = mapped[n]
        if t.shape != shape:
            field = ("vocab_size" if n.startswith("selector_p") or n.startswith("selector_s") else "shape")
            raise ConvertError(f"{t.file}: tensor '{t.name}' has shape {list(t.shape)}, expected {list(shape)} "
                               f"({field})")
    order = list(want)  # deterministic, upstream-like order
    srcs = [TensorSource(n, want[n], mapped[n].load, mapped[n].load_rows) for n in order] + extra
    if extra_cfg.rope_freqs is not None:  # computed from the config, as llama.cpp's LlamaModel does
        f = extra_cfg.rope_freqs
        srcs.append(TensorSource("rope_freqs.weight", f.shape, lambda: f))
    out = Path(outfile)
    tmp = out.with_name(out.name + ".part")
    try:
        n = write_drafter(tmp, c, srcs, target.write_vocab, outtype=outtype,
                          progress=_progress_bar(f"converting to {outtype}") if progress else None)
        try:  # what the loader would refuse is refused here, with its reason (a GGUF target: against it too)
            check_drafter(tmp, target.path if target.path.is_file() else None)
        except DFlashError as e:
            raise ConvertError(f"{cfg_path}: the converted drafter would not load: {e}") from None
        tmp.replace(out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return {"outfile": str(out), "tensors": n, "bytes": out.stat().st_size, "version": version,
            "block_size": c.block_size, "target_layers": c.target_layers, "outtype": outtype,
            "draft_vocab": n_draft}


def _reduced_vocab(d: Path, cfg_path: Path, vmaps: dict[str, LazyTensor], n_draft, c: DrafterConfig,
                   n_vocab: int) -> list[TensorSource]:
    """The drafter's own head and absolute d2t ids (upstream's GGUF layout), or nothing when the
    drafter uses the full vocabulary (a full-size lm_head is then the target's and is skipped, as
    upstream's converter does)."""
    if not isinstance(n_draft, int) or not 0 < n_draft <= n_vocab:
        raise ConvertError(f"{cfg_path}: draft_vocab_size: {n_draft!r} is not in 1..{n_vocab}")
    if "d2t" not in vmaps:
        if n_draft < n_vocab:
            raise ConvertError(f"{d}: draft_vocab_size {n_draft} < vocab_size {n_vocab} but there is no d2t tensor")
        return []
    head = vmaps.get("lm_head.weight")
    if head is None:
        raise ConvertError(f"{d}: a d2t map needs the drafter's own lm_head.weight")
    if head.shape != (n_draft, c.n_embd):
        raise ConvertError(f"{head.file}: tensor '{head.name}' has shape {list(head.shape)}, "
                           f"expected {[n_draft, c.n_embd]} (draft_vocab_size)")
    m = vmaps["d2t"]
    try:
        off = m.load_ints()
    except SafetensorsError as e:
        raise ConvertError(str(e)) from None
    if off.shape != (n_draft,):
        raise ConvertError(f"{m.file}: d2t has shape {list(off.shape)}, expected [{n_draft}] (draft_vocab_size)")
    ids = off + np.arange(n_draft, dtype=np.int64)
    if ids.min() < 0 or ids.max() >= n_vocab:
        raise ConvertError(f"{m.file}: d2t maps draft rows outside the target vocabulary ({n_vocab} tokens)")
    if np.unique(ids).size != ids.size:
        raise ConvertError(f"{m.file}: d2t maps two draft rows to the same target token")
    if c.is_v2 and c.selector_top_k > n_draft:
        raise ConvertError(f"{cfg_path}: selector_top_k {c.selector_top_k} exceeds draft_vocab_size {n_draft}")
    return [TensorSource("output.weight", head.shape, head.load, head.load_rows),
            TensorSource("d2t", (n_draft,), lambda: ids, raw_type=GGMLQuantizationType.I64)]
