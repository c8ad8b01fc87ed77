"""The OpenAI-compatible server over real HTTP on localhost (uvicorn in a thread, httpx client)."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

httpx = pytest.importorskip("httpx", reason="server tests need the server extras (scripts/setup.sh --test)")
uvicorn = pytest.importorskip("uvicorn")

PROMPTS = [f"The number {i} is" for i in range(50)]
REPEAT = 1.1  # the server's default repeat_penalty (llama_cpp.Llama's is 1.0)


def _want(server, p: str) -> dict:
    return server["plain"].create_completion(p, max_tokens=8, temperature=0.0, repeat_penalty=REPEAT)


@contextlib.contextmanager
def _serving(model_settings, **server_kw):
    """An app on a free localhost port, uvicorn in a thread; yields its base URL."""
    from llama_dflash.api.server import DFlashServerSettings, create_app

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    app = create_app(server_settings=DFlashServerSettings(host="127.0.0.1", port=port, **server_kw),
                     model_settings=model_settings)
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    th = threading.Thread(target=srv.run, daemon=True)
    th.start()
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(200):
            try:
                httpx.get(base + "/v1/models", timeout=1.0)
                break
            except httpx.TransportError:
                time.sleep(0.05)
        yield base
    finally:
        srv.should_exit = True
        th.join(timeout=30)


@pytest.fixture(scope="module")
def server(artifacts):
    import llama_cpp

    from llama_dflash.api.server import DFlashModelSettings

    a = artifacts["llama"]
    ms = DFlashModelSettings(model=a["target"], model_alias="tiny", draft_model_path=a["drafter"], n_ctx=512,
                             n_threads=2, verbose=False, speculation="on")
    plain = llama_cpp.Llama(a["target"], n_ctx=512, n_threads=2, verbose=False)
    with _serving([ms]) as base:
        yield {"base": base, "plain": plain}
    plain.close()


def _complete(base: str, prompt: str, **kw) -> dict:
    r = httpx.post(base + "/v1/completions", json={"prompt": prompt, "max_tokens": 8, "temperature": 0.0, **kw},
                   timeout=600)
    assert r.status_code == 200, r.text
    return r.json()


def _stream(base: str, path: str, body: dict, hang_up_after: int | None = None) -> tuple[str, int]:
    """(concatenated text, number of chunks) of a streaming request; hang up after n chunks."""
    text, n = [], 0
    with httpx.stream("POST", base + path, json={**body, "stream": True}, timeout=600) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            c = json.loads(line[6:])["choices"][0]
            text.append(c.get("text") or (c.get("delta") or {}).get("content") or "")
            n += 1
            if hang_up_after is not None and n >= hang_up_after:
                break
    return "".join(text), n


@pytest.mark.parametrize("how", [["-m", "llama_dflash.api.server"], ["-m", "llama_dflash.api.cli", "serve"]])
def test_server_errors_are_one_line(tmp_path, how):
    import subprocess
    import sys

    for args in (["--model", str(tmp_path / "missing.gguf")], [], ["--n_ctx", "-5", "--model", "x"],
                 ["--no-such-flag"]):
        r = subprocess.run([sys.executable, *how, *args], capture_output=True, text=True, timeout=600)
        assert r.returncode == 2 and r.stderr.startswith("llama-dflash: error:"), (args, r.stderr)
        assert r.stderr.count("\n") == 1, r.stderr


def test_serve_command_starts_as_documented(artifacts, tmp_path):
    """`llama-dflash serve --model T.gguf --draft_model_path D.gguf` (the README's command) serves."""
    import subprocess
    import sys

    a = artifacts["llama"]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(tmp_path / "log", "wb")  # noqa: SIM115 - closed after the server exits
    p = subprocess.Popen([sys.executable, "-m", "llama_dflash.api.cli", "serve", "--model", a["target"],
                          "--draft_model_path", a["drafter"], "--n_ctx", "256", "--port", str(port),
                          "--speculation", "on", "--host", "127.0.0.1"], stdout=subprocess.DEVNULL, stderr=log)
    try:
        base = f"http://127.0.0.1:{port}"
        for _ in range(1200):
            assert p.poll() is None, (tmp_path / "log").read_text()[-2000:]
            try:
                r = httpx.get(base + "/v1/models", timeout=1.0)
                break
            except httpx.TransportError:
                time.sleep(0.05)
        assert r.status_code == 200
        got = _complete(base, PROMPTS[0])
        assert got["choices"][0]["text"]
        stats = httpx.get(base + "/extras/speculative_stats").json()
        assert stats["total"]["drafted"] > 0
    finally:
        p.terminate()
        p.wait(timeout=60)
        log.close()


BAD_BODIES = [
    ("/v1/completions", b"{bad"), ("/v1/completions", b""), ("/v1/completions", b"\xff\xfe{}"),
    ("/v1/completions", b"[1, 2]"), ("/v1/completions", b"null"), ("/v1/chat/completions", b"{}"),
    ("/v1/embeddings", b"{bad"), ("/extras/tokenize", b"{}"), ("/extras/detokenize", b'{"tokens": [-1]}'),
    ("/extras/detokenize", b'{"tokens": [99999999]}'),
]
_CHAT = {"messages": [{"role": "user", "content": "hi"}]}
BAD_REQUESTS = [
    ("/v1/completions", {"prompt": 5}, "prompt"), ("/v1/completions", {"prompt": ["a", "b"]}, "prompt"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "nobody", "content": "x"}]}, None),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2**70}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": -1}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "temperature": -5}, "temperature"),
    ("/v1/completions", {"prompt": "hi", "top_p": 1.5}, "top_p"),
    ("/v1/completions", {"prompt": "hi", "min_p": -0.1}, "min_p"),
    ("/v1/completions", {"prompt": "hi", "top_k": -5}, "top_k"),
    ("/v1/completions", {"prompt": "hi", "repeat_penalty": 0}, "repeat_penalty"),
    ("/v1/completions", {"prompt": "hi", "presence_penalty": 9}, "presence_penalty"),
    ("/v1/completions", {"prompt": "hi", "seed": 2**64}, "seed"),
    ("/v1/completions", {"prompt": "hi", "mirostat_mode": 7}, "mirostat_mode"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"99999999": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"abc": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "grammar": "root ::= ("}, "grammar"),
    ("/v1/completions", {"prompt": "hi", "grammar": "notroot ::= \"a\""}, "grammar"),
    ("/v1/completions", {"prompt": "hi", "n": 3}, "n"), ("/v1/completions", {"prompt": "hi", "best_of": 2}, "best_of"),
    ("/v1/chat/completions", {**_CHAT, "n": 2}, "n"),
    ("/v1/chat/completions", {**_CHAT, "response_format": {"type": "json_object", "schema": {"type": 5}}},
     "response_format"),
    ("/v1/chat/completions", {**_CHAT, "response_format": {"type": "json_schema", "json_schema": {
        "schema": {"type": "object", "properties": {"a": {"type": "strin"}}}}}}, "response_format"),
    ("/v1/completions", {"prompt": "hi " * 600}, None),  # longer than the context
]


