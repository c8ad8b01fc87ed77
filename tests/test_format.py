"""The format table (csrc/dflash_format.h): one owner for the C loader and the Python side.

The Python DrafterConfig, the C struct and the writer agree with the table; every file the
loader refuses is refused, with its reason, by both the runtime load and the target-free check
(and so by `inspect` and the converter), never a crash.
"""

from __future__ import annotations

import json
import math
from dataclasses import fields

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
from gguf.quants import dequantize

from llama_dflash import DFlashError, _native
from llama_dflash.core.drafter import Drafter
from llama_dflash.formats import ConvertError, convert_hf_to_gguf
from llama_dflash.formats.check import check_drafter
from llama_dflash.formats.config import DrafterConfig
from llama_dflash.formats.gguf import ARCH, quantize_drafter, random_drafter_tensors, write_drafter
from llama_dflash.formats.table import evaluate, table

from hf_fixtures import make_variant
from models import VOCAB, drafter_config

T = table()


def test_config_fields_are_the_table_fields():
    names = [f.name for f in fields(DrafterConfig)]
    assert set(names) == {k.field for k in T.keys} | {"n_vocab", "n_vocab_draft"}
    cfg = DrafterConfig(n_layer=2, n_embd=64, n_ff=96, n_head=4, block_size=8, target_layers=[0], mask_token_id=3)
    for k in T.keys:
        if k.need == "REQ":
            continue
        want = [] if k.type.startswith("ARR") else evaluate(k.default, cfg)
        assert getattr(cfg, k.field) == want, k.field
    assert cfg.head_dim == 16 and cfg.n_head_kv == 4 and cfg.rope_orig_ctx == cfg.n_ctx_train  # derived defaults


def test_c_struct_has_every_table_field():
    c_fields = {name for name, _ in _native.ffi.typeof("struct dflash_drafter_info").fields}
    assert {k.field for k in T.keys} <= c_fields
    assert {"n_vocab", "n_vocab_draft"} <= c_fields


def test_tensor_rows_are_unique_and_shapes_evaluate():
    names = [t.name for t in T.top] + [t.name for t in T.layer]
    assert len(names) == len(set(names))
    cfg = DrafterConfig(n_layer=1, n_embd=64, n_ff=96, n_head=4, n_head_kv=2, block_size=8, target_layers=[0, 2],
                        mask_token_id=3, conv_kernel_size=2, conv_group_size=16, selector_rank=8, selector_top_k=4,
                        n_vocab=VOCAB)
    req = T.required(cfg)
    assert req["fc.weight"] == (64, 128) and req["blk.0.attn_conv_proj.weight"] == (16, 64)
    assert req["blk.0.attn_conv_base"] == (2, 2, 64) and req["selector_predecessor.weight"] == (VOCAB, 8)
    assert T.from_hf("model.layers.0.self_attn.q_proj.weight") == "blk.0.attn_q.weight"
    assert T.from_hf("encoder.fc.weight") == "fc.weight" and T.to_hf("fc.weight") == "fc.weight"
    assert T.from_hf("lm_head.weight") is None


VARIANTS = [
    {},
    {"causal": True, "n_swa": 9, "swa_layers": [True, False], "rms_eps": 1e-5},
    {"rope_scaling": "yarn", "rope_factor": 4.0, "rope_orig_ctx": 64, "yarn_beta_fast": 16.0},
    {"rope_scaling": "linear", "rope_factor": 2.0, "logit_scale": 0.5, "softcap": 3.0, "embedding_scale": 1.5},
    {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 8, "selector_top_k": 4, "n_vocab": VOCAB},
]


@pytest.mark.parametrize("over", VARIANTS, ids=["plain", "swa", "yarn", "linear", "dflash2"])
def test_written_config_reads_back_through_the_c_reader(artifacts, tmp_path, over):
    a = artifacts["llama"]
    cfg = drafter_config(a["spec"], **over)
    p = tmp_path / "d.gguf"
    write_drafter(p, cfg, random_drafter_tensors(cfg, seed=3), a["target"])
    got = check_drafter(p)
    exp = DrafterConfig(**{**cfg.__dict__, "n_vocab": VOCAB, "n_vocab_draft": VOCAB})
    for f in ("rms_eps", "rope_theta", "rope_factor", "logit_scale", "softcap", "embedding_scale"):
        setattr(exp, f, float(np.float32(getattr(exp, f))))
    if exp.n_swa and not exp.swa_layers:
        exp.swa_layers = [True] * exp.n_layer
    assert got == exp


