"""`llama_dflash.Llama`: a llama_cpp.Llama whose outputs are unchanged by the drafter."""

from __future__ import annotations

import json

import llama_cpp
import pytest

import llama_dflash

PROMPTS = ["def fibonacci(n):", "The capital of France is", "Once upon a time, there was", "1, 2, 3, 4,"]


@pytest.fixture(scope="module")
def pair(artifacts):
    a = artifacts["llama"]
    base = llama_cpp.Llama(a["target"], n_ctx=256, verbose=False)
    spec = llama_dflash.Llama(a["target"], n_ctx=256, verbose=False, draft_model_path=a["drafter"], draft_n_max=7,
                              speculation="on")
    yield base, spec
    spec.close()
    base.close()


def test_is_a_llama_and_validates_options(artifacts, pair):
    import inspect

    _, spec = pair
    assert isinstance(spec, llama_cpp.Llama) and spec.draft_n_max == 7
    for name in dir(llama_cpp.Llama):  # every public method keeps llama-cpp-python's signature
        if not name.startswith("_") and callable(getattr(llama_cpp.Llama, name)):
            assert inspect.signature(getattr(llama_dflash.Llama, name)) == \
                inspect.signature(getattr(llama_cpp.Llama, name)), name
    with pytest.raises(TypeError, match="draft_n_maxx"):
        llama_dflash.Llama(artifacts["llama"]["target"], n_ctx=64, verbose=False, draft_n_maxx=3)
    with pytest.raises(ValueError, match="verify"):
        llama_dflash.Llama(artifacts["llama"]["target"], n_ctx=64, verbose=False, verify="fast")


@pytest.mark.parametrize("kw", [dict(temperature=0.0), dict(temperature=0.8, seed=3), dict(temperature=1.5, seed=11)])
def test_completions_equal_plain(pair, kw):
    base, spec = pair
    for p in PROMPTS:
        want = base.create_completion(p, max_tokens=24, **kw)
        got = spec.create_completion(p, max_tokens=24, **kw)
        assert got["choices"][0]["text"] == want["choices"][0]["text"], p
        assert got["choices"][0]["finish_reason"] == want["choices"][0]["finish_reason"]
        assert got["usage"] == want["usage"]
        st = spec.last_speculative_stats
        assert st.fallback_reason == "" and st.drafted > 0
        # streaming: the same chunks as plain's stream
        chunks = [[c["choices"][0]["text"] for c in llm.create_completion(p, max_tokens=24, stream=True, **kw)]
                  for llm in (base, spec)]
        assert chunks[0] == chunks[1]


def test_stop_strings_and_max_tokens(pair):
    base, spec = pair
    text = base.create_completion(PROMPTS[2], max_tokens=30, temperature=0.0)["choices"][0]["text"]
    stop = text.split()[2]
    want = base.create_completion(PROMPTS[2], max_tokens=30, temperature=0.0, stop=[stop])
    got = spec.create_completion(PROMPTS[2], max_tokens=30, temperature=0.0, stop=[stop])
    assert got["choices"][0]["text"] == want["choices"][0]["text"] == text[:text.index(stop)]  # cut exactly there
    assert got["choices"][0]["finish_reason"] == want["choices"][0]["finish_reason"]
    for m in (1, 2, 3):
        got = spec.create_completion(PROMPTS[0], max_tokens=m, temperature=0.0)
        assert got["usage"]["completion_tokens"] == m
        st = spec.last_speculative_stats
        assert st.drafted <= max(0, m - 1)  # drafts never ran past the budget


def test_chat_and_fallback(pair):
    base, spec = pair
    msgs = [{"role": "user", "content": "Say something."}]
    want = base.create_chat_completion(msgs, max_tokens=20, temperature=0.0)
    got = spec.create_chat_completion(msgs, max_tokens=20, temperature=0.0)
    assert got["choices"][0]["message"] == want["choices"][0]["message"]
    # the chat handler's stopping criteria are honoured on verified tokens: still speculative
    assert spec.last_speculative_stats.fallback_reason == "" and spec.last_speculative_stats.drafted > 0
    # mirostat keeps a state per sampled token the verify loop cannot replay: served by plain
    # decoding, recorded, output unchanged
    got = spec.create_completion(PROMPTS[1], max_tokens=12, temperature=0.8, mirostat_mode=2, seed=4)
    want = base.create_completion(PROMPTS[1], max_tokens=12, temperature=0.8, mirostat_mode=2, seed=4)
    assert got["choices"][0]["text"] == want["choices"][0]["text"]
    assert spec.last_speculative_stats.fallback_reason == "mirostat"
    assert spec.speculative_stats_total.fallbacks >= 1 and spec.speculative_stats_total.generations >= 1