@pytest.mark.parametrize("path,body", BAD_BODIES)
def test_malformed_bodies_get_400_with_an_openai_error(server, path, body):
    r = httpx.post(server["base"] + path, content=body, headers={"content-type": "application/json"}, timeout=600)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"]
    assert "/" not in err["message"] and ".py" not in err["message"]  # no internal paths


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_deeply_nested_bodies_get_400(server, path):
    """50,000 levels of nesting (past the json module's recursion limit): a 400 naming the cause,
    not the 500 of an uncaught RecursionError."""
    deep = b"[" * 50_000 + b"]" * 50_000
    for body in (deep, b'{"a":' * 50_000 + b"1" + b"}" * 50_000, b'{"prompt": "hi", "x": ' + deep + b"}"):
        r = httpx.post(server["base"] + path, content=body, headers={"content-type": "application/json"},
                       timeout=600)
        assert r.status_code == 400, r.text[:300]
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and "nested too deeply" in err["message"], err


def _outcomes(base: str) -> dict[str, int]:
    lines = httpx.get(base + "/metrics", timeout=60).text.splitlines()
    return {ln.split('"')[1]: int(ln.split()[-1]) for ln in lines
            if ln.startswith("llama_dflash_http_requests_total{")}


def test_client_hanging_up_while_sending_the_body_leaves_no_traceback(server):
    """A client that disconnects half-way through its body is counted as cancelled, quietly: no
    ClientDisconnect traceback in the server's log; the next request is answered."""
    import logging

    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    log = logging.getLogger("uvicorn.error")
    log.addHandler(handler)
    base = server["base"]
    host, port = base.removeprefix("http://").split(":")
    before = _outcomes(base).get("cancelled", 0)
    try:
        for path in ("/v1/completions", "/v1/chat/completions"):
            with socket.create_connection((host, int(port))) as s:
                s.sendall(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                          "Content-Length: 1000\r\n\r\n".encode() + b'{"prompt": "hi')
                time.sleep(0.1)  # the server has the first part of the body when the client hangs up
        for _ in range(100):
            if _outcomes(base).get("cancelled", 0) >= before + 2:
                break
            time.sleep(0.05)
    finally:
        log.removeHandler(handler)
    assert [r.getMessage() for r in records if r.exc_info] == []
    assert _outcomes(base).get("cancelled", 0) == before + 2
    _complete(base, "Hello")


