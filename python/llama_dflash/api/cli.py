"""Command line: `llama-dflash generate | demo`."""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
from collections.abc import Callable, Sequence
from typing import Any

from .. import options
from .._native import lib
from ..errors import DFlashError
from ..formats.gguf import OUTTYPES
from ..train.store import FORMATS as FEATURE_FORMATS
from ..verify.certify import divergence_report, replay_divergence


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (no usage dump)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"llama-dflash: error: {message}\n")


_I32 = 2**31 - 1


def _int(lo: int, hi: int = _I32):
    """argparse type: an integer in [lo, hi] (what the C side can hold), else a one-line error."""
    def parse(text: str) -> int:
        try:
            v = int(text, 0)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
        if not lo <= v <= hi:
            raise argparse.ArgumentTypeError(f"{v} is outside {lo}..{hi}")
        return v
    return parse


def _float(name: str, lo: float, hi: float | None = None, lo_open: bool = False):
    """argparse type: a finite number in [lo, hi] ((lo, hi] with lo_open), else a one-line error."""
    rng = (f"> {lo:g}" if lo_open else f">= {lo:g}") + (f" and <= {hi:g}" if hi is not None else "")

    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid float value: {text!r}") from None
        if not math.isfinite(v) or v < lo or (hi is not None and v > hi) or (lo_open and v == lo):
            raise argparse.ArgumentTypeError(f"{name} must be {rng} (and finite), got {text}")
        return v
    return parse


def _floats(text: str) -> list[float]:
    """argparse type: comma-separated distinct temperatures, each finite and > 0."""
    parse = _float("a temperature", 0.0, lo_open=True)
    vals = [parse(x.strip()) for x in text.split(",") if x.strip()]
    if not vals or len(set(vals)) != len(vals):
        raise argparse.ArgumentTypeError(f"expected distinct comma-separated temperatures, got {text!r}")
    return vals


def _seed(text: str) -> int:
    """A sampling seed: 0..2**32-1, or -1 (random: llama.cpp's default seed)."""
    v = _int(-1, 2**32 - 1)(text)
    return 0xFFFFFFFF if v == -1 else v


SPECULATION = list(options.choices("speculation"))
SPECULATION_HELP = options.doc("speculation").replace("draft_n_max", "--draft-len")


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=_int(1), default=128)
    p.add_argument("--draft-len", type=_int(0, lib.DFLASH_MAX_DRAFT), default=None,
                   help="longest draft per step (auto) / tokens drafted per step (on); default: block - 1")
    p.add_argument("--speculation", choices=SPECULATION, default="auto", help=SPECULATION_HELP)
    p.add_argument("--n-ctx", type=_int(1, 2**24), default=2048)
    p.add_argument("--threads", type=_int(1, 1024), default=None)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--verbose", action="store_true", help="show llama.cpp's log")
    p.add_argument("--no-kernels", action="store_true",
                   help="ggml's kernels for the target's small matrix products instead of ours "
                        "(as LLAMA_DFLASH_KERNELS=0; for A/B runs)")


def _add_sampling(p: argparse.ArgumentParser) -> None:
    p.add_argument("--temperature", type=_float("temperature", 0.0), default=0.0,
                   help="0 = greedy (token-identical to plain decoding in exact mode, the default; --default-mode "
                        "may differ at numerical near-ties)")
    p.add_argument("--mode", choices=["match", "rejection"], default="match",
                   help="T > 0 verification: match (same seed => same text as plain) or rejection (higher acceptance)")
    p.add_argument("--top-k", type=_int(0), default=40)
    p.add_argument("--top-p", type=_float("top-p", 0.0, 1.0), default=0.95)
    p.add_argument("--min-p", type=_float("min-p", 0.0, 1.0), default=0.05)
    p.add_argument("--repeat-penalty", type=_float("repeat-penalty", 0.0, lo_open=True), default=1.0)
    p.add_argument("--seed", type=_seed, default=0xFFFFFFFF, help="default (or -1): random")


def _sampling(a: argparse.Namespace):
    from ..core.sampling import SamplingParams

    return SamplingParams(temperature=a.temperature, top_k=a.top_k, top_p=a.top_p, min_p=a.min_p,
                          repeat_penalty=a.repeat_penalty, seed=a.seed, mode=a.mode)


def _stats_json(res) -> dict:
    s = res.stats
    d = s.as_dict()
    d["tokens_per_s"] = s.tokens_per_s
    return {"text": res.text, "tokens": res.tokens, "stats": d}


