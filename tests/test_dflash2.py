"""DFlash2 in our graph: convolution + candidate selector vs the PyTorch reference and upstream."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from llama_dflash import SpeculativeGenerator
from llama_dflash.core.drafter import Drafter, walk_lattice
from llama_dflash.formats import convert_hf_to_gguf
from llama_dflash.formats.gguf import read_tensors
from llama_dflash.verify.reference import DFlashReference
from llama_dflash.verify.upstream import UpstreamDrafter

from hf_fixtures import GROUP, TOPK, VARIANTS, hf_tensors, write_checkpoint
from models import MASK_ID, compare_lattice, growing_context, reference_draft

ATOL = 2e-3


def test_graph_matches_reference(artifacts, load_model, v2_drafter):
    a = artifacts["llama"]
    model = load_model(a["target"])
    d = Drafter(v2_drafter, model, n_ctx=512, n_threads=2)
    assert d.info.version == 2 and d.info.selector_top_k == TOPK and d.info.conv_group_size == GROUP
    ref = DFlashReference.from_gguf(v2_drafter)
    embed = torch.from_numpy(read_tensors(a["target"], ["token_embd.weight"])["token_embd.weight"].copy())
    feats = np.random.default_rng(0).standard_normal((300, 192)).astype(np.float32)
    for done, anchor, n in growing_context([d], feats, [(1, 1), (9, 2), (30, 7), (2, 4), (150, 7)],
                                           np.random.default_rng(1)):
        toks, logits = d.draft(anchor, n, return_logits=True)
        cand, scores = d.last_lattice()
        lg, rcand, rscores, rtoks, q = reference_draft(ref, feats[:done], anchor, n, embed, embed)
        assert np.abs(logits - lg).max() < ATOL
        compare_lattice(cand, scores, rcand, rscores, ATOL)
        assert toks == rtoks
        assert (q.sum(-1) == 1).all()  # greedy rows emit a one-hot q
    d.close()


def test_sampled_walk_q(artifacts, load_model, v2_drafter):
    """T > 0: each slot's q is softmax(scores[prev] / T) for the drafted predecessor, sums to 1,
    and the walk's frequencies follow q."""
    a = artifacts["llama"]
    model = load_model(a["target"])
    d = Drafter(v2_drafter, model, n_ctx=256, n_threads=2)
    feats = np.random.default_rng(4).standard_normal((30, 192)).astype(np.float32)
    d.push(feats)
    T = 1.5
    d.draft(77, 5)
    cand, scores = d.last_lattice()  # the lattice does not depend on the draw
    counts = {}
    for seed in range(400):
        toks, c, q = d.draft_sample(77, 5, T, seed)
        assert (c == cand).all() and np.allclose(q.sum(1), 1.0, atol=1e-5)
        prev = 0
        for k in range(5):
            j = list(c[k]).index(toks[k])
            x = scores[k, prev] / T
            want = np.exp(x - x.max()) / np.exp(x - x.max()).sum()
            assert np.allclose(q[k], want, atol=1e-5)
            prev = j
        counts[toks[0]] = counts.get(toks[0], 0) + 1
    # slot 1 (after the anchor): empirical frequencies follow q
    x = scores[0, 0] / T
    q0 = np.exp(x - x.max()) / np.exp(x - x.max()).sum()
    from scipy.stats import chisquare

    obs = np.array([counts.get(int(t), 0) for t in cand[0]], float)
    keep = q0 * 400 >= 5
    f_exp = np.append(q0[keep], q0[~keep].sum()) * 400
    f_obs = np.append(obs[keep], obs[~keep].sum())
    mask = f_exp > 0
    assert chisquare(f_obs[mask], f_exp[mask] * f_obs[mask].sum() / f_exp[mask].sum()).pvalue > 1e-3
    d.close()


def test_identity_conv_and_zero_selector_is_v1(artifacts, load_model, tmp_path):
    """With identity convolutions and zero pairwise scores, DFlash2 proposes what DFlash v1 proposes."""
    a = artifacts["llama"]
    cfg2, _ = VARIANTS["v2"]
    t2 = hf_tensors(cfg2, seed=5)
    for k in list(t2):
        if k.endswith("base_kernel"):
            t2[k] = np.zeros_like(t2[k])
            t2[k][:, 0, :] = 1.0
        elif k.endswith("kernel_projection.weight") or k.endswith("hidden_projection.weight"):
            t2[k] = np.zeros_like(t2[k])
    cfg1 = json.loads(json.dumps(cfg2))
    cfg1["architectures"] = ["DFlashDraftModel"]
    t1 = {k: v for k, v in t2.items() if "_conv." not in k and not k.startswith("candidate_selector")}
    write_checkpoint(tmp_path / "hf1", cfg1, t1)
    write_checkpoint(tmp_path / "hf2", cfg2, t2)
    convert_hf_to_gguf(tmp_path / "hf1", a["target"], tmp_path / "v1.gguf", outtype="f32")
    convert_hf_to_gguf(tmp_path / "hf2", a["target"], tmp_path / "v2.gguf", outtype="f32")
    model = load_model(a["target"])
    d1 = Drafter(tmp_path / "v1.gguf", model, n_ctx=256, n_threads=2)
    d2 = Drafter(tmp_path / "v2.gguf", model, n_ctx=256, n_threads=2)
    feats = np.random.default_rng(2).standard_normal((60, 192)).astype(np.float32)
    d1.push(feats)
    d2.push(feats)
    for anchor in (30, 400, 777):
        t1_, l1 = d1.draft(anchor, 7, return_logits=True)
        t2_, l2 = d2.draft(anchor, 7, return_logits=True)
        assert np.abs(l1 - l2).max() < 1e-4
        assert t1_ == t2_
    d1.close()
    d2.close()