@pytest.mark.parametrize("path,body,param", BAD_REQUESTS)
def test_invalid_requests_get_400_before_the_model(server, path, body, param):
    for stream in (False, True):
        r = httpx.post(server["base"] + path, json={**body, "stream": stream}, timeout=600)
        assert r.status_code == 400, (body, r.text)
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and "/" not in err["message"], err
        if param is not None:
            assert err["param"].split(".")[0] == param, err
    assert httpx.get(server["base"] + "/v1/models", timeout=60).status_code == 200


def test_max_tokens_zero_ends_at_the_context_size(server):
    r = httpx.post(server["base"] + "/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 0,
                                                              "temperature": 0.0}, timeout=600)
    assert r.status_code == 200, r.text
    u = r.json()["usage"]
    assert u["total_tokens"] <= 512


def test_models_listed(server):
    r = httpx.get(server["base"] + "/v1/models").json()
    assert [m["id"] for m in r["data"]] == ["tiny"]


def test_completion_equals_plain_llama_cpp(server):
    for p in PROMPTS[:3]:
        got = _complete(server["base"], p)
        want = _want(server, p)
        assert got["choices"][0]["text"] == want["choices"][0]["text"]
        assert got["usage"] == want["usage"]
        assert got["choices"][0]["finish_reason"] == want["choices"][0]["finish_reason"]
    stats = httpx.get(server["base"] + "/extras/speculative_stats").json()
    assert stats["model"] == "tiny" and stats["total"]["drafted"] > 0 and stats["last"]["drafted"] > 0
    m = httpx.get(server["base"] + "/metrics").text
    vals = dict(line.split() for line in m.splitlines() if not line.startswith("#"))
    proposed, accepted = (float(vals[f"llama_dflash_tokens_{k}_total"]) for k in ("proposed", "accepted"))
    assert proposed == stats["total"]["drafted"] > 0 and accepted == stats["total"]["accepted"]
    assert float(vals["llama_dflash_tokens_rejected_total"]) == proposed - accepted
    assert float(vals["llama_dflash_tau"]) >= 1.0 and "# TYPE llama_dflash_tau gauge" in m


