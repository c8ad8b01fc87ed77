"""Training data: one target pass per sequence against the previous two, and what 8-bit rows
change in drafting.

Part ``speed`` (run it on a quiet machine): the same prompts' responses (the default target,
8 sequences per decode, greedy) made two ways, interleaved chunk by chunk in alternating order:
``one-pass`` -- the generator captures the features and the top-32 log-probabilities in the
decodes that generate (what ``llama-dflash train`` does now); ``two-pass`` -- generation
without capture, then a second target pass per sequence for its features (what it did before).
Seconds per sequence and per token, and the ratio.

Part ``q8``: the held-out prompts' one-pass rows (the shipped drafter never trained on them)
stored as fp16 and as q8; the shipped drafter (the C drafter, as the engine runs it) drafts 7
tokens at every 4th response position with either: block tau (1 + the leading drafted tokens
that equal the target's own continuation) for both, how often the two drafts are the same, and
the q8 rows' error in units of each channel's deviation.

Part ``nseq`` (quiet machine): one-pass generation with 8, 16 and 32 sequences per decode on the
same prompts, the orders rotated chunk by chunk: seconds per sequence and the speed-up over 8.

Usage: python bench/bench_data.py [--parts speed,q8,nseq] [--prompts 48] [--max-new 192]
                                  [--out bench/results/data.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from llama_dflash.api.models import default_target, shipped_drafter
from llama_dflash.core import Tokenizer
from llama_dflash.core.batchgen import BatchGenerator, Job
from llama_dflash.core.generator import SpeculativeGenerator
from llama_dflash.formats.gguf import read_drafter_config
from llama_dflash.train.data import _held_out
from llama_dflash.train.data import prompt_ids as data_prompt_ids
from llama_dflash.train.prompts import training_prompts
from llama_dflash.train.store import RowStore

TOP_K = 32


def prompt_ids(target: str, n: int, held_out: bool, max_prompt: int = 320) -> list[list[int]]:
    out = []
    with Tokenizer(target) as tok:
        for p in training_prompts():
            if _held_out(p.key, 0.03) != held_out:
                continue
            ids = data_prompt_ids(tok, p)
            if len(ids) <= max_prompt:
                out.append(ids)
            if len(out) == n:
                break
    return out


def one_pass(target: str, taps: list[int], prompts: list[list[int]], max_new: int,
             n_seq: int = 8) -> tuple[float, int, list]:
    t0 = time.perf_counter()
    with BatchGenerator(target, n_seq=n_seq, max_len=320 + max_new, capture_layers=taps, top_k=TOP_K) as g:
        done = list(g.run([Job(i, p) for i, p in enumerate(prompts)], max_new))
    return time.perf_counter() - t0, sum(len(c.response) for c in done), done


def two_pass(target: str, taps: list[int], prompts: list[list[int]], max_new: int) -> tuple[float, int]:
    t0 = time.perf_counter()
    with BatchGenerator(target, n_seq=8, max_len=320 + max_new) as g:
        done = list(g.run([Job(i, p) for i, p in enumerate(prompts)], max_new))
    n = max(len(c.prompt) + len(c.response) for c in done) + 8
    with SpeculativeGenerator(target, capture_layers=taps, n_ctx=n, n_batch=512) as sg:
        for c in done:
            sg.features(c.prompt + c.response)
    return time.perf_counter() - t0, sum(len(c.response) for c in done)


def speed(target: str, taps: list[int], n_prompts: int, max_new: int) -> dict:
    prompts = prompt_ids(target, n_prompts, held_out=False)
    chunks = [prompts[i:i + 16] for i in range(0, len(prompts), 16)]
    tot = {"one-pass": [0.0, 0], "two-pass": [0.0, 0]}
    for k, ch in enumerate(chunks):
        order = ["one-pass", "two-pass"] if k % 2 == 0 else ["two-pass", "one-pass"]
        for name in order:
            secs, toks = (one_pass(target, taps, ch, max_new)[:2] if name == "one-pass"
                          else two_pass(target, taps, ch, max_new))
            tot[name][0] += secs
            tot[name][1] += toks
            print(f"chunk {k} {name}: {secs:.1f} s, {toks} response tokens", flush=True)
    res = {name: {"seconds": round(s, 1), "response_tokens": t, "s_per_sequence": round(s / len(prompts), 3),
                  "response_tok_s": round(t / s, 1)} for name, (s, t) in tot.items()}
    res["sequences"] = len(prompts)
    res["two_pass_over_one_pass"] = round(tot["two-pass"][0] / tot["one-pass"][0], 3)
    return res


def n_seq_speed(target: str, taps: list[int], n_prompts: int, max_new: int, sizes=(8, 16, 32)) -> dict:
    prompts = prompt_ids(target, n_prompts, held_out=False)
    chunks = [prompts[i:i + 64] for i in range(0, len(prompts), 64)]
    tot = {n: [0.0, 0] for n in sizes}
    for k, ch in enumerate(chunks):
        for n in sizes[k % len(sizes):] + sizes[:k % len(sizes)]:  # each size first in turn
            secs, toks, _ = one_pass(target, taps, ch, max_new, n_seq=n)
            tot[n][0] += secs
            tot[n][1] += toks
            print(f"chunk {k} n_seq {n}: {secs:.1f} s, {toks} response tokens", flush=True)
    res = {str(n): {"seconds": round(s, 1), "response_tokens": t, "s_per_sequence": round(s / len(prompts), 3),
                    "response_tok_s": round(t / s, 1), "speedup_over_8": round(tot[8][0] / s, 3)}
           for n, (s, t) in tot.items()}
    res["sequences"] = len(prompts)
    return res


def q8_effect(target: str, drafter: str, taps: list[int], n_prompts: int, max_new: int) -> dict:
    prompts = prompt_ids(target, n_prompts, held_out=True)
    _, _, done = one_pass(target, taps, prompts, max_new)
    W = done[0].features.shape[1]
    with tempfile.TemporaryDirectory() as d:
        stores = {fmt: RowStore(Path(d) / fmt, {"bench": 1}, W, len(taps), fmt, TOP_K) for fmt in ("f16", "q8")}
        for i, c in enumerate(done):
            for st in stores.values():
                st.add(("p", 0.0, i), c.prompt + c.response, c.features, c.top_ids, c.top_logp)
        for st in stores.values():
            st.flush()
        seqs = {fmt: [(st.tokens(*st.refs[("p", 0.0, i)]), st.features(*st.refs[("p", 0.0, i)]))
                      for i in range(len(done))] for fmt, st in stores.items()}
        bytes_per_row = {fmt: st.bytes_per_row for fmt, st in stores.items()}
    f16 = np.concatenate([f for _, f in seqs["f16"]])
    q8 = np.concatenate([f for _, f in seqs["q8"]])
    err = (q8 - f16) / (f16.std(0) + 1e-6)
    n = read_drafter_config(drafter).block_size - 1
    taus, same, blocks = {"f16": [], "q8": []}, 0, 0
    with SpeculativeGenerator(target, drafter, n_ctx=1024) as g:
        d = g.drafter
        for i, c in enumerate(done):
            toks = seqs["f16"][i][0]
            start = len(c.prompt)
            drafts = {}
            for fmt in ("f16", "q8"):
                feats = seqs[fmt][i][1]
                d.reset()
                pushed, out = 0, []
                for p in range(start - 1, len(toks) - n, 4):  # anchor at p: context = rows before it
                    d.push(feats[pushed:p])
                    pushed = p
                    dr = d.draft(int(toks[p]), n)
                    truth = toks[p + 1:p + 1 + n].tolist()
                    k = 0
                    while k < n and dr[k] == truth[k]:
                        k += 1
                    taus[fmt].append(1 + k)
                    out.append(list(dr))
                drafts[fmt] = out
            same += sum(a == b for a, b in zip(drafts["f16"], drafts["q8"], strict=True))
            blocks += len(drafts["f16"])
    return {"sequences": len(done), "blocks": blocks, "draft_len": n,
            "block_tau": {fmt: round(float(np.mean(v)), 4) for fmt, v in taus.items()},
            "same_drafts": round(same / max(1, blocks), 4),
            "q8_error_rms_sd": round(float(np.sqrt((err ** 2).mean())), 4),
            "q8_error_max_sd": round(float(np.abs(err).max()), 4),
            "bytes_per_token": bytes_per_row}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default="speed,q8")
    ap.add_argument("--prompts", type=int, default=48)
    ap.add_argument("--max-new", type=int, default=192)
    ap.add_argument("--out", default="bench/results/data.json")
    a = ap.parse_args()
    target, drafter = str(default_target()), str(shipped_drafter())
    taps = list(read_drafter_config(drafter).target_layers)
    out = Path(a.out)
    res = json.loads(out.read_text()) if out.is_file() else {}
    for part in a.parts.split(","):
        t0 = time.time()
        r = {"speed": lambda: speed(target, taps, a.prompts, a.max_new),
             "q8": lambda: q8_effect(target, drafter, taps, a.prompts, a.max_new),
             "nseq": lambda: n_seq_speed(target, taps, a.prompts, a.max_new)}[part]()
        r.update(command="python " + " ".join(sys.argv), date=time.strftime("%Y-%m-%d %H:%M"),
                 target=Path(target).name, taps=taps, max_new=a.max_new, wall_s=round(time.time() - t0, 1))
        res[part] = r
        print(json.dumps({part: r}, indent=1), flush=True)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
