"""The drop-in class speculates on real cb_eval targets: Gemma-3-270M (gemma3) and
Qwen2.5-Coder-1.5B-Instruct (qwen2), both Q4_K_M from their PyPI part packages.

Neither architecture records layer inputs, so the capture is the cb_eval callback that
``llama_dflash.Llama`` installs in the one context the base class creates.  With a random-weight
drafter shaped for each target, greedy output equals plain llama-cpp-python's token for token,
or differs only where plain llama-cpp-python itself, fed the speculative run's own batches,
picks the speculative token (certified batch numerics).
"""

from __future__ import annotations

import ctypes

import llama_cpp
import pytest

import llama_dflash
from llama_dflash.formats.config import DrafterConfig
from llama_dflash.verify.certify import certify

from models import cached_random_drafter, real_target

PROMPTS = ["def fibonacci(n):\n", "The three primary colours are"]
N = 16


def _sizes(path) -> tuple[int, int, int]:
    """Hidden size, layers and vocabulary of a GGUF, from a vocab-only load (no weights read)."""
    params = llama_cpp.llama_model_default_params()
    params.vocab_only = True
    m = llama_cpp.llama_model_load_from_file(str(path).encode(), params)

    def meta(key: str) -> str:
        buf = ctypes.create_string_buffer(256)
        assert llama_cpp.llama_model_meta_val_str(m, key.encode(), buf, 256) > 0, key
        return buf.value.decode()

    try:
        arch = meta("general.architecture")
        return (int(meta(f"{arch}.embedding_length")), int(meta(f"{arch}.block_count")),
                llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(m)))
    finally:
        llama_cpp.llama_model_free(m)