def test_streaming_chat_matches_non_streaming(server):
    body = {"messages": [{"role": "user", "content": "Say something."}], "max_tokens": 10, "temperature": 0.0}
    full = httpx.post(server["base"] + "/v1/chat/completions", json=body, timeout=600).json()
    text = []
    with httpx.stream("POST", server["base"] + "/v1/chat/completions", json={**body, "stream": True},
                      timeout=600) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text.append(json.loads(line[6:])["choices"][0]["delta"].get("content") or "")
    assert "".join(text) == full["choices"][0]["message"]["content"]


def test_fifty_concurrent_requests_each_get_their_own_answer(server):
    want = {p: _want(server, p)["choices"][0]["text"] for p in PROMPTS}
    with ThreadPoolExecutor(50) as ex:
        got = list(ex.map(lambda p: (p, _complete(server["base"], p)), PROMPTS))
    for p, r in got:
        assert r["choices"][0]["text"] == want[p], p


def test_hundred_concurrent_streams_each_equal_alone(server):
    """100 streaming requests at once (distinct prompts, T = 0): each answer equals the same
    request sent alone, none is cut or emptied, and /v1/models answers while they run."""
    prompts = [f"Item {i}: the colour of the" for i in range(100)]
    body = {"max_tokens": 8, "temperature": 0.0}
    joint0 = _joint(server)
    with ThreadPoolExecutor(100) as ex:
        futs = [ex.submit(_stream, server["base"], "/v1/completions", {"prompt": p, **body}) for p in prompts]
        time.sleep(0.5)
        t0 = time.perf_counter()
        assert httpx.get(server["base"] + "/v1/models", timeout=60).status_code == 200
        models_s = time.perf_counter() - t0
        got = [f.result() for f in futs]
    steps, seqs = (b - a for a, b in zip(joint0, _joint(server), strict=True))
    alone = [_stream(server["base"], "/v1/completions", {"prompt": p, **body}) for p in prompts]
    assert got == alone
    assert all(n >= 1 for _, n in got)
    assert models_s < 30  # a hang guard, not a speed test: it does not wait for the queue
    m = httpx.get(server["base"] + "/metrics").text
    assert "llama_dflash_queue_waiting 0" in m and 'llama_dflash_http_requests_total{outcome="server_error"} 0' in m
    # served together, not only queued: the decodes verified several requests' rows at once
    assert seqs > 2 * steps > 0


def _joint(server) -> tuple[float, float]:
    """/metrics' joint decodes and the sequences they verified."""
    m = httpx.get(server["base"] + "/metrics").text
    vals = dict(line.split() for line in m.splitlines() if not line.startswith("#") and "{" not in line)
    return float(vals["llama_dflash_joint_steps_total"]), float(vals["llama_dflash_joint_sequences_total"])


def test_fifty_disconnects_mid_stream_are_survived(server):
    """50 clients hang up after their first chunk while 20 others run to the end; the server
    stays correct and its memory bounded."""
    import resource

    def rss_mb() -> float:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize() / 2**20

    long = {"max_tokens": 200, "temperature": 0.0}
    short = {"max_tokens": 8, "temperature": 0.0}
    before = rss_mb()
    for _ in range(2):
        with ThreadPoolExecutor(70) as ex:
            quits = [ex.submit(_stream, server["base"], "/v1/completions", {"prompt": p, **long}, 1)
                     for p in PROMPTS]
            full = [ex.submit(_stream, server["base"], "/v1/chat/completions",
                              {"messages": [{"role": "user", "content": p}], **short}) for p in PROMPTS[:20]]
            assert all(f.result()[1] == 1 for f in quits)
            got = [f.result()[0] for f in full]
    for p, t in zip(PROMPTS[:20], got, strict=True):
        r = httpx.post(server["base"] + "/v1/chat/completions",
                       json={"messages": [{"role": "user", "content": p}], **short}, timeout=600).json()
        assert r["choices"][0]["message"]["content"] == t
    assert rss_mb() - before < 300
    deadline = time.time() + 120
    while time.time() < deadline and "requests_running 0" not in httpx.get(server["base"] + "/metrics").text:
        time.sleep(0.1)
    m = httpx.get(server["base"] + "/metrics").text
    assert "llama_dflash_queue_waiting 0" in m and "llama_dflash_requests_running 0" in m


