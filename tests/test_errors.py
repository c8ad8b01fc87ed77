"""Bad input gives a clear Python exception; the process never dies."""

from __future__ import annotations

import numpy as np
import pytest

from llama_dflash import DFlashError, SpeculativeGenerator
from llama_dflash.formats.gguf import random_drafter_tensors, write_drafter

from models import TargetSpec, drafter_config, write_random_drafter, write_target


@pytest.fixture(scope="module")
def llama(artifacts):
    return artifacts["llama"]


def test_missing_files(llama, tmp_path):
    with pytest.raises(FileNotFoundError, match="target model file not found"):
        SpeculativeGenerator(tmp_path / "nope.gguf")
    with pytest.raises(FileNotFoundError, match="drafter file not found"):
        SpeculativeGenerator(llama["target"], tmp_path / "nope.gguf")


def test_corrupt_target(tmp_path):
    p = tmp_path / "garbage.gguf"
    p.write_bytes(b"GGUF" + bytes(range(256)) * 4)
    with pytest.raises(DFlashError, match="cannot load target model"):
        SpeculativeGenerator(p)


@pytest.mark.parametrize("cut", [10, 200, 0.5, -16])
def test_truncated_drafter(llama, tmp_path, cut):
    data = open(llama["drafter"], "rb").read()
    n = int(len(data) * cut) if isinstance(cut, float) else (cut if cut > 0 else len(data) + cut)
    p = tmp_path / "trunc.gguf"
    p.write_bytes(data[:n])
    with pytest.raises(DFlashError, match="truncated|not a valid GGUF"):
        SpeculativeGenerator(llama["target"], p)


def test_not_a_drafter(llama):
    with pytest.raises(DFlashError, match="is a 'llama' model, not a DFlash drafter"):
        SpeculativeGenerator(llama["target"], llama["target"])


@pytest.mark.parametrize("extra,msg", [
    ({"selector_hidden.weight": np.zeros((16, 64), np.float32)}, "DFlash2 drafter"),
    ({"markov_w1.weight": np.zeros((1024, 8), np.float32)}, "DSpark drafter"),
    ({"blk.0.post_ffw_norm.weight": np.ones(64, np.float32)}, "unsupported tensor 'blk.0.post_ffw_norm.weight'"),
])
def test_unsupported_variants(llama, tmp_path, extra, msg):
    cfg = drafter_config(llama["spec"])
    t = random_drafter_tensors(cfg)
    t.update(extra)
    p = tmp_path / "v.gguf"
    write_drafter(p, cfg, t, llama["target"])
    with pytest.raises(DFlashError, match=msg):
        SpeculativeGenerator(llama["target"], p)


