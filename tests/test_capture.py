"""Feature capture: both paths agree, and capturing does not change the target."""

from __future__ import annotations

import numpy as np
import pytest

from llama_dflash import DFlashError, SpeculativeGenerator

TEXT = "def add(a, b):\n    return a + b\n\nprint(add(2, 3))  # five, as expected by everyone reading this"


def test_layer_inp_and_cb_eval_capture_agree(artifacts):
    a = artifacts["llama"]
    taps = [0, 2, 4]
    with SpeculativeGenerator(a["target"], n_ctx=256, n_batch=16, capture_layers=taps,
                              capture="layer_inp") as g1, \
         SpeculativeGenerator(a["target"], n_ctx=256, n_batch=16, capture_layers=taps, capture="cb_eval") as g2:
        assert (g1.capture_mode, g2.capture_mode) == ("layer_inp", "cb_eval")
        toks = g1.tokenize(TEXT)
        assert len(toks) > 16  # several chunks of n_batch
        f1, f2 = g1.features(toks), g2.features(toks)
    assert f1.shape == (len(toks), 3 * 64)
    assert np.isfinite(f1).all() and np.abs(f1).max() > 0
    np.testing.assert_array_equal(f1, f2)
    # the taps are distinct layers, concatenated in target_layers order
    assert not np.array_equal(f1[:, :64], f1[:, 64:128])


@pytest.mark.parametrize("name,mode", [("llama", "layer_inp"), ("qwen3", "layer_inp"), ("qwen2", "cb_eval")])
def test_capture_does_not_change_logits(artifacts, name, mode):
    a = artifacts[name]
    with SpeculativeGenerator(a["target"], n_ctx=256) as plain, \
         SpeculativeGenerator(a["target"], n_ctx=256, capture_layers=[0, 1, 4]) as cap:
        assert cap.capture_mode == mode
        toks = plain.tokenize(TEXT)
        r0 = plain.generate(toks, 24, stop_on_eos=False, return_margins=True)
        r1 = cap.generate(toks, 24, stop_on_eos=False, return_margins=True)
    assert r0.tokens == r1.tokens
    assert r0.margins == r1.margins  # bit-identical logits


def test_capture_refuses_unsupported(artifacts):
    a = artifacts["qwen2"]
    with pytest.raises(DFlashError, match="does not record layer inputs"):
        SpeculativeGenerator(a["target"], n_ctx=64, capture_layers=[1], capture="layer_inp")
    with pytest.raises(DFlashError, match="cannot capture layer 5"):
        SpeculativeGenerator(a["target"], n_ctx=64, capture_layers=[5])  # last layer is pruned