def _summary(label: str, s) -> str:
    line = (f"{label} ({s.mode}): {s.n_generated} tokens, {s.tokens_per_s:.1f} tok/s, tau {s.tau:.2f}, "
            f"accepted {s.accepted}/{s.drafted}, draft {s.t_draft_s * 1e3:.0f} ms, "
            f"verify {s.t_verify_s * 1e3:.0f} ms, other {s.t_other_s * 1e3:.0f} ms")
    line += f"\n  target's small matrix products: {s.kernels}"
    if s.adaptive:
        line += (f"\n  adaptive: {s.plain_steps} of {s.steps} steps plain, verified draft lengths "
                 f"{dict(enumerate(s.lengths))}, predicted {s.t_predicted_s * 1e3:.0f} ms of draft + verify")
    return line


def cmd_generate(a: argparse.Namespace) -> int:
    from ..core.generator import SpeculativeGenerator

    prompt = _prompt(a)
    _speculates(a.model, a.drafter)
    with SpeculativeGenerator(a.model, a.drafter, n_ctx=a.n_ctx, n_threads=a.threads, verbose=None,
                              exact=a.exact, **_placement(a)) as g:
        res = g.generate(prompt, a.max_tokens, draft_len=a.draft_len, sampling=_sampling(a),
                         speculation=a.speculation)
    if a.json:
        print(json.dumps(_stats_json(res)))
    else:
        print(res.text)
        print(_summary("speculative" if a.drafter else "plain", res.stats), file=sys.stderr)
    return 0


EXACT_HELP = ("exact mode only: refuse a target whose self-check fails (default: exact mode where the target's "
              "self-check passes, else the default mode with the reason logged)")
DEFAULT_MODE_HELP = ("the default mode: faster verify batches on some targets, but output may differ from plain "
                     "decoding at numerical near-ties")


def _option(name: str, flag: str) -> Callable[[str], Any]:
    """An argparse type: the option's own check (options.py), its error naming the flag."""
    def check(text: str) -> Any:
        try:
            return options.check(name, text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e).replace(name, flag, 1)) from None
    return check


def _add_rpc(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rpc", metavar="HOST:PORT[,HOST:PORT]", type=_option("rpc_servers", "--rpc"), default=None,
                   help="split the target over these llama.cpp rpc-servers (scripts/setup.sh --rpc builds "
                        "rpc-server); the drafter stays local unless --rpc-drafter")
    p.add_argument("--rpc-drafter", metavar="HOST:PORT", type=_option("rpc_drafter", "--rpc-drafter"), default=None,
                   help=options.doc("rpc_drafter"))
    p.add_argument("--n-gpu-layers", type=_int(-1), default=None,
                   help="the target's layers offloaded (with --rpc: to the servers; default there: all)")


def _speculates(model: str, drafter: str | None) -> None:
    """A drafter asked for on the command line must be able to speculate with this target: the very
    check of `inspect --target` (vocab-only loads, before any weights), its reason a one-line error
    (exit 2) -- the Python API and the server decode plainly with a warning instead."""
    if drafter is None:
        return
    from ..formats.inspect import fit

    verdict = fit(drafter, model)
    if not verdict["ok"]:
        raise DFlashError(f"--drafter: {verdict['error']}")


def _placement(a: argparse.Namespace) -> dict:
    """The generator's rpc_servers and n_gpu_layers from --rpc / --n-gpu-layers."""
    n = a.n_gpu_layers if a.n_gpu_layers is not None else (-1 if a.rpc else 0)
    if a.rpc_drafter is not None and a.rpc is None:
        raise DFlashError("--rpc-drafter needs --rpc (the drafter goes to one of those servers)")
    return {"rpc_servers": a.rpc, "n_gpu_layers": n, "rpc_drafter": a.rpc_drafter}


def _add_exact(p: argparse.ArgumentParser, exact_help: str = EXACT_HELP) -> None:
    m = p.add_mutually_exclusive_group()
    m.add_argument("--exact", dest="exact", action="store_const", const=True, default="auto", help=exact_help)
    m.add_argument("--default-mode", dest="exact", action="store_const", const=False, help=DEFAULT_MODE_HELP)


DEMO_PROMPT = ("<|im_start|>user\nWrite a Python function that checks whether a string is a palindrome."
               "<|im_end|>\n<|im_start|>assistant\n")
DEMO_ROUNDS = 2  # plain and speculative alternate; each side's faster run is reported (this machine's speed drifts)