def test_file_supplied_names_are_escaped_in_messages(llama, tmp_path, capsys):
    """A tensor name with control characters is quoted escaped, on one line: it cannot split a
    message or drive the terminal."""
    from llama_dflash.api.cli import main

    cfg = drafter_config(llama["spec"])
    t = random_drafter_tensors(cfg)
    t["blk.0.evil\n\x1b[31mred"] = np.ones(64, np.float32)
    p = tmp_path / "v.gguf"
    write_drafter(p, cfg, t, llama["target"])
    with pytest.raises(DFlashError) as e:
        SpeculativeGenerator(llama["target"], p)
    assert "unsupported tensor 'blk.0.evil\\n\\x1b[31mred'" in str(e.value)
    assert "\n" not in str(e.value) and "\x1b" not in str(e.value)
    assert main(["inspect", str(p)]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "\x1b" not in err and "evil\\n\\x1b[31mred" in err, err


def test_missing_tensor_and_bad_shape(llama, tmp_path):
    cfg = drafter_config(llama["spec"])
    t = random_drafter_tensors(cfg)
    del t["blk.1.ffn_up.weight"]
    write_drafter(tmp_path / "a.gguf", cfg, t, llama["target"])
    with pytest.raises(DFlashError, match="missing tensor 'blk.1.ffn_up.weight'"):
        SpeculativeGenerator(llama["target"], tmp_path / "a.gguf")
    t = random_drafter_tensors(cfg)
    t["blk.0.attn_k.weight"] = np.zeros((8, 64), np.float32)
    write_drafter(tmp_path / "b.gguf", cfg, t, llama["target"])
    with pytest.raises(DFlashError, match="'blk.0.attn_k.weight' has shape"):
        SpeculativeGenerator(llama["target"], tmp_path / "b.gguf")


def test_drafter_target_mismatch(llama, tmp_path):
    spec = llama["spec"]
    # hidden size
    wide = write_target(str(tmp_path / "wide.gguf"), TargetSpec(n_embd=96, n_head=4, n_head_kv=2))
    with pytest.raises(DFlashError, match="hidden size 64 but the target has 96"):
        SpeculativeGenerator(wide, llama["drafter"])
    # tap beyond the target's layers
    p = write_random_drafter(str(tmp_path / "taps.gguf"), llama["target"],
                             drafter_config(spec, target_layers=[0, 2, 9]))
    with pytest.raises(DFlashError, match="taps target layer 9 but the target has 6 layers"):
        SpeculativeGenerator(llama["target"], p)
    # mask token outside the vocabulary
    p = write_random_drafter(str(tmp_path / "mask.gguf"), llama["target"], drafter_config(spec, mask_token_id=5000))
    with pytest.raises(DFlashError, match="mask token id 5000 outside the target vocabulary"):
        SpeculativeGenerator(llama["target"], p)


def test_generation_parameters(llama):
    g = SpeculativeGenerator(llama["target"], llama["drafter"], n_ctx=64)
    toks = g.tokenize("hello there")
    with pytest.raises(DFlashError, match="exceeds the drafter's block"):
        g.generate(toks, 8, draft_len=16)
    with pytest.raises(DFlashError, match="prompt has 80 tokens but n_ctx is 64"):
        g.generate(list(range(20, 100)), 4)
    with pytest.raises(DFlashError, match="exceeds n_ctx"):
        g.generate(toks, 64)
    with pytest.raises(DFlashError, match="outside the vocabulary"):
        g.generate([5, 99999], 4)
    with pytest.raises(DFlashError, match="empty"):
        g.generate([], 4)
    with pytest.raises(ValueError):
        g.generate(toks, 0)

    def broken(history, n):
        raise KeyError("boom")
    with pytest.raises(KeyError, match="boom"):
        g.generate(toks, 8, draft_source=broken)
    with pytest.raises(DFlashError, match="draft source returned"):
        g.generate(toks, 8, draft_len=3, draft_source=lambda h, n: [1, 2, 3, 4, 5])
    # still fully usable afterwards
    assert len(g.generate(toks, 8).tokens) == 8
    g.close()
    with pytest.raises(DFlashError, match="closed"):
        g.generate(toks, 4)


def test_every_small_context_size_runs_to_its_end(llama):
    """Contexts smaller than the drafter's block (down to 2 positions) load and generate to the
    last position without an abort; greedy output equals plain decoding's."""
    for n_ctx in range(2, 21):
        with SpeculativeGenerator(llama["target"], llama["drafter"], n_ctx=n_ctx) as g:
            toks = g.tokenize("Hello", add_special=False)[:1]
            spec = g.generate(toks, max_tokens=n_ctx - len(toks), draft_len=15)
            plain = g.generate(toks, max_tokens=n_ctx - len(toks), draft_len=0)
            assert spec.tokens == plain.tokens, n_ctx
            assert len(spec.tokens) == n_ctx - len(toks) or spec.stats.stop_reason == "eos", n_ctx


def test_small_contexts_and_batches_in_adaptive_and_exact_mode(llama, tmp_path, monkeypatch):
    """Tiny n_ctx / n_batch never reach a llama.cpp abort: verify batches stay within n_batch, the
    cost model times what fits, exact mode's self-check runs whatever the batch."""
    monkeypatch.setenv("LLAMA_DFLASH_CACHE", str(tmp_path))
    for n_ctx, n_batch in ((8, 8), (20, 4), (64, 2), (256, 1)):
        with SpeculativeGenerator(llama["target"], llama["drafter"], n_ctx=n_ctx, n_batch=n_batch) as g:
            toks = g.tokenize("Hello", add_special=False)[:1]
            n = min(g._core.n_ctx - 1, 32)
            plain = g.generate(toks, max_tokens=n, draft_len=0)
            assert g.generate(toks, max_tokens=n).tokens == plain.tokens, (n_ctx, n_batch)  # adaptive
            fixed = g.generate(toks, max_tokens=n, draft_len=15)
            assert fixed.tokens == plain.tokens and len(fixed.stats.lengths) - 1 <= n_batch - 1, (n_ctx, n_batch)
    # exact mode's self-check runs on a probe context of its own, whatever the target's n_batch (this
    # f32 target fails it: the default mode, with the reason in the stats)
    with SpeculativeGenerator(llama["target"], llama["drafter"], n_ctx=64, n_batch=4, exact="auto") as g:
        toks = g.tokenize("Hello", add_special=False)[:1]
        r = g.generate(toks, max_tokens=16, draft_len=3)
        assert r.tokens == g.generate(toks, max_tokens=16, draft_len=0).tokens
        assert r.stats.exact.startswith("not exact: self-check failed"), r.stats.exact


def test_drop_in_below_the_context_floor(llama):
    """n_ctx below llama.cpp's floor (the context gets 256 positions, llama-cpp-python's token
    buffers the n_ctx asked for): ours serves what fits in llama.cpp's context, as the base class
    does -- the same text where the base class does not overrun its own buffers -- or refuses a
    prompt that does not fit with a clear ValueError; never an ignored exception or an IndexError
    later on."""
    import llama_cpp

    import llama_dflash

    for n_ctx in (4, 8, 16, 24):
        base = llama_cpp.Llama(llama["target"], n_ctx=n_ctx, verbose=False)
        ours = llama_dflash.Llama(llama["target"], n_ctx=n_ctx, verbose=False, draft_model_path=llama["drafter"])
        try:
            for call in (lambda m: m("Hello there, how are you?", max_tokens=8, temperature=0.0),
                         lambda m: m.create_chat_completion([{"role": "user", "content": "Hi"}], max_tokens=8,
                                                            temperature=0.0)):
                try:
                    got = call(ours)
                except ValueError as e:
                    assert "exceed context window" in str(e), e
                    continue
                assert got["usage"]["total_tokens"] <= ours.n_ctx(), n_ctx
                try:
                    want = call(base)
                except ValueError:  # the base class's buffer overrun (a numpy error)
                    continue
                text = lambda r: r["choices"][0].get("text", r["choices"][0].get("message", {}).get("content"))  # noqa: E731
                assert text(want) == text(got) and want["usage"] == got["usage"], (n_ctx, text(got), text(want))
        finally:
            ours.close()
            base.close()
