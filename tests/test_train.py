"""Training: the loss, anchors, labels and export line up with inference.

A drafter trained to memorise the target's continuation of one prompt must, once exported
to GGUF and run by our loop, predict that continuation: τ close to the block size.  Any
off-by-one between training (context strictly before the anchor, slot k -> x_{a+k}) and
inference, or a wrong name in the export, makes this fail.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from llama_dflash import SpeculativeGenerator
from llama_dflash.formats.gguf import read_tensors
from llama_dflash.train import loop as T
from llama_dflash.verify.reference import DFlashReference

from models import drafter_config

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def memorised(artifacts, tmp_path_factory):
    """A v1 drafter trained to memorise the target's continuation of PROMPT, and its GGUF."""
    a = artifacts["llama"]
    cfg = drafter_config(a["spec"], block_size=8, n_ff=128)
    with SpeculativeGenerator(a["target"], n_ctx=256, capture_layers=cfg.target_layers) as g:
        samples = T.generate_samples(g, [PROMPT], 48)
    embed = torch.from_numpy(read_tensors(a["target"], ["token_embd.weight"])["token_embd.weight"].copy())
    torch.manual_seed(0)
    model = DFlashReference(cfg)
    for p in model.parameters():
        if p.dim() > 1:
            torch.nn.init.normal_(p, std=0.05)
    before = T.evaluate(model, samples, embed, embed)
    T.train(model, samples, embed, embed, steps=250, lr=3e-3, anchors_per_sample=16)
    after = T.evaluate(model, samples, embed, embed)
    out = tmp_path_factory.mktemp("train") / "memorised.gguf"
    T.export_gguf(model, out, a["target"])
    return {"samples": samples, "before": before, "after": after, "gguf": out, "state": model.state_dict(),
            "cfg": cfg, "embed": embed}


def test_memorised_continuation_is_drafted(artifacts, memorised):
    a = artifacts["llama"]
    s = memorised["samples"][0]
    assert s.features.shape == (len(s.tokens), 3 * 64)
    assert memorised["after"]["implied_tau"] > 6.0 > memorised["before"]["implied_tau"], memorised
    with SpeculativeGenerator(a["target"], memorised["gguf"], n_ctx=256) as g:
        toks = g.tokenize(PROMPT)
        plain = g.generate(toks, 48, draft_len=0, stop_on_eos=False)
        spec = g.generate(toks, 48, draft_len=7, stop_on_eos=False)
    assert spec.tokens == plain.tokens
    assert spec.stats.tau > 5.0, spec.stats  # the loop drafts what training taught
    assert np.mean(spec.stats.per_position) > 0.7


def test_rejection_accepts_more_than_match_at_t1(tmp_path, capsys):
    """At T = 1, with a drafter trained on the target's own T = 1 samples, rejection sampling
    accepts more than match verification (both exact).  The target is nearly a bigram model
    (tiny layer weights, separate head), which a small drafter learns in seconds."""
    from dataclasses import replace

    from llama_dflash import SamplingParams

    from models import TargetSpec, write_target

    spec = replace(TargetSpec(tied=False, seed=7), layer_scale=0.05)
    target = write_target(str(tmp_path / "bigram.gguf"), spec)
    cfg = drafter_config(spec, block_size=4, n_ff=128, target_layers=[0, 2])
    t1 = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
    rng = np.random.default_rng(0)
    samples = []
    with SpeculativeGenerator(target, n_ctx=256, capture_layers=cfg.target_layers) as g:
        for i in range(150):
            toks = [int(x) for x in rng.integers(20, 1000, size=4)]
            seq = toks + g.generate(toks, 48, stop_on_eos=False, sampling=SamplingParams(seed=1000 + i, **t1)).tokens
            samples.append(T.Sample(np.asarray(seq), g.features(seq), len(toks)))
    t = read_tensors(target, ["token_embd.weight", "output.weight"])
    embed, head = (torch.from_numpy(t[k].copy()) for k in ("token_embd.weight", "output.weight"))
    torch.manual_seed(0)
    model = DFlashReference(cfg)
    for p in model.parameters():
        if p.dim() > 1:
            torch.nn.init.normal_(p, std=0.05)
    T.train(model, samples, embed, head, steps=1500, lr=3e-3, anchors_per_sample=24)
    T.export_gguf(model, tmp_path / "d.gguf", target)
    taus: dict[str, list[float]] = {"match": [], "rejection": []}
    with SpeculativeGenerator(target, tmp_path / "d.gguf", n_ctx=256) as g:
        for i in range(12):
            toks = [int(x) for x in np.random.default_rng(500 + i).integers(20, 1000, size=4)]
            for mode in taus:
                taus[mode] += [g.generate(toks, 32, draft_len=3, stop_on_eos=False,
                                          sampling=SamplingParams(seed=s, mode=mode, **t1)).stats.tau
                               for s in range(4)]
    m, r = float(np.mean(taus["match"])), float(np.mean(taus["rejection"]))
    with capsys.disabled():
        print(f"\n[T=1, drafter trained on T=1 samples, n=3, 48 runs] mean tau: match {m:.3f}, rejection {r:.3f}")
    assert m > 1.1  # the drafter does predict
    assert r > m