def test_full_queue_is_503_and_timeout_ends_a_request(artifacts):
    """Past max_queue a request gets 503 (not a dropped connection); a generation past
    request_timeout ends as at its length limit."""
    from llama_dflash.api.server import DFlashModelSettings

    a = artifacts["llama"]
    ms = DFlashModelSettings(model=a["target"], draft_model_path=a["drafter"], n_ctx=4096, n_threads=2, verbose=False,
                             speculation="on")
    with _serving([ms], max_queue=2, request_timeout=0.5) as base:
        body = {"prompt": PROMPTS[0], "max_tokens": 0, "temperature": 0.0, "logit_bias": {"0": -1e9, "2": -1e9}}

        def post():
            return httpx.post(base + "/v1/completions", json=body, timeout=600)

        with ThreadPoolExecutor(8) as ex:
            rs = list(ex.map(lambda _: post(), range(8)))
        codes = sorted(r.status_code for r in rs)
        assert codes.count(503) >= 1 and codes.count(200) >= 3, codes
        for r in rs:
            if r.status_code == 503:
                assert r.json()["error"]["code"] == "server_busy"
            else:
                c = r.json()["choices"][0]
                assert c["finish_reason"] == "length" and r.json()["usage"]["completion_tokens"] < 4000
        # every request served timed out (none could reach the context's end in 0.5 s), every other was refused
        o = _outcomes(base)
        assert o["rejected_busy"] == codes.count(503) and o["timed_out"] == codes.count(200), (o, codes)


def test_client_disconnect_mid_stream_then_new_request(server):
    with httpx.stream("POST", server["base"] + "/v1/completions",
                      json={"prompt": PROMPTS[0], "max_tokens": 200, "stream": True, "temperature": 0.0},
                      timeout=600) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                break  # hang up after the first chunk
    got = _complete(server["base"], PROMPTS[1])
    want = _want(server, PROMPTS[1])
    assert got["choices"][0]["text"] == want["choices"][0]["text"]


def test_tools_json_schema_and_logprobs_over_http(server):
    """A forced tool call and OpenAI's json_schema response_format (which llama-cpp-python's own
    server rejects) answer like plain llama_cpp.Llama; chat logprobs work with logits_all off."""
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "required": ["city", "unit"],
        "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}, "unit": {"enum": ["C", "F"]}}}}}]
    schema = {"type": "object", "required": ["ok"], "properties": {"ok": {"type": "boolean"}}}
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    plain = server["plain"]
    common = dict(max_tokens=40, temperature=0.0, repeat_penalty=REPEAT)

    def post(body):
        r = httpx.post(server["base"] + "/v1/chat/completions", json={"messages": msgs, **common, **body}, timeout=600)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]

    forced = {"type": "function", "function": {"name": "get_weather"}}
    got = post({"tools": tools, "tool_choice": forced})
    want = plain.create_chat_completion(msgs, tools=tools, tool_choice=forced, **common)["choices"][0]
    call = got["message"]["tool_calls"][0]["function"]
    assert call == want["message"]["tool_calls"][0]["function"] and call["name"] == "get_weather"
    args = json.loads(call["arguments"])
    assert args["city"] in ("Paris", "Oslo") and args["unit"] in ("C", "F")

    got = post({"response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": schema}}})
    want = plain.create_chat_completion(msgs, response_format={"type": "json_object", "schema": schema}, **common)
    assert got["message"] == want["choices"][0]["message"]
    assert isinstance(json.loads(got["message"]["content"])["ok"], bool)

    got = post({"logprobs": True, "top_logprobs": 2, "max_tokens": 6})
    lp = got["logprobs"]["content"]
    assert len(lp) == 6 and all(len(t["top_logprobs"]) >= 1 and t["logprob"] <= 0 for t in lp)
    r = httpx.post(server["base"] + "/v1/chat/completions",
                   json={"messages": msgs, "response_format": {"type": "json_schema"}}, timeout=600)
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format"