def cmd_demo(a: argparse.Namespace) -> int:
    """The README's main job: plain vs speculative on the embedded default model."""
    from ..core.generator import SpeculativeGenerator
    from .models import default_target, shipped_drafter

    target = default_target()
    drafter = shipped_drafter()
    trained = drafter is not None
    if drafter is None:
        from ..cache import files_dir
        from ..formats.gguf import DrafterConfig, random_drafter_tensors, write_drafter

        drafter = files_dir() / "smollm2-135m-dflash-untrained.gguf"
        if not drafter.is_file():
            cfg = DrafterConfig(n_embd=576, n_layer=2, n_head=9, n_head_kv=3, head_dim=64, n_ff=1536,
                                target_layers=[1, 8, 14, 20, 27], block_size=8, mask_token_id=16,
                                rope_theta=100000.0, rms_eps=1e-5)
            write_drafter(drafter, cfg, random_drafter_tensors(cfg, seed=0), target, outtype="q8_0")
    with SpeculativeGenerator(target, drafter, n_ctx=a.n_ctx, n_threads=a.threads, verbose=None,
                              exact=a.exact, **_placement(a)) as g:
        toks = g.tokenize(DEMO_PROMPT)
        g.generate(toks, 8, draft_len=0)  # warm-up
        plain = spec = None
        for _ in range(DEMO_ROUNDS):
            pr = g.generate(toks, a.max_tokens, draft_len=0, stop_on_eos=False, return_margins=True)
            sr = g.generate(toks, a.max_tokens, draft_len=a.draft_len, stop_on_eos=False, return_margins=True,
                            speculation=a.speculation)
            plain = pr if plain is None or pr.stats.tokens_per_s > plain.stats.tokens_per_s else plain
            spec = sr if spec is None or sr.stats.tokens_per_s > spec.stats.tokens_per_s else spec
        report = divergence_report(g, plain, spec, 0.1)
        # the ceiling of any length policy: a run at n_max says what the drafter gets accepted
        steps: list[dict] = []
        g.generate(toks, a.max_tokens, draft_len=g.max_draft_len, speculation="on", stop_on_eos=False,
                   on_step=steps.append)
        ceiling = plain.stats.tokens_per_s * g.ceiling([s["accepted"] for s in steps])
        exact_on = g.exact_verdict is not None
    same = plain.tokens == spec.tokens
    if a.json:
        print(json.dumps({"target": str(target), "drafter": str(drafter), "trained_drafter": trained,
                          "identical": same, "divergence": report, "plain": _stats_json(plain),
                          "speculative": _stats_json(spec), "ceiling_tokens_per_s": ceiling}))
        return 0
    print(f"target : {target}")
    print(f"drafter: {drafter}" + ("  (the shipped DFlash2 drafter; its training and measured results: "
                                      "MODEL_CARD.md beside it)" if trained else
                                      "  (untrained random weights: the shipped drafter is missing from this "
                                      "install, so expect tau ~ 1 and no speedup)"))
    print(spec.text)
    print(_summary("plain      ", plain.stats))
    print(_summary("speculative", spec.stats))
    base = max(plain.stats.tokens_per_s, 1e-9)
    gain = (spec.stats.tokens_per_s - base) / max(ceiling - base, 1e-9)
    print(f"speedup {spec.stats.tokens_per_s / base:.2f}x ({a.speculation}; the faster of {DEMO_ROUNDS} interleaved "
          f"runs each); ceiling {ceiling / base:.2f}x "
          f"(the best draft lengths with this drafter at the measured costs)"
          + (f", reached {100 * gain:.0f} % of its gain" if ceiling > base else ""))
    if exact_on:  # exact mode: identity was checked, token by token, against the plain run
        print(f"greedy outputs bit-identical: {'yes' if same else 'NO - this is a bug, please report it'} "
              f"(exact mode, {spec.stats.exact})")
        return 0 if same else 1
    print(f"greedy outputs identical: {same} (default mode{': ' + spec.stats.exact if spec.stats.exact else ''}; "
          "verify batches may round differently from one-token decoding)")
    if not same and "plain_margin" in report:
        print(f"first difference at token {report['position']}: top-1/top-2 margins {report['plain_margin']:.3f} "
              f"(plain) / {report['spec_margin']:.3f} (speculative) -> "
              + ("a numerical near-tie: batched verification and single-token decoding round differently"
                 if report["verdict"] == "near-tie" else "NOT a near-tie: please report this"))
    return 0