def test_interrupted_stream_then_new_request(pair, artifacts):
    base, spec = pair
    it = spec.create_completion(PROMPTS[0], max_tokens=24, temperature=0.0, stream=True)
    next(it)
    next(it)
    it.close()  # a client that went away mid-stream
    want = base.create_completion(PROMPTS[3], max_tokens=16, temperature=0.0)
    got = spec.create_completion(PROMPTS[3], max_tokens=16, temperature=0.0)
    assert got["choices"][0]["text"] == want["choices"][0]["text"]


@pytest.mark.parametrize("n_ctx", [128, 0])
def test_cb_eval_target_speculates_through_the_drop_in(artifacts, n_ctx):
    """qwen2's graph records no layer inputs: the drop-in class installs the cb_eval capture in
    the one context the base class creates, and speculates (greedy output equal to plain)."""
    q = artifacts["qwen2"]
    llm = llama_dflash.Llama(q["target"], n_ctx=n_ctx, verbose=False, draft_model_path=q["drafter"], speculation="on")
    ref = llama_cpp.Llama(q["target"], n_ctx=n_ctx, verbose=False)
    try:
        assert llm._core.capture_mode == "cb_eval"
        for p in PROMPTS[:3]:
            got = llm(p, max_tokens=24, temperature=0.0)["choices"][0]["text"]
            assert got == ref(p, max_tokens=24, temperature=0.0)["choices"][0]["text"], p
            st = llm.last_speculative_stats
            assert st.fallback_reason == "" and st.drafted > 0 and st.mode == "greedy", st
        msgs = [{"role": "user", "content": "Hello there"}]
        want = ref.create_chat_completion(msgs, max_tokens=16, temperature=0.0)["choices"][0]["message"]
        chunks = llm.create_chat_completion(msgs, max_tokens=16, temperature=0.0, stream=True)
        assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == want["content"]
        assert llm.last_speculative_stats.drafted > 0
    finally:
        llm.close()
        ref.close()


def _decodes_plainly(llm, target: str, reason: str) -> None:
    """llm's output equals llama_cpp.Llama's and the stats name the fallback; closes llm."""
    ref = llama_cpp.Llama(target, n_ctx=128, verbose=False)
    assert llm("Hello", max_tokens=8, temperature=0.0)["choices"][0]["text"] == \
        ref("Hello", max_tokens=8, temperature=0.0)["choices"][0]["text"]
    assert reason in llm.last_speculative_stats.fallback_reason
    llm.close()
    ref.close()


def test_drafter_object_in_llama_cpp_pythons_draft_model_slot(artifacts):
    a = artifacts["llama"]
    d = llama_dflash.DFlashDraftModel(a["drafter"], n_max=4)
    llm = llama_dflash.Llama(a["target"], n_ctx=128, verbose=False, draft_model=d, speculation="on")
    ref = llama_cpp.Llama(a["target"], n_ctx=128, verbose=False)
    assert llm.draft_n_max == 4 and llm.draft_model is None
    assert llm("Hello", max_tokens=8, temperature=0.0)["choices"][0]["text"] == \
        ref("Hello", max_tokens=8, temperature=0.0)["choices"][0]["text"]
    assert llm.last_speculative_stats.drafted > 0
    llm.close()
    with pytest.raises(ValueError, match="once"):
        llama_dflash.Llama(a["target"], n_ctx=64, verbose=False, draft_model=d, draft_model_path=a["drafter"])
    with pytest.raises(TypeError, match="llama_dflash.Llama"):  # plain llama_cpp.Llama cannot run it
        ref.draft_model = d
        ref("Hello", max_tokens=4, temperature=0.0)
    ref.close()


def test_specconfig_like_object(artifacts):
    from types import SimpleNamespace

    a = artifacts["llama"]
    cfg = SimpleNamespace(spec_type="SpeculativeType.DRAFT_DFLASH", draft_model_path=a["drafter"], draft_n_max=5,
                          draft_p_min=0.0)
    llm = llama_dflash.Llama(a["target"], n_ctx=128, verbose=False, speculative=cfg, speculation="on")
    assert llm.draft_n_max == 5
    llm("Hello", max_tokens=6, temperature=0.0)
    assert llm.last_speculative_stats.drafted > 0
    llm.close()
    with pytest.raises(ValueError, match="only DFlash"):
        llama_dflash.Llama(a["target"], n_ctx=64, verbose=False, speculative=SimpleNamespace(spec_type="NGRAM"))