def test_exact_model_setting_serves_bit_identical_output():
    """exact=True in the model settings: the served drop-in is loaded in exact mode (flash
    attention on although the proxy passes its default) and its completions equal plain
    decoding under the same settings; by default it drafts adaptively, and /metrics carries the
    chosen lengths, predicted and measured step time and calibrated acceptance per position."""
    import llama_dflash
    from llama_dflash.api.models import default_target, shipped_drafter
    from llama_dflash.api.server import DFlashModelSettings

    target = str(default_target())
    ms = DFlashModelSettings(model=target, draft_model_path=str(shipped_drafter()), n_ctx=512, n_threads=2,
                             verbose=False, exact=True)
    plain = llama_dflash.Llama(target, n_ctx=512, n_threads=2, verbose=False, exact=True)  # no drafter
    try:
        with _serving([ms]) as base:
            for p in ("def fizzbuzz(n):", "The moon is"):
                # (the server's own default repeat_penalty is 1.1: given to both)
                r = httpx.post(base + "/v1/completions", json={"prompt": p, "max_tokens": 32, "temperature": 0,
                                                               "repeat_penalty": 1.1}, timeout=600).json()
                want = plain(p, max_tokens=32, temperature=0.0, repeat_penalty=1.1)["choices"][0]["text"]
                assert r["choices"][0]["text"] == want, p
            # the server's default is adaptive drafting; /metrics shows what it chose, predicted and measured
            last = httpx.get(base + "/extras/speculative_stats").json()["last"]
            assert last["adaptive"] and sum(last["lengths"]) == last["steps"]
            m = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
                 for line in httpx.get(base + "/metrics").text.splitlines() if not line.startswith("#")}
            steps = sum(v for k, v in m.items() if k.startswith("llama_dflash_draft_length_steps_total{"))
            assert steps > last["steps"] and m['llama_dflash_draft_length_steps_total{length="0"}'] >= \
                m["llama_dflash_plain_steps_total"]
            assert m['llama_dflash_step_seconds_total{kind="measured"}'] > 0
            assert m['llama_dflash_step_seconds_total{kind="predicted"}'] > 0
            drafted = m['llama_dflash_position_drafted_total{position="1"}']  # code: the drafter is used
            assert 0 < m['llama_dflash_position_accepted_total{position="1"}'] <= drafted
            assert 0 < m['llama_dflash_position_expected_accepted_total{position="1"}'] <= drafted
    finally:
        plain.close()


def _fuzz_body(rng) -> tuple[str, bytes]:
    """A random request: a valid one with one field replaced by a random value (of a random type),
    a field dropped or added, or raw bytes."""
    import json as _json

    values = [None, True, -1, 0, 3, 2**40, -2**63, 1.5, -0.5, 1e308, "", "x", "hi " * 50, [], [1, "a"], {},
              {"a": {"b": [None]}}, [[[[[]]]]], "\u0000\ud7ff", -0.0]
    if rng.random() < 0.1:
        return rng.choice(["/v1/completions", "/v1/chat/completions"]), bytes(rng.randrange(256)
                                                                              for _ in range(rng.randrange(1, 40)))
    chat = rng.random() < 0.5
    body = ({"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"})
    body.update(max_tokens=3, temperature=0.0)
    fields = ["prompt", "messages", "max_tokens", "temperature", "top_p", "top_k", "min_p", "stop", "stream", "seed",
              "logit_bias", "n", "repeat_penalty", "presence_penalty", "frequency_penalty", "logprobs",
              "top_logprobs", "response_format", "tools", "tool_choice", "grammar", "echo", "suffix", "model",
              "mirostat_mode", "typical_p", "best_of", "user"]
    for _ in range(rng.randint(1, 3)):
        f = rng.choice(fields)
        if rng.random() < 0.15:
            body.pop(f, None)
        else:
            body[f] = rng.choice(values)
    if chat and rng.random() < 0.3 and isinstance(body.get("messages"), list):
        body["messages"] = [{"role": rng.choice(["user", "system", "assistant", "tool", 5]),
                             "content": rng.choice(values)}]
    if isinstance(body.get("max_tokens"), int) and body["max_tokens"] > 16:
        body["max_tokens"] = 16  # (large valid values are tested above; keep the fuzz bounded)
    return ("/v1/chat/completions" if chat else "/v1/completions"), _json.dumps(body).encode()


