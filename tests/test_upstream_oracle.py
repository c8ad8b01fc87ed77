"""The same drafter GGUF through upstream's `dflash` graph proposes what ours proposes."""

from __future__ import annotations

import numpy as np
import pytest

from llama_dflash.core.drafter import Drafter
from llama_dflash.verify.upstream import UpstreamDrafter

from models import MASK_ID, growing_context

# Upstream runs with an f32 cache and without flash attention (tests/upstream.py):
# then both graphs perform the same operations and agree to float rounding.
TOL = (1e-4, 1e-6)


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_same_as_upstream_graph(artifacts, load_model, name):
    a = artifacts[name]
    model = load_model(a["target"])
    ours = Drafter(a["drafter"], model, n_ctx=512, n_threads=2)
    up = UpstreamDrafter(a["drafter"], model, n_ctx=512)
    width = len(ours.info.target_layers) * ours.info.n_embd
    feats = np.random.default_rng(7).standard_normal((300, width)).astype(np.float32)
    tol = TOL
    compared = 0
    for _, anchor, n in growing_context([ours, up], feats, [(12, 7), (3, 15), (1, 1), (90, 5), (4, 15)],
                                        np.random.default_rng(8)):
        ids, logits = ours.draft(anchor, n, return_logits=True)
        exp = up.draft(anchor, MASK_ID, n)
        lim = tol[0] + tol[1] * np.abs(exp).max()
        assert np.abs(logits - exp).max() < lim
        top2 = np.sort(exp, axis=1)[:, -2:]
        clear = (top2[:, 1] - top2[:, 0]) > 2 * lim
        assert (np.asarray(ids)[clear] == exp.argmax(1)[clear]).all()
        compared += int(clear.sum())
    assert compared >= 30  # the comparison actually covered most slots
    up.close()
    ours.close()


def test_yarn_same_as_upstream(artifacts, load_model, tmp_path):
    """YaRN-scaled RoPE: upstream reads the same keys; both graphs agree."""
    from models import drafter_config, write_random_drafter

    a = artifacts["llama"]
    cfg = drafter_config(a["spec"], rope_scaling="yarn", rope_factor=4.0, rope_orig_ctx=32)
    path = write_random_drafter(str(tmp_path / "yarn.gguf"), a["target"], cfg, seed=12)
    model = load_model(a["target"])
    ours = Drafter(path, model, n_ctx=256, n_threads=2)
    info = ours.info
    assert info.rope_scaling == "yarn" and info.yarn_ext_factor == 1.0 and abs(1 / info.rope_factor - 0.25) < 1e-7
    up = UpstreamDrafter(path, model, n_ctx=256)
    feats = np.random.default_rng(13).standard_normal((120, 192)).astype(np.float32)
    ours.push(feats)
    up.push(feats)
    _, logits = ours.draft(77, 7, return_logits=True)
    exp = up.draft(77, MASK_ID, 7)
    assert np.abs(logits - exp).max() < TOL[0] + TOL[1] * np.abs(exp).max()
    up.close()
    ours.close()