def test_second_chat_turn_reuses_the_prefix(pair):
    base, spec = pair
    msgs = [{"role": "user", "content": "Tell me a story."}]
    first = spec.create_chat_completion(msgs, max_tokens=16, temperature=0.0)
    msgs2 = msgs + [first["choices"][0]["message"], {"role": "user", "content": "And then?"}]
    want = base.create_chat_completion(msgs2, max_tokens=16, temperature=0.0)
    got = spec.create_chat_completion(msgs2, max_tokens=16, temperature=0.0)
    assert spec.last_speculative_stats.n_reused > 10  # only the new suffix was evaluated
    assert got["choices"][0]["message"] == want["choices"][0]["message"]


def test_speculation_auto_keeps_output(artifacts, tmp_path, monkeypatch):
    """speculation="auto" (the default) decides each step's draft length from the measured cost
    model: an untrained drafter's drafts soon stop (plain steps, a probe now and then); the output
    is unchanged either way."""
    from llama_dflash._native import ffi, lib

    monkeypatch.setenv("LLAMA_DFLASH_CACHE", str(tmp_path))
    a = artifacts["llama"]
    base = llama_cpp.Llama(a["target"], n_ctx=256, verbose=False)
    auto = llama_dflash.Llama(a["target"], n_ctx=256, verbose=False, draft_model_path=a["drafter"], draft_n_max=7)
    assert auto.speculation == "auto"
    # steps timed on a modelled clock (the default model's verify curve, drafts at a quarter of a row), so
    # that what the policy decides does not depend on this machine's speed or load
    costs = ffi.new("struct dflash_costs *", {"n_rows": 8, "t_verify": [1e-3 * x for x in (1, 1.35, 1.6, 1.39, 1.8,
                                                                                            2.25, 2.66, 2.34)],
                                              "n_draft": 7, "t_draft": [0.25e-3] * 7})
    lib.dflash_engine_set_clock(auto._core._engine, costs)
    lib.dflash_engine_set_costs(auto._core._engine, costs)
    for p in PROMPTS[:3]:
        want = base.create_completion(p, max_tokens=48, temperature=0.0)["choices"][0]["text"]
        assert auto.create_completion(p, max_tokens=48, temperature=0.0)["choices"][0]["text"] == want
        st = auto.last_speculative_stats
        assert st.adaptive and st.fallback_reason == "" and sum(st.lengths) == st.steps
    # by the third completion the drafts have been priced: every step plain but the probes (and the last,
    # one token short of the limit, with nothing to draft)
    assert st.plain_steps >= st.steps - st.probes - 1 and st.plain_steps >= 0.9 * st.steps, st
    assert (tmp_path / "costs.json").is_file() is False  # written at close
    auto.close()
    assert (tmp_path / "costs.json").is_file()
    base.close()


TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather forecast",
    "parameters": {"type": "object", "required": ["city", "days", "unit"], "properties": {
        "city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
        "days": {"type": "integer"}, "unit": {"type": "string", "enum": ["C", "F"]}}}}}]
SCHEMA = {"type": "object", "required": ["name", "n"],
          "properties": {"name": {"type": "string", "maxLength": 8}, "n": {"type": "integer"}}}


def _no_ids(x):
    """A chat result without its random ids (completion id, tool-call ids derived from it)."""
    if isinstance(x, dict):
        return {k: _no_ids(v) for k, v in x.items() if k not in ("id", "created")}
    if isinstance(x, list):
        return [_no_ids(v) for v in x]
    return x


def _chat(llm, stream, **kw):
    out = llm.create_chat_completion([{"role": "user", "content": "Weather in Paris for 3 days?"}],
                                     max_tokens=48, stream=stream, **kw)
    return [_no_ids(c) for c in out] if stream else _no_ids(out)


