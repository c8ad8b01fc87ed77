"""Exact mode, measured: which kernels are batch-invariant, what exact mode costs, identity counts.

Four parts (each can run alone):

- ``invariance``: SmolLM2-135M requantized to every type below; for each, with the default
  settings (repacked weights, no flash attention) and with exact mode's in either weight layout
  (flash attention; llama.cpp's repacked CPU weights or the plain layout: core.exact.settings),
  whether a verify batch of k rows (k = 2 ... 16) and a 64-row prefill give bit-identical logits
  (and K/V) to one-token decoding -- the self-check's probe, run at every size.
- ``cost``: one-token decode and k-row verify-batch times under the three settings, interleaved
  rounds, on the default target and on Qwen2.5-Coder-1.5B (PyPI parts).
- ``layout``: exact mode end to end in either weight layout (core.exact.weight_layout's choice
  forced), on SmolLM2 Q4_0 and Q8_0 with the shipped drafter: plain, fixed n = 3 and adaptive
  tok/s over mixed prompts, interleaved prompt by prompt, every greedy output checked against its
  layout's plain one.
- ``identity``: prompts x (greedy, T = 0.8 x seeds) x drafters (shipped DFlash2, random DFlash v1 and
  DFlash2) x n on SmolLM2 Q4_0 and Q8_0, and random drafters on Gemma-3-270M (cb_eval capture), in
  exact mode and in the default mode: how many speculative runs equal plain decoding token for token
  (identity_layout: the weight layout exact mode used for them).

Usage: python3 bench/bench_exact.py [--parts invariance,cost,layout,identity] [--prompts 50] [--seeds 3]
                                    [--out bench/results/exact.json]
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

import llama_cpp
import numpy as np
from llama_cpp import _logger

from llama_dflash import SamplingParams, SpeculativeGenerator
from llama_dflash.api.models import default_target, pypi_target, shipped_drafter, smollm2_q4_1
from llama_dflash.cache import files_dir
from llama_dflash.core import exact
from llama_dflash.formats.config import DrafterConfig
from llama_dflash.formats.gguf import random_drafter_tensors, write_drafter

TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K_M", "Q4_K_M", "Q5_K_M", "Q6_K", "IQ4_NL", "F16", "BF16"]
SETTINGS = {"default": {"use_extra_bufts": True, "flash_attn": False}, "exact": exact.settings(False),
            "exact, repacked": exact.settings(True)}
SIZES = list(range(2, 17)) + [64]


def quantized(t: str) -> Path:
    dst = files_dir() / f"SmolLM2-135M-Instruct.{t}.gguf"
    if dst.is_file():
        return dst
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{t}")
    params.allow_requantize = True
    params.nthread = 2
    tmp = dst.with_suffix(".tmp")
    if llama_cpp.llama_model_quantize(str(smollm2_q4_1()).encode(), str(tmp).encode(), ctypes.byref(params)) != 0:
        raise RuntimeError(f"quantizing to {t} failed")
    tmp.replace(dst)
    return dst


def load(path: Path, s: dict, n_ctx: int = 256):
    mp = llama_cpp.llama_model_default_params()
    mp.use_extra_bufts = s["use_extra_bufts"]
    model = llama_cpp.llama_model_load_from_file(str(path).encode(), mp)
    cp = llama_cpp.llama_context_default_params()
    cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_threads, cp.n_threads_batch = n_ctx, n_ctx, n_ctx, 2, 2
    cp.flash_attn_type = (llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED if s["flash_attn"]
                          else llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED)
    ctx = llama_cpp.llama_init_from_model(model, cp)
    if s.get("reference_kernels"):
        exact.reference_kernels(ctx)
    return model, ctx


def part_invariance() -> dict:
    out = {}
    for t in TYPES:
        path = quantized(t)
        out[t] = {}
        for name, s in SETTINGS.items():
            model, ctx = load(path, s)
            nv = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))
            rng = np.random.default_rng(7)
            out[t][name] = {str(k): exact._probe(ctx, nv, k, rng) for k in SIZES}
            llama_cpp.llama_free(ctx)
            llama_cpp.llama_model_free(model)
            ok = [k for k, d in out[t][name].items() if d == 0.0]
            print(f"{t:7s} {name:7s} invariant sizes: {','.join(ok) or 'none'}", flush=True)
    return out


def _time_decode(ctx, nv: int, k: int, reps: int) -> float:
    mem = llama_cpp.llama_get_memory(ctx)
    rng = np.random.default_rng(0)
    ts = []
    for _ in range(reps):
        llama_cpp.llama_memory_clear(mem, True)
        exact._decode(ctx, [int(x) for x in rng.integers(0, nv, 32)], 0, nv, False)
        toks = [int(x) for x in rng.integers(0, nv, k)]
        t0 = time.perf_counter()
        exact._decode(ctx, toks, 32, nv, False)
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3


COST_ROWS = (1, 2, 3, 4, 8, 16)


def part_cost(rounds: int = 5) -> dict:
    out = {}
    for label, path in (("SmolLM2-135M Q4_0", default_target()), ("Qwen2.5-Coder-1.5B Q4_K_M",
                                                                    pypi_target("qwen2.5-coder-1.5b"))):
        loaded = {name: load(path, s) for name, s in SETTINGS.items()}
        nv = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(loaded["exact"][0]))
        ms = {name: {k: [] for k in COST_ROWS} for name in SETTINGS}
        for _ in range(rounds):  # interleaved: the two settings see the same machine state
            for name, (_, ctx) in loaded.items():
                for k in ms[name]:
                    ms[name][k].append(_time_decode(ctx, nv, k, 3))
        out[label] = {name: {str(k): statistics.median(v) for k, v in d.items()} for name, d in ms.items()}
        for name in SETTINGS:
            if name != "default":
                out[label][f"{name} over default"] = {str(k): out[label][name][str(k)] / out[label]["default"][str(k)]
                                                       for k in COST_ROWS}
        print(label, json.dumps(out[label]), flush=True)
        for model, ctx in loaded.values():
            llama_cpp.llama_free(ctx)
            llama_cpp.llama_model_free(model)
    return out


def prompts(n: int) -> list[str]:
    base = [
        "def merge_sort(xs):\n", "class LinkedList:\n    def __init__(self):", "import os\nfor root, dirs, files in",
        "Write a haiku about the sea.", "Explain what a hash table is in two sentences.", "Once upon a time, in a",
        '{"id": 17, "tags": [', "Return a JSON object with keys name and age for Ada Lovelace.",
        "Traduis en français : il pleut depuis ce matin.", "Übersetze ins Englische: Guten Morgen, wie geht's?",
        "¿Cuál es la capital de Perú?", "日本の首都は", "a b c a b c a b c a b c", "1, 2, 3, 4, 5, 6,",
        "SELECT id, name FROM users WHERE", "<html>\n  <body>\n", "The quick brown fox", "Q: What is 17 * 23?\nA:",
        "List the planets of the solar system:", "#include <stdio.h>\nint main(void) {",
    ]
    out = []
    for i in range(n):
        p = base[i % len(base)]
        out.append(p if i < len(base) else f"<|im_start|>user\n{p}<|im_end|>\n<|im_start|>assistant\n")
    return out


def random_drafters(target: Path, name: str, dims: dict) -> dict[str, Path]:
    """A random DFlash v1 and a random DFlash2 drafter for ``target`` (written once per machine)."""
    out = {}
    n_vocab = dims.pop("n_vocab")
    for kind, extra in (("random-v1", dict(block_size=16)),
                        ("random-v2", dict(block_size=16, conv_kernel_size=2, conv_group_size=16, selector_rank=16,
                                           selector_top_k=4, n_vocab=n_vocab))):
        p = files_dir() / f"bench-exact-{name}-{kind}.gguf"
        if not p.is_file():
            cfg = DrafterConfig(**dims, **extra)
            tmp = p.with_suffix(".part")
            write_drafter(tmp, cfg, random_drafter_tensors(cfg, seed=4, std=0.05), target, outtype="f16")
            tmp.replace(p)
        out[kind] = p
    return out


def targets() -> list[tuple[str, Path, dict[str, Path]]]:
    """(label, target, drafters): two llama targets with the shipped and random drafters, and Gemma-3
    (cb_eval capture) with random ones -- no trained drafter exists for it."""
    smol = dict(n_layer=1, n_embd=576, n_ff=512, n_head=9, n_head_kv=3, head_dim=64, target_layers=[1, 14, 27],
                mask_token_id=16, rope_theta=100000.0, rms_eps=1e-5, n_vocab=49152)
    gemma = dict(n_layer=1, n_embd=640, n_ff=256, n_head=4, n_head_kv=2, head_dim=64, target_layers=[1, 9, 15],
                 mask_token_id=262143, rope_theta=10000.0, rms_eps=1e-6, n_vocab=262144)
    out = []
    for ftype in ("q4_0", "q8_0"):
        out.append((ftype, default_target(ftype), {"shipped-v2": shipped_drafter(),
                                                  **random_drafters(default_target(), "smollm2", dict(smol))}))
    g = pypi_target("gemma-3-270m")
    out.append(("gemma-3-270m", g, random_drafters(g, "gemma3", dict(gemma))))
    return out


def part_identity(n_prompts: int, seeds: int, max_tokens: int, modes: tuple[str, ...], res: dict,
                  path: Path) -> None:
    """Fills res["identity"] block by block (target / mode / drafter) and within a block draft
    length by draft length, saving after each, so that a stopped run resumes where it stopped:
    what was measured with the same settings is kept (a block still incomplete is marked
    "partial" in identity_blocks)."""
    settings = {"prompts": n_prompts, "seeds": seeds, "max_tokens": max_tokens}
    ident, blocks = res.setdefault("identity", {}), res.setdefault("identity_blocks", {})
    for key in [k for k in ident if blocks.get(k, {}).get("settings") != settings]:
        del ident[key]  # measured with other settings: not comparable with this run's blocks
    for label, target, drafters in targets():
        for mode in modes:
            plain: dict = {}  # (prompt, seed) -> tokens: plain decoding does not depend on the drafter
            for dname, dpath in drafters.items():
                key = f"{label}/{mode}/{dname}"
                if key in ident and not blocks[key].get("partial"):
                    print(key, "(kept from", blocks[key]["date"] + ")", json.dumps(ident[key]), flush=True)
                    continue
                counts = ident.setdefault(key, {})
                with SpeculativeGenerator(target, dpath, n_ctx=1024, exact=mode == "exact") as g:
                    for n in sorted({min(n, g.max_draft_len) for n in (1, 3, 7, 15)}):  # the self-check caps n
                        if str(n) in counts:
                            print(key, f"n={n} (kept)", json.dumps(counts[str(n)]), flush=True)
                            continue
                        same = runs = 0
                        for p in prompts(n_prompts):
                            toks = g.tokenize(p)
                            for seed in [None, *range(1, seeds + 1)]:
                                sp = None if seed is None else SamplingParams(temperature=0.8, seed=seed)
                                if (p, seed) not in plain:
                                    plain[p, seed] = g.generate(toks, max_tokens, draft_len=0, sampling=sp).tokens
                                same += g.generate(toks, max_tokens, draft_len=n, sampling=sp).tokens == plain[p, seed]
                                runs += 1
                        counts[str(n)] = {"identical": same, "runs": runs}
                        blocks[key] = {"settings": settings, "partial": True,
                                       "date": datetime.datetime.now().isoformat(timespec="seconds")}
                        path.write_text(json.dumps(res, indent=1))
                        print(key, f"n={n}", json.dumps(counts[str(n)]), flush=True)
                blocks[key] = {"settings": settings, "date": datetime.datetime.now().isoformat(timespec="seconds")}
                path.write_text(json.dumps(res, indent=1))
                print(key, json.dumps(counts), flush=True)
    res["identity_settings"] = settings


def part_layout(n_prompts: int, max_tokens: int) -> dict:
    """Exact mode in either weight layout, end to end (see the module's docstring)."""
    out = {}
    pick = exact.weight_layout
    for ftype in ("q4_0", "q8_0"):
        target = default_target(ftype)
        gens = {}
        try:
            for repacked in (True, False):
                exact.weight_layout = lambda *a, r=repacked, **k: r  # noqa: E731 -- force the layout
                gens[repacked] = SpeculativeGenerator(target, shipped_drafter(), n_ctx=1024, n_threads=2, exact=True)
        finally:
            exact.weight_layout = pick
        secs = {(r, kind): 0.0 for r in gens for kind in ("plain", "fixed_n3", "auto")}
        toks_out = {(r, kind): 0 for r in gens for kind in ("plain", "fixed_n3", "auto")}
        same = {r: 0 for r in gens}
        verdicts = {r: "" for r in gens}
        accepted = {(r, kind): [0, 0] for r in gens for kind in ("fixed_n3", "auto")}
        for i, p in enumerate(prompts(n_prompts)):
            for r, g in gens.items():  # interleaved: both layouts see the same machine state
                toks = g.tokenize(p)
                plain = g.generate(toks, max_tokens, draft_len=0)
                runs = {"plain": plain, "fixed_n3": g.generate(toks, max_tokens, draft_len=3, speculation="on"),
                        "auto": g.generate(toks, max_tokens)}
                same[r] += all(x.tokens == plain.tokens for x in runs.values())
                for kind, x in runs.items():
                    secs[r, kind] += x.stats.t_total_s
                    toks_out[r, kind] += max(0, x.stats.n_generated - 1)
                    if kind != "plain":
                        accepted[r, kind][0] += x.stats.accepted
                        accepted[r, kind][1] += x.stats.steps
                    verdicts[r] = x.stats.exact
            print(f"  {ftype} [{i + 1}/{n_prompts}]", file=sys.stderr, flush=True)
        res = {}
        for r, g in gens.items():
            name = "repacked" if r else "plain layout"
            tok_s = {kind: toks_out[r, kind] / secs[r, kind] for kind in ("plain", "fixed_n3", "auto")}
            res[name] = {**{f"{k}_tok_s": round(v, 1) for k, v in tok_s.items()},
                         "fixed_n3_x": round(tok_s["fixed_n3"] / tok_s["plain"], 3),
                         "auto_x": round(tok_s["auto"] / tok_s["plain"], 3),
                         "tau": {k: round(1 + a / max(1, n), 2) for (rr, k), (a, n) in accepted.items() if rr == r},
                         "self_check": verdicts[r], "identical_to_plain": f"{same[r]} of {n_prompts}"}
            g.close()
        rp, pl = res["repacked"], res["plain layout"]
        res["repacked_over_plain_layout"] = {k: round(rp[f"{k}_tok_s"] / pl[f"{k}_tok_s"], 3)
                                             for k in ("plain", "fixed_n3", "auto")}
        print(ftype, json.dumps(res), flush=True)
        out[f"SmolLM2-135M {ftype.upper()}"] = res
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--parts", default="invariance,cost,layout,identity")
    ap.add_argument("--prompts", type=int, default=50)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--layout-prompts", type=int, default=20)
    ap.add_argument("--modes", default="exact", help="identity in these modes (exact,default)")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "exact.json"))
    a = ap.parse_args()
    _logger.set_verbose(False)
    llama_cpp.llama_backend_init()
    parts = a.parts.split(",")
    path = Path(a.out)
    res = json.loads(path.read_text()) if path.is_file() else {}
    run = {"command": "python3 bench/bench_exact.py " + " ".join(sys.argv[1:]),
           "date": datetime.datetime.now().isoformat(timespec="seconds")}
    res.update(threads=2, exact_settings={n: s for n, s in SETTINGS.items() if n != "default"})
    res.pop("exact_over_default", None)
    res.setdefault("runs", {}).update({part: run for part in parts})  # which command measured each part
    if "invariance" in parts:
        res["invariance"] = part_invariance()
    if "cost" in parts:
        res["cost_ms"] = part_cost()
    if "layout" in parts:
        res["layout"] = part_layout(a.layout_prompts, 128)
    if "identity" in parts:
        res["identity_layout"] = "exact mode's layout picked by core.exact.weight_layout"
        part_identity(a.prompts, a.seeds, a.max_tokens, tuple(a.modes.split(",")), res, path)
    path.write_text(json.dumps(res, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
