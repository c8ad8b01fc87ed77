"""Reduced draft vocabularies (d2t): choosing the ids, writing the file, and drafting with it
in our graph against the PyTorch reference, upstream llama.cpp and the full-vocabulary drafter."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter

from llama_dflash import DFlashError, SpeculativeGenerator
from llama_dflash.core.drafter import Drafter
from llama_dflash.formats.gguf import ARCH, copy_fields, read_tensors
from llama_dflash.formats.vocab import choose_vocab, reduce_vocab, token_counts
from llama_dflash.verify.reference import DFlashReference
from llama_dflash.verify.upstream import UpstreamDrafter

from hf_fixtures import TOPK
from models import MASK_ID, VOCAB, compare_lattice, growing_context, reference_draft

ATOL = 2e-3


def test_choose_vocab_orders_by_count_then_id():
    counts = token_counts(10, [np.array([3, 3, 3, 7, 7, 1]), np.array([[7, 9]])])
    assert counts.tolist() == [0, 1, 0, 3, 0, 0, 0, 3, 0, 1]
    assert choose_vocab(counts, 2).tolist() == [3, 7]            # tie on count: lower id first
    assert choose_vocab(counts, 3).tolist() == [1, 3, 7]
    assert choose_vocab(counts, 3, always=[8]).tolist() == [3, 7, 8]
    assert choose_vocab(counts, 6).tolist() == [0, 1, 2, 3, 7, 9]  # unseen ids fill by id
    with pytest.raises(ValueError, match="1..10"):
        choose_vocab(counts, 11)
    with pytest.raises(ValueError, match="must lie in 0..9"):
        token_counts(10, [np.array([10])])


@pytest.fixture(scope="module")
def keep():
    rng = np.random.default_rng(7)
    return rng.permutation(np.concatenate([[MASK_ID + 1, 2], rng.choice(np.arange(20, VOCAB), 150, replace=False)]))


def reduced(src, target, out, keep) -> str:
    reduce_vocab(src, target, out, keep)
    return str(out)


def head_tables(target):
    t = read_tensors(target, ["token_embd.weight", "output.weight"])
    embed = torch.from_numpy(t["token_embd.weight"].copy())
    return embed, torch.from_numpy(t.get("output.weight", t["token_embd.weight"]).copy())


@pytest.mark.parametrize("name", ["llama", "qwen3"])  # tied f32 head / separate Q8_0 head
def test_file_layout_is_upstreams(artifacts, v2_drafter, tmp_path, keep, name):
    a = artifacts[name]
    src = v2_drafter if name == "llama" else a["drafter"]
    path = reduced(src, a["target"], tmp_path / "r.gguf", keep)
    r = GGUFReader(path)
    t = {x.name: x for x in r.tensors}
    assert t["d2t"].tensor_type == GGMLQuantizationType.I64 and t["d2t"].data.tolist() == keep.tolist()
    tt = {x.name: x for x in GGUFReader(a["target"]).tensors}
    head = tt.get("output.weight", tt["token_embd.weight"])
    assert t["output.weight"].tensor_type == head.tensor_type
    assert np.array_equal(np.asarray(t["output.weight"].data), np.asarray(head.data)[keep])  # rows copied as stored
    src = GGUFReader(str(src))
    assert {x.name for x in src.tensors} | {"d2t", "output.weight"} == set(t)
    assert {k for k in src.fields if not k.startswith("GGUF.")} == {k for k in r.fields if not k.startswith("GGUF.")}
    with pytest.raises(ValueError, match="already has its own output head"):
        reduce_vocab(path, a["target"], tmp_path / "again.gguf", keep)
    with pytest.raises(ValueError, match="distinct ids"):
        reduce_vocab(v2_drafter, a["target"], tmp_path / "dup.gguf", np.array([5, 5, 6, 7, 8, 9, 10, 11, 12]))
    with pytest.raises(ValueError, match="smaller than the selector's top-K"):
        reduce_vocab(v2_drafter, a["target"], tmp_path / "small.gguf", np.array([5, 6]))
    with pytest.raises(ValueError, match="not a DFlash drafter"):
        reduce_vocab(a["target"], a["target"], tmp_path / "t.gguf", keep)


def test_dflash2_graph_matches_reference_and_upstream(artifacts, load_model, v2_drafter, tmp_path, keep):
    a = artifacts["llama"]
    path = reduced(v2_drafter, a["target"], tmp_path / "r.gguf", keep)
    model = load_model(a["target"])
    d = Drafter(path, model, n_ctx=512, n_threads=2)
    assert d.info.n_vocab_draft == len(keep) and d.info.n_vocab == VOCAB
    assert d.memory()["borrows_embedding"] and not d.memory()["borrows_head"]
    ref = DFlashReference.from_gguf(path)
    up = UpstreamDrafter(path, model, n_ctx=512)
    embed, head = head_tables(a["target"])
    feats = np.random.default_rng(0).standard_normal((300, 192)).astype(np.float32)
    kept = set(keep.tolist())
    for done, anchor, n in growing_context([d, up], feats, [(1, 1), (9, 2), (30, 7), (2, 4), (150, 7)],
                                           np.random.default_rng(1)):
        toks, logits = d.draft(anchor, n, return_logits=True)
        cand, scores = d.last_lattice()
        lg, rcand, rscores, rtoks, _ = reference_draft(ref, feats[:done], anchor, n, embed, head)
        out = ~np.isin(np.arange(VOCAB), keep)
        assert np.isneginf(logits[:, out]).all() and np.isneginf(lg[:, out]).all()
        assert np.abs(logits[:, keep] - lg[:, keep]).max() < ATOL
        compare_lattice(cand, scores, rcand, rscores, ATOL)
        assert toks == rtoks and set(toks) <= kept and set(cand.ravel().tolist()) <= kept
        ucand, uscores, utoks = up.lattice(anchor, MASK_ID, n)
        compare_lattice(cand, scores, ucand, uscores, 1e-4)
        assert toks == utoks
    up.close()
    d.close()


@pytest.mark.parametrize("which", ["v1", "v2", "v1-q8-head"])
def test_full_vocabulary_in_any_order_equals_the_original(artifacts, load_model, v2_drafter, tmp_path, which):
    """d2t holding every id, shuffled: the same drafts, lattices and logits as borrowing the target's head."""
    a = artifacts["qwen3" if which == "v1-q8-head" else "llama"]
    src = v2_drafter if which == "v2" else a["drafter"]
    perm = np.random.default_rng(3).permutation(VOCAB)
    path = reduced(src, a["target"], tmp_path / "p.gguf", perm)
    model = load_model(a["target"])
    full, red = Drafter(str(src), model, n_ctx=256, n_threads=2), Drafter(path, model, n_ctx=256, n_threads=2)
    feats = np.random.default_rng(4).standard_normal((80, 192)).astype(np.float32)
    for d in (full, red):
        d.push(feats)
    for anchor, n in [(30, 3), (500, 7), (17, 1)]:
        ft, fl = full.draft(anchor, n, return_logits=True)
        rt, rl = red.draft(anchor, n, return_logits=True)
        assert ft == rt and np.allclose(fl, rl, atol=1e-5)
        if which == "v2":
            (fc, fs), (rc, rs) = full.last_lattice(), red.last_lattice()
            compare_lattice(fc, fs, rc, rs, 1e-5)
        fs_t, fs_c, fs_q = full.draft_sample(anchor, n, 0.8, seed=11)
        rs_t, rs_c, rs_q = red.draft_sample(anchor, n, 0.8, seed=11)
        assert fs_t == rs_t
        for k in range(n):  # the same proposal q over the same candidates
            fo, ro = np.argsort(fs_c[k]), np.argsort(rs_c[k])
            assert (fs_c[k][fo] == rs_c[k][ro]).all() and np.allclose(fs_q[k][fo], rs_q[k][ro], atol=1e-5)
    full.close()
    red.close()