# -- refusals ----------------------------------------------------------------------------------

def _rewrite(src, dst, keys=None, drop=(), tensor_f16=(), tensor_i32=(), extra_tensor=None, drop_tensors=()):
    """A copy of a drafter GGUF with keys replaced / removed and tensors re-typed or added."""
    r = GGUFReader(str(src))
    w = GGUFWriter(str(dst), ARCH)
    keys = keys or {}
    for name, f in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture" or name in drop or name in keys:
            continue
        vtype = GGUFValueType(f.types[0])
        sub = GGUFValueType(f.types[-1]) if vtype == GGUFValueType.ARRAY else None
        w.add_key_value(name, f.contents(), vtype, sub_type=sub)
    for name, (value, vtype, sub) in keys.items():
        w.add_key_value(name, value, vtype, sub_type=sub)
    for t in r.tensors:
        if t.name in drop_tensors:
            continue
        data = np.asarray(t.data)
        shape = tuple(int(x) for x in reversed(t.shape.tolist()))
        if t.name in tensor_f16:
            w.add_tensor(t.name, data.astype(np.float16).reshape(shape))
        elif t.name in tensor_i32:
            w.add_tensor(t.name, data.astype(np.int32).reshape(shape))
        else:
            w.add_tensor(t.name, data, raw_dtype=t.tensor_type)
    if extra_tensor:
        w.add_tensor(extra_tensor[0], extra_tensor[1])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


U32, F32, STR, BOOL, ARR = (GGUFValueType.UINT32, GGUFValueType.FLOAT32, GGUFValueType.STRING, GGUFValueType.BOOL,
                           GGUFValueType.ARRAY)
BAD = {
    "eps_nan": ({"keys": {"dflash.attention.layer_norm_rms_epsilon": (math.nan, F32, None)}}, "not a finite number"),
    "eps_negative": ({"keys": {"dflash.attention.layer_norm_rms_epsilon": (-1.0, F32, None)}}, "rms epsilon -1"),
    "eps_zero": ({"keys": {"dflash.attention.layer_norm_rms_epsilon": (0.0, F32, None)}}, "rms epsilon 0"),
    "block_0": ({"keys": {"dflash.block_size": (0, U32, None)}}, "'dflash.block_size' must be positive"),
    "block_1": ({"keys": {"dflash.block_size": (1, U32, None)}}, "block_size 1 is outside 2..65"),
    "block_huge": ({"keys": {"dflash.block_size": (100000, U32, None)}}, "block_size 100000 is outside"),
    "block_string": ({"keys": {"dflash.block_size": ("16", STR, None)}}, "has type str, expected an integer"),
    "block_anchor": ({"keys": {"dflash.block_size": (65, U32, None), "dflash.sample_from_anchor": (True, BOOL, None)}},
                     "block_size 65 with sample_from_anchor drafts 65 tokens, more than 64"),
    "layers_string": ({"keys": {"dflash.target_layers": (["1", "3"], ARR, STR)}}, "array of str, expected integers"),
    "layers_zero": ({"keys": {"dflash.target_layers": ([0, 3], ARR, GGUFValueType.INT32)}}, "stored + 1"),
    "no_block_size": ({"drop": ["dflash.block_size"]}, "missing or invalid key 'dflash.block_size'"),
    "no_mask": ({"drop": ["tokenizer.ggml.mask_token_id"]}, "missing or invalid key 'tokenizer.ggml.mask_token_id'"),
    "heads_0": ({"keys": {"dflash.attention.head_count": (0, U32, None)}}, "head_count' must be positive"),
    "kv_heads_3": ({"keys": {"dflash.attention.head_count_kv": (3, U32, None)}}, "unsupported attention shape"),
    "layers_65": ({"keys": {"dflash.block_count": (65, U32, None)}}, "65 drafter layers"),
    "value_length": ({"keys": {"dflash.attention.value_length": (8, U32, None)}}, "value_length = 8 differs"),
    "rope_dynamic": ({"keys": {"dflash.rope.scaling.type": ("dynamic", STR, None)}}, "'dynamic' is not supported"),
    "rope_factor_negative": ({"keys": {"dflash.rope.scaling.type": ("linear", STR, None),
                                       "dflash.rope.scaling.factor": (-2.0, F32, None)}}, "needs a positive"),
    "gemma_key": ({"keys": {"dflash.hidden_activation": ("gelu", STR, None)}}, "Gemma-style"),
    "eps_as_int": ({"keys": {"dflash.attention.layer_norm_rms_epsilon": (1, U32, None)}}, "expected a float"),
    "norm_f16": ({"tensor_f16": ["blk.0.attn_norm.weight"]}, "'blk.0.attn_norm.weight' has type f16, expected f32"),
    "norm_i32": ({"tensor_i32": ["output_norm.weight"]}, "'output_norm.weight' has type i32, expected f32"),
    "matrix_i32": ({"tensor_i32": ["blk.1.attn_q.weight"]}, "'blk.1.attn_q.weight' has type i32"),
    "v2_without_selector": ({"extra_tensor": ("blk.0.attn_conv_base", np.ones((2, 2, 64), np.float32))},
                            "DFlash2 tensor 'blk.0.attn_conv_base' but no selector_hidden.weight"),
    "unknown_tensor": ({"extra_tensor": ("blk.0.extra.weight", np.ones(4, np.float32))}, "unsupported tensor"),
    "layer_out_of_range": ({"extra_tensor": ("blk.7.attn_norm.weight", np.ones(64, np.float32))}, "unsupported"),
    "missing_tensor": ({"drop_tensors": ["blk.1.ffn_down.weight"]}, "missing tensor 'blk.1.ffn_down.weight'"),
    # the fuzz's findings: each was refused by `inspect` but generated, or generated unchecked
    "no_tokens": ({"drop": ["tokenizer.ggml.tokens"]}, "tokenizer.ggml.tokens is missing"),
    "tokens_corrupt": ({"keys": {"tokenizer.ggml.tokens": (["a", b"\xff\xfeb"] + ["t"] * (VOCAB - 2), ARR, STR)}},
                       r"tokenizer.ggml.tokens\[1\] is not valid UTF-8"),
    "taps_duplicate": ({"keys": {"dflash.target_layers": ([3, 3, 3], ARR, GGUFValueType.INT32)}},
                       "dflash.target_layers taps layer 2 twice"),
    "context_length_1": ({"keys": {"dflash.context_length": (1, U32, None)}},
                         "dflash.context_length 1 is shorter than one block"),
}


