"""A target split over two llama.cpp rpc-servers, with round-trip delay added: plain decoding vs our
adaptive speculation over the same split (issue 45; docs/architecture.md §14).

Two ``rpc-server`` processes on 127.0.0.1 (one thread each) hold the target's layers (n_gpu_layers
= all); in front of each, a small delaying TCP proxy (threads, this script's ``--proxy`` mode, its
own process) adds half the round-trip delay to every chunk in each direction, so a request and its
answer pay the whole delay (0, 0.5, 2 and 5 ms: a LAN's range; ``tc netem`` is not available here).
The drafter and its cache stay local.  The proxy's added round trip is measured first (a ping-pong
through it to an echo listener).

Per target and delay: two ``SpeculativeGenerator``s over the proxies (exact="auto", the default of
``Llama`` and the CLI: its self-check runs over the split), one without a drafter (plain decoding:
one ``llama_decode`` a token, as llama.cpp decodes, no capture) and one with it (adaptive
speculation, the default; its capture reads the drafter's tapped rows from the servers), then
prompt by prompt, interleaved, and the speculative one again with the guards' read-ahead off (the
two speculative runs' order alternating prompt by prompt)
(``Cluster.read_ahead``: without it each tensor read after a decode, the logits and every tapped
layer's rows, waits for its own round trip); greedy, the same tokens each.  Recorded: tok/s of decoding,
tau, steps kept plain, whether the outputs are identical, the cost model's predicted draft + verify
time against the measured one (its verify costs are measured on the real context, so they include
the round trips), its t_verify(1) and t_verify(8), the RPC requests a plain token and a step cost and
how many of them waited for the server's answer (a round trip each), and one
``llama_decode`` of 1 and of 8 rows, each repeated and the two alternating (``decode_by_shape``: a
batch whose size differs from the last one's makes ggml-rpc send its graph again, with requests
that wait for an answer).

Targets: SmolLM2-135M-Instruct Q4_0 with the shipped DFlash2 drafter; Gemma-3-270M Q4_K_M with a
random-weight drafter (no trained drafter exists for it; the same recipe as bench/bench_exact.py):
what the adaptive policy does when drafting cannot pay.  Upstream llama.cpp's own DFlash loop
(llama-speculative-simple, bench/build-upstream.sh, built with the RPC backend) runs over the same
proxies after ours at each delay (an rpc-server serves one client at a time), its drafter local.

Usage: python3 bench/bench_rpc.py [--targets smollm2,gemma] [--delays 0,0.5,2,5] [--prompts 3]
                                  [--tokens 64] [--out bench/results/rpc.json] [--no-upstream]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import queue
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

UPSTREAM_N = 3  # upstream's draft length (its best of 3 / 7 on this CPU: bench/RESULTS.md)
PROMPTS = [
    "<|im_start|>user\nWrite a Python function that checks whether a string is a palindrome.<|im_end|>\n"
    "<|im_start|>assistant\n",
    "<|im_start|>user\nExplain what a hash table is in three sentences.<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\nWrite a Python class for a stack with push, pop and peek.<|im_end|>\n"
    "<|im_start|>assistant\n",
    "<|im_start|>user\nList five tips for writing clear documentation.<|im_end|>\n<|im_start|>assistant\n",
]


# ---------------------------------------------------------------------------------------------
# the delaying proxy (runs in its own process: `bench_rpc.py --proxy SPEC`)


def _nodelay(s: socket.socket) -> None:
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def _pump(src: socket.socket, dst: socket.socket, one_way_s: float) -> None:
    """src -> dst, each chunk sent one_way_s after it arrived (a writer thread keeps the order and
    lets chunks in flight overlap, as a link's latency does)."""
    q: queue.Queue = queue.Queue()

    def writer() -> None:
        while (item := q.get()) is not None:
            due, data = item
            wait = due - time.perf_counter()
            if wait > 0:
                time.sleep(wait)
            try:
                dst.sendall(data)
            except OSError:
                break
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    w = threading.Thread(target=writer, daemon=True)
    w.start()
    try:
        while data := src.recv(1 << 20):
            q.put((time.perf_counter() + one_way_s, data))
    except OSError:
        pass
    q.put(None)


def _serve(listen_port: int, up_port: int, rtt_ms: float, ready: threading.Event, ports: dict, key: str) -> None:
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("127.0.0.1", listen_port))
    srv.listen(16)
    ports[key] = srv.getsockname()[1]
    ready.set()
    while True:
        c, _ = srv.accept()
        try:
            u = socket.create_connection(("127.0.0.1", up_port))
        except OSError:
            c.close()  # (the server is down: the client sees the connection end)
            continue
        _nodelay(c)
        _nodelay(u)
        for a, b in ((c, u), (u, c)):
            threading.Thread(target=_pump, args=(a, b, rtt_ms / 2e3), daemon=True).start()