def test_v1_drafts_only_kept_tokens(artifacts, load_model, tmp_path, keep):
    a = artifacts["llama"]
    path = reduced(a["drafter"], a["target"], tmp_path / "v1.gguf", keep)
    model = load_model(a["target"])
    d = Drafter(path, model, n_ctx=256, n_threads=2)
    ref = DFlashReference.from_gguf(path)
    embed, head = head_tables(a["target"])
    feats = np.random.default_rng(5).standard_normal((60, 192)).astype(np.float32)
    d.push(feats)
    toks, logits = d.draft(123, 7, return_logits=True)
    with torch.no_grad():
        exp = ref(torch.from_numpy(feats), torch.tensor([123] + [MASK_ID] * 7), embed, head).numpy()
    assert np.abs(logits[:, keep] - exp[:, keep]).max() < ATOL
    assert toks == exp.argmax(1).tolist() and set(toks) <= set(keep.tolist())
    st, sc, _ = d.draft_sample(123, 7, 1.0, seed=2)
    assert set(st) <= set(keep.tolist()) and set(sc[sc >= 0].ravel().tolist()) <= set(keep.tolist())
    d.close()


def test_greedy_identity_with_a_reduced_drafter(artifacts, v2_drafter, tmp_path, keep):
    a = artifacts["llama"]
    path = reduced(v2_drafter, a["target"], tmp_path / "r.gguf", keep)
    with SpeculativeGenerator(a["target"], path, n_ctx=512) as g:
        assert g.drafter_info.n_vocab_draft == len(keep)
        for p in ["def fibonacci(n):", "1, 2, 3, 4,"]:
            toks = g.tokenize(p)
            plain = g.generate(toks, 40, draft_len=0, stop_on_eos=False, return_margins=True)
            spec = g.generate(toks, 40, draft_len=3, stop_on_eos=False)
            i = next((k for k, (x, y) in enumerate(zip(plain.tokens, spec.tokens, strict=True)) if x != y), None)
            assert i is None or plain.margins[i] < 0.05, f"diverged at {i}"
            assert spec.stats.drafted > 0


