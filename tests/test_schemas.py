"""The published drafter catalogue (../shared/docs/published-drafters.md, docs/architecture.md §4):
each schema, sizes scaled down and every other field as published, converts against a tiny target and
the C drafter's logits (DFlash2: lattices and drafts) match the PyTorch reference on it; RoPE matches
HF transformers; bad inputs are refused by name."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter

from llama_dflash.core.drafter import Drafter
from llama_dflash.errors import DFlashError
from llama_dflash.formats import ConvertError, convert_hf_to_gguf
from llama_dflash.formats.gguf import copy_fields, read_drafter_config, read_tensors
from llama_dflash.formats.safetensors import open_checkpoint
from llama_dflash.verify.reference import DFlashReference, hf_to_reference, rope_neox

from hf_fixtures import PUBLISHED, PUBLISHED_TARGET_LAYERS, make_published, make_variant
from models import MASK_ID, TargetSpec, compare_lattice, growing_context, reference_draft, write_target

T, F = True, False
# What each schema must turn into (beyond the sizes): causality per layer, windows, RoPE, transforms.
EXPECT = {
    "qwen3_v1_b16": dict(version=1, block_size=16, n_layer=5, causal=F, causal_layers=[], n_swa=0,
                         rope_theta=1e6, rope_dims=16),
    "qwen35_june": dict(version=1, block_size=16, n_layer=6, causal=F, causal_layers=[T] * 5 + [F], n_swa=9,
                        swa_layers=[T] * 5 + [F], rope_theta=1e7),
    "qwen36_27b_flat": dict(version=1, block_size=16, n_layer=5, causal=F, causal_layers=[T] * 4 + [F], n_swa=9,
                            swa_layers=[T] * 4 + [F], rope_theta=1e7),
    "llama31_llama3_rope": dict(version=1, block_size=10, n_layer=5, causal=F, rope_scaling="none",
                                rope_theta=5e5, rope_freqs=True),
    "gptoss_20b": dict(version=1, block_size=8, n_layer=8, head_dim=64, rope_dims=64, causal=F, rope_scaling="none",
                       rope_theta=1.5e5, yarn_attn_factor=1 + 0.1 * math.log(32), bias=True, rope_freqs=True),
    "mimo_no_sink": dict(version=1, block_size=8, n_layer=5, rope_dims=8, value_scale=0.612, causal=F, n_swa=9,
                         swa_layers=[T] * 5, target_layers=[0, 2, 4, 6, 8]),
    "muse_dflash2": dict(version=2, block_size=16, causal=F, causal_layers=[], n_swa=9, swa_layers=[T] * 5,
                         softcap=20.0, logit_scale=0.19611613513818404, selector_rank=32, selector_top_k=4),
    "muse_v1_assistant": dict(version=1, block_size=16, causal=F, causal_layers=[], n_swa=9, swa_layers=[T] * 5),
    "qwen38_dflash2": dict(version=2, block_size=8, causal=F, n_swa=9, swa_layers=[T] * 5, rms_eps=1e-6),
    "speculators_dflash2": dict(version=2, block_size=8, n_layer=2, causal=F, n_swa=9, swa_layers=[T] * 2),
    # z-lab's code reads the transforms at the top level too (no published checkpoint sets them there yet)
    "qwen3_toplevel_transforms": dict(version=1, block_size=16, embedding_scale=1.5, logit_scale=0.5, softcap=8.0),
}
# MiMo without the two fields this runtime refuses (attention_sink_bias, backbone_rotary_base)
_MIMO_DC = {k: v for k, v in PUBLISHED["mimo"][0]["dflash_config"].items()
            if k not in ("attention_sink_bias", "backbone_rotary_base")}
CHANGES = {"mimo_no_sink": ("mimo", {"dflash_config": _MIMO_DC}),
           "qwen3_toplevel_transforms": ("qwen3_v1_b16", {"input_embedding_scale": 1.5, "output_multiplier": 0.5,
                                                         "final_logit_softcapping": 8.0})}


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    d = tmp_path_factory.mktemp("schemas")
    return write_target(str(d / f"llama-{PUBLISHED_TARGET_LAYERS}.gguf"),
                        TargetSpec(arch="llama", n_layer=PUBLISHED_TARGET_LAYERS, seed=7))


def build(tmp_path, name, **extra):
    src, changes = CHANGES.get(name, (name, {}))
    return make_published(tmp_path, src, **{**changes, **extra})


def reference_for(hf_dir, gguf_path, n_vocab=1024) -> DFlashReference:
    """The reference on the HF checkpoint's weights, with the converted file's config and RoPE factors."""
    cfg = read_drafter_config(gguf_path)
    cfg.n_vocab = n_vocab
    hf = {k.removeprefix("model."): t.load() for k, t in open_checkpoint(hf_dir).items()}
    freqs = read_tensors(gguf_path, ["rope_freqs.weight"]).get("rope_freqs.weight")
    ref = DFlashReference(cfg, attention_bias=any(k.endswith(".bias") for k in hf), rope_freqs=freqs)
    ref.load_state_dict(hf_to_reference(hf), strict=True)
    return ref


@pytest.mark.parametrize("name", sorted(EXPECT))
def test_published_schema_converts_and_matches_reference(target, load_model, tmp_path, name):
    hf_dir, _, _ = build(tmp_path, name)
    out = tmp_path / f"{name}.gguf"
    convert_hf_to_gguf(hf_dir, target, out, outtype="f32")
    got = read_drafter_config(out)
    exp = dict(EXPECT[name])
    bias, has_freqs = exp.pop("bias", False), exp.pop("rope_freqs", False)
    for k, v in exp.items():
        g = got.version if k == "version" else getattr(got, k)
        assert (g == pytest.approx(v, rel=1e-6)) if isinstance(v, float) else g == v, (k, g, v)
    names = {t.name for t in GGUFReader(str(out)).tensors}
    assert ("blk.0.attn_q.bias" in names) == bias and ("blk.7.attn_output.bias" in names) == bias
    assert ("rope_freqs.weight" in names) == has_freqs

    model = load_model(target)
    ref = reference_for(hf_dir, out)
    embed = torch.from_numpy(read_tensors(target, ["token_embd.weight"])["token_embd.weight"].copy())
    H = got.n_embd * got.n_taps
    feats = np.random.default_rng(3).standard_normal((80, H)).astype(np.float32)
    d = Drafter(out, model, n_ctx=256, n_threads=2)
    n = got.max_draft
    # contexts shorter and longer than the window (9); several calls on a growing cache
    for done, anchor, _ in growing_context([d], feats, [(3, n), (20, n), (40, n)], np.random.default_rng(1)):
        toks, logits = d.draft(anchor, n, return_logits=True)
        if got.is_v2:
            lg, rcand, rscores, rtoks, _ = reference_draft(ref, feats[:done], anchor, n, embed, embed)
            cand, scores = d.last_lattice()
            compare_lattice(cand, scores, rcand, rscores, 2e-3)
            assert toks == rtoks
        else:
            with torch.no_grad():
                lg = ref(torch.from_numpy(feats[:done]), torch.tensor([anchor] + [MASK_ID] * n), embed, embed).numpy()
        assert np.abs(logits - lg).max() < 2e-3, (done, np.abs(logits - lg).max())
    d.close()


def test_causality_changes_the_draft(target, load_model, tmp_path):
    """The per-layer pattern is run, not ignored: the same weights with is_causal: false draft differently."""
    model = load_model(target)
    feats = np.random.default_rng(5).standard_normal((30, 64 * 8)).astype(np.float32)
    outs = []
    for sub, change in (("mixed", {}), ("flag", {"is_causal": False})):
        hf_dir, _, _ = make_published(tmp_path / sub, "qwen35_june", **change)
        convert_hf_to_gguf(hf_dir, target, tmp_path / f"{sub}.gguf", outtype="f32")
        d = Drafter(tmp_path / f"{sub}.gguf", model, n_ctx=128, n_threads=2)
        d.push(feats)
        outs.append(d.draft(50, 15, return_logits=True)[1])
        d.close()
    assert read_drafter_config(tmp_path / "flag.gguf").causal_layers == []
    assert np.abs(outs[0] - outs[1]).max() > 1e-3


def _hf_rope(cfg: dict, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """RoPE as HF transformers computes it for this config (ROPE_INIT_FUNCTIONS; rotate-half over the
    first head_dim * partial_rotary_factor dims)."""
    from transformers import Qwen3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    c = Qwen3Config(**{k: v for k, v in cfg.items() if k not in ("dflash_config", "auto_map", "architectures")})
    p = c.rope_parameters
    dim = int(c.head_dim * p.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)))
    if p.get("rope_type", "default") == "default":
        inv, att = 1.0 / p["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim), 1.0
    else:
        inv, att = ROPE_INIT_FUNCTIONS[p["rope_type"]](c, "cpu")
    ang = pos.double()[:, None] * inv.double()[None, :]
    cos = (torch.cat([ang.cos(), ang.cos()], -1) * att).float()[:, None, :]
    sin = (torch.cat([ang.sin(), ang.sin()], -1) * att).float()[:, None, :]
    xr, rest = x[..., :dim], x[..., dim:]
    x1, x2 = xr[..., : dim // 2], xr[..., dim // 2:]
    return torch.cat([xr * cos + torch.cat([-x2, x1], -1) * sin, rest], -1)


@pytest.mark.parametrize("name", ["llama31_llama3_rope", "gptoss_20b", "mimo_no_sink", "v1_yarn",
                                  "gptoss_truncated", "yarn_mscale"])
def test_rope_matches_transformers(target, tmp_path, name):
    """The converted RoPE (native scaling keys or rope_freqs factors + attn factor) as the reference
    (= the C graph, checked above) applies it equals HF transformers' on the published config."""
    gpt = PUBLISHED["gptoss_20b"][0]["rope_scaling"]
    if name == "v1_yarn":  # ggml's own YaRN (truncated bounds)
        hf_dir, cfg, _ = make_variant(tmp_path, name)
    else:
        extra = {"gptoss_truncated": {"rope_scaling": {**gpt, "truncate": True}},
                 "yarn_mscale": {"rope_scaling": {**gpt, "mscale": 1.0, "mscale_all_dim": 0.5}}}.get(name, {})
        hf_dir, cfg, _ = build(tmp_path, "gptoss_20b" if name in ("gptoss_truncated", "yarn_mscale") else name,
                               **extra)
    out = tmp_path / "r.gguf"
    convert_hf_to_gguf(hf_dir, target, out, outtype="f32")
    c = read_drafter_config(out)
    if name == "gptoss_truncated":
        assert c.rope_scaling == "yarn"  # ggml's own YaRN: truncated bounds, default attention factor
    freqs = read_tensors(out, ["rope_freqs.weight"]).get("rope_freqs.weight")
    x = torch.randn(300, 2, c.head_dim, generator=torch.Generator().manual_seed(0))
    pos = torch.arange(300) * 7
    ours = rope_neox(x, pos, c, None if freqs is None else torch.from_numpy(freqs.copy()))
    theirs = _hf_rope(cfg, x, pos)
    assert (ours - theirs).abs().max() < 2e-4