@pytest.mark.parametrize("aware", [True, False])
def test_tools_and_json_schema_equal_plain(pair, aware):
    """Forced and auto tool calls, json_object with a schema and OpenAI's json_schema form: the
    same messages / chunks as llama_cpp.Llama, arguments that parse and satisfy the schema."""
    base, spec = pair
    spec.grammar_aware_drafting = aware
    forced = {"type": "function", "function": {"name": "get_weather"}}
    openai_form = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA, "strict": True}}
    try:
        for stream in (False, True):
            for kw in (dict(temperature=0.0), dict(temperature=0.8, seed=3)):
                want = _chat(base, stream, tools=TOOLS, tool_choice=forced, **kw)
                assert _chat(spec, stream, tools=TOOLS, tool_choice=forced, **kw) == want
                st = spec.last_speculative_stats
                assert st.fallback_reason == ""
                assert (st.grammar_cut + st.grammar_skipped > 0) == aware  # this random drafter: JSON forbids most
                assert _chat(spec, stream, tools=TOOLS, tool_choice="auto", **kw) == \
                    _chat(base, stream, tools=TOOLS, tool_choice="auto", **kw)
                want = _chat(base, stream, response_format={"type": "json_object", "schema": SCHEMA}, **kw)
                assert _chat(spec, stream, response_format={"type": "json_object", "schema": SCHEMA}, **kw) == want
                assert _chat(spec, stream, response_format=openai_form, **kw) == want
        msg = _chat(spec, False, tools=TOOLS, tool_choice=forced, temperature=0.0)["choices"][0]["message"]
        args = json.loads(msg["tool_calls"][0]["function"]["arguments"])
        assert msg["tool_calls"][0]["function"]["name"] == "get_weather"
        assert args["city"] in ("Paris", "Oslo", "Lima") and args["unit"] in ("C", "F") and type(args["days"]) is int
        obj = json.loads(_chat(spec, False, response_format=openai_form, temperature=0.0)["choices"][0]["message"]
                         ["content"])
        assert set(obj) == {"name", "n"} and isinstance(obj["name"], str) and type(obj["n"]) is int
    finally:
        spec.grammar_aware_drafting = True
    with pytest.raises(ValueError, match="json_schema"):
        spec.create_chat_completion([{"role": "user", "content": "x"}], response_format={"type": "json_schema"})


def test_prompt_cache_hit_keeps_speculating(artifacts):
    """With a LlamaRAMCache, a hit restores the saved state and the request still speculates;
    outputs equal llama_cpp.Llama's with the same cache."""
    a = artifacts["llama"]
    base = llama_cpp.Llama(a["target"], n_ctx=256, verbose=False)
    spec = llama_dflash.Llama(a["target"], n_ctx=256, verbose=False, draft_model_path=a["drafter"], speculation="on")
    for llm in (base, spec):
        llm.set_cache(llama_cpp.LlamaRAMCache(capacity_bytes=1 << 30))
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[0] + " return", PROMPTS[1]]
    for p in prompts:
        want = base.create_completion(p, max_tokens=12, temperature=0.0)
        got = spec.create_completion(p, max_tokens=12, temperature=0.0)
        assert got["choices"][0]["text"] == want["choices"][0]["text"], p
        st = spec.last_speculative_stats
        assert st.fallback_reason == "" and st.drafted > 0
    assert len(spec.cache.cache_state) == len(base.cache.cache_state) >= 2
    spec.close()
    base.close()


def test_save_state_and_load_state_round_trip_keeps_speculating(pair):
    """save_state after a completion, another completion, load_state: the context holds what it held
    (its tokens), and the next completions -- the other prompt again (whose KV the loaded state replaced:
    nothing of it may be reused) and one that continues the saved text -- speculate and equal
    llama_cpp.Llama's doing the same."""
    base, spec = pair
    # (as many tokens each: the loaded KV is as long as what the engine left there, so only being told of
    # the load keeps the engine from reusing it as the other prompt's)
    saved_prompt, other = "1, 2, 3, 4,", "5, 6, 7, 8,"
    assert len(spec.tokenize(saved_prompt.encode())) == len(spec.tokenize(other.encode()))
    texts: dict[str, list[str]] = {}
    for llm in (base, spec):
        got = [llm.create_completion(saved_prompt, max_tokens=16, temperature=0.0)["choices"][0]["text"]]
        state = llm.save_state()
        saved = llm.input_ids[:llm.n_tokens].tolist()
        got.append(llm.create_completion(other, max_tokens=16, temperature=0.0)["choices"][0]["text"])
        llm.load_state(state)
        assert llm.input_ids[:llm.n_tokens].tolist() == saved
        for p in (other, saved_prompt + got[0]):
            got.append(llm.create_completion(p, max_tokens=16, temperature=0.0)["choices"][0]["text"])
            if llm is spec:
                st = spec.last_speculative_stats
                assert st.fallback_reason == "" and st.drafted > 0, st
        texts["spec" if llm is spec else "base"] = got
    assert texts["spec"] == texts["base"]
    assert texts["spec"][2] == texts["spec"][1]  # the other prompt: its completion again