@pytest.fixture(scope="module")
def model(artifacts, load_model):
    return load_model(artifacts["llama"]["target"])


def _pattern(message: str) -> str:
    return message if "\\[" in message else message.replace("(", r"\(").replace(")", r"\)").replace("+", r"\+")


@pytest.mark.parametrize("case", sorted(BAD))
def test_loader_and_check_refuse(artifacts, model, tmp_path, case):
    """One validation: the file alone, the file against its target and the load refuse alike."""
    mutation, message = BAD[case]
    bad = _rewrite(artifacts["llama"]["drafter"], tmp_path / f"{case}.gguf", **mutation)
    with pytest.raises(DFlashError, match=_pattern(message)):
        check_drafter(bad)
    with pytest.raises(DFlashError, match=_pattern(message)):
        check_drafter(bad, model)
    with pytest.raises(DFlashError, match=_pattern(message)):
        Drafter(bad, model, n_ctx=64, n_threads=1)


def _tokens(src) -> list[str]:
    return list(GGUFReader(str(src)).fields["tokenizer.ggml.tokens"].contents())


# files that are sound alone but not for this target: the check against the target and the load refuse
TARGET_BAD = {
    "other_tokenizer": (lambda toks: toks[:100] + ["Zq"] + toks[101:],
                        r"made for another tokenizer: tokenizer.ggml.tokens\[100\] is \"Zq\""),
    "smaller_vocabulary": (lambda toks: toks[:512],
                           "made for another vocabulary: tokenizer.ggml.tokens holds 512 tokens, the target's 1024"),
}


@pytest.mark.parametrize("case", sorted(TARGET_BAD))
def test_drafter_for_another_tokenizer_is_refused(artifacts, model, tmp_path, case):
    change, message = TARGET_BAD[case]
    src = artifacts["llama"]["drafter"]
    bad = _rewrite(src, tmp_path / f"{case}.gguf", keys={"tokenizer.ggml.tokens": (change(_tokens(src)), ARR, STR)})
    check_drafter(bad)  # sound alone
    with pytest.raises(DFlashError, match=message):
        check_drafter(bad, model)
    with pytest.raises(DFlashError, match=message):
        check_drafter(bad, artifacts["llama"]["target"])  # a target path: its vocabulary loaded alone
    with pytest.raises(DFlashError, match=message):
        Drafter(bad, model, n_ctx=64, n_threads=1)