def cmd_chat(a: argparse.Namespace) -> int:
    """Interactive streaming chat through the drop-in Llama; prints tau and tok/s after each reply."""
    from ..core.rpc import RPCError
    from .llama import Llama

    model = a.model
    drafter = a.drafter
    if model is None:
        from .models import default_target, shipped_drafter

        model = str(default_target())
        shipped = shipped_drafter()
        drafter = drafter or (str(shipped) if shipped else None)
    _speculates(model, drafter)
    llm = Llama(model, draft_model_path=drafter, draft_n_max=a.draft_len, n_ctx=a.n_ctx, n_threads=a.threads,
                seed=a.seed, verbose=a.verbose, exact=a.exact, speculation=a.speculation, **_placement(a))
    messages: list[dict] = [{"role": "system", "content": a.system}] if a.system else []
    interactive = sys.stdin.isatty()
    try:
        while True:
            if interactive:
                print("> ", end="", flush=True)
            line = sys.stdin.readline()
            if not line:
                break
            text = line.strip()
            if not text:
                continue
            if text in ("/exit", "/quit"):
                break
            messages.append({"role": "user", "content": text})
            reply = []
            try:
                for chunk in llm.create_chat_completion(messages, max_tokens=a.max_tokens,
                                                        temperature=a.temperature, seed=a.seed, stream=True):
                    piece = chunk["choices"][0]["delta"].get("content") or ""
                    reply.append(piece)
                    print(piece, end="", flush=True)
            except RPCError as e:  # a lost rpc server: this reply is dropped, the next message reloads
                print(f"\nllama-dflash: error: {e}", file=sys.stderr)
                messages.pop()
                continue
            print()
            messages.append({"role": "assistant", "content": "".join(reply)})
            s = llm.last_speculative_stats
            if s is not None:
                print(f"[{s.n_generated} tokens, {s.tokens_per_s:.1f} tok/s, tau {s.tau:.2f}, {s.mode}"
                      + (f", fallback: {s.fallback_reason}" if s.fallback_reason else "") + "]", file=sys.stderr)
    finally:
        llm.close()
    return 0


def cmd_train(a: argparse.Namespace) -> int:
    """The drafter recipe (data -> features -> DFlash v1 -> DFlash2 -> HF -> GGUF), resumable."""
    from ..train.run import RunSpec, run

    if a.target is None:
        from .models import default_target

        a.target = str(default_target())
    spec = RunSpec.smoke(a.target) if a.smoke else RunSpec(target=a.target)
    for k in ("prompts", "max_new", "sampled_every", "samples", "max_sequences", "v1_steps", "v2_steps", "n_layer",
              "block_size", "outtype", "final_type", "seed", "draft_vocab", "tune_steps", "init", "feature_format",
              "top_k", "distill", "prompt_sources", "data", "extend", "temperatures"):
        v = getattr(a, k)
        if v is not None:
            setattr(spec, k, v)
    if (spec.prompts < 0 or spec.max_sequences < 0 or spec.sampled_every < 0 or spec.samples < 1
            or spec.max_new < 1 or spec.v1_steps < 1 or spec.v2_steps < 1 or spec.block_size < 2 or spec.n_layer < 1
            or spec.draft_vocab < 0 or spec.tune_steps < 0 or spec.top_k < 0):
        raise ValueError("--prompts, --sampled-every, --max-sequences, --draft-vocab, --tune-steps and --top-k must be "
                         ">= 0; "
                         "--samples, --max-new, --v1-steps, --v2-steps and --n-layer >= 1; --block-size >= 2")
    s = run(a.out, spec)
    if a.json:
        print(json.dumps(s))
        return 0
    last = (s["held_out"].get("tune") or s["held_out"].get("v2") or [{}])[-1]
    print(f"wrote {s['gguf']['path']} ({s['gguf']['bytes'] / 2**20:.1f} MiB, {s['gguf']['final_type']}); "
          f"data {s['data']['sequences']} sequences / {s['data']['response_tokens']} response tokens; "
          f"held-out block tau {last.get('block_tau')}, path tau {last.get('path_tau')}; "
          f"wall {sum(s['wall_s'].values()):.0f} s")
    return 0


