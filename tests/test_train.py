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
from llama_dflash import train as T
from llama_dflash.gguf_io import read_tensors
from llama_dflash.reference import DFlashReference

from models import drafter_config

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def memorised(artifacts, tmp_path_factory):
    """A v1 drafter trained to memorise the target's continuation of PROMPT, and its GGUF."""
    a = artifacts["llama"]
    cfg = drafter_config(a["spec"], block_size=8, n_ff=128)
    with SpeculativeGenerator(a["target"], n_ctx=256, capture_layers=cfg.target_layer_ids) as g:
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
    return {"samples": samples, "before": before, "after": after, "gguf": out}


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


def test_rejection_vs_match_acceptance_at_t1(artifacts, memorised, capsys):
    """Rejection vs match verification at T = 1 on a drafter that predicts (the memorised one),
    measured over 30 seeds (both are exact; only acceptance differs)."""
    from llama_dflash import SamplingParams

    a = artifacts["llama"]
    taus = {}
    with SpeculativeGenerator(a["target"], memorised["gguf"], n_ctx=256) as g:
        toks = g.tokenize(PROMPT)
        for mode in ("match", "rejection"):
            taus[mode] = float(np.mean([
                g.generate(toks, 48, draft_len=7, stop_on_eos=False,
                           sampling=SamplingParams(temperature=1.0, seed=s, mode=mode)).stats.tau
                for s in range(30)]))
    with capsys.disabled():
        print(f"\n[T=1 (top-k 40, top-p 0.95, min-p 0.05), memorised v1 drafter, n=7] mean tau: "
              f"match {taus['match']:.2f}, rejection {taus['rejection']:.2f}")
    assert taus["rejection"] >= taus["match"] - 0.05
