"""One RPC scenario in a process of its own (tests/test_rpc.py): ggml's device registry is
process-wide, so the servers registered here never reach the rest of the suite's models.

    python rpc_child.py SCENARIO JSON_ARGS

prints one line ``RESULT <json>`` (and, for "kill", ``STEP <n>`` lines, reading ``GO`` on stdin).
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np

from llama_dflash import SpeculativeGenerator
from llama_dflash.core.rpc import RPCError


def out(kind: str, obj) -> None:
    print(kind, json.dumps(obj), flush=True)


def generator(a: dict, rpc: bool = True) -> SpeculativeGenerator:
    """The target split over the servers (rpc: the generator's rpc_servers), or all local."""
    if not rpc:
        return SpeculativeGenerator(a["target"], a.get("drafter"), n_ctx=512, n_threads=1, n_gpu_layers=0)
    return SpeculativeGenerator(a["target"], a.get("drafter"), n_ctx=512, n_threads=1,
                                n_gpu_layers=a["n_gpu_layers"], flash_attn=a.get("flash_attn"),
                                rpc_servers=a["endpoints"], rpc_timeout_s=a.get("timeout_s", 60),
                                rpc_drafter=a.get("rpc_drafter"))


def identity(a: dict) -> dict:
    """Plain vs speculative greedy over the same split; the capture's features against a local run."""
    res = {"plain": [], "spec": [], "margins": [], "taus": []}
    with generator(a) as g:
        cluster = g.cluster
        res["capture"] = g.capture_mode
        for p in a["prompts"]:
            toks = g.tokenize(p)
            plain = g.generate(toks, a["n_tokens"], draft_len=0, stop_on_eos=False, return_margins=True)
            before = [t["requests"] for t in cluster.traffic()]
            spec = g.generate(toks, a["n_tokens"], draft_len=a["draft_len"], speculation="on", stop_on_eos=False)
            res["spec_requests"] = [t["requests"] - b for t, b in zip(cluster.traffic(), before, strict=True)]
            res["spec_steps"] = spec.stats.steps
            res["plain"].append(plain.tokens)
            res["margins"].append(plain.margins)
            res["spec"].append(spec.tokens)
            res["taus"].append(spec.stats.tau)
        feats = g.features(g.tokenize(a["prompts"][0])) if a.get("features") else None
        res["drafter_memory"] = g.drafter.memory() if g.drafter is not None else None
        if res["drafter_memory"] is not None:
            n_vocab, n_embd = g.n_vocab, g.drafter_info.n_embd
            res["drafter_memory"]["borrowed_embedding"] = n_vocab * n_embd * 4  # (the tiny targets' f32 embedding)
            res["head_bytes"] = n_vocab * n_embd * 34 // 32  # a Q8_0 head (qwen3)
    res["traffic"] = cluster.traffic()
    if feats is not None:
        with generator(a, rpc=False) as g:
            # (the registered devices hold no layer of a model loaded with n_gpu_layers=0)
            local = g.features(g.tokenize(a["prompts"][0]))
        res["feature_max_abs_diff"] = float(np.max(np.abs(feats - local)))
        res["feature_scale"] = float(np.max(np.abs(local)))
    return res


def kill(a: dict) -> dict:
    """Stream; the parent kills a server after the first STEP lines: the generator raises one clear
    RPCError line (no abort, no hang) before handing out a failed step's tokens; then (GO: the
    server is back) the same generator's next requests (it loads the model again) equal plain ones."""
    res = {}
    g = generator(a)
    toks = g.tokenize(a["prompts"][0])
    got: list[int] = []
    try:
        n = 0
        for step in g.stream(toks, a["n_tokens"], draft_len=a["draft_len"], speculation="on", stop_on_eos=False):
            got += step
            n += 1
            out("STEP", n)
            time.sleep(a.get("step_sleep", 0))
        res["error"] = None
    except RPCError as e:
        res["error"] = str(e)
    res["tokens_before_error"] = len(got)
    out("LOST", {"error": res["error"], "n": len(got)})
    sys.stdin.readline()  # GO
    with g:
        plain = g.generate(toks, a["n_tokens"], draft_len=0, stop_on_eos=False, return_margins=True)
        spec = g.generate(toks, a["n_tokens"], draft_len=a["draft_len"], speculation="on", stop_on_eos=False)
    res["partial"] = got
    res["plain"], res["spec"], res["margins"] = [plain.tokens], [spec.tokens], [plain.margins]
    return res


def llama_kill(a: dict) -> dict:
    """llama_dflash.Llama(rpc_servers=..., n_gpu_layers=...): a greedy completion (speculative, then
    plain on the same split); a stream the parent cuts by killing a server: one RPCError line and
    the Llama's state dropped whole (n_tokens 0, its engine's KV forgotten); a request while the
    server is down: one RPCError line; once it is back (GO), the next completion loads the model
    again and equals the first."""
    from llama_dflash import Llama

    llm = Llama(a["target"], draft_model_path=a.get("drafter"), rpc_servers=a["endpoints"],
                n_gpu_layers=a["n_gpu_layers"], n_ctx=512, n_threads=1, verbose=False)
    res = {"options_rpc": llm.options.rpc_servers}
    prompt = a["prompts"][0]
    usage = {}

    def complete(n: int) -> str:
        r = llm.create_completion(prompt, max_tokens=n, temperature=0)
        usage.update(r["usage"])
        return r["choices"][0]["text"]

    res["spec"] = complete(a["n_tokens"])
    res["exact"] = llm.last_speculative_stats.exact
    llm.speculation = "off"  # (llama-cpp-python's own decoding over the split)
    res["plain"] = complete(a["n_tokens"])
    llm.speculation = "on"
    res["n_tokens_after"] = llm.n_tokens
    pieces: list[str] = []
    try:
        for n, ch in enumerate(llm.create_completion(prompt, max_tokens=400, temperature=0, stream=True), 1):
            pieces.append(ch["choices"][0]["text"])
            out("STEP", n)
            time.sleep(a.get("step_sleep", 0))
        res["error"] = None
    except RPCError as e:
        res["error"] = str(e)
    res["partial"] = "".join(pieces)
    res["n_tokens_lost"] = llm.n_tokens
    try:
        complete(4)
        res["error_down"] = None
    except RPCError as e:
        res["error_down"] = str(e)
    out("LOST", {"error": res["error"], "n": len(pieces)})
    sys.stdin.readline()  # GO
    res["again"] = complete(a["n_tokens"])
    # what the Llama holds: the prompt and every token handed out but the last (not evaluated yet)
    res["n_tokens_again"], res["n_expected"] = llm.n_tokens, usage["prompt_tokens"] + usage["completion_tokens"] - 1
    res["stats_again"] = llm.last_speculative_stats.as_dict()
    llm.close()
    return res


def too_big(a: dict) -> dict:
    try:
        g = generator(a)
    except Exception as e:  # noqa: BLE001 - the test asserts its type and message
        return {"error": f"{type(e).__name__}: {e}"}
    g.close()
    return {"error": None}


if __name__ == "__main__":
    scenario, args = sys.argv[1], json.loads(sys.argv[2])
    out("RESULT", {"identity": identity, "kill": kill, "llama_kill": llama_kill, "too_big": too_big}[scenario](args))