def cmd_convert(a: argparse.Namespace) -> int:
    from ..formats import convert_hf_to_gguf

    if a.speculators:
        from ..formats.hf import write_speculators

        print(f"wrote {write_speculators(a.hf_dir, a.target, a.speculators, verifier=a.verifier)} "
              "(speculators' schema)")
        return 0
    res = convert_hf_to_gguf(a.hf_dir, a.target, a.outfile, outtype=a.outtype, progress=True)
    print(f"wrote {res['outfile']}: DFlash{'2' if res['version'] == 2 else ''} drafter, {res['tensors']} tensors, "
          f"{res['bytes'] / 2**20:.1f} MiB ({res['outtype']})")
    return 0


def cmd_reduce_vocab(a: argparse.Namespace) -> int:
    from ..formats.vocab import choose_vocab, eog_ids, read_token_sources, reduce_vocab

    counts = read_token_sources(a.target, a.tokens)
    keep = choose_vocab(counts, a.size, eog_ids(a.target))
    out = reduce_vocab(a.drafter, a.target, a.out, keep)
    covered = counts[keep].sum() / max(1, counts.sum())
    print(f"wrote {out}: {a.size} draft tokens covering {100 * covered:.2f}% of {int(counts.sum())} counted "
          f"tokens, {out.stat().st_size / 2**20:.1f} MiB")
    return 0


def cmd_quantize(a: argparse.Namespace) -> int:
    from ..formats.gguf import quantize_drafter

    res = quantize_drafter(a.drafter, a.out, a.outtype)
    print(f"wrote {res['path']}: {res['tensors_changed']} matrices as {a.outtype}, {res['bytes'] / 2**20:.1f} MiB")
    return 0


def cmd_inspect(a: argparse.Namespace) -> int:
    from ..formats.inspect import describe, fit

    info = describe(a.file)
    verdict = fit(a.file, a.target) if a.target else None
    if a.json:
        print(json.dumps({**info, "fits_target": verdict}))
        return 0 if verdict is None or verdict["ok"] else 1
    print(f"{info['file']}: DFlash{'2' if info['version'] == 2 else ''} drafter, {info['bytes'] / 2**20:.1f} MiB")
    print(f"  block size {info['block_size']}, taps {info['target_layers']} (HF ids), mask token "
          f"{info['mask_token_id']}")
    print(f"  {info['n_layer']} layers, hidden {info['n_embd']}, heads {info['n_head']}/{info['n_head_kv']} x "
          f"{info['head_dim']}, ffn {info['n_ff']}, causal {info['causal']}, sliding window {info['n_swa']}")
    if info["version"] == 2:
        print("  DFlash2: " + ", ".join(f"{k} {info[k]}" for k in ("conv_kernel_size", "conv_group_size",
                                                                   "selector_rank", "selector_top_k")))
    print("  draft vocabulary: " + (f"{info['draft_vocab']} tokens (d2t, own head)" if info["draft_vocab"]
                                    else "the target's (borrowed head)"))
    print(f"  {info['n_tensors']} tensors: " + ", ".join(f"{n} {k}" for k, n in info["types"].items()))
    for name, shape, typ in info["tensors"]:
        print(f"    {name:40s} {str(shape):24s} {typ}")
    if verdict is not None:
        print(f"target {a.target}: " + ("speculates with this drafter" if verdict["ok"]
                                        else f"will not speculate: {verdict['error']}"))
    return 0 if verdict is None or verdict["ok"] else 1