def test_eval_then_generate_keeps_speculating(pair):
    """The common pattern -- eval() a prefix, then generate from it -- speculates: the loop prefills
    the evaluated tokens itself (their features were not captured) and the output is the base's."""
    base, spec = pair
    toks = spec.tokenize(PROMPTS[2].encode())
    for llm in (base, spec):
        llm.reset()
        llm._ctx.kv_cache_clear()
        llm.eval(toks)
    want = base.create_completion(base.input_ids[:base.n_tokens].tolist(), max_tokens=10, temperature=0.0)
    got = spec.create_completion(spec.input_ids[:spec.n_tokens].tolist(), max_tokens=10, temperature=0.0)
    assert got["choices"][0]["text"] == want["choices"][0]["text"]
    st = spec.last_speculative_stats
    assert st.fallback_reason == "" and st.drafted > 0


def test_context_filled_outside_the_loop_falls_back(pair):
    """A chat handler that writes the context itself (multimodal: mtmd evaluates image / audio
    chunks straight into it and moves n_tokens) is served by plain decoding from that context,
    reason recorded; the next request speculates again."""
    base, spec = pair
    toks = spec.tokenize(PROMPTS[2].encode())
    for llm in (base, spec):
        llm.reset()
        llm._ctx.kv_cache_clear()
        llm.eval(toks[:4])  # a text chunk, then a chunk written without our eval() (an image's)
        llama_cpp.Llama.eval(llm, toks[4:])
    want = base.create_completion(base.input_ids[:base.n_tokens].tolist(), max_tokens=10, temperature=0.0)
    got = spec.create_completion(spec.input_ids[:spec.n_tokens].tolist(), max_tokens=10, temperature=0.0)
    assert got["choices"][0]["text"] == want["choices"][0]["text"]
    assert "multimodal" in spec.last_speculative_stats.fallback_reason
    got = spec.create_completion(PROMPTS[3], max_tokens=10, temperature=0.0)
    assert got["choices"][0]["text"] == base.create_completion(PROMPTS[3], max_tokens=10, temperature=0.0)[
        "choices"][0]["text"]
    assert spec.last_speculative_stats.fallback_reason == "" and spec.last_speculative_stats.drafted > 0


def test_partially_consumed_generate_leaves_the_base_class_state(pair):
    """Stopping inside a step whose tokens came from accepted drafts: n_tokens and input_ids are
    what the base class leaves (the last token handed out is not evaluated yet)."""
    from llama_dflash.verify.oracle import ReplayDraftSource

    base, spec = pair
    toks = spec.tokenize(PROMPTS[0].encode())
    ref = base.create_completion(toks, max_tokens=16, temperature=0.0)  # the drafts a replay source proposes
    cont = base.tokenize(ref["choices"][0]["text"].encode(), add_bos=False)
    spec.draft_source = ReplayDraftSource(toks + cont, spec.n_vocab())
    try:
        for k in (1, 2, 5, 9):
            got = {}
            for name, llm in (("base", base), ("spec", spec)):
                llm.reset()
                out = []
                for t in llm.generate(toks, temp=0.0):
                    out.append(t)
                    if len(out) == k:
                        break
                got[name] = (out, llm.n_tokens, llm.input_ids[:llm.n_tokens].tolist())
            assert got["spec"] == got["base"], k
            assert k == 1 or spec.last_speculative_stats.accepted > 0, k
    finally:
        spec.draft_source = None


def test_empty_stop_string_as_the_base_class(pair):
    base, spec = pair
    for stop in ([""], ["", "zzz"]):
        want = base.create_completion(PROMPTS[0], max_tokens=8, temperature=0.0, stop=stop)["choices"][0]
        got = spec.create_completion(PROMPTS[0], max_tokens=8, temperature=0.0, stop=stop)["choices"][0]
        assert (got["text"], got["finish_reason"]) == (want["text"], want["finish_reason"]) == ("", "stop")