def test_dflash2_stage_trains_the_selector_and_exports_through_the_converter(artifacts, memorised, tmp_path):
    """The DFlash2 stage (v1 weights, identity convolutions, fresh selector, joint loss) learns the
    selector; its HF export goes through our converter and the C graph drafts what it learned."""
    from dataclasses import replace

    from llama_dflash.formats import convert_hf_to_gguf
    from llama_dflash.train.run import _init_v2_from_v1, export_hf

    a = artifacts["llama"]
    cfg = replace(memorised["cfg"], conv_kernel_size=2, conv_group_size=16, selector_rank=16, selector_top_k=4,
                  n_vocab=1024)
    model = DFlashReference(cfg)
    _init_v2_from_v1(model, memorised["state"], seed=0)
    embed, samples = memorised["embed"], memorised["samples"]
    src = T._Samples(samples)
    at_init = T.evaluate_source(model, src, [0], embed, embed)
    # identity convolutions: the v1 weights give the v1 accuracy before any DFlash2 step, and the
    # small-init selector is neutral (its walk follows the unary logits)
    assert at_init["per_slot_accuracy"] == memorised["after"]["per_slot_accuracy"]
    assert at_init["path_tau"] == at_init["block_tau"] > 6.0
    sel = model.candidate_selector
    with torch.no_grad():  # a scrambled selector ruins the walk; training must repair it
        for p in (sel.predecessor_codebook, sel.successor_codebook, sel.hidden_projection.weight):
            p.normal_(0.0, 2.0, generator=torch.Generator().manual_seed(3))
    scrambled = T.evaluate_source(model, src, [0], embed, embed)
    assert scrambled["path_tau"] < 4.0 < scrambled["block_tau"], scrambled
    tc = T.TrainConfig(steps=150, lr=3e-3, seqs_per_step=1, anchors_per_seq=16, bf16_head=False)
    T.Trainer(model, src, [0], embed, embed, tc).run()
    after = T.evaluate_source(model, src, [0], embed, embed)
    assert after["topk_recall"] > 0.98 and after["path_tau"] > 6.0, after
    hf = export_hf(model, {"n_layer": 6, "context_length": 4096, "n_vocab": 1024}, tmp_path / "hf")
    out = tmp_path / "v2.gguf"
    convert_hf_to_gguf(hf, a["target"], out, outtype="f32")
    with SpeculativeGenerator(a["target"], out, n_ctx=256) as g:
        assert g.drafter_info.version == 2
        toks = g.tokenize(PROMPT)
        plain = g.generate(toks, 48, draft_len=0, stop_on_eos=False)
        spec = g.generate(toks, 48, draft_len=7, stop_on_eos=False)
    assert spec.tokens == plain.tokens
    assert spec.stats.tau > 5.0, spec.stats