def cmd_diff(a: argparse.Namespace) -> int:
    """Plain vs speculative on the same request; classify the first divergence."""
    from ..core.generator import SpeculativeGenerator

    sp = _sampling(a)
    if sp.temperature > 0 and sp.mode == "rejection":
        raise ValueError("rejection mode is not seed-identical to plain decoding by design: diff it with --mode match")
    _speculates(a.model, a.drafter)
    with SpeculativeGenerator(a.model, a.drafter, n_ctx=a.n_ctx, n_threads=a.threads, verbose=None,
                              exact=a.exact, **_placement(a)) as g:
        toks = g.tokenize(_prompt(a))
        plain = g.generate(toks, a.max_tokens, draft_len=0, sampling=sp, return_margins=True)
        steps: list[dict] = []
        spec = g.generate(toks, a.max_tokens, draft_len=a.draft_len, sampling=sp, return_margins=True,
                          on_step=steps.append, speculation=a.speculation)
        replay = None
        if g.exact_verdict is not None:  # no numerics to certify: any divergence is a bug
            report = divergence_report(g, plain, spec, a.eps, sampled=sp.temperature > 0)
            return _exact_diff(a, report, spec.stats.exact)
        if sp.temperature == 0 and not a.no_replay and not a.rpc:  # (the replay runs locally)
            replay = replay_divergence(a.model, toks, plain, spec, steps, a.n_ctx, a.threads, g.flash_attn)
        report = divergence_report(g, plain, spec, a.eps, sampled=sp.temperature > 0, replay=replay)
    i = report.get("position")
    if a.json:
        print(json.dumps(report))
    elif i is None:
        print(f"identical: {report['n_tokens']} tokens (tau {report['tau']:.2f})")
    else:
        print(f"first divergence at generated token {i}")
        _print_tokens(report)
        rp = report.get("replay")
        if rp and rp["gap_in_spec_batches"] is not None:
            print(f"  plain llama-cpp-python's logit gap (its token - the speculative one): "
                  f"{rp['gap_one_by_one']:.4f} one token per decode, {rp['gap_in_spec_batches']:.4f} "
                  "in the speculative run's verify batches")
        print({"batch-numerics": "verdict: llama.cpp batch numerics (certified): plain llama-cpp-python picks the "
                                 "speculative token itself when it evaluates the speculative run's batches; "
                                 "not a drafter bug",
               "near-tie": f"verdict: numerical near-tie (margin < {a.eps}): batched verification and "
                           "single-token decoding round differently; not a drafter bug",
               "sampled": "verdict: sampled run - a near-tie moves a draw when the two rows differ in their last "
                          "digits; the argmax margins above are for reference",
               "mismatch": "verdict: REAL MISMATCH - the outputs differ where the target is not near a tie: "
                           "this is a bug, please report it",
               "length": "verdict: one run stopped earlier (end of sequence)"}[report["verdict"]])
    return 1 if report.get("verdict") == "mismatch" else 0


def _print_tokens(report: dict) -> None:
    """Both runs' tokens at the first divergence, with their rows' top-1/top-2 margins."""
    if "plain_token" in report:
        for who, k in (("plain      ", "plain"), ("speculative", "spec")):
            print(f"  {who}: {report[k + '_token']} {report[k + '_piece']!r}, top-1/top-2 margin "
                  f"{report[k + '_margin']:.4f}")


def _exact_diff(a: argparse.Namespace, report: dict, checked: str) -> int:
    """diff in exact mode: identity expected; a divergence exits 1 with both tokens and margins."""
    i = report.get("position")
    if a.json:
        print(json.dumps({**report, "exact": checked}))
    elif i is None:
        print(f"bit-identical: {report['n_tokens']} tokens (tau {report['tau']:.2f}; exact mode, {checked})")
    else:
        print(f"DIVERGENCE in exact mode at generated token {i} (a bug: please report it; {checked})")
        _print_tokens(report)
    return 0 if i is None else 1