def test_pickle_keeps_the_drafter(pair):
    import pickle

    _, spec = pair
    twin = pickle.loads(pickle.dumps(spec))
    try:
        assert twin.draft_model_path == spec.draft_model_path and twin._core is not None
        assert (twin.draft_n_max, twin.speculation, twin.verify) == (spec.draft_n_max, spec.speculation, spec.verify)
        a = twin.create_completion(PROMPTS[1], max_tokens=12, temperature=0.0)["choices"][0]["text"]
        assert twin.last_speculative_stats.drafted > 0
        assert a == spec.create_completion(PROMPTS[1], max_tokens=12, temperature=0.0)["choices"][0]["text"]
    finally:
        twin.close()


def test_recurrent_or_hybrid_target_falls_back(artifacts, monkeypatch):
    """A target whose memory cannot drop rejected positions (recurrent / hybrid) decodes plainly,
    with the reason recorded (llama.cpp reports the kind; this tiny target is made to say so)."""
    a = artifacts["llama"]
    monkeypatch.setattr(llama_cpp.llama_cpp, "llama_model_is_hybrid", lambda model: True)
    llm = llama_dflash.Llama(a["target"], n_ctx=128, verbose=False, draft_model_path=a["drafter"], speculation="on")
    monkeypatch.undo()
    _decodes_plainly(llm, a["target"], "cannot roll back")


def test_draft_n_min_drops_short_drafts(artifacts):
    """draft_n_min: a draft shorter than it (here: a source proposing 0-4 tokens) is not
    verified; longer ones are; output unchanged."""

    a = artifacts["llama"]
    base = llama_cpp.Llama(a["target"], n_ctx=256, verbose=False)
    want = base.create_completion(PROMPTS[0], max_tokens=40, temperature=0.0)
    ref = base.tokenize(PROMPTS[0].encode()) + base.tokenize(want["choices"][0]["text"].encode(), add_bos=False)
    spec = llama_dflash.Llama(a["target"], n_ctx=256, verbose=False, draft_model_path=a["drafter"], draft_n_min=3,
                              speculation="on")
    calls = []

    def source(hist, n):
        k = min(n, len(calls) % 5)
        calls.append(k)
        return [ref[len(hist) + i] if len(hist) + i < len(ref) else 0 for i in range(k)]

    spec.draft_source = source
    got = spec.create_completion(PROMPTS[0], max_tokens=40, temperature=0.0)
    spec.draft_source = None
    assert got["choices"][0]["text"] == want["choices"][0]["text"]
    st = spec.last_speculative_stats
    assert {1, 2, 3, 4} <= set(calls) and st.drafted == sum(k for k in calls if k >= 3) > 0
    assert st.per_position_drafted[0] == st.per_position_drafted[2]  # never a 1- or 2-token draft
    with pytest.raises(ValueError, match="draft_n_min"):
        llama_dflash.Llama(a["target"], n_ctx=64, verbose=False, draft_n_min=-1)
    spec.close()
    base.close()


@pytest.mark.parametrize("kw", [
    dict(temperature=0.9, top_k=5, seed=7),
    dict(temperature=0.8, top_p=0.7, min_p=0.0, seed=8),
    dict(temperature=1.1, min_p=0.2, seed=9),
    dict(temperature=0.9, typical_p=0.8, seed=10),
    dict(temperature=0.7, repeat_penalty=1.3, frequency_penalty=0.3, presence_penalty=0.2, seed=11),
    dict(temperature=0.0, repeat_penalty=1.2),
])
def test_sampler_settings_equal_plain(pair, kw):
    """Each sampler setting, seeded: the same completion and stream chunks as llama_cpp.Llama,
    served speculatively; and the generate() entry point yields the same tokens."""
    base, spec = pair
    for p in PROMPTS[:2]:
        want = base.create_completion(p, max_tokens=20, **kw)["choices"][0]["text"]
        assert spec.create_completion(p, max_tokens=20, **kw)["choices"][0]["text"] == want, p
        st = spec.last_speculative_stats
        assert st.fallback_reason == "" and st.drafted > 0
        # streamed: the same chunks (which drop bytes that never form a UTF-8 character, as plain's do)
        chunks = [[c["choices"][0]["text"] for c in llm.create_completion(p, max_tokens=20, stream=True, **kw)]
                  for llm in (base, spec)]
        assert chunks[0] == chunks[1]
    toks = base.tokenize(PROMPTS[2].encode())
    gen = {k.replace("temperature", "temp"): v for k, v in kw.items() if k != "seed"}
    runs = []
    for llm in (base, spec):
        llm.set_seed(kw.get("seed", 0))
        llm.reset()
        out = []
        for t in llm.generate(toks, **gen):
            out.append(t)
            if len(out) == 16:
                break
        runs.append(out)
    assert runs[0] == runs[1]