def test_same_as_upstream(artifacts, load_model, v2_drafter):
    a = artifacts["llama"]
    model = load_model(a["target"])
    ours = Drafter(v2_drafter, model, n_ctx=512, n_threads=2)
    up = UpstreamDrafter(str(v2_drafter), model, n_ctx=512)
    feats = np.random.default_rng(3).standard_normal((200, 192)).astype(np.float32)
    for _, _, n in growing_context([ours, up], feats, [(20, 7), (3, 3), (100, 7), (1, 1)]):
        toks = ours.draft(99, n)
        cand, scores = ours.last_lattice()
        ucand, uscores, utoks = up.lattice(99, MASK_ID, n)
        compare_lattice(cand, scores, ucand, uscores, 1e-4)
        assert toks == utoks
    up.close()
    ours.close()


def test_greedy_identity_with_dflash2(artifacts, v2_drafter):
    a = artifacts["llama"]
    with SpeculativeGenerator(a["target"], v2_drafter, n_ctx=512) as g:
        assert g.drafter_info.version == 2
        for p in ["def fibonacci(n):", "The capital of France is", "1, 2, 3, 4,", "Dear Sir or Madam,"]:
            toks = g.tokenize(p)
            plain = g.generate(toks, 48, draft_len=0, stop_on_eos=False, return_margins=True)
            for n in (1, 3, 7):
                spec = g.generate(toks, 48, draft_len=n, stop_on_eos=False)
                i = next((k for k, (x, y) in enumerate(zip(plain.tokens, spec.tokens, strict=True)) if x != y), None)
                assert i is None or plain.margins[i] < 0.05, f"diverged at {i}, margin {plain.margins[i]}"
                assert spec.stats.drafted > 0 and 1 <= spec.stats.tau <= n + 1
                with pytest.raises(Exception, match="exceeds the drafter's block"):
                    g.generate(toks, 4, draft_len=8)


def test_dflash2_errors(artifacts, v2_drafter, tmp_path):
    from llama_dflash import DFlashError
    from llama_dflash.formats.gguf import read_drafter_config, write_drafter

    a = artifacts["llama"]
    cfg = read_drafter_config(v2_drafter)
    t = read_tensors(v2_drafter)
    # selector tensors present but no DFlash2 keys
    bad = read_drafter_config(v2_drafter)
    bad.selector_top_k = 0
    write_drafter(tmp_path / "k.gguf", bad, t, a["target"])
    with pytest.raises(DFlashError, match="DFlash2 drafter is missing conv/selector key 'dflash.conv_kernel_size'"):
        SpeculativeGenerator(a["target"], tmp_path / "k.gguf")
    # a conv projection of the wrong width
    t2 = dict(t)
    t2["blk.1.ffn_conv_proj.weight"] = np.zeros((8, 64), np.float32)
    write_drafter(tmp_path / "s.gguf", cfg, t2, a["target"])
    with pytest.raises(DFlashError, match="'blk.1.ffn_conv_proj.weight' has shape"):
        SpeculativeGenerator(a["target"], tmp_path / "s.gguf")


def test_p_min_cuts_the_walk(artifacts, load_model, v2_drafter):
    a = artifacts["llama"]
    model = load_model(a["target"])
    d = Drafter(v2_drafter, model, n_ctx=128, n_threads=2)
    d.push(np.random.default_rng(5).standard_normal((20, 192)).astype(np.float32))
    full = d.draft(55, 7)
    cand, scores = d.last_lattice()
    conf, prev = [], 0
    for k in range(7):
        row = scores[k, prev]
        p = np.exp(row - row.max()) / np.exp(row - row.max()).sum()
        j = int(np.argmax(row))
        conf.append(float(p[j]))
        prev = j
    thresholds = [c + e for c in conf for e in (-1e-4, 1e-4)] + [0.0, 1.01]  # away from float rounding
    for thr in thresholds:
        want = next((k for k, c in enumerate(conf) if c < thr), 7)
        assert d.draft(55, 7, p_min=thr) == full[:want]
    d.close()