def _prompt(a: argparse.Namespace) -> str:
    if a.prompt_file is None:
        return a.prompt
    try:
        return open(a.prompt_file, encoding="utf-8").read()
    except OSError as e:
        raise DFlashError(f"cannot read prompt file {a.prompt_file!r}: {e.strerror}") from None


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="llama-dflash", description="DFlash speculative decoding for llama.cpp GGUF models")
    sub = p.add_subparsers(dest="cmd", required=True, parser_class=_Parser)
    g = sub.add_parser("generate", help="generate from a prompt")
    g.add_argument("--model", required=True, help="target GGUF")
    g.add_argument("--drafter", default=None, help="DFlash drafter GGUF (omit for plain decoding)")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt")
    src.add_argument("--prompt-file")
    _add_common(g)
    _add_sampling(g)
    _add_exact(g)
    _add_rpc(g)
    g.set_defaults(func=cmd_generate)
    d = sub.add_parser("demo", help="plain vs speculative on the embedded default model")
    _add_common(d)
    _add_exact(d)
    _add_rpc(d)
    d.set_defaults(func=cmd_demo)
    df = sub.add_parser("diff", help="plain vs speculative side by side; classify the first divergence")
    df.add_argument("--model", required=True)
    df.add_argument("--drafter", required=True)
    src = df.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt")
    src.add_argument("--prompt-file")
    df.add_argument("--eps", type=_float("eps", 0.0), default=0.1,
                    help="top-1/top-2 logit margin below which a divergence is a numerical near-tie")
    df.add_argument("--no-replay", action="store_true",
                    help="greedy: do not replay the speculative run's batches in plain llama-cpp-python (a second "
                         "copy of the model) to certify a divergence; classify by --eps alone")
    _add_common(df)
    _add_sampling(df)
    _add_exact(df, EXACT_HELP + "; in exact mode any divergence exits 1")
    _add_rpc(df)
    df.set_defaults(func=cmd_diff)
    ch = sub.add_parser("chat", help="interactive streaming chat (default: the embedded model and drafter)")
    ch.add_argument("--model", default=None, help="target GGUF (default: the embedded SmolLM2-135M-Instruct)")
    ch.add_argument("--drafter", default=None, help="drafter GGUF (default with the embedded model: the shipped one)")
    ch.add_argument("--system", default=None, help="system message")
    ch.add_argument("--max-tokens", type=_int(1), default=256)
    ch.add_argument("--draft-len", type=_int(0, lib.DFLASH_MAX_DRAFT), default=None)
    ch.add_argument("--speculation", choices=SPECULATION, default="auto", help=SPECULATION_HELP)
    ch.add_argument("--n-ctx", type=_int(1, 2**24), default=4096)
    ch.add_argument("--threads", type=_int(1, 1024), default=None)
    ch.add_argument("--temperature", type=_float("temperature", 0.0), default=0.0)
    ch.add_argument("--seed", type=_seed, default=0xFFFFFFFF)
    ch.add_argument("--verbose", action="store_true")
    _add_exact(ch)
    _add_rpc(ch)
    ch.set_defaults(func=cmd_chat)
    # `serve` is parsed by the server itself (main() hands it every argument); listed for --help
    sub.add_parser("serve", help="OpenAI-compatible server: llama-dflash serve --model T.gguf --draft_model_path "
                                 "D.gguf [...] (see llama-dflash serve --help)")
    t = sub.add_parser("train", help="train a DFlash2 drafter for a target on its own generations (resumable)")
    t.add_argument("--out", required=True, help="run directory (data, checkpoints, hf/, drafter.gguf, summary.json)")
    t.add_argument("--target", default=None, help="target GGUF (default: the embedded SmolLM2-135M-Instruct)")
    t.add_argument("--smoke", action="store_true", help="tiny data and a few steps, end to end (a minute or two)")
    t.add_argument("--prompts", type=_int(-_I32), default=None, help="training prompts (0 = all)")
    t.add_argument("--max-new", type=_int(-_I32), default=None, help="response tokens per prompt")
    t.add_argument("--sampled-every", type=_int(-_I32), default=None,
                   help="every k-th prompt also gets sampled responses (default 1; 0 = greedy only)")
    t.add_argument("--samples", type=_int(-_I32), default=None,
                   help="sampled responses per such prompt and temperature (default 1)")
    t.add_argument("--temperatures", default=None, metavar="T,T", type=_floats,
                   help="the sampled responses' temperatures, each > 0 (default 0.7; e.g. 0.7,1.0)")
    t.add_argument("--max-sequences", type=_int(-_I32), default=None,
                   help="train on at most this many generated sequences")
    t.add_argument("--v1-steps", type=_int(-_I32), default=None)
    t.add_argument("--v2-steps", type=_int(-_I32), default=None)
    t.add_argument("--n-layer", type=_int(-_I32), default=None)
    t.add_argument("--block-size", type=_int(-_I32), default=None)
    t.add_argument("--outtype", default=None, choices=OUTTYPES, help="the converter's matrix type (default q8_0)")
    t.add_argument("--final-type", default=None, choices=OUTTYPES,
                   help="drafter.gguf's matrices, re-encoded after the vocabulary stage (default q4_0: the CPU "
                        "repacks it for its multi-row kernels)")
    t.add_argument("--seed", type=_int(-_I32), default=None)
    t.add_argument("--draft-vocab", type=_int(-_I32), default=None,
                   help="keep the N most frequent tokens in the drafter's own head (default 8192; 0 = all)")
    t.add_argument("--tune-steps", type=_int(-_I32), default=None,
                   help="DFlash2 steps continued in the draft vocabulary (default 10800; 0 = none)")
    t.add_argument("--feature-format", default=None, choices=list(FEATURE_FORMATS),
                   help="features on disk: 8-bit rows (default, 2.9 KB per token for SmolLM2's 5 taps) or fp16")
    t.add_argument("--top-k", type=_int(-_I32), default=None,
                   help="the target's top-k next-token log-probabilities kept per position (default 32; 0 = none)")
    t.add_argument("--distill", type=_float("distill", 0.0, 1.0), default=None,
                   help="weight of the loss against the target's top-k distribution (default 0: the generated "
                        "tokens only; needs --top-k > 0)")
    t.add_argument("--prompt-sources", default=None, type=lambda v: [x.strip() for x in v.split(",") if x.strip()],
                   metavar="A,B", help="prompt sources (stdlib-code, authored, package-code, raw-code, "
                                       "package-more, raw-more; default stdlib-code,authored; "
                                       "docs/training-data.md)")
    t.add_argument("--init", default=None, metavar="RUN_DIR|DRAFTER.gguf",
                   help="start from a finished run's final weights, or from a DFlash2 drafter file (e.g. the "
                        "shipped one; same drafter shape and target; its draft vocabulary is kept), and train "
                        "only the tuning stage on this run's data")
    t.add_argument("--data", default=None, metavar="RUN_DIR",
                   help="train on another run's finished data (read only; no generation): e.g. several "
                        "--max-sequences samples of one data set")
    t.add_argument("--extend", default=None, metavar="RUN_DIR",
                   help="start this run's data from another run's (same --max-new, --seed, taps, feature format "
                        "and --top-k): its responses and rows are copied, generation adds what it lacks, e.g. "
                        "for more --prompts")
    t.add_argument("--json", action="store_true")
    t.add_argument("--verbose", action="store_true")
    t.set_defaults(func=cmd_train)
    c = sub.add_parser("convert", help="HF DFlash/DFlash2 checkpoint (z-lab's or speculators' schema) -> GGUF "
                                       "drafter, or -> a speculators checkpoint (--speculators)")
    c.add_argument("hf_dir")
    c.add_argument("--target", required=True, help="the target model's GGUF, or its HF directory (vocabulary, sizes)")
    out = c.add_mutually_exclusive_group(required=True)
    out.add_argument("--outfile", help="the GGUF drafter to write")
    out.add_argument("--speculators", metavar="DIR", help="write a checkpoint in vLLM speculators' schema instead")
    c.add_argument("--verifier", help="with --speculators: the verifier's name or path to record (default: --target)")
    c.add_argument("--outtype", default="f16", choices=OUTTYPES)
    c.add_argument("--verbose", action="store_true")
    c.set_defaults(func=cmd_convert)
    r = sub.add_parser("reduce-vocab", help="a drafter that proposes only the N most frequent tokens (cheaper "
                                            "drafting on CPU; outputs stay exact)")
    r.add_argument("drafter", help="a drafter GGUF that borrows the target's head")
    r.add_argument("--target", required=True, help="the target GGUF (its head rows are copied)")
    r.add_argument("--size", type=_int(1), required=True, help="draft vocabulary size, e.g. 8192")
    r.add_argument("--tokens", nargs="+", required=True,
                   help="what to count: text files (tokenized with the target) or .npy token-id arrays")
    r.add_argument("--out", required=True)
    r.add_argument("--verbose", action="store_true")
    r.set_defaults(func=cmd_reduce_vocab)
    q = sub.add_parser("quantize", help="a drafter GGUF with its matrices in another type (q4_0: the CPU's "
                                        "repacked kernels, drafts about twice as fast as q8_0)")
    q.add_argument("drafter", help="a drafter GGUF")
    q.add_argument("--outtype", required=True, choices=OUTTYPES)
    q.add_argument("--out", required=True)
    q.add_argument("--verbose", action="store_true")
    q.set_defaults(func=cmd_quantize)
    i = sub.add_parser("inspect", help="describe a drafter GGUF (and whether it speculates with a target)")
    i.add_argument("file")
    i.add_argument("--target", default=None)
    i.add_argument("--json", action="store_true")
    i.add_argument("--verbose", action="store_true")
    i.set_defaults(func=cmd_inspect)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["serve"]:  # the server's own parser takes every argument after `serve`
        try:
            from .server import main as server_main
        except ImportError as e:  # the server extras are not installed
            print(f"llama-dflash: error: {e}", file=sys.stderr)
            return 2
        return server_main(argv[1:])
    a = build_parser().parse_args(argv)
    # Errors are reported by us, in one line; llama.cpp's log only on request.
    logging.getLogger("llama-cpp-python").setLevel(logging.DEBUG if a.verbose else logging.CRITICAL + 1)
    if getattr(a, "no_kernels", False):
        from ..core import kernels

        kernels.set_enabled(False)
    try:
        return a.func(a)
    except (DFlashError, OSError, ValueError) as e:  # ConvertError is a ValueError
        print(f"llama-dflash: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