def test_selector_loss_forces_a_missing_label_into_the_candidates():
    """At init the label is rarely in the top-K: the selector loss still has a target (the K-th
    candidate is overwritten with the label), and recall reports how often it was present."""
    model = _selector_model()
    embed = torch.randn(1024, model.cfg.n_embd)
    toks = torch.randint(20, 1000, (40,))
    r = T.block_losses(model, toks, torch.randn(40, 3 * model.cfg.n_embd), torch.tensor([5, 17, 30]), embed, embed)
    assert r["sel_ce"].shape == (3, 3) and torch.isfinite(r["sel_ce"]).all()
    assert not r["recall"].all()  # some labels were missing and forced in
    assert not (r["sel_hit"] & ~r["recall"]).any()  # a forced label never counts as a selector hit


def _selector_model(top_k: int = 3):
    from models import TargetSpec

    cfg = drafter_config(TargetSpec(), block_size=4, n_ff=64, conv_kernel_size=2, conv_group_size=16,
                         selector_rank=8, selector_top_k=top_k, n_vocab=1024)
    torch.manual_seed(0)
    model = DFlashReference(cfg)
    for p in model.parameters():
        if p.dim() > 1:
            torch.nn.init.normal_(p, std=0.05)
    return model


def test_draft_vocabulary_losses_are_the_full_ones_under_a_shuffled_full_map():
    """Training in a draft vocabulary with every token kept, in shuffled order, computes exactly
    the losses, hits, selector scores and recall of full-vocabulary training: the label map, the
    top-K in head rows and the codebook lookups by target id line up."""
    model = _selector_model()
    torch.manual_seed(1)
    embed, feats = torch.randn(1024, model.cfg.n_embd), torch.randn(40, 3 * model.cfg.n_embd)
    toks, anchors = torch.randint(20, 1000, (40,)), torch.tensor([5, 17, 30])
    full = T.block_losses(model, toks, feats, anchors, embed, embed)
    perm = torch.randperm(1024)
    mapped = T.block_losses(model, toks, feats, anchors, embed, embed[perm], vocab=perm)
    assert full.keys() == mapped.keys()
    for k in full:
        torch.testing.assert_close(mapped[k], full[k], rtol=1e-5, atol=1e-5, msg=k)


def test_draft_vocabulary_loss_scores_only_kept_rows_and_skips_other_labels():
    """With a reduced vocabulary the unary loss is the cross-entropy over the kept rows only;
    a label outside them is not trained on (loss 0, no selector target) and counts as a miss."""
    model = _selector_model()
    torch.manual_seed(2)
    embed, feats = torch.randn(1024, model.cfg.n_embd), torch.randn(40, 3 * model.cfg.n_embd)
    toks, anchors = torch.randint(20, 1000, (40,)), torch.tensor([5, 17, 30])
    labels = toks[anchors[:, None] + torch.arange(1, 4)[None, :]]
    kept = labels.flatten().unique()
    keep = torch.cat([kept[kept != labels[1, 1]], torch.arange(1000, 1024)])  # one label left out
    r = T.block_losses(model, toks, feats, anchors, embed, embed[keep], vocab=keep)
    z = T.block_hidden(model, feats, toks, anchors, embed)
    logits = z @ embed[keep].T
    row = {int(t): i for i, t in enumerate(keep)}
    for a in range(3):
        for k in range(3):
            lab = int(labels[a, k])
            if lab == int(labels[1, 1]):
                assert r["ce"][a, k] == 0 and not r["hit"][a, k] and not r["sel_ce"][a, k] and not r["sel_hit"][a, k]
            else:
                want = -torch.log_softmax(logits[a, k], -1)[row[lab]]
                torch.testing.assert_close(r["ce"][a, k], want, rtol=1e-4, atol=1e-4)
                assert bool(r["hit"][a, k]) == (int(logits[a, k].argmax()) == row[lab])
    assert torch.isfinite(r["sel_ce"]).all()
    # a trainer over the kept rows steps and evaluates in them
    tc = T.TrainConfig(steps=2, lr=1e-3, seqs_per_step=1, anchors_per_seq=3, bf16_head=False)
    samples = [T.Sample(toks.numpy(), feats.numpy(), 2)]
    tr = T.Trainer(model, T._Samples(samples), [0], embed, embed, tc, val_ids=[0], vocab=keep)
    assert tr.head.shape == (len(keep), model.cfg.n_embd)
    hist = tr.run()
    assert hist[-1]["step"] == 2 and len(hist[-1]["per_slot_accuracy"]) == 3


