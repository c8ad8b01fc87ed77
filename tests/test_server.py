"""The OpenAI-compatible server over real HTTP on localhost (uvicorn in a thread, httpx client)."""

from __future__ import annotations

import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

httpx = pytest.importorskip("httpx", reason="server tests need the server extras (scripts/setup.sh --test)")
uvicorn = pytest.importorskip("uvicorn")

PROMPTS = [f"The number {i} is" for i in range(50)]
REPEAT = 1.1  # the server's default repeat_penalty (llama_cpp.Llama's is 1.0)


def _want(server, p: str) -> dict:
    return server["plain"].create_completion(p, max_tokens=8, temperature=0.0, repeat_penalty=REPEAT)


@pytest.fixture(scope="module")
def server(artifacts):
    import llama_cpp

    from llama_dflash.server import DFlashModelSettings, ServerSettings, create_app

    a = artifacts["llama"]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ms = DFlashModelSettings(model=a["target"], model_alias="tiny", draft_model_path=a["drafter"], n_ctx=512,
                             n_threads=2, verbose=False)
    app = create_app(server_settings=ServerSettings(host="127.0.0.1", port=port), model_settings=[ms])
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    th = threading.Thread(target=srv.run, daemon=True)
    th.start()
    base = f"http://127.0.0.1:{port}"
    for _ in range(200):
        try:
            httpx.get(base + "/v1/models", timeout=1.0)
            break
        except httpx.TransportError:
            time.sleep(0.05)
    plain = llama_cpp.Llama(a["target"], n_ctx=512, n_threads=2, verbose=False)
    yield {"base": base, "plain": plain}
    srv.should_exit = True
    th.join(timeout=10)
    plain.close()


def _complete(base: str, prompt: str, **kw) -> dict:
    r = httpx.post(base + "/v1/completions", json={"prompt": prompt, "max_tokens": 8, "temperature": 0.0, **kw},
                   timeout=600)
    assert r.status_code == 200, r.text
    return r.json()


def test_server_errors_are_one_line(tmp_path):
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "llama_dflash.server", "--model", str(tmp_path / "missing.gguf")],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 2 and r.stderr.startswith("llama_dflash.server: error:") and r.stderr.count("\n") == 1


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
    assert r.status_code in (400, 422, 500) and r.status_code != 200