@pytest.mark.parametrize("outtype", ["q8_0", "bf16"])
def test_dflash2_quantized_codebooks(target, load_model, tmp_path, outtype):
    """Codebooks, selector_hidden, fc and conv projections at the output type, as upstream writes them;
    conv bases and norms f32.  The drafter loads and matches the reference on the dequantized file;
    codebooks dequantized at load (the default) and gathered as stored draft bit-identically."""
    hf_dir, _, _ = build(tmp_path, "muse_dflash2")
    out = tmp_path / f"{outtype}.gguf"
    convert_hf_to_gguf(hf_dir, target, out, outtype=outtype)
    types = {t.name: t.tensor_type.name for t in GGUFReader(str(out)).tensors}
    want = outtype.upper()
    for n in ("selector_predecessor.weight", "selector_successor.weight", "selector_hidden.weight", "fc.weight",
              "blk.0.attn_conv_proj.weight", "blk.4.ffn_conv_proj.weight"):
        assert types[n] == want, (n, types[n])
    assert types["blk.0.attn_conv_base"] == "F32" and types["output_norm.weight"] == "F32"
    model = load_model(target)
    ref = DFlashReference.from_gguf(out)
    embed = torch.from_numpy(read_tensors(target, ["token_embd.weight"])["token_embd.weight"].copy())
    feats = np.random.default_rng(2).standard_normal((40, 64 * 5)).astype(np.float32)
    d = Drafter(out, model, n_ctx=128, n_threads=2)
    d.push(feats)
    toks, logits = d.draft(77, 15, return_logits=True)
    lg, rcand, rscores, rtoks, _ = reference_draft(ref, feats, 77, 15, embed, embed)
    # q8_0 / bf16 matrices multiply 8-bit / bf16 activations: close, not equal (the codebook rows are
    # gathered exactly)
    assert np.abs(logits - lg).max() < 0.05 * np.abs(lg).max()
    cand, scores = d.last_lattice()
    assert cand.shape == rcand.shape and len(toks) == 15
    mem = d.memory()["weights"]
    d.close()
    d = Drafter(out, model, n_ctx=128, n_threads=2, gathered_as_stored=True)
    d.push(feats)
    toks2, logits2 = d.draft(77, 15, return_logits=True)
    cand2, scores2 = d.last_lattice()
    assert d.memory()["weights"] < mem  # (codebooks as stored: the other path really taken)
    d.close()
    assert toks2 == toks and logits2.tobytes() == logits.tobytes()
    assert cand2.tobytes() == cand.tobytes() and scores2.tobytes() == scores.tobytes()