def rewrite(src: str, out, d2t: np.ndarray | None, d2t_type=GGMLQuantizationType.I64, drop_head: bool = False,
            head_rows: int | None = None) -> str:
    """A copy of a reduced drafter with its d2t / head replaced (for the error paths)."""
    r = GGUFReader(src)
    w = GGUFWriter(os.fspath(out), ARCH)
    copy_fields(r, w)
    for t in r.tensors:
        if t.name == "d2t":
            if d2t is not None:
                w.add_tensor("d2t", d2t.astype(np.int64 if d2t_type == GGMLQuantizationType.I64 else np.int32),
                             raw_dtype=d2t_type)
        elif t.name == "output.weight":
            if not drop_head:
                w.add_tensor(t.name, np.asarray(t.data)[:head_rows], raw_dtype=t.tensor_type)
        else:
            w.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return os.fspath(out)


def test_bad_reduced_vocabularies_are_clear_errors(artifacts, v2_drafter, tmp_path, keep):
    a = artifacts["llama"]
    good = reduced(v2_drafter, a["target"], tmp_path / "r.gguf", keep)
    n = len(keep)
    cases = [
        (dict(d2t=np.r_[keep[:-1], keep[0]]), "d2t maps two draft rows to target token"),
        (dict(d2t=np.r_[keep[:-1], VOCAB]), f"d2t\\[{n - 1}\\] = {VOCAB} is outside the target vocabulary"),
        (dict(d2t=keep, d2t_type=GGMLQuantizationType.I32), "d2t must be a 1-D I64 map"),
        (dict(d2t=keep, drop_head=True), "'output.weight'"),
        (dict(d2t=keep, head_rows=n - 1), "'output.weight' has shape"),
        (dict(d2t=keep[:TOPK - 1], head_rows=TOPK - 1), f"selector_top_k {TOPK} exceeds its {TOPK - 1}-token vocab"),
    ]
    for i, (kw, msg) in enumerate(cases):
        bad = rewrite(good, tmp_path / f"bad{i}.gguf", **kw)
        with pytest.raises(DFlashError, match=msg):
            SpeculativeGenerator(a["target"], bad)
            pytest.fail(f"case {i} ({msg}) loaded")


def test_cli_reduce_vocab(artifacts, v2_drafter, tmp_path, capsys):
    from llama_dflash.api.cli import main

    a = artifacts["llama"]
    text = tmp_path / "corpus.txt"
    text.write_text("def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n" * 20)
    ids = tmp_path / "ids.npy"
    np.save(ids, np.array([5, 5, 5, 6, 700], np.int32))
    out = tmp_path / "small.gguf"
    assert main(["reduce-vocab", str(v2_drafter), "--target", a["target"], "--size", "64", "--tokens", str(text),
                 str(ids), "--out", str(out)]) == 0
    assert "64 draft tokens covering 100.00%" in capsys.readouterr().out
    d2t = next(np.asarray(t.data) for t in GGUFReader(str(out)).tensors if t.name == "d2t")
    assert {5, 6, 700} <= set(d2t.tolist()) and len(d2t) == 64
    with SpeculativeGenerator(a["target"], out, n_ctx=256) as g:
        assert g.drafter_info.n_vocab_draft == 64
    assert main(["inspect", str(out)]) == 0
    assert "draft vocabulary: 64 tokens (d2t, own head)" in capsys.readouterr().out
    for args, msg in [(["--tokens", str(tmp_path / "none.txt")], "token source not found"),
                      (["--tokens", str(text), "--size", "5000"], "must lie in 1..1024"),
                      (["--drafter", str(tmp_path / "no.gguf")], "drafter file not found")]:
        argv = {"--drafter": str(v2_drafter), "--target": a["target"], "--size": "64", "--tokens": str(text),
                "--out": str(tmp_path / "e.gguf")}
        argv.update(dict(zip(args[::2], args[1::2], strict=True)))
        drafter = argv.pop("--drafter")
        assert main(["reduce-vocab", drafter, *[x for kv in argv.items() for x in kv]]) == 2
        err = capsys.readouterr().err
        assert msg in err and err.count("\n") == 1, err