def test_untouched_copy_is_accepted(artifacts, model, tmp_path):
    ok = _rewrite(artifacts["llama"]["drafter"], tmp_path / "same.gguf")
    assert check_drafter(ok) == check_drafter(artifacts["llama"]["drafter"])
    Drafter(ok, model, n_ctx=64, n_threads=1).close()


@pytest.mark.parametrize("change,message", [
    ({"rms_norm_eps": float("nan")}, "not a finite number"),
    ({"rms_norm_eps": -1.0}, "rms epsilon -1"),
    ({"block_size": 1_000_000_000}, "block_size 1000000000 is outside"),
])
def test_converter_refuses_what_the_loader_refuses(artifacts, tmp_path, change, message):
    hf, _, _ = make_variant(tmp_path, "v1_toplevel")
    cfg = json.loads((hf / "config.json").read_text())
    cfg.update(change)
    (hf / "config.json").write_text(json.dumps(cfg))
    out = tmp_path / "out.gguf"
    with pytest.raises(ConvertError, match=message):
        convert_hf_to_gguf(hf, artifacts["llama"]["target"], out, outtype="f32")
    assert not out.exists() and not (tmp_path / "out.gguf.part").exists()


def test_quantized_matrices_are_accepted(artifacts, model, tmp_path):
    a = artifacts["llama"]
    cfg = drafter_config(a["spec"])
    p = tmp_path / "q8.gguf"
    write_drafter(p, cfg, random_drafter_tensors(cfg, seed=1), a["target"], outtype="q8_0")
    types = {t.name: t.tensor_type for t in GGUFReader(str(p)).tensors}
    assert types["blk.0.attn_q.weight"] == GGMLQuantizationType.Q8_0
    assert types["blk.0.attn_norm.weight"] == GGMLQuantizationType.F32  # the table's F32 rows stay f32
    assert check_drafter(p).n_layer == 2
    Drafter(p, model, n_ctx=64, n_threads=1).close()


def test_quantize_rewrites_the_matrices_only(artifacts, model, tmp_path):
    """quantize_drafter: every matrix in the new type (the converter's rule), every other tensor and
    key as it was; the weights are the old ones within the new type's rounding, and the file loads."""
    a = artifacts["llama"]
    cfg = drafter_config(a["spec"], conv_kernel_size=2, conv_group_size=16, selector_rank=8, selector_top_k=4,
                         n_vocab=VOCAB)
    src = tmp_path / "q8.gguf"
    write_drafter(src, cfg, random_drafter_tensors(cfg, seed=1), a["target"], outtype="q8_0")
    res = quantize_drafter(src, tmp_path / "q4.gguf", "q4_0")
    r0, r1 = GGUFReader(str(src)), GGUFReader(res["path"])
    assert {k: f.contents() for k, f in r0.fields.items()} == {k: f.contents() for k, f in r1.fields.items()}
    t1 = {t.name: t for t in r1.tensors}
    changed = 0
    for t0 in r0.tensors:
        t = t1.pop(t0.name)
        assert t.shape.tolist() == t0.shape.tolist()
        if t0.tensor_type != GGMLQuantizationType.Q8_0:
            assert t.tensor_type == t0.tensor_type and np.array_equal(np.asarray(t.data), np.asarray(t0.data))
            continue
        changed += 1
        assert t.tensor_type == GGMLQuantizationType.Q4_0
        x0, x1 = dequantize(t0.data, t0.tensor_type), dequantize(t.data, t.tensor_type)
        assert np.abs(x1 - x0).max() <= 0.15 * np.abs(x0).max()  # 4-bit blocks: within a step of the block's scale
    assert not t1 and changed == res["tensors_changed"] > 0
    assert GGMLQuantizationType.F32 in {t.tensor_type for t in r1.tensors}  # norms, conv bases, codebooks
    Drafter(res["path"], model, n_ctx=64, n_threads=1).close()
    with pytest.raises(ValueError, match="not a DFlash drafter"):
        quantize_drafter(a["target"], tmp_path / "x.gguf", "q4_0")
    with pytest.raises(ValueError, match="outtype"):
        quantize_drafter(src, tmp_path / "x.gguf", "q3_k")
    assert not (tmp_path / "x.gguf").exists()