def proxy_main(spec: str) -> None:
    """spec: JSON {key: [upstream_port, rtt_ms]}; prints one line PORTS {key: listen_port}, then
    serves until stdin closes."""
    want = json.loads(spec)
    ports: dict = {}
    for key, (up, rtt) in want.items():
        ev = threading.Event()
        threading.Thread(target=_serve, args=(0, up, rtt, ev, ports, key), daemon=True).start()
        ev.wait(10)
    print("PORTS", json.dumps(ports), flush=True)
    sys.stdin.read()


def _echo_server() -> int:
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(4)

    def serve() -> None:
        while True:
            c, _ = srv.accept()
            _nodelay(c)

            def echo(c=c) -> None:
                with c:
                    while data := c.recv(65536):
                        c.sendall(data)

            threading.Thread(target=echo, daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    return srv.getsockname()[1]


def _ping_ms(port: int, n: int = 200) -> float:
    """Median round trip of a 64-byte ping-pong through 127.0.0.1:port."""
    with socket.create_connection(("127.0.0.1", port)) as s:
        _nodelay(s)
        out = []
        for _ in range(n):
            t0 = time.perf_counter()
            s.sendall(b"x" * 64)
            got = 0
            while got < 64:
                got += len(s.recv(64 - got))
            out.append(time.perf_counter() - t0)
    return statistics.median(out) * 1e3


# ---------------------------------------------------------------------------------------------
# the benchmark


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def gemma_drafter(target: Path) -> Path:
    """bench/bench_exact.py's random DFlash v1 drafter for Gemma-3-270M (written once per machine)."""
    from llama_dflash.cache import files_dir
    from llama_dflash.formats.config import DrafterConfig
    from llama_dflash.formats.gguf import random_drafter_tensors, write_drafter

    p = files_dir() / "bench-exact-gemma3-random-v1.gguf"
    if not p.is_file():
        cfg = DrafterConfig(n_layer=1, n_embd=640, n_ff=256, n_head=4, n_head_kv=2, head_dim=64,
                            target_layers=[1, 9, 15], mask_token_id=262143, rope_theta=10000.0, rms_eps=1e-6,
                            block_size=16)
        tmp = p.with_suffix(".part")
        write_drafter(tmp, cfg, random_drafter_tensors(cfg, seed=4, std=0.05), target, outtype="f16")
        tmp.replace(p)
    return p


def shape_probe(g, rounds: int = 6) -> dict:
    """``llama_decode`` over the split of 1 row and of 8 rows (all logits), each repeated, and the two
    alternating: median ms and RPC requests a decode (a batch of another size than the last one makes
    ggml-rpc send its graph again, with more requests that wait for an answer)."""
    import llama_cpp

    from llama_dflash.core import exact

    ctx = g._ctx
    mem = llama_cpp.llama_get_memory(ctx)
    llama_cpp.llama_memory_clear(mem, True)
    g._core.forget()
    pos = 0

    def decode(k: int) -> tuple[float, int]:
        nonlocal pos
        before = sum(t["requests"] for t in g.cluster.traffic())  # (shape probe: all requests)
        t0 = time.perf_counter()
        exact._decode(ctx, [100 + (pos + i) % 1000 for i in range(k)], pos, g.n_vocab, False)
        dt = time.perf_counter() - t0
        pos += k
        return dt * 1e3, sum(t["requests"] for t in g.cluster.traffic()) - before

    decode(16)  # a prefix
    out = {}
    for label, ks in (("1_repeated", [1] * rounds), ("8_repeated", [8] * rounds), ("1_8_alternating", [1, 8] * rounds)):
        decode(ks[0])
        got = [decode(k) for k in ks]
        for k in sorted(set(ks)):
            sel = [x for x, kk in zip(got, ks, strict=True) if kk == k]
            out[f"{label}/{k}"] = {"ms": round(statistics.median(x[0] for x in sel), 2),
                                   "requests": round(statistics.mean(x[1] for x in sel), 1)}
    llama_cpp.llama_memory_clear(mem, True)
    g._core.forget()
    return out


def run_upstream(binary: str, target: Path, drafter: Path, endpoints: str, prompts: list[str], n_tok: int) -> dict:
    """Upstream's DFlash loop over the same split (all layers on the servers, its drafter local),
    one process per prompt: tok/s of decoding and tau from its log, or why it failed."""
    from bench_adaptive import Upstream

    up = Upstream(binary, target, drafter, threads=1, rpc=endpoints)
    n = secs = drafted = accepted = steps = 0
    try:
        for p in prompts:
            k, t, st = up.run(p, n_tok, UPSTREAM_N)
            n, secs, drafted, accepted, steps = n + k, secs + t, drafted + st.drafted, accepted + st.accepted, \
                steps + st.steps
    except (RuntimeError, OSError) as e:  # (its log's tail: report.py picks ggml's abort line out of it)
        return {"error": " ".join(str(e).split())[-300:]}
    return {"tok_s": round(n / secs, 2), "tau": round((accepted + steps) / steps, 2) if steps else None,
            "n_draft": UPSTREAM_N}


def run_target(name: str, target: Path, drafter: Path, endpoints: dict[float, str], delays: list[float],
               prompts: list[str], n_tok: int, upstream: str | None = None) -> dict:
    """Per delay: the target loaded twice over the same servers (one connection each, shared): plain
    (no drafter, so no capture: llama.cpp's own decoding) and with the drafter (adaptive)."""
    from llama_dflash.core.generator import SpeculativeGenerator

    out = {"target": target.name, "drafter": drafter.name, "delays": {}}

    def requests(g) -> tuple[int, int]:
        tr = g.cluster.traffic()
        return sum(t["requests"] for t in tr), sum(t["waited"] for t in tr)

    for d in delays:
        kw = dict(n_ctx=1024, n_threads=1, n_gpu_layers=-1, rpc_servers=endpoints[d], exact="auto")
        t0 = time.perf_counter()
        gp = SpeculativeGenerator(target, None, **kw)
        gs = None
        try:
            gs = SpeculativeGenerator(target, drafter, **kw)
            t_load = time.perf_counter() - t0
            toks = [gs.tokenize(p) for p in prompts]
            gp.generate(toks[0], 8)  # warm-up
            gs.generate(toks[0], 8)  # (the cost model is measured then, over the split)
            acc = {k: {"tokens": 0, "seconds": 0.0} for k in ("plain", "adaptive", "no_read_ahead")}
            steps = plain_steps = accepted = same = same_nra = 0
            t_pred = t_meas = 0.0
            req = {k: [] for k in ("plain", "adaptive", "no_read_ahead")}
            exact = ""

            def run(g, tk, key, per_step, acc=acc, req=req):
                before = requests(g)
                r = g.generate(tk, n_tok, stop_on_eos=False)
                n = max(r.stats.steps, 1) if per_step else n_tok
                req[key].append([(b - a) / n for a, b in zip(before, requests(g), strict=True)])
                acc[key]["tokens"] += len(r.tokens) - 1  # (decoding: the prefill's token excluded)
                acc[key]["seconds"] += r.stats.t_total_s
                return r

            for i, tk in enumerate(toks):
                plain = run(gp, tk, "plain", False)
                for arm in (("adaptive", "no_read_ahead") if i % 2 == 0 else ("no_read_ahead", "adaptive")):
                    gs.cluster.read_ahead(arm == "adaptive")
                    try:
                        r = run(gs, tk, arm, True)
                    finally:
                        gs.cluster.read_ahead(True)
                    if arm == "adaptive":
                        spec = r
                    else:
                        same_nra += r.tokens == plain.tokens
                s = spec.stats
                steps += s.steps
                plain_steps += s.plain_steps
                accepted += s.accepted
                t_pred += s.t_predicted_s
                t_meas += s.t_draft_s + s.t_verify_s
                same += plain.tokens == spec.tokens
                exact = s.exact
            costs = gs.cost_model() or {}
            shapes = shape_probe(gp)
        finally:
            gp.close()
            if gs is not None:
                gs.close()
        tps = {k: v["tokens"] / v["seconds"] for k, v in acc.items()}
        tv = costs.get("t_verify", [])
        # (after ours: an rpc-server serves one client at a time)
        ups = run_upstream(upstream, target, drafter, endpoints[d], prompts, n_tok) if upstream else None
        if ups and "tok_s" in ups:
            ups["speedup"] = round(ups["tok_s"] / tps["plain"], 3)

        def mean_req(key: str, i: int, req=req) -> float:
            return round(statistics.mean(x[i] for x in req[key]), 1)

        row = {"plain_tok_s": round(tps["plain"], 2), "adaptive_tok_s": round(tps["adaptive"], 2),
               "speedup": round(tps["adaptive"] / tps["plain"], 3),
               "no_read_ahead_tok_s": round(tps["no_read_ahead"], 2),
               "no_read_ahead_speedup": round(tps["no_read_ahead"] / tps["plain"], 3),
               "no_read_ahead_identical": f"{same_nra}/{len(toks)}",
               "plain_ms_per_token": round(1e3 / tps["plain"], 2),
               "tau": round((accepted + steps) / steps, 2) if steps else None,
               "plain_steps": f"{plain_steps}/{steps}", "identical": f"{same}/{len(toks)}",
               "predicted_s": round(t_pred, 4), "measured_s": round(t_meas, 4),
               "predicted_over_measured": round(t_pred / t_meas, 3) if t_meas else None,
               "cost_t_verify_ms": {str(k): round(tv[k - 1] * 1e3, 2) for k in (1, 2, 4, 8) if k <= len(tv)},
               "rpc_requests_per_plain_token": mean_req("plain", 0),
               "rpc_requests_per_adaptive_step": mean_req("adaptive", 0),
               "rpc_waited_per_plain_token": mean_req("plain", 1),
               "rpc_waited_per_adaptive_step": mean_req("adaptive", 1),
               "rpc_waited_per_step_no_read_ahead": mean_req("no_read_ahead", 1),
               "load_s": round(t_load, 1), "exact": exact, "decode_by_shape": shapes, "upstream": ups}
        out["delays"][str(d)] = row
        print(f"{name} +{d} ms: {row}", flush=True)
    return out


def plot(res: dict, path: Path) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)")
        return False
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 5))
    for name, r in res["targets"].items():
        xs = [float(d) for d in r["delays"]]
        rows = list(r["delays"].values())
        ax1.plot(xs, [x["plain_tok_s"] for x in rows], "o--", label=f"{name}: plain")
        ax1.plot(xs, [x["adaptive_tok_s"] for x in rows], "o-", label=f"{name}: adaptive speculation")
        line = ax2.plot(xs, [x["speedup"] for x in rows], "o-", label=name)[0]
        if all("no_read_ahead_speedup" in x for x in rows):
            ax2.plot(xs, [x["no_read_ahead_speedup"] for x in rows], "x:", color=line.get_color(),
                     label=f"{name}: without the guard's read-ahead")
        if all("speedup" in (x.get("upstream") or {}) for x in rows):
            ax2.plot(xs, [x["upstream"]["speedup"] for x in rows], "s-.", color=line.get_color(), alpha=0.6,
                     label=f"{name}: upstream's loop")
    ax1.set_xlabel("added round trip per RPC request (ms)")
    ax1.set_ylabel("decode tok/s")
    ax1.set_title("Target split over two rpc-servers")
    ax1.legend(fontsize=7)
    ax2.axhline(1.0, color="grey", lw=0.8)
    ax2.set_xlabel("added round trip per RPC request (ms)")
    ax2.set_ylabel("adaptive / plain")
    ax2.set_title("Speedup of speculation over RPC")
    ax2.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2)
    fig.text(0.01, 0.01, f"{res['date']}, {res['cpu']}, load {res['load'][0]:.1f}", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    return True


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "--proxy":
        proxy_main(sys.argv[2])
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--targets", default="smollm2,gemma")
    ap.add_argument("--delays", default="0,0.5,2,5", help="added round trips, ms")
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--out", default="bench/results/rpc.json")
    ap.add_argument("--no-upstream", action="store_true", help="skip upstream's loop (bench/build-upstream.sh)")
    a = ap.parse_args()
    from llama_cpp import _logger

    from llama_dflash.api.models import default_target, pypi_target, shipped_drafter
    from llama_dflash.core import rpc

    _logger.set_verbose(False)
    binary = rpc.server_binary()
    if not rpc.available() or binary is None:
        raise SystemExit(f"no RPC build here: {rpc.INSTALL_HINT}")
    delays = [float(x) for x in a.delays.split(",")]
    names = a.targets.split(",")
    targets = {}
    if "smollm2" in names:
        targets["smollm2-135m-q4_0"] = (default_target(), shipped_drafter())
    if "gemma" in names:
        g = pypi_target("gemma-3-270m")
        targets["gemma-3-270m-q4_k_m"] = (g, gemma_drafter(g))
    upstream, upstream_why = None, "--no-upstream"
    if not a.no_upstream:  # (built in the user's cache, before the cache folder changes below)
        b = subprocess.run(["bash", str(Path(__file__).parent / "build-upstream.sh")], capture_output=True, text=True)
        upstream = b.stdout.strip().splitlines()[-1] if b.returncode == 0 and b.stdout.strip() else None
        upstream_why = None if upstream else f"bench/build-upstream.sh failed: {b.stderr.strip()[-200:]}"
    # a fresh cache folder: every delay's cost model and exact-mode verdict measured anew (the proxies'
    # ports are new each run), the user's cache untouched
    os.environ["LLAMA_DFLASH_CACHE"] = tempfile.mkdtemp(prefix="bench-rpc-")
    res = {"command": "python3 " + " ".join(sys.argv), "date": datetime.datetime.now().isoformat(timespec="seconds"),
           "cpu": cpu_model(), "load": os.getloadavg(), "threads": {"client": 1, "each_server": 1},
           "servers": 2, "prompts": a.prompts, "tokens": a.tokens,
           "upstream": None}
    if upstream_why is None:
        res["upstream"] = (f"llama-speculative-simple --spec-type draft-dflash --spec-draft-n-max {UPSTREAM_N} "
                           "--rpc ... -ngl 99 -devd none (its drafter local), 1 thread, after ours per delay")
    else:
        res["upstream"] = f"not run: {upstream_why}"
    servers = [rpc.RPCServer(n_threads=1, binary=binary) for _ in range(2)]
    echo = _echo_server()
    spec = {f"{i}/{d}": [s.port, d] for i, s in enumerate(servers) for d in delays}
    spec.update({f"echo/{d}": [echo, d] for d in delays})
    proxy = subprocess.Popen([sys.executable, __file__, "--proxy", json.dumps(spec)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        line = proxy.stdout.readline()
        if not line.startswith("PORTS "):
            raise SystemExit(f"the proxy did not start: {line!r}")
        ports = json.loads(line[6:])
        res["measured_rtt_ms"] = {str(d): round(_ping_ms(ports[f"echo/{d}"]) - 0.0, 3) for d in delays}
        res["direct_rtt_ms"] = round(_ping_ms(echo), 3)
        print("ping through the proxy (ms):", res["measured_rtt_ms"], "direct:", res["direct_rtt_ms"], flush=True)
        endpoints = {d: ",".join(f"127.0.0.1:{ports[f'{i}/{d}']}" for i in range(2)) for d in delays}
        res["targets"] = {}
        for name, (target, drafter) in targets.items():
            res["targets"][name] = run_target(name, Path(target), Path(drafter), endpoints, delays,
                                              PROMPTS[:a.prompts], a.tokens, upstream)
    finally:
        proxy.stdin.close()
        proxy.kill()
        proxy.wait(timeout=10)
        for s in servers:
            s.stop()
    res["load_after"] = os.getloadavg()
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1) + "\n")
    if plot(res, out.with_suffix(".png")):
        res["plot"] = out.with_suffix(".png").name
        out.write_text(json.dumps(res, indent=1) + "\n")
    print(f"saved {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