def random_drafter_for(name: str, target) -> str:
    """A random-weight drafter shaped for the real target ``name`` at ``target``, written once per
    machine (bench/bench_catalogue.py uses the same)."""
    n_embd, n_layer, n_vocab = _sizes(target)
    cfg = DrafterConfig(n_layer=1, n_embd=n_embd, n_ff=256, n_head=4, n_head_kv=2, head_dim=64, block_size=4,
                        target_layers=[1, n_layer // 2, n_layer - 3], mask_token_id=n_vocab - 1,
                        rope_theta=10000.0, rms_eps=1e-6)
    return str(cached_random_drafter(name, cfg, target))


@pytest.fixture(scope="module", params=["gemma-3-270m", "qwen2.5-coder-1.5b"])
def real(request, tmp_path_factory):
    target = real_target(request.param)
    return request.param, str(target), random_drafter_for(request.param, target)


def _tokens(llm, prompt: str, steps=None) -> list[int]:
    out = []
    for tok in llm.generate(llm.tokenize(prompt.encode()), temp=0.0, top_k=1):
        if llama_cpp.llama_vocab_is_eog(llm._model.vocab, tok) or len(out) == N:
            break
        out.append(tok)
    return out


def test_drop_in_speculates_on_a_real_cb_eval_target(real):
    name, target, drafter = real
    steps: list[dict] = []
    # the default mode against llama_cpp.Llama at its defaults, divergences certified (exact mode on a real
    # cb_eval target, bit for bit: tests/test_exact.py)
    llm = llama_dflash.Llama(target, n_ctx=512, verbose=False, draft_model_path=drafter, speculation="on",
                             exact=False)
    llm.on_step = steps.append  # the verify batches, for certification
    ref = llama_cpp.Llama(target, n_ctx=512, verbose=False)
    checker = None
    try:
        assert llm._core.capture_mode == "cb_eval", name
        for p in PROMPTS:
            steps.clear()
            got, want = _tokens(llm, p), _tokens(ref, p)
            st = llm.last_speculative_stats
            assert st.fallback_reason == "" and st.drafted > 0 and st.mode == "greedy", st
            print(f"\n[{name}] {p!r}: drafted {st.drafted}, accepted {st.accepted}, "
                  + ("identical" if got == want else "differs"))
            if got != want:
                if checker is None:
                    checker = llama_cpp.Llama(target, n_ctx=512, logits_all=True, verbose=False)
                prompt = llm.tokenize(p.encode())
                rep = certify(checker, prompt + want, prompt + got, len(prompt), list(steps))
                assert rep is not None and rep["certified"], (name, p, rep)
                print(f"[{name}] certified batch numerics at {rep['position']}: {rep}")
            else:  # and the completion API on top gives the same text
                a = llm(p, max_tokens=8, temperature=0.0)["choices"][0]["text"]
                assert a == ref(p, max_tokens=8, temperature=0.0)["choices"][0]["text"], (name, p)
    finally:
        llm.close()
        ref.close()
        if checker is not None:
            checker.close()


# (a long prompt: prose that does not repeat, so that greedy continuations do not loop at once)
STORY = ("The lighthouse keeper counted the ships that passed each night and wrote their names in a ledger "
         "that nobody else ever read. ")


@pytest.mark.parametrize("name, n_prompt, n_gen, draft_len", [
    ("gemma-3-270m", 720, 320, 3),          # past its 512-token window and past 1,000 positions
    ("qwen2.5-coder-1.5b", 40, 256, 2),
])
def test_exact_mode_holds_over_long_runs(name, n_prompt, n_gen, draft_len):
    """Real targets speculate over long runs in exact mode, through cb_eval capture: Gemma-3-270M from a
    720-token prompt to 1,040 positions (every step past its 512-token sliding window), Qwen2.5-Coder-1.5B
    for 256 tokens; the speculative tokens equal plain decoding's (the same loop, no drafts: bit for bit
    what llama_cpp.Llama gives under these settings, tests/test_exact.py), and a replayed draft source that
    is right 70 % of the time (long accepted drafts, rejections after them) gives them too."""
    from llama_dflash import SpeculativeGenerator
    from llama_dflash.verify.oracle import ReplayDraftSource

    target = str(real_target(name))
    drafter = random_drafter_for(name, target)  # (the module fixture's)
    with SpeculativeGenerator(target, drafter, n_ctx=n_prompt + n_gen + 16, exact=True) as g:
        assert g.capture_mode == "cb_eval" and g.exact_verdict.max_rows >= draft_len + 1
        toks = (g.tokenize(STORY * 40) if n_prompt > 100 else g.tokenize(PROMPTS[0]))[:n_prompt]
        plain = g.generate(toks, n_gen, draft_len=0, stop_on_eos=False)
        spec = g.generate(toks, n_gen, draft_len=draft_len, speculation="on", stop_on_eos=False)
        assert len(plain.tokens) == n_gen and spec.stats.drafted > 0
        assert spec.tokens == plain.tokens, [i for i, (a, b) in enumerate(zip(spec.tokens, plain.tokens,
                                                                               strict=True)) if a != b][:1]
        src = ReplayDraftSource.with_acceptance(toks + plain.tokens, g.n_vocab, 0.7, seed=1)
        rep = g.generate(toks, n_gen, draft_len=min(7, g.exact_verdict.max_rows - 1), draft_source=src,
                         speculation="on", stop_on_eos=False)
        assert rep.tokens == plain.tokens and rep.stats.accepted > 0 and rep.stats.accepted < rep.stats.drafted
        print(f"\n[{name}] {len(toks)} + {n_gen} positions: identical; drafter drafted {spec.stats.drafted}, "
              f"replay tau {rep.stats.tau:.2f}")


def test_offline_download_is_a_clear_error(tmp_path, monkeypatch):
    """Without the index (offline), a real target not in the cache is a DownloadError naming it
    (tests skip on it with that reason); every part list carries the assembled file's SHA256."""
    from llama_dflash.api import models

    monkeypatch.setenv("LLAMA_DFLASH_FILES", str(tmp_path))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path))
    with pytest.raises(models.DownloadError, match="cannot download gemma-3-270m from PyPI"):
        models.pypi_target("gemma-3-270m")
    assert all(sha and len(sha) == 64 for _, _, sha in models._PYPI_TARGETS.values())