def test_whitened_features_fold_into_fc_on_export():
    """Training on standardised features is a reparametrisation: the exported weights (scale
    folded into fc) compute the same drafter on raw features."""
    from models import TargetSpec

    cfg = drafter_config(TargetSpec(), block_size=4, n_ff=64)
    torch.manual_seed(0)
    feats = torch.randn(30, 3 * cfg.n_embd) * torch.logspace(-1, 3, 3 * cfg.n_embd)  # massive channels
    model = DFlashReference(cfg)
    T.whiten_features(model, feats.numpy())
    assert float(model.feature_scale.max() / model.feature_scale.min()) > 1e3
    plain = DFlashReference(cfg)
    plain.load_state_dict(T.exported_state(model))
    toks, embed, a = torch.randint(20, 1000, (30,)), torch.randn(1024, cfg.n_embd), torch.tensor([4, 12, 20])
    torch.testing.assert_close(T.block_hidden(model, feats, toks, a, embed),
                               T.block_hidden(plain, feats, toks, a, embed), rtol=1e-4, atol=1e-4)


def test_distillation_loss_is_the_cross_entropy_against_the_targets_top_k():
    """soft_ce: slot k against the target's distribution at position a + k - 1 (its top-k,
    renormalised over the tokens the head scores); one-hot rows give the hard loss, positions
    without top-k rows fall back to it, and a trainer with distill > 0 steps on it."""
    model = _selector_model()
    torch.manual_seed(3)
    embed, feats = torch.randn(1024, model.cfg.n_embd), torch.randn(40, 3 * model.cfg.n_embd)
    toks, anchors = torch.randint(20, 1000, (40,)), torch.tensor([5, 17, 30])
    ids, logp = np.full((40, 4), -1, np.int32), np.zeros((40, 4), np.float32)
    ids[:-1, 0] = toks[1:].numpy()  # one-hot on the next token: exactly the hard loss
    r = T.block_losses(model, toks, feats, anchors, embed, embed, soft=(ids, logp))
    torch.testing.assert_close(r["soft_ce"], r["ce"], rtol=1e-5, atol=1e-5)
    # a two-token distribution at one position; no rows at another (hard loss there)
    ids[17] = [7, 8, -1, -1]
    logp[17] = [np.log(0.56), np.log(0.24), 0, 0]  # renormalised: 0.7 / 0.3
    ids[30] = -1
    r = T.block_losses(model, toks, feats, anchors, embed, embed, soft=(ids, logp))
    z = T.block_hidden(model, feats, toks, anchors, embed)
    lq = torch.log_softmax(z @ embed.T, -1)
    torch.testing.assert_close(r["soft_ce"][1, 0], -(0.7 * lq[1, 0, 7] + 0.3 * lq[1, 0, 8]), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(r["soft_ce"][2, 0], r["ce"][2, 0])
    assert not torch.allclose(r["soft_ce"][1, 0], r["ce"][1, 0])
    # a reduced head: top-k tokens outside it drop out and the rest renormalise
    keep = torch.cat([torch.tensor([7]), torch.arange(20, 1000)])
    r = T.block_losses(model, toks, feats, anchors, embed, embed[keep], vocab=keep, soft=(ids, logp))
    lq = torch.log_softmax(z @ embed[keep].T, -1)
    torch.testing.assert_close(r["soft_ce"][1, 0], -lq[1, 0, 0], rtol=1e-4, atol=1e-4)

    class Source(T._Samples):
        def top(self, i):
            return ids, logp

    tc = T.TrainConfig(steps=2, lr=1e-3, seqs_per_step=1, anchors_per_seq=3, bf16_head=False, distill=0.5)
    tr = T.Trainer(model, Source([T.Sample(toks.numpy(), feats.numpy(), 2)]), [0], embed, embed, tc)
    m = tr.train_step()
    assert np.isfinite(m["loss"]) and tr.step == 1
