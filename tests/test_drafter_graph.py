"""Our ggml drafter graph against the PyTorch reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from llama_dflash.core.drafter import Drafter
from llama_dflash.formats.gguf import read_tensors
from llama_dflash.verify.reference import DFlashReference

from models import MASK_ID, drafter_config, growing_context, write_random_drafter

# Tolerances as (absolute, relative to the largest |logit| of the step).
# f32 weights and head: the graph and the reference differ only by summation order.
ATOL_F32 = (2e-3, 0.0)
# Q8_0 weights or head: ggml also quantizes the activations to Q8_0 for the dot products.
ATOL_Q8 = (0.0, 1.5e-2)


def target_tables(path):
    t = read_tensors(path, ["token_embd.weight", "output.weight"])
    embed = torch.from_numpy(t["token_embd.weight"].copy())
    head = torch.from_numpy(t.get("output.weight", t["token_embd.weight"]).copy())
    return embed, head


def reference_logits(ref, feats, anchor, n, embed, head):
    block = torch.tensor([anchor] + [MASK_ID] * n)
    with torch.no_grad():
        return ref(torch.from_numpy(feats), block, embed, head).numpy()


def check(drafter, ref, feats_all, steps, embed, head, atol):
    """Push features in `steps` chunks, drafting after each; compare every draft."""
    drafter.reset()
    for done, anchor, n in growing_context([drafter], feats_all, steps, np.random.default_rng(5)):
        assert drafter.n_ctx_used == done
        ids, logits = drafter.draft(anchor, n, return_logits=True)
        exp = reference_logits(ref, feats_all[:done], anchor, n, embed, head)
        assert logits.shape == exp.shape
        err = np.abs(logits - exp).max()
        tol = atol[0] + atol[1] * np.abs(exp).max()
        assert err < tol, f"ctx {done} block {n + 1}: max |diff| {err:.2e} >= {tol:.2e}"
        # Greedy ids agree wherever the reference has a clear winner.
        top2 = np.sort(exp, axis=1)[:, -2:]
        clear = (top2[:, 1] - top2[:, 0]) > 2 * tol
        assert (np.asarray(ids)[clear] == exp.argmax(1)[clear]).all()
        # Drafting never adds to the committed context.
        assert drafter.n_ctx_used == done


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_graph_matches_reference(artifacts, load_model, name):
    a = artifacts[name]
    model = load_model(a["target"])
    d = Drafter(a["drafter"], model, n_ctx=512, n_threads=2)
    ref = DFlashReference.from_gguf(a["drafter"])
    embed, head = target_tables(a["target"])
    width = len(d.info.target_layers) * d.info.n_embd
    feats = np.random.default_rng(0).standard_normal((400, width)).astype(np.float32)
    atol = ATOL_Q8 if name == "qwen3" else ATOL_F32
    # Several single-shot (context, block) sizes ...
    for n_ctx, n in [(1, 1), (5, 3), (37, 7), (130, 15)]:
        check(d, ref, feats, [(n_ctx, n)], embed, head, atol)
    # ... and a context that grows over several steps (lazy projection in chunks).
    check(d, ref, feats, [(10, 7), (1, 3), (4, 15), (7, 7), (300, 5)], embed, head, atol)
    d.close()


@pytest.mark.parametrize("variant", [
    {"causal": True},
    {"n_swa": 8, "swa_layers": [True, False]},
    {"logit_scale": 0.5, "softcap": 3.0, "embedding_scale": 1.7},
    {"rope_scaling": "linear", "rope_factor": 2.0},
    {"rope_scaling": "yarn", "rope_factor": 4.0, "rope_orig_ctx": 32},
])
def test_graph_variants(artifacts, load_model, tmp_path, variant):
    a = artifacts["llama"]
    cfg = drafter_config(a["spec"], **variant)
    path = write_random_drafter(str(tmp_path / "v.gguf"), a["target"], cfg, seed=3)
    model = load_model(a["target"])
    d = Drafter(path, model, n_ctx=256, n_threads=2)
    ref = DFlashReference.from_gguf(path)
    embed, head = target_tables(a["target"])
    feats = np.random.default_rng(1).standard_normal((100, 3 * 64)).astype(np.float32)
    check(d, ref, feats, [(3, 7), (20, 15), (2, 2), (30, 9)], embed, head, ATOL_F32)
    d.close()


def test_quantized_drafter_weights(artifacts, load_model, tmp_path):
    """A Q8_0 drafter runs and stays close to the f32 reference of the same weights."""
    a = artifacts["llama"]
    cfg = drafter_config(a["spec"])
    path = write_random_drafter(str(tmp_path / "q8.gguf"), a["target"], cfg, seed=4, outtype="q8_0")
    model = load_model(a["target"])
    d = Drafter(path, model, n_ctx=256, n_threads=2)
    ref = DFlashReference.from_gguf(path)  # dequantized weights
    embed, head = target_tables(a["target"])
    feats = np.random.default_rng(2).standard_normal((50, 3 * 64)).astype(np.float32)
    check(d, ref, feats, [(20, 7), (5, 15)], embed, head, ATOL_Q8)
    d.close()


def test_q4_0_weights_run_repacked(artifacts, load_model, tmp_path):
    """Q4_0 matrices go to the CPU backend's repacking buffer where its multi-row kernels take them
    (AVX2 here) and the drafts stay close to the f32 reference of the same weights."""
    import llama_cpp

    a = artifacts["llama"]
    cfg = drafter_config(a["spec"])
    path = write_random_drafter(str(tmp_path / "q4.gguf"), a["target"], cfg, seed=4, outtype="q4_0")
    model = load_model(a["target"])
    d = Drafter(path, model, n_ctx=256, n_threads=2)
    mem = d.memory()
    if b"AVX2 = 1" in llama_cpp.llama_print_system_info():
        assert 0 < mem["repacked"] < mem["weights"]  # the matrices; the norms are not
    ref = DFlashReference.from_gguf(path)
    embed, head = target_tables(a["target"])
    feats = np.random.default_rng(2).standard_normal((50, 3 * 64)).astype(np.float32)
    check(d, ref, feats, [(20, 7), (5, 15), (3, 5)], embed, head, ATOL_Q8)
    d.close()


def test_p_min_cuts_the_draft(artifacts, load_model):
    """DFlash v1: the draft stops at the first slot whose top-K softmax confidence is below p_min."""
    a = artifacts["llama"]
    model = load_model(a["target"])
    d = Drafter(a["drafter"], model, n_ctx=128, n_threads=2)
    d.push(np.random.default_rng(6).standard_normal((12, 192)).astype(np.float32))
    full, logits = d.draft(42, 7, return_logits=True)
    top = np.sort(logits, axis=1)[:, -32:]
    conf = np.exp(top[:, -1] - top.max(1)) / np.exp(top - top.max(1, keepdims=True)).sum(1)
    thresholds = [float(c) + e for c in conf for e in (-1e-4, 1e-4)] + [0.0, 1.01]  # away from float rounding
    for thr in thresholds:
        want = next((k for k, c in enumerate(conf) if c < thr), 7)
        assert d.draft(42, 7, p_min=thr) == full[:want], (thr, conf)
    d.close()


def test_padded_keys_weigh_nothing(artifacts, load_model):
    """Attention spans the used cache cells rounded up to a multiple of 16, the rest masked: rows
    left there by a longer context (then reset or truncated) change no logit -- bit for bit against
    a fresh state, at used counts on and off the multiple."""
    a = artifacts["llama"]
    model = load_model(a["target"])
    width = None
    for n_used, n in [(9, 3), (13, 3), (16, 7), (29, 2)]:
        fresh = Drafter(a["drafter"], model, n_ctx=256, n_threads=2)
        width = width or len(fresh.info.target_layers) * fresh.info.n_embd
        feats = np.random.default_rng(n_used).standard_normal((200, width)).astype(np.float32)
        fresh.push(feats[:n_used])
        want = fresh.draft(7, n, return_logits=True)[1]
        fresh.close()
        stale = Drafter(a["drafter"], model, n_ctx=256, n_threads=2)
        stale.push(100 * feats[50:200])  # large rows in every cell the padded span may reach
        stale.draft(5, 15)
        stale.reset()
        stale.push(feats[:n_used])
        got = stale.draft(7, n, return_logits=True)[1]
        assert np.array_equal(got, want), f"{n_used} rows, n = {n}"
        stale.truncate(n_used - 4)
        stale.push(feats[n_used - 4:n_used])
        assert np.array_equal(stale.draft(7, n, return_logits=True)[1], want)
        stale.close()