def _retype(src, dst, name, qtype: GGMLQuantizationType, data: np.ndarray):
    """A copy of a GGUF with one tensor replaced (any type)."""
    r = GGUFReader(str(src))
    w = GGUFWriter(str(dst), r.fields["general.architecture"].contents())
    copy_fields(r, w)
    for t in r.tensors:
        if t.name == name:
            w.add_tensor(t.name, data, raw_dtype=qtype)
        else:  # (an f32 file: every other tensor's data as it is)
            w.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_bad_codebook_type_is_refused_by_name(target, tmp_path):
    from test_convert import run_cli

    hf_dir, _, _ = build(tmp_path, "qwen38_dflash2")
    convert_hf_to_gguf(hf_dir, target, tmp_path / "ok.gguf", outtype="f32")
    _retype(tmp_path / "ok.gguf", tmp_path / "bad.gguf", "selector_successor.weight", GGMLQuantizationType.I32,
            np.zeros((1024, 32), np.int32))
    with pytest.raises(DFlashError, match="'selector_successor.weight' has type i32"):
        read_drafter_config(tmp_path / "bad.gguf")
    r = run_cli("inspect", str(tmp_path / "bad.gguf"))
    assert r.returncode == 2 and "selector_successor.weight" in r.stderr and len(r.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("name,change,msg", [
    ("mimo", {}, "dflash_config.attention_sink_bias: True is not supported"),
    ("mimo", {"dflash_config": {**_MIMO_DC, "attention_sink_bias": False, "backbone_rotary_base": 5e6}},
     "dflash_config.backbone_rotary_base"),
    ("mimo", {"v_head_dim": 32, "dflash_config": _MIMO_DC}, "v_head_dim: 32 differs from head_dim 16"),
    ("qwen3_v1_b16", {"hidden_act": "gelu"}, "hidden_act: 'gelu' is not supported"),
    ("qwen3_v1_b16", {"rope_scaling": {"rope_type": "longrope", "factor": 4.0}},
     "rope_scaling: rope type 'longrope' is not supported"),
    ("qwen3_v1_b16", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                                       "yarn_log_multiplier": 0.1}}, "rope_scaling.yarn_log_multiplier: not supported"),
    ("qwen3_v1_b16", {"block_size": None, "dflash_config": {"block_size": 0, "mask_token_id": 16,
                                                            "target_layer_ids": [1, 3, 5, 7, 8]}},
     "block_size: 0 is not an integer >= 2"),
    ("qwen3_v1_b16", {"layer_types": ["chunked_attention"] * 5}, "layer_types: 'chunked_attention' is not"),
    ("qwen3_v1_b16", {"mlp_bias": True}, "mlp_bias: True is not supported"),
    ("qwen35_june", {"output_multiplier": 0.5, "dflash_config": {"block_size": 16, "mask_token_id": 16,
                                                                "target_layer_ids": [1, 2, 3, 4, 5, 6, 7, 8],
                                                                "output_multiplier": 0.25}},
     "output_multiplier: top level (0.5) and dflash_config (0.25) disagree"),
    ("gptoss_20b", {"rope_scaling": {"rope_type": "yarn", "factor": 32.0, "extrapolation_factor": 2.0}},
     "rope_scaling.extrapolation_factor"),
])
def test_config_fields_refused_by_name(target, tmp_path, name, change, msg):
    hf_dir, _, _ = make_published(tmp_path, name, **change)
    with pytest.raises(ConvertError) as e:
        convert_hf_to_gguf(hf_dir, target, tmp_path / "o.gguf")
    assert msg in str(e.value) and "config.json" in str(e.value), str(e.value)
    assert "\n" not in str(e.value)