def test_fuzzed_bodies_get_an_answer_never_a_500(server):
    """Seeded random requests: each one answered with 200 or a 4xx carrying an OpenAI error (no
    internal paths), never a 500 or silence; the server answers between them."""
    import random

    rng = random.Random(20261201)
    statuses: dict[int, int] = {}
    for i in range(100):
        path, body = _fuzz_body(rng)
        r = httpx.post(server["base"] + path, content=body, headers={"content-type": "application/json"},
                       timeout=600)
        statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
        assert r.status_code == 200 or 400 <= r.status_code < 500, (i, body[:300], r.status_code, r.text[:300])
        if r.status_code >= 400:
            err = r.json()["error"]
            assert err["message"] and ".py" not in err["message"], (body[:300], err)
        if i % 25 == 0:
            assert httpx.get(server["base"] + "/v1/models", timeout=60).status_code == 200
    print(f"\nHTTP fuzz: 100 bodies, statuses {dict(sorted(statuses.items()))}")
    assert statuses.get(200, 0) > 0 and sum(v for k, v in statuses.items() if k >= 400) > 0


# -- a server with an API key, a body limit and several models ------------------------------------

KEY = {"authorization": "Bearer sesame"}


@pytest.fixture(scope="module")
def guarded(artifacts):
    """Three models (a llama target with its drafter, a qwen2 one with its own, the llama target for
    embeddings), an API key and a 4 KiB body limit."""
    import llama_cpp

    from llama_dflash.api.server import DFlashModelSettings

    a, b = artifacts["llama"], artifacts["qwen2"]
    common = dict(n_ctx=256, n_threads=2, verbose=False)
    models = [DFlashModelSettings(model=a["target"], model_alias="tiny", draft_model_path=a["drafter"],
                                  speculation="on", **common),
              DFlashModelSettings(model=b["target"], model_alias="other", draft_model_path=b["drafter"],
                                  speculation="on", **common),
              DFlashModelSettings(model=a["target"], model_alias="embed", embedding=True, **common)]
    plain = {"tiny": llama_cpp.Llama(a["target"], **common), "other": llama_cpp.Llama(b["target"], **common)}
    with _serving(models, api_key="sesame", max_body_bytes=4096) as base:
        yield {"base": base, "plain": plain, "target": a["target"]}
    for m in plain.values():
        m.close()


def test_an_api_key_guards_every_route_but_health(guarded):
    base = guarded["base"]
    body = {"prompt": "Hello", "max_tokens": 2, "model": "tiny"}
    for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": "sesame"}, {"x-api-key": "sesame"}):
        for method, path in (("GET", "/v1/models"), ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
                             ("POST", "/v1/embeddings"), ("GET", "/metrics"), ("GET", "/extras/speculative_stats")):
            r = httpx.request(method, base + path, json=body if method == "POST" else None, headers=headers,
                              timeout=600)
            assert r.status_code == 401, (headers, path, r.text)
            assert r.json()["error"]["type"] == "authentication_error", r.text
    assert httpx.get(base + "/v1/models", headers=KEY, timeout=60).status_code == 200
    r = httpx.post(base + "/v1/completions", json=body, headers=KEY, timeout=600)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text
    # /health needs no key: a load balancer's probe
    r = httpx.get(base + "/health", timeout=60)
    assert r.status_code == 200 and r.json() == {"status": "ok", "queue_waiting": 0, "requests_running": 0}, r.text