def test_vocab_only_and_mismatched_drafters(artifacts):
    """vocab_only=True with a drafter tokenizes as llama_cpp.Llama does (no drafter is loaded); a
    file that is no drafter is a clear DFlashError from the constructor, and a missing one a
    FileNotFoundError before the model loads."""
    from llama_dflash import DFlashError

    a = artifacts["llama"]
    llm = llama_dflash.Llama(a["target"], vocab_only=True, draft_model_path=a["drafter"], verbose=False)
    ref = llama_cpp.Llama(a["target"], vocab_only=True, verbose=False)
    try:
        assert llm.tokenize(b"Hello world") == ref.tokenize(b"Hello world")
        assert llm._core is None and "vocab-only" in llm._unavailable
    finally:
        llm.close()
        ref.close()
    with pytest.raises(DFlashError, match="not a DFlash drafter"):
        llama_dflash.Llama(a["target"], n_ctx=128, verbose=False, draft_model_path=a["target"])
    with pytest.raises(FileNotFoundError, match="drafter file not found"):
        llama_dflash.Llama(a["target"], n_ctx=128, verbose=False, draft_model_path=a["target"] + ".missing")


def test_calls_after_close_are_clear_errors(artifacts):
    """llama_cpp.Llama hands freed pointers to libllama after close(); the drop-in raises."""
    from llama_dflash import DFlashError

    a = artifacts["llama"]
    llm = llama_dflash.Llama(a["target"], n_ctx=128, verbose=False, draft_model_path=a["drafter"], speculation="on")
    llm.close()
    llm.close()  # twice is fine
    calls = [lambda: llm("Hello", max_tokens=4), lambda: llm.tokenize(b"Hello"), lambda: llm.detokenize([1]),
             lambda: llm.create_chat_completion([{"role": "user", "content": "hi"}]), lambda: llm.eval([1, 2]),
             lambda: next(llm.generate([1, 2])), llm.n_ctx, lambda: llm.embed("hi"), llm.save_state, llm.n_vocab,
             llm.token_eos]
    for call in calls:
        with pytest.raises(DFlashError, match="this Llama is closed"):
            call()


def test_two_threads_on_one_model_are_served_one_after_the_other(pair):
    """libllama's context is not thread-safe (the base class crashes here): ours serializes."""
    import threading

    base, spec = pair
    want = [base.create_completion(p, max_tokens=24, temperature=0.0)["choices"][0]["text"] for p in PROMPTS[:4]]
    got: dict[int, str] = {}
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            for _ in range(2):
                got[i] = spec.create_completion(PROMPTS[i], max_tokens=24, temperature=0.0)["choices"][0]["text"]
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors and [got[i] for i in range(4)] == want


def test_unlimited_max_tokens_run_to_llama_cpps_context(artifacts):
    """max_tokens None or <= 0 generate up to llama.cpp's context (n_ctx raised to its floor:
    256 positions for n_ctx 96), as llama-cpp-python's completions do, not to the n_ctx asked for."""
    a = artifacts["llama"]
    base = llama_cpp.Llama(a["target"], n_ctx=96, verbose=False)
    spec = llama_dflash.Llama(a["target"], n_ctx=96, verbose=False, draft_model_path=a["drafter"], speculation="on",
                              draft_n_max=3)
    try:
        assert spec.n_ctx() == base.n_ctx() > 96
        prompt = base.tokenize(" ".join(PROMPTS * 8).encode())[:90]  # (fewer tokens to generate)
        want = base.create_completion(prompt, max_tokens=None, temperature=0.0)
        for max_tokens in (None, 0, -1):
            got = spec.create_completion(prompt, max_tokens=max_tokens, temperature=0.0)
            assert got["usage"] == want["usage"] and got["usage"]["total_tokens"] > 96, max_tokens
            assert got["choices"][0] == want["choices"][0], max_tokens
            assert spec.last_speculative_stats.drafted > 0
    finally:
        spec.close()
        base.close()
