"""HF checkpoints (every schema variant) -> GGUF: round trip, upstream loading, errors."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGUFReader

from llama_dflash.core.drafter import Drafter
from llama_dflash.formats import ConvertError, convert_hf_to_gguf, default_target_layer_ids
from llama_dflash.formats.gguf import DrafterConfig, read_drafter_config, read_tensors
from llama_dflash.formats.safetensors import open_checkpoint
from llama_dflash.verify.reference import DFlashReference, hf_to_reference
from llama_dflash.verify.upstream import UpstreamDrafter

from hf_fixtures import VARIANTS, draft_ids, hf_tensors, make_variant, with_changes, write_checkpoint
from models import MASK_ID, VOCAB

# What each variant's config must turn into (checked field by field, then used by the reference).
EXPECTED = {
    "v1_toplevel": dict(block_size=16, target_layers=[0, 2, 4], rope_theta=10000.0),
    "v1_nested_swa": dict(block_size=8, target_layers=[1, 3], rope_theta=5000.0, n_swa=9,
                          swa_layers=[True, False]),
    "v1_encoder_names": dict(block_size=16, target_layers=[0, 1, 2, 3]),
    "v1_default_taps": dict(block_size=16, target_layers=[1, 3]),
    "v1_transforms": dict(block_size=16, target_layers=[0, 4], logit_scale=0.5, softcap=4.0, embedding_scale=1.5,
                          causal=True, n_swa=12, swa_layers=[True, True]),
    "v1_sharded_bf16": dict(block_size=16, target_layers=[0, 2]),
    "v1_yarn": dict(block_size=16, target_layers=[0, 2], rope_scaling="yarn", rope_factor=4.0, rope_orig_ctx=64),
    "v2": dict(block_size=8, target_layers=[0, 2, 4], conv_kernel_size=2, conv_group_size=16, selector_rank=8,
               selector_top_k=4),
    "v1_reduced_vocab": dict(block_size=16, target_layers=[0, 2]),
    "v2_reduced_vocab": dict(block_size=8, target_layers=[0, 2], conv_kernel_size=2, conv_group_size=16,
                             selector_rank=8, selector_top_k=4),
}


def expected_config(name: str) -> DrafterConfig:
    base = dict(n_embd=64, n_layer=2, n_head=4, n_head_kv=2, head_dim=16, n_ff=96, mask_token_id=MASK_ID,
                rms_eps=1e-6, n_ctx_train=4096, target_layers=[], block_size=16)
    base.update(EXPECTED[name])
    # the vocabulary as the loader reads it: the target's (1024 tokens), reduced by a d2t map
    base.update(n_vocab=VOCAB, n_vocab_draft=VARIANTS[name][1].get("draft_vocab") or VOCAB)
    c = DrafterConfig(**base)
    for f in ("rms_eps", "rope_theta", "logit_scale", "softcap", "embedding_scale"):  # GGUF stores f32
        setattr(c, f, float(np.float32(getattr(c, f))))
    return c


def test_default_tap_formula():
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert default_target_layer_ids(52, 5) == [1, 13, 25, 37, 49]
    assert default_target_layer_ids(30, 5) == [1, 8, 14, 20, 27]
    assert default_target_layer_ids(28, 5) == [1, 7, 13, 19, 25]
    assert default_target_layer_ids(30, 1) == [15]
    # a target too small for z-lab's spread to stay distinct: every usable layer instead
    assert default_target_layer_ids(6, 5) == [0, 1, 2, 3, 4]
    assert default_target_layer_ids(7, 5) == [0, 1, 2, 4, 5]


def draft_each(model, paths, feats, anchor, n, return_logits=False):
    """Load each drafter file, push the same features, draft after the same anchor."""
    outs = []
    for p in paths:
        d = Drafter(p, model, n_ctx=128, n_threads=2)
        d.push(feats)
        r = d.draft(anchor, n, return_logits=return_logits)
        outs.append(r[1] if return_logits else r)
        d.close()
    return outs


def read_gguf_ints(path, name):
    return next(np.asarray(t.data) for t in GGUFReader(str(path)).tensors if t.name == name)


def target_tables(path):
    t = read_tensors(path, ["token_embd.weight", "output.weight"])
    return torch.from_numpy(t["token_embd.weight"].copy()), torch.from_numpy(
        t.get("output.weight", t["token_embd.weight"]).copy())


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_convert_variant(artifacts, load_model, tmp_path, name):
    a = artifacts["llama"]
    hf_dir, cfg, _ = make_variant(tmp_path, name)
    out = tmp_path / f"{name}.gguf"
    res = convert_hf_to_gguf(hf_dir, a["target"], out, outtype="f32")
    got = read_drafter_config(out)
    exp = expected_config(name)
    assert got == exp, f"config mismatch:\n{got}\n{exp}"
    assert res["tensors"] == len(read_tensors(out))

    model = load_model(a["target"])
    # upstream's libllama loads and drafts every converted variant
    up = UpstreamDrafter(str(out), model, n_ctx=256)
    feats = np.random.default_rng(3).standard_normal((40, 64 * len(exp.target_layers))).astype(np.float32)
    up.push(feats)
    up.draft(123, MASK_ID, 7, return_logits=False)
    n_draft = VARIANTS[name][1].get("draft_vocab")
    if n_draft:
        assert res["draft_vocab"] == n_draft
        assert read_gguf_ints(out, "d2t").tolist() == draft_ids(1024, n_draft).tolist()  # absolute ids, as upstream
    if name.startswith("v2"):  # same greedy selector path as upstream (lattices: tests/test_dflash2.py)
        d = Drafter(out, model, n_ctx=256, n_threads=2)
        d.push(feats)
        toks = d.draft(123, 7)
        assert toks == up.lattice(123, MASK_ID, 7)[2]
        assert not n_draft or set(toks) <= set(draft_ids(1024, n_draft).tolist())
        d.close()
        up.close()
        return
    # round trip: our runtime on the GGUF == PyTorch reference on the HF weights
    ref = DFlashReference(exp)
    hf = {k.removeprefix("model."): t for k, t in open_checkpoint(hf_dir).items()}
    vmaps = {k: hf.pop(k) for k in ("lm_head.weight", "d2t", "t2d") if k in hf}
    ref.load_state_dict(hf_to_reference({k: t.load() for k, t in hf.items()}))
    if vmaps:
        ref.draft_head = torch.from_numpy(vmaps["lm_head.weight"].load())
        ref.d2t = torch.from_numpy(vmaps["d2t"].load_ints() + np.arange(n_draft))
    embed, head = target_tables(a["target"])
    d = Drafter(out, model, n_ctx=256, n_threads=2)
    d.push(feats)
    ids, logits = d.draft(123, 7, return_logits=True)
    with torch.no_grad():
        want = ref(torch.from_numpy(feats), torch.tensor([123] + [MASK_ID] * 7), embed, head).numpy()
    fin = np.isfinite(want)
    assert (np.isfinite(logits) == fin).all() and np.abs(logits[fin] - want[fin]).max() < 2e-3
    up_logits = up.draft(123, MASK_ID, 7)
    assert (np.isfinite(up_logits) == fin).all() and np.abs(logits[fin] - up_logits[fin]).max() < 1e-4
    d.close()
    up.close()


@pytest.mark.parametrize("outtype,tol", [("f16", 2e-2), ("bf16", 6e-2), ("q8_0", 4e-2), ("q4_0", 0.25)])
def test_output_types(artifacts, load_model, tmp_path, outtype, tol):
    """Quantized outputs stay close to the f32 conversion (relative to the logit scale)."""
    a = artifacts["llama"]
    hf_dir, _, _ = make_variant(tmp_path, "v1_toplevel")
    convert_hf_to_gguf(hf_dir, a["target"], tmp_path / "f32.gguf", outtype="f32")
    res = convert_hf_to_gguf(hf_dir, a["target"], tmp_path / "q.gguf", outtype=outtype)
    assert res["bytes"] < (tmp_path / "f32.gguf").stat().st_size
    types = {t.name: t.tensor_type.name for t in GGUFReader(str(tmp_path / "q.gguf")).tensors}
    assert types["blk.0.attn_norm.weight"] == "F32" and types["output_norm.weight"] == "F32"
    assert types["blk.0.ffn_up.weight"] == outtype.upper()
    model = load_model(a["target"])
    feats = np.random.default_rng(4).standard_normal((30, 192)).astype(np.float32)
    outs = draft_each(model, [tmp_path / "f32.gguf", tmp_path / "q.gguf"], feats, 50, 7, return_logits=True)
    rel = np.abs(outs[0] - outs[1]).max() / np.abs(outs[0]).max()
    assert rel < tol, rel


def break_config(tmp_path, **changes):
    cfg = with_changes(VARIANTS["v1_toplevel"][0], **changes)
    d = write_checkpoint(tmp_path / "bad", cfg, hf_tensors(VARIANTS["v1_toplevel"][0]))
    return d


@pytest.mark.parametrize("change,msg", [
    ({"architectures": ["DSparkDraftModel"]}, "architectures: 'DSparkDraftModel' is not a DFlash drafter"),
    ({"hidden_size": 96}, "hidden_size: 96 differs from the target's hidden size 64"),
    ({"vocab_size": 2000}, "vocab_size: 2000 differs from the target's vocabulary (1024 tokens)"),
    ({"dflash_config": {"mask_token_id": 5000, "target_layer_ids": [0, 2]}}, "mask_token_id: 5000 lies outside"),
    ({"dflash_config": {"mask_token_id": 16, "target_layer_ids": [0, 5]}}, "layer 5 is not below the target's last"),
    ({"dflash_config": {"block_size": 8, "mask_token_id": 16}}, "block_size: top level (16) and dflash_config (8)"),
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 4.0}}, "rope_scaling: rope type 'dynamic' is not supported"),
    ({"rope_scaling": {"rope_type": "yarn"}}, "rope_scaling.factor: yarn rope scaling needs a positive factor"),
])
def test_config_errors(artifacts, tmp_path, change, msg):
    d = break_config(tmp_path, **change)
    with pytest.raises(ConvertError) as e:
        convert_hf_to_gguf(d, artifacts["llama"]["target"], tmp_path / "o.gguf")
    assert msg in str(e.value) and "config.json" in str(e.value)
    assert not (tmp_path / "o.gguf").exists()


def test_tensor_errors(artifacts, tmp_path):
    tgt = artifacts["llama"]["target"]
    cfg = VARIANTS["v1_toplevel"][0]
    t = hf_tensors(cfg)
    del t["layers.1.mlp.up_proj.weight"]
    d = write_checkpoint(tmp_path / "missing", cfg, t)
    with pytest.raises(ConvertError, match="missing tensors: blk.1.ffn_up.weight"):
        convert_hf_to_gguf(d, tgt, tmp_path / "o.gguf")
    t = hf_tensors(cfg)
    t["layers.0.self_attn.extra.weight"] = np.zeros(3, np.float32)
    d = write_checkpoint(tmp_path / "extra", cfg, t)
    with pytest.raises(ConvertError, match="unexpected tensor 'layers.0.self_attn.extra.weight'"):
        convert_hf_to_gguf(d, tgt, tmp_path / "o.gguf")
    t = hf_tensors(cfg)
    t["layers.0.self_attn.k_proj.weight"] = np.zeros((8, 64), np.float32)
    d = write_checkpoint(tmp_path / "shape", cfg, t)
    with pytest.raises(ConvertError, match=r"'layers.0.self_attn.k_proj.weight' has shape \[8, 64\], expected"):
        convert_hf_to_gguf(d, tgt, tmp_path / "o.gguf")
    # a v1 checkpoint carrying DFlash2 tensors
    t = hf_tensors(cfg)
    t["candidate_selector.hidden_projection.weight"] = np.zeros((8, 64), np.float32)
    d = write_checkpoint(tmp_path / "v2bits", cfg, t)
    with pytest.raises(ConvertError, match="unexpected tensor 'candidate_selector.hidden_projection.weight'"):
        convert_hf_to_gguf(d, tgt, tmp_path / "o.gguf")


def test_tensor_names_are_escaped_in_errors(artifacts, tmp_path):
    """Checkpoint tensor names with control characters are quoted escaped, on one line."""
    cfg = VARIANTS["v1_toplevel"][0]
    t = hf_tensors(cfg)
    t["layers.0.evil\n\x1b[31mred"] = np.zeros(3, np.float32)
    d = write_checkpoint(tmp_path / "evil", cfg, t)
    with pytest.raises(ConvertError) as e:
        convert_hf_to_gguf(d, artifacts["llama"]["target"], tmp_path / "o.gguf")
    assert "unexpected tensor 'layers.0.evil\\n\\x1b[31mred'" in str(e.value)
    assert "\n" not in str(e.value) and "\x1b" not in str(e.value)


def test_file_errors(artifacts, tmp_path):
    tgt = artifacts["llama"]["target"]
    d, _, _ = make_variant(tmp_path, "v1_toplevel")
    st = d / "model.safetensors"
    good = st.read_bytes()
    st.write_bytes(b"\xff" * 8 + good[8:])
    with pytest.raises(ConvertError, match="model.safetensors: corrupt safetensors header"):
        convert_hf_to_gguf(d, tgt, tmp_path / "o.gguf")
    st.write_bytes(good[:-100])
    with pytest.raises(ConvertError, match="outside the file"):
        convert_hf_to_gguf(d, tgt, tmp_path / "o.gguf")
    # header entries of the wrong JSON types: a list or object as dtype, offsets that are not integers
    n = int.from_bytes(good[:8], "little")
    header = json.loads(good[8:8 + n])
    name = next(k for k in header if k != "__metadata__")
    for field, value, msg in (("dtype", ["F32"], "unsupported dtype"), ("dtype", {"a": 1}, "unsupported dtype"),
                              ("data_offsets", ["0", "4"], "corrupt safetensors header"),
                              ("data_offsets", [0.0, 4.5], "corrupt safetensors header")):
        bad_header = json.dumps({**header, name: {**header[name], field: value}}).encode()
        st.write_bytes(len(bad_header).to_bytes(8, "little") + bad_header + good[8 + n:])
        with pytest.raises(ConvertError, match=msg):
            convert_hf_to_gguf(d, tgt, tmp_path / "o.gguf")
    st.write_bytes(good)
    with pytest.raises(ConvertError, match="unreadable target GGUF"):
        bad = tmp_path / "t.gguf"
        bad.write_bytes(b"GGUF" + b"\0" * 64)
        convert_hf_to_gguf(d, bad, tmp_path / "o.gguf")
    with pytest.raises(ConvertError, match="no config.json"):
        convert_hf_to_gguf(tmp_path, tgt, tmp_path / "o.gguf")
    sd, _, _ = make_variant(tmp_path, "v1_sharded_bf16")
    (sd / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(ConvertError, match="shard 'model-00002-of-00003.safetensors' is missing"):
        convert_hf_to_gguf(sd, tgt, tmp_path / "o.gguf")


@pytest.mark.parametrize("text,msg", [
    ("[1, 2]", "expected a JSON object, got an array"),
    ("null", "expected a JSON object, got null"),
    ("[" * 100_000 + "]" * 100_000, "invalid JSON (nested too deeply)"),
], ids=["array", "null", "deep"])
def test_cli_convert_config_not_an_object(tmp_path, capsys, text, msg):
    """A config.json that parses but is no object, or nests past the json module's recursion
    limit, is a one-line error (exit 2), not a traceback."""
    from llama_dflash.api.cli import main

    from models import TargetSpec, write_target

    target = write_target(str(tmp_path / "t.gguf"), TargetSpec())
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(text)
    for out in (["--outfile", str(tmp_path / "o.gguf")], ["--speculators", str(tmp_path / "spec")]):
        assert main(["convert", str(tmp_path / "hf"), "--target", target, *out]) == 2
        err = capsys.readouterr().err
        assert err.startswith("llama-dflash: error: ") and len(err.splitlines()) == 1, err
        assert "config.json" in err and msg in err
    # the same for a target given as a HF directory
    hf, _, _ = make_variant(tmp_path, "v1_toplevel")
    tdir = tmp_path / "target-hf"
    tdir.mkdir()
    (tdir / "config.json").write_text(text)
    (tdir / "tokenizer.json").write_text("{}")
    assert main(["convert", str(hf), "--target", str(tdir), "--outfile", str(tmp_path / "o.gguf")]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and msg in err, err


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "llama_dflash.api.cli", *args], capture_output=True, text=True,
                          timeout=600)


def test_cli_quantize(artifacts, tmp_path):
    a = artifacts["llama"]
    out = tmp_path / "q4.gguf"
    r = run_cli("quantize", a["drafter"], "--outtype", "q4_0", "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert "as q4_0" in r.stdout and out.is_file()
    r = run_cli("quantize", str(tmp_path / "missing.gguf"), "--outtype", "q4_0", "--out", str(out))
    assert r.returncode != 0 and len(r.stderr.strip().splitlines()) == 1 and "not found" in r.stderr


def test_convert_scripts_run_as_the_cli(artifacts, tmp_path):
    """convert/*.py: runnable scripts, thin over the package (the CLI's subcommands)."""
    a = artifacts["llama"]
    root = Path(__file__).resolve().parents[1] / "convert"
    hf, _, _ = make_variant(tmp_path, "v1_toplevel")
    out = tmp_path / "d.gguf"

    def script(name, *args):
        return subprocess.run([sys.executable, str(root / name), *args], capture_output=True, text=True, timeout=600)

    r = script("convert_hf_to_gguf.py", str(hf), "--target", a["target"], "--outfile", str(out), "--outtype", "q8_0")
    assert r.returncode == 0 and out.is_file(), r.stderr
    r = script("inspect_drafter.py", str(out), "--target", a["target"])
    assert r.returncode == 0 and "speculates with this drafter" in r.stdout, r.stdout + r.stderr
    r = script("quantize_drafter.py", str(out), "--outtype", "q4_0", "--out", str(tmp_path / "q4.gguf"))
    assert r.returncode == 0 and "as q4_0" in r.stdout, r.stderr
    r = script("reduce_vocab.py", "--help")
    assert r.returncode == 0 and "--size" in r.stdout
    r = script("convert_hf_to_gguf.py", str(tmp_path / "nope"), "--target", a["target"], "--outfile", str(out))
    assert r.returncode == 2 and "no config.json" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_cli_convert_and_inspect(artifacts, tmp_path):
    a = artifacts["llama"]
    d, _, _ = make_variant(tmp_path, "v2")
    out = tmp_path / "v2.gguf"
    r = run_cli("convert", str(d), "--target", a["target"], "--outfile", str(out), "--outtype", "q8_0")
    assert r.returncode == 0, r.stderr
    assert "DFlash2 drafter" in r.stdout and "tensors" in r.stdout and "MiB" in r.stdout
    r = run_cli("inspect", str(out), "--json")
    info = json.loads(r.stdout)
    assert info["version"] == 2 and info["block_size"] == 8 and info["dflash2"]["selector_top_k"] == 4
    names = {n: (shape, typ) for n, shape, typ in info["tensors"]}
    assert names["blk.0.attn_conv_base"] == ([64, 2, 2], "F32")           # no .weight, ggml {H, K, 2}
    # {rank, V}, at the output type as upstream writes it (rank 8 is no q8_0 block: f16)
    assert names["selector_predecessor.weight"] == ([8, 1024], "F16")
    assert names["selector_hidden.weight"][0] == [64, 8]
    v1, _, _ = make_variant(tmp_path, "v1_toplevel")
    out1 = tmp_path / "v1.gguf"
    assert run_cli("convert", str(v1), "--target", a["target"], "--outfile", str(out1)).returncode == 0
    r = run_cli("inspect", str(out1), "--target", a["target"])
    assert r.returncode == 0 and "speculates with this drafter" in r.stdout.splitlines()[-1], r.stdout
    from models import TargetSpec, write_target

    wide = write_target(str(tmp_path / "wide.gguf"), TargetSpec(n_embd=96, n_head=4, n_head_kv=2))
    r = run_cli("inspect", str(out1), "--target", wide)
    # a drafter that does not fit the target is a failed check: exit status 1
    assert r.returncode == 1 and "will not speculate" in r.stdout and "hidden size 64 but the target has 96" in r.stdout
    # user errors: one line, non-zero
    r = run_cli("convert", str(tmp_path / "nope"), "--target", a["target"], "--outfile", str(out))
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "no config.json" in r.stderr
    r = run_cli("inspect", a["target"])
    assert r.returncode == 2 and "not a DFlash drafter" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_mrope_target(artifacts, load_model, tmp_path):
    """A target with M-RoPE sections gives the drafter degenerate sections [head_dim/2, 0, 0, 0]."""
    from gguf import GGUFReader, GGUFWriter

    src = GGUFReader(artifacts["llama"]["target"])
    w = GGUFWriter(str(tmp_path / "mrope.gguf"), "llama")
    for name, f in src.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        vt = f.types[0]
        w.add_key_value(name, f.contents(), vt, sub_type=f.types[-1] if len(f.types) > 1 else None)
    w.add_array("llama.rope.dimension_sections", [4, 2, 2, 0])
    for t in src.tensors:
        w.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    hf, _, _ = make_variant(tmp_path, "v1_toplevel")
    out = tmp_path / "d.gguf"
    convert_hf_to_gguf(hf, tmp_path / "mrope.gguf", out, outtype="f32")
    assert read_drafter_config(out).rope_sections == [8, 0, 0, 0]
    model = load_model(artifacts["llama"]["target"])
    d = Drafter(out, model, n_ctx=64, n_threads=2)  # plain 1-D positions
    d.push(np.zeros((3, 192), np.float32))
    assert len(d.draft(20, 3)) == 3
    d.close()


def hf_target_dir(tmp_path, n_layer=6, tokenizer_type="BPE"):
    """The tiny llama target as a HF directory: config.json + tokenizer.json + tokenizer_config.json."""
    from models import VOCAB, small_bpe_vocab

    voc = small_bpe_vocab()
    d = tmp_path / "target-hf"
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64, "num_hidden_layers": n_layer,
                                               "vocab_size": VOCAB}))
    specials = [{"id": i, "content": t, "special": True} for i, t in enumerate(voc["tokens"]) if voc["types"][i] == 3]
    tok = {"model": {"type": tokenizer_type, "vocab": {t: i for i, t in enumerate(voc["tokens"])},
                     "merges": voc["merges"]}, "added_tokens": specials}
    (d / "tokenizer.json").write_text(json.dumps(tok))
    (d / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}))
    return d


def test_target_as_hf_directory(artifacts, load_model, tmp_path):
    a = artifacts["llama"]
    hf, _, _ = make_variant(tmp_path, "v1_toplevel")
    convert_hf_to_gguf(hf, hf_target_dir(tmp_path), tmp_path / "from-hf.gguf", outtype="f32")
    convert_hf_to_gguf(hf, a["target"], tmp_path / "from-gguf.gguf", outtype="f32")
    r1, r2 = GGUFReader(str(tmp_path / "from-hf.gguf")), GGUFReader(str(tmp_path / "from-gguf.gguf"))
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type",
                "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id", "tokenizer.ggml.mask_token_id"):
        assert r1.fields[key].contents() == r2.fields[key].contents(), key
    model = load_model(a["target"])
    feats = np.random.default_rng(9).standard_normal((10, 192)).astype(np.float32)
    outs = draft_each(model, [tmp_path / "from-hf.gguf", tmp_path / "from-gguf.gguf"], feats, 33, 5)
    up = UpstreamDrafter(str(tmp_path / "from-hf.gguf"), model, n_ctx=64)  # loads upstream too
    up.push(feats)
    up.close()
    assert outs[0] == outs[1]
    with pytest.raises(ConvertError, match="only byte-level BPE tokenizers"):
        convert_hf_to_gguf(hf, hf_target_dir(tmp_path / "u", tokenizer_type="Unigram"), tmp_path / "x.gguf")
    (tmp_path / "u" / "target-hf" / "tokenizer.json").unlink()
    with pytest.raises(ConvertError, match="has no tokenizer.json"):
        convert_hf_to_gguf(hf, tmp_path / "u" / "target-hf", tmp_path / "x.gguf")


def test_reduced_vocab_errors(artifacts, tmp_path):
    tgt = artifacts["llama"]["target"]
    cfg, opt = VARIANTS["v1_reduced_vocab"]

    def convert(cfg_change=None, drop=(), **tensors):
        c = json.loads(json.dumps(cfg))
        c.update(cfg_change or {})
        t = hf_tensors(c, draft_vocab=opt["draft_vocab"])
        for k in drop:
            del t[k]
        t.update(tensors)
        d = write_checkpoint(tmp_path / "r", c, t)
        convert_hf_to_gguf(d, tgt, tmp_path / "o.gguf")

    ids = draft_ids(1024, 300)
    cases = [
        (dict(drop=("d2t",)), "draft_vocab_size 300 < vocab_size 1024 but there is no d2t tensor"),
        (dict(drop=("lm_head.weight",)), "a d2t map needs the drafter's own lm_head.weight"),
        (dict(d2t=np.r_[ids[:-1], 1024] - np.arange(300)), "d2t maps draft rows outside the target vocabulary"),
        (dict(d2t=np.r_[ids[:-1], ids[0]] - np.arange(300)), "d2t maps two draft rows to the same target token"),
        (dict(d2t=np.zeros(5, np.int64)), "d2t has shape [5], expected [300]"),
        (dict(lm_head=None, **{"lm_head.weight": np.zeros((299, 64), np.float32)}), "expected [300, 64]"),
        (dict(cfg_change={"draft_vocab_size": 5000}), "draft_vocab_size: 5000 is not in 1..1024"),
        (dict(d2t=np.zeros(300, np.float32)), "d2t' is F32, not an integer tensor"),
    ]
    for kw, msg in cases:
        kw.pop("lm_head", None)
        with pytest.raises(ConvertError) as e:
            convert(**kw)
        assert msg in str(e.value), (msg, str(e.value))
        assert not (tmp_path / "o.gguf").exists()


@pytest.mark.parametrize("shard,message", [
    ("../../etc/passwd", "shard name '../../etc/passwd' is not a file name"),
    ("/etc/passwd", "shard name '/etc/passwd' is not a file name"),
    ("..", "shard name '..' is not a file name"),
    (5, "weight_map must map tensor names to shard file names"),
    (b"\xff\xfe", "not a valid safetensors index"),
])
def test_shard_index_cannot_point_outside_the_checkpoint(artifacts, tmp_path, shard, message):
    hf_dir, _, _ = make_variant(tmp_path, "v1_sharded_bf16")
    index = hf_dir / "model.safetensors.index.json"
    if isinstance(shard, bytes):
        index.write_bytes(shard)
    else:
        data = json.loads(index.read_text())
        first = next(iter(data["weight_map"]))
        data["weight_map"][first] = shard
        index.write_text(json.dumps(data))
    with pytest.raises(ConvertError, match=re.escape(message)):
        convert_hf_to_gguf(hf_dir, artifacts["llama"]["target"], tmp_path / "out.gguf", outtype="f32")


def test_speculators_schema_round_trip(artifacts, tmp_path):
    """`convert --speculators` writes vLLM speculators' schema (taps as hidden-state indices, the
    transformer fields nested), and that checkpoint converts to the same GGUF as the original."""
    a = artifacts["llama"]
    hf, _, _ = make_variant(tmp_path, "v2")
    r = run_cli("convert", str(hf), "--target", a["target"], "--speculators", str(tmp_path / "spec"))
    assert r.returncode == 0, r.stderr
    cfg = json.loads((tmp_path / "spec" / "config.json").read_text())
    assert cfg["speculators_model_type"] == "dflash2" and cfg["aux_hidden_state_layer_ids"] == [1, 3, 5]
    assert cfg["transformer_layer_config"]["hidden_size"] == 64 and cfg["selector_top_k"] == 4
    one, two = tmp_path / "one.gguf", tmp_path / "two.gguf"
    convert_hf_to_gguf(hf, a["target"], one, outtype="f32")
    convert_hf_to_gguf(tmp_path / "spec", a["target"], two, outtype="f32")
    assert read_drafter_config(one) == read_drafter_config(two)
    t1, t2 = read_tensors(one), read_tensors(two)
    assert t1.keys() == t2.keys() and all(np.array_equal(t1[k], t2[k]) for k in t1)
    cfg["aux_hidden_state_layer_ids"] = [0, 2]
    (tmp_path / "spec" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConvertError, match="embeddings"):
        convert_hf_to_gguf(tmp_path / "spec", a["target"], tmp_path / "bad.gguf")
