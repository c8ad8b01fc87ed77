"""Interoperability with vLLM's speculators (the [speculators] extra): a drafter we export loads in
speculators' DFlash2 model and its PyTorch forward gives our C drafter's logits and lattice on the
same features; a checkpoint saved by speculators converts and drafts the same.  Skipped, with the
reason, where the package is not installed."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
from gguf import GGUFReader

from llama_dflash.core.drafter import Drafter
from llama_dflash.formats import convert_hf_to_gguf
from llama_dflash.formats.hf import write_speculators

from hf_fixtures import make_variant

pytestmark = pytest.mark.skipif(importlib.util.find_spec("speculators") is None,
                                reason="speculators is not installed (pip install --no-deps speculators==0.9.0 "
                                       "hs-connectors==0.9.0, with torch, transformers<=5.19, openai, datasets)")

TOL = 2e-4  # f32 on both sides; the two graphs sum in different orders


def _load_speculators(path, target_gguf):
    import torch
    from speculators.models.dflash2 import DFlash2DraftModel, DFlash2SpeculatorConfig

    cfg = DFlash2SpeculatorConfig.from_pretrained(path)
    cfg.transformer_layer_config._attn_implementation = "eager"  # no flex-attention compile on the CPU
    model, info = DFlash2DraftModel.from_pretrained(path, config=cfg, output_loading_info=True, dtype=torch.float32)
    # what speculators takes from the verifier: its embedding (tied head here)
    emb = torch.from_numpy(np.array(GGUFReader(target_gguf).get_tensor(0).data, np.float32))
    names = [t.name for t in GGUFReader(target_gguf).tensors]
    assert names[0] == "token_embd.weight", names[0]
    with torch.no_grad():
        model.embed_tokens.weight.copy_(emb)
        model.lm_head.weight.copy_(emb)
    return model.eval(), info


def _speculators_block(model, feats: np.ndarray, anchor_pos: int, anchor: int):
    """speculators' forward for one block anchored at anchor_pos: (unary logits [B, V], normed
    hidden [B, H]).  The block sees the features before anchor_pos, as ours does."""
    import torch

    B = model.block_size
    T = anchor_pos + B + 1
    hs = torch.zeros(1, T, feats.shape[1])
    hs[0, :anchor_pos] = torch.from_numpy(feats[:anchor_pos])
    ids = torch.zeros(1, T, dtype=torch.long)
    ids[0, anchor_pos] = anchor
    loss_mask = torch.zeros(1, T)
    loss_mask[0, anchor_pos] = 1  # the one anchor
    with torch.no_grad():
        hidden, logits, *_ = model._backbone_forward(hs, ids, loss_mask, torch.zeros(1, T, model.config.
                                                     transformer_layer_config.hidden_size),
                                                     torch.zeros(1, T, dtype=torch.long), max_anchors=1)
    return logits[0].numpy(), hidden[0]


def _skip(model) -> int:
    """Block rows that predict nothing: the anchor's, unless sample_from_anchor."""
    return 0 if model.config.sample_from_anchor else 1


def _speculators_lattice(model, logits: np.ndarray, hidden, anchor: int):
    """Our lattice's definition through speculators' selector: slot k's top-K candidates and their
    scores after each candidate of slot k-1 (slot 0: after the anchor)."""
    import torch

    sel = model.candidate_selector
    lg = torch.from_numpy(logits)
    cands, scores = [], []
    for p in range(_skip(model), lg.shape[0]):
        cand = lg[p].topk(sel.top_k).indices
        preds = torch.full((sel.top_k,), anchor) if not cands else cands[-1]
        with torch.no_grad():
            s = sel.score_candidates(lg[p].expand(sel.top_k, -1), hidden[p].expand(sel.top_k, -1), preds,
                                     cand.expand(sel.top_k, -1))
        cands.append(cand)
        scores.append(s.numpy())
    return np.stack([c.numpy() for c in cands]), np.stack(scores)


def _compare(ours: Drafter, model, feats: np.ndarray, rng) -> int:
    n, skip = ours.info.max_draft, _skip(model)
    compared = 0
    pushed = 0
    for anchor_pos in (5, 23, 60):
        ours.push(feats[pushed:anchor_pos])
        pushed = anchor_pos
        anchor = int(rng.integers(20, 1000))
        _, logits = ours.draft(anchor, n, return_logits=True)
        cand, scores = ours.last_lattice()
        theirs, hidden = _speculators_block(model, feats, anchor_pos, anchor)
        assert np.abs(logits - theirs[skip:]).max() < TOL * max(1.0, np.abs(theirs).max())
        tc, ts = _speculators_lattice(model, theirs, hidden, anchor)
        K = ours.info.selector_top_k
        for k in range(n):
            top = np.sort(theirs[k + skip])[::-1]
            if top[K - 1] - top[K] < 1e-3:
                continue  # a near-tie at the K-th candidate: the sets may differ
            assert set(cand[k].tolist()) == set(tc[k].tolist()), k
            if k and set(cand[k - 1].tolist()) != set(tc[k - 1].tolist()):
                continue
            # score of (predecessor id, candidate id), in either's own candidate order
            mine = {(int(cand[k - 1][a]) if k else anchor, int(cand[k][b])): scores[k][a][b]
                    for a in range(K) for b in range(K)}
            for a in range(K):
                for b in range(K):
                    key = (int(tc[k - 1][a]) if k else anchor, int(tc[k][b]))
                    assert abs(mine[key] - ts[k][a][b]) < TOL * max(1.0, np.abs(ts[k]).max()), (k, key)
            compared += 1
    return compared