def test_confidence_is_the_walk_capped_by_the_unary_probability(artifacts, load_model, v2_drafter):
    """What adaptive steps calibrate, per slot: the walk's softmax over the K candidates, no more
    than the unary head's probability of the token over the whole draft vocabulary."""
    a = artifacts["llama"]
    model = load_model(a["target"])
    d = Drafter(v2_drafter, model, n_ctx=128, n_threads=2)
    d.push(np.random.default_rng(5).standard_normal((20, 192)).astype(np.float32))
    ids, logits, conf = d.draft(55, 7, return_logits=True, return_conf=True)
    assert d.draft(55, 7) == ids  # (asking for them changes no token)
    cand, scores = d.last_lattice()
    walked, walk_conf = walk_lattice(cand, scores)
    assert walked == ids
    p = np.exp(logits - logits.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    unary = [float(p[k, t]) for k, t in enumerate(ids)]
    want = np.minimum(walk_conf, unary)
    assert np.allclose(conf, want, rtol=1e-4, atol=1e-6), (conf, list(walk_conf), unary)
    assert any(u < w for u, w in zip(unary, walk_conf, strict=True))  # (the cap bites on this drafter)
    d.close()


@pytest.mark.parametrize("which", ["v1", "v2", "v1_causal_swa"])
def test_batched_blocks_equal_each_alone(artifacts, load_model, v2_drafter, tmp_path, which):
    """Several sequences' blocks in one graph: nothing leaks between blocks (convolution taps,
    attention, selector predecessors), every sequence gets what it gets alone."""
    from models import drafter_config, write_random_drafter

    a = artifacts["llama"]
    path = {"v1": a["drafter"], "v2": v2_drafter}.get(which)
    if path is None:
        cfg = drafter_config(a["spec"], causal=True, n_swa=9, swa_layers=[True, False])
        path = write_random_drafter(str(tmp_path / "cs.gguf"), a["target"], cfg, seed=9)
    model = load_model(a["target"])
    d = Drafter(path, model, n_ctx=256, n_threads=2)
    rng = np.random.default_rng(11)
    lengths, anchors = [5, 40, 17], [100, 200, 300]
    feats = [rng.standard_normal((m, 192)).astype(np.float32) for m in lengths]
    states = [d.new_state() for _ in lengths]
    for st, f in zip(states, feats, strict=True):
        st.push(f)
    ids, logits = d.draft_batch(states, anchors, 7, return_logits=True)
    lattices = [st.last_lattice() for st in states] if which == "v2" else None
    for s, (f, anc) in enumerate(zip(feats, anchors, strict=True)):
        d.reset()
        d.push(f)
        alone, lg = d.draft(anc, 7, return_logits=True)
        assert ids[s] == alone
        assert np.abs(logits[s] - lg).max() < 1e-3
        if lattices:
            c, sc = d.last_lattice()
            assert (lattices[s][0] == c).all() and np.abs(lattices[s][1] - sc).max() < 1e-3
    # the states kept their own contexts (the block is scratch), and a second round still matches
    assert [st.n_ctx_used for st in states] == lengths
    with pytest.raises(Exception, match="appears twice"):
        d.draft_batch([states[0], states[0]], [1, 2], 3)
    d.close()


def test_fused_cpu_conv_is_bit_identical_to_ggml_ops(artifacts, load_model, v2_drafter):
    """On the CPU the DFlash2 convolution runs as one fused node (csrc/drafter/graph.c); it repeats
    the generic graph's float operations in their order, so drafts, logits, lattices and
    confidences equal those of ggml's own ops (generic_conv, as on a GPU) bit for bit --
    alone, in growing contexts and with several sequences' blocks in one graph."""
    a = artifacts["llama"]
    model = load_model(a["target"])
    feats = np.random.default_rng(21).standard_normal((200, 192)).astype(np.float32)

    def run(generic_conv: bool) -> list:
        d = Drafter(v2_drafter, model, n_ctx=512, n_threads=2, generic_conv=generic_conv)
        out = []
        for done, anchor, n in growing_context([d], feats, [(1, 1), (9, 2), (30, 7), (2, 4), (150, 7)],
                                               np.random.default_rng(22)):
            toks, logits, conf = d.draft(anchor, n, return_logits=True, return_conf=True)
            out.append((done, toks, logits.tobytes(), conf, *(x.tobytes() for x in d.last_lattice())))
        states = [d.new_state() for _ in range(3)]
        for i, st in enumerate(states):
            st.push(feats[: 10 + 20 * i])
        ids, logits = d.draft_batch(states, [5, 6, 7], 7, return_logits=True)
        out.append((ids, logits.tobytes(), *(x.tobytes() for st in states for x in st.last_lattice())))
        d.close()
        return out

    generic = run(True)
    fused = run(False)
    assert len(fused) == len(generic) == 6
    for f, g in zip(fused, generic, strict=True):
        assert f == g