def test_each_request_is_served_by_the_model_it_names(guarded):
    """Requests name their model (an alias the server lists): each answer is that model's (plain
    llama-cpp-python's on the same target), switching back and forth; an unknown name gets the first."""
    base, plain = guarded["base"], guarded["plain"]
    assert [m["id"] for m in httpx.get(base + "/v1/models", headers=KEY).json()["data"]] == ["tiny", "other", "embed"]
    want = {name: llm.create_completion("The number 7 is", max_tokens=8, temperature=0.0,
                                        repeat_penalty=REPEAT)["choices"][0]["text"] for name, llm in plain.items()}
    assert want["tiny"] != want["other"]  # (two random targets: the answers tell which model spoke)
    for name in ("tiny", "other", "tiny", "other", "no-such-model"):
        r = httpx.post(base + "/v1/completions", json={"prompt": "The number 7 is", "max_tokens": 8,
                                                       "temperature": 0.0, "model": name}, headers=KEY, timeout=600)
        assert r.status_code == 200, r.text
        served = name if name in want else "tiny"
        assert r.json()["choices"][0]["text"] == want[served], name
        stats = httpx.get(base + "/extras/speculative_stats", headers=KEY).json()
        assert stats["model"] == served and stats["last"]["drafted"] > 0, stats


def test_embeddings_over_http(guarded):
    """/v1/embeddings on a model loaded with embedding=True: what llama-cpp-python computes for the
    same input (a string, or a list: one entry per string, as llama-cpp-python batches them)."""
    import llama_cpp

    inputs = ("hello world", ["hello world", "the moon"])
    ref = llama_cpp.Llama(guarded["target"], n_ctx=256, n_threads=2, verbose=False, embedding=True)
    try:
        want = [[d["embedding"] for d in ref.create_embedding(x)["data"]] for x in inputs]
    finally:
        ref.close()
    for x, w in zip(inputs, want, strict=True):
        r = httpx.post(guarded["base"] + "/v1/embeddings", json={"input": x, "model": "embed"}, headers=KEY,
                       timeout=600)
        assert r.status_code == 200, r.text
        got = r.json()
        assert got["object"] == "list" and [d["index"] for d in got["data"]] == list(range(len(w)))
        assert got["usage"]["prompt_tokens"] > 0
        for d, e in zip(got["data"], w, strict=True):
            assert np.asarray(d["embedding"]).shape == np.asarray(e).shape  # (this target pools nothing: per token)
            assert np.allclose(d["embedding"], e, rtol=1e-5, atol=1e-5)


def test_bodies_past_max_body_bytes_get_413(guarded):
    """A body larger than max_body_bytes is refused with 413 whether it declares its length or is sent
    in chunks; the server answers the next request."""
    base = guarded["base"]
    big = json.dumps({"prompt": "x" * 5000, "max_tokens": 1}).encode()
    r = httpx.post(base + "/v1/completions", content=big, headers={**KEY, "content-type": "application/json"},
                   timeout=600)
    assert r.status_code == 413 and "max_body_bytes" in r.json()["error"]["message"], r.text

    def chunks():
        for i in range(0, len(big), 1000):
            yield big[i:i + 1000]

    r = httpx.post(base + "/v1/completions", content=chunks(), headers={**KEY, "content-type": "application/json"},
                   timeout=600)
    assert r.status_code == 413 and "max_body_bytes" in r.json()["error"]["message"], r.text
    fits = json.dumps({"prompt": "Hello", "max_tokens": 1, "model": "tiny", "user": "u" * 3500}).encode()
    assert 3500 < len(fits) < 4096
    r = httpx.post(base + "/v1/completions", content=fits, headers={**KEY, "content-type": "application/json"},
                   timeout=600)
    assert r.status_code == 200, r.text


def test_health(server):
    r = httpx.get(server["base"] + "/health", timeout=60)
    assert r.status_code == 200 and r.json()["status"] == "ok", r.text