def test_our_export_runs_in_speculators(artifacts, load_model, tmp_path):
    target = artifacts["llama"]["target"]
    hf, _, _ = make_variant(tmp_path, "v2")
    spec = write_speculators(hf, target, tmp_path / "speculators")
    model, info = _load_speculators(spec, target)
    loaded_from_file = {k for k in info["missing_keys"]}
    assert loaded_from_file <= {"embed_tokens.weight", "lm_head.weight", "verifier_lm_head.weight",
                                "verifier_norm.weight"}, info  # every drafter weight came from our file
    assert not info["unexpected_keys"], info
    gguf = tmp_path / "ours.gguf"
    convert_hf_to_gguf(hf, target, gguf, outtype="f32")
    ours = Drafter(gguf, load_model(target), n_ctx=256, n_threads=2)
    feats = np.random.default_rng(3).standard_normal((80, 3 * 64)).astype(np.float32)
    assert _compare(ours, model, feats, np.random.default_rng(4)) >= 10
    ours.close()


def test_speculators_checkpoint_converts_and_drafts_the_same(artifacts, load_model, tmp_path):
    """speculators' own save_pretrained -> llama-dflash convert: the same drafts as the original."""
    target = artifacts["llama"]["target"]
    hf, _, _ = make_variant(tmp_path, "v2")
    model, _ = _load_speculators(write_speculators(hf, target, tmp_path / "speculators"), target)
    saved = tmp_path / "saved"
    model.save_pretrained(saved)  # speculators' layout: config.json + model.safetensors of its own
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    convert_hf_to_gguf(hf, target, a, outtype="f32")
    convert_hf_to_gguf(saved, target, b, outtype="f32")
    m = load_model(target)
    da, db = Drafter(a, m, n_ctx=256, n_threads=2), Drafter(b, m, n_ctx=256, n_threads=2)
    assert da.info == db.info
    feats = np.random.default_rng(5).standard_normal((40, 3 * 64)).astype(np.float32)
    for d in (da, db):
        d.push(feats)
    for anchor in (30, 400, 999):
        ia, la = da.draft(anchor, 7, return_logits=True)
        ib, lb = db.draft(anchor, 7, return_logits=True)
        assert ia == ib and np.array_equal(la, lb)
    da.close()
    db.close()


def test_sample_from_anchor_layout(artifacts, load_model, tmp_path):
    """speculators' sample_from_anchor: the anchor's slot predicts too, block_size tokens per block.
    Converted, our C drafter and the PyTorch reference give speculators' logits and lattice."""
    import json

    import torch

    from llama_dflash.verify.reference import DFlashReference

    target = artifacts["llama"]["target"]
    hf, _, _ = make_variant(tmp_path, "v2")
    spec = write_speculators(hf, target, tmp_path / "speculators")
    cfg = json.loads((spec / "config.json").read_text())
    cfg["sample_from_anchor"] = True
    (spec / "config.json").write_text(json.dumps(cfg))
    model, _ = _load_speculators(spec, target)
    assert model.config.sample_from_anchor
    gguf = tmp_path / "saf.gguf"
    convert_hf_to_gguf(spec, target, gguf, outtype="f32")
    ours = Drafter(gguf, load_model(target), n_ctx=256, n_threads=2)
    assert ours.info.sample_from_anchor and ours.info.max_draft == ours.info.block_size == 8
    feats = np.random.default_rng(6).standard_normal((80, 3 * 64)).astype(np.float32)
    assert _compare(ours, model, feats, np.random.default_rng(7)) >= 10
    # the reference drafts all 8 slots too, and our write-back keeps the layout
    ref = DFlashReference.from_gguf(gguf)
    emb = torch.from_numpy(np.array(GGUFReader(target).get_tensor(0).data, np.float32))
    blk = torch.tensor([77] + [ours.info.mask_token_id] * 7)
    with torch.no_grad():
        want = ref(torch.from_numpy(feats[:60]), blk, emb, emb).numpy()
    fresh = Drafter(gguf, load_model(target), n_ctx=256, n_threads=2)
    fresh.push(feats[:60])
    _, got = fresh.draft(77, 8, return_logits=True)
    assert want.shape == got.shape == (8, emb.shape[0])
    assert np.abs(got - want).max() < TOL * max(1.0, np.abs(want).max())
    assert json.loads((write_speculators(spec, target, tmp_path / "again") / "config.json").read_text())[
        "sample_from_anchor"] is True
    fresh.close()
    ours.close()
    # and the loop drafts whole blocks with it: 8 tokens per step, 9 verify rows
    from llama_dflash import SpeculativeGenerator

    with SpeculativeGenerator(target, gguf, n_ctx=256) as g:
        assert g.max_draft_len == 8
        r = g.generate(g.tokenize("Once upon a time"), 40, draft_len=8, stop_on_eos=False)
        assert r.stats.draft_len == 8 and len(r.stats.per_position_drafted) == 8 and r.stats.drafted >= 8