def test_bias_tensors_must_match_attention_bias(target, tmp_path):
    from test_convert import run_cli

    from hf_fixtures import hf_tensors, write_checkpoint

    cfg = PUBLISHED["qwen3_v1_b16"][0]
    t = hf_tensors({**cfg, "attention_bias": True})  # biases in the file, config says none
    d = write_checkpoint(tmp_path / "b", cfg, t)
    with pytest.raises(ConvertError, match=r"tensor 'layers.0.self_attn.q_proj.bias' is a bias but config.json "
                                           r"says attention_bias: false"):
        convert_hf_to_gguf(d, target, tmp_path / "o.gguf")
    r = run_cli("convert", str(d), "--target", target, "--outfile", str(tmp_path / "o.gguf"))
    assert r.returncode == 2 and "layers.0.self_attn.q_proj.bias" in r.stderr
    cfg = PUBLISHED["gptoss_20b"][0]
    t = hf_tensors(cfg)
    del t["layers.3.self_attn.v_proj.bias"]
    d = write_checkpoint(tmp_path / "m", cfg, t)
    with pytest.raises(ConvertError, match="missing tensors: blk.3.attn_v.bias"):
        convert_hf_to_gguf(d, target, tmp_path / "o.gguf")


def test_unknown_rope_type_cli_exit_2(target, tmp_path):
    from test_convert import run_cli

    hf_dir, _, _ = make_published(tmp_path, "qwen3_v1_b16", rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    r = run_cli("convert", str(hf_dir), "--target", target, "--outfile", str(tmp_path / "o.gguf"))
    assert r.returncode == 2 and "rope type 'dynamic' is not supported" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1



def test_dflash2_llama_quantize_k_quants(target, load_model, tmp_path):
    """A DFlash2 drafter through upstream's llama-quantize (Q4_K_M: Q4_K codebooks, the small matrices at
    its fallback types) loads and drafts like the reference on the dequantized file; its codebooks
    dequantized at load (the default) or gathered as stored, bit-identically."""
    import llama_cpp

    cfg = PUBLISHED["muse_dflash2"][0]
    hf_dir, _, _ = make_published(tmp_path, "muse_dflash2",
                                  dflash_config={**cfg["dflash_config"], "selector_rank": 256})
    convert_hf_to_gguf(hf_dir, target, tmp_path / "f32.gguf", outtype="f32")
    p = llama_cpp.llama_model_quantize_default_params()
    p.ftype = 15  # LLAMA_FTYPE_MOSTLY_Q4_K_M
    assert llama_cpp.llama_model_quantize(str(tmp_path / "f32.gguf").encode(), str(tmp_path / "q.gguf").encode(),
                                          p) == 0
    types = {t.name: t.tensor_type.name for t in GGUFReader(str(tmp_path / "q.gguf")).tensors}
    assert types["selector_predecessor.weight"] == types["selector_successor.weight"] == "Q4_K"
    assert types["selector_hidden.weight"] != "F32" and types["blk.0.attn_conv_base"] == "F32"
    model = load_model(target)
    ref = DFlashReference.from_gguf(tmp_path / "q.gguf")
    embed = torch.from_numpy(read_tensors(target, ["token_embd.weight"])["token_embd.weight"].copy())
    feats = np.random.default_rng(6).standard_normal((40, 64 * 5)).astype(np.float32)
    outs = []
    for as_stored in (False, True):
        d = Drafter(tmp_path / "q.gguf", model, n_ctx=128, n_threads=2, gathered_as_stored=as_stored)
        d.push(feats)
        toks, logits = d.draft(88, 15, return_logits=True)
        outs.append((toks, logits.tobytes(), *(x.tobytes() for x in d.last_lattice())))
        d.close()
    assert outs[0] == outs[1]
    lg = reference_draft(ref, feats, 88, 15, embed, embed)[0]
    err = np.abs(np.frombuffer(outs[0][1], np.float32).reshape(lg.shape) - lg)
    # (its q5_0 / q8_0 matrices multiply 8-bit activations through 5 layers)
    assert err.max() < 0.1 * np.abs(lg).max() and err.mean() < 0.01 * np.abs(lg).max()
