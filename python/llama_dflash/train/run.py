"""`llama-dflash train`: the whole drafter recipe as one resumable run (docs/architecture.md §6.6).

Stages, each skipped when its output exists (so an interrupted run picks up where it
stopped; added responses capture only their new sequences): data (the target's responses,
batched, features and top-k log-probabilities captured in the same pass) -> features (the training set; a
second pass only for responses without rows) -> DFlash v1 training -> DFlash2 training
(v1 weights, identity convolutions, fresh selector, joint unary + selector loss) -> DFlash2
tuned (continued at a lower learning rate) -> HF export (config.json + model.safetensors, the
z-lab layout) -> GGUF through the converter (the path downloaded drafters take) -> the draft
vocabulary's head rows and d2t map.  Every stage scores in the draft vocabulary (the most
frequent training tokens, what the shipped head proposes), chosen once before training.
With ``init`` (an earlier finished run) the v1 and v2 stages are that run's final weights and
only the tuning stage trains, on this run's data: more data without repeating the first stages
(the earlier run's responses and features are reused when made with the same settings).
``summary.json`` records data sizes, wall times and held-out metrics of every stage.
"""

from __future__ import annotations

import json
import math
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from ..formats.gguf import OUTTYPES, DrafterConfig, quantize_drafter, read_tensors
from ..formats.hf import convert_hf_to_gguf, default_target_layer_ids, read_target, write_speculators
from ..formats.safetensors import write_safetensors
from ..verify.reference import DFlashReference
from .data import Dataset, DataSpec, Progress, build_features, generate_responses, index_shared, top_k_coverage
from .loop import TrainConfig, Trainer, evaluate_source, exported_state, whiten_features, with_feature_scale
from .prompts import DEFAULT_SOURCES, check_sources, prompt_licences, training_prompts
from .store import FORMATS, RowStore, StoreMismatch


@dataclass
class RunSpec:
    target: str
    prompts: int = 0                    # training prompts (0 = all)
    max_new: int = 192
    n_seq: int = 32                     # sequences per decode while generating (speed only: bench_data nseq)
    max_sequences: int = 0              # train on at most this many generated sequences (0 = all)
    sampled_every: int = 1              # every k-th prompt also gets sampled responses (0 = none)
    samples: int = 1                    # sampled responses per such prompt and temperature
    temperatures: list[float] = field(default_factory=lambda: [0.7])  # the sampled responses' temperatures
    taps: list[int] | None = None       # HF layer ids; default: z-lab's formula for 5 taps
    n_layer: int = 2
    block_size: int = 8
    mask_token_id: int = 16             # SmolLM2's <empty_output>: a special token the target never emits
    n_ff: int | None = None             # default: the target's
    v1_steps: int = 1100
    v2_steps: int = 1300
    v1_lr: float = 1e-3
    v2_lr: float = 5e-4
    seqs_per_step: int = 4
    anchors_per_seq: int = 32
    selector_rank: int = 64
    selector_top_k: int = 8
    conv_kernel_size: int = 2
    conv_group_size: int = 16
    eval_every: int = 250
    ckpt_every: int = 50
    outtype: str = "q8_0"               # the converter's matrix type (drafter-fullvocab.gguf)
    final_type: str = "q4_0"            # drafter.gguf's matrices, re-encoded by llama-dflash quantize after the
                                        # vocabulary stage ("" = outtype): q4_0 is what the CPU repacks
    whiten_features: bool = True        # train fc on standardised features (folded into fc on export)
    seed: int = 0
    draft_vocab: int = 8192             # reduced draft vocabulary: the most frequent tokens of the training
                                        # data (0 = the target's whole vocabulary); cuts the head's cost
    tune_steps: int = 10800             # DFlash2 continued at a lower learning rate (every stage scores in the
    tune_lr: float = 3e-4               # draft vocabulary: a step costs under half a full-vocabulary one)
    feature_format: str = "q8"          # features on disk: "q8" (8-bit rows) or "f16"
    top_k: int = 32                     # the target's top-k log-probabilities kept per position (0 = none)
    distill: float = 0.0                # weight of the loss against those (1 - distill: the sampled token's)
    prompt_sources: list[str] | None = None  # train/prompts.py SOURCES (None: DEFAULT_SOURCES)
    init: str = ""                      # a finished run directory, or a DFlash2 drafter GGUF, of the same drafter
                                        # shape: start from its final weights and train only the tuning stage
                                        # on this run's data (a GGUF's draft vocabulary is kept)
    data: str = ""                      # another run directory whose finished data to train on (read only, no
                                        # generation): e.g. several max_sequences samples of one data set
    extend: str = ""                    # another run directory whose data this run's data starts from: its
                                        # responses and rows are copied, generation adds only what it lacks
                                        # (e.g. more prompts: the first ones keep their places in the mix)

    @classmethod
    def smoke(cls, target: str) -> RunSpec:
        """Tiny data and a few steps, end to end through export and conversion (tests)."""
        return cls(target=target, prompts=6, max_sequences=0, max_new=24, n_seq=4, v1_steps=6, v2_steps=6,
                   seqs_per_step=2, anchors_per_seq=8, eval_every=3, ckpt_every=2, selector_rank=16,
                   selector_top_k=4, outtype="f16", final_type="", draft_vocab=256, tune_steps=6)


def _target_config(target: str) -> dict:
    """The target's sizes from its GGUF (read once per run)."""
    from gguf import GGUFReader

    n_vocab = read_target(target).n_vocab  # also the clear error for a missing / unreadable file
    r = GGUFReader(target)
    arch = r.fields["general.architecture"].contents()

    def get(k, default=None):
        f = r.fields.get(f"{arch}.{k}")
        return f.contents() if f is not None else default

    n_head = int(get("attention.head_count"))
    n_embd = int(get("embedding_length"))
    return {"arch": arch, "n_vocab": n_vocab, "n_embd": n_embd, "n_layer": int(get("block_count")), "n_head": n_head,
            "n_head_kv": int(get("attention.head_count_kv", n_head)),
            "head_dim": int(get("attention.key_length", n_embd // n_head)), "n_ff": int(get("feed_forward_length")),
            "rope_theta": float(get("rope.freq_base", 10000.0)),
            "rms_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
            "context_length": int(get("context_length", 8192))}


def check_spec(spec: RunSpec, t: dict) -> None:
    """What the runtime and the converter would refuse, refused before any data is generated."""
    usable = t["n_layer"] - 2  # the last layer's output is pruned to output rows inside llama.cpp
    bad = [i for i in spec.taps if not 0 <= i <= usable]
    if bad:
        raise ValueError(f"tap {bad[0]} is not a usable layer of the target (0..{usable} of {t['n_layer']})")
    if not 0 <= spec.mask_token_id < t["n_vocab"]:
        raise ValueError(f"mask token {spec.mask_token_id} lies outside the target vocabulary ({t['n_vocab']})")
    E, K = t["n_embd"], spec.selector_top_k
    if E % spec.conv_group_size:
        raise ValueError(f"conv_group_size {spec.conv_group_size} does not divide the hidden size {E}")
    if K * (K + 1) > E:
        raise ValueError(f"selector_top_k {K} needs a hidden size >= K(K+1) = {K * (K + 1)} (target: {E})")
    if 0 < spec.draft_vocab < K:
        raise ValueError(f"a draft vocabulary of {spec.draft_vocab} tokens is smaller than selector_top_k {K}")
    check_sources(spec.prompt_sources or ())
    if spec.distill and not spec.top_k:
        raise ValueError("distillation (distill > 0) trains on the target top-k log-probabilities: top_k must be >= 1")
    if spec.outtype not in OUTTYPES or spec.final_type not in ("", *OUTTYPES):
        raise ValueError(f"outtype must be one of {', '.join(OUTTYPES)} (final_type also ''), "
                         f"got {spec.outtype!r} / {spec.final_type!r}")
    if spec.feature_format not in FORMATS:
        raise ValueError(f"feature_format must be {' or '.join(FORMATS)}, got {spec.feature_format!r}")
    if not spec.temperatures or len(set(spec.temperatures)) != len(spec.temperatures) \
            or not all(math.isfinite(t) and t > 0 for t in spec.temperatures):
        raise ValueError(f"temperatures must be distinct and > 0, got {spec.temperatures!r}")
    if spec.init and spec.tune_steps < 1:
        raise ValueError("starting from an earlier run (init) trains the tuning stage only: tune_steps must be >= 1")


# settings that fix what a data directory holds: a run that trains on another's data (data) must share them
_DATA = ("max_new", "seed", "taps", "feature_format", "top_k")


def _other_run(src: Path, what: str, spec: RunSpec) -> tuple[dict, dict]:
    """Another run directory's summary and its settings (defaults filled in), or a one-line error."""
    path = src / "summary.json"
    if not path.is_file():
        raise ValueError(f"{what} {src}: not a training run directory (no summary.json)")
    try:
        prev = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ValueError(f"{what} {src}: {path.name} cannot be read ({e})") from None
    if not isinstance(prev, dict) or not isinstance(prev.get("spec"), dict):
        raise ValueError(f"{what} {src}: {path.name} holds no run settings")
    return prev, {**asdict(RunSpec(target=spec.target)), **prev["spec"]}


def _data_source(spec: RunSpec, what: str = "data") -> Path:
    """The data directory of run `spec.data` (or `spec.extend`), checked to hold data made as this
    run would make it."""
    src = Path(getattr(spec, what))
    _, pspec = _other_run(src, what, spec)
    other = [k for k in _DATA if pspec[k] != getattr(spec, k)]
    if other:
        raise ValueError(f"{what} {src}: made with other settings ({', '.join(f'{k}={pspec[k]}' for k in other)})")
    if what == "extend":
        if not (src / "data" / "responses.jsonl").is_file():
            raise ValueError(f"extend {src}: no responses there yet")
        _check_target(src, what, pspec, spec, rows=src / "data" / "rows")
    return src / "data"


def _check_target(src: Path, what: str, pspec: dict, spec: RunSpec, rows: Path | None = None) -> None:
    """One line unless run `src` (settings pspec) was made for this run's target: the capture id of its
    row store `rows` where it has one, else that of the target file it names (which must be there)."""
    from .data import _capture_id

    try:
        theirs = RowStore.open(rows).meta["capture"] if rows is not None and (rows / "meta.json").is_file() else None
    except (StoreMismatch, OSError, ValueError, KeyError, TypeError):
        theirs = None
    if theirs is None:
        if not Path(pspec["target"]).is_file():
            raise ValueError(f"{what} {src}: its target {pspec['target']} is missing (needed to check it is this one)")
        theirs = _capture_id(DataSpec(pspec["target"], spec.taps))
    if theirs != _capture_id(DataSpec(spec.target, spec.taps)):
        made = "trained" if what == "init" else "its data was made"
        raise ValueError(f"{what} {src}: {made} for another target ({pspec['target']})")


def _extended(spec: RunSpec) -> list[Path]:
    """The data directories `spec.extend` copies from: that run's, then those it extended in turn (a run
    stopped before its features stage has not copied their rows yet)."""
    out = [_data_source(spec, "extend")]
    src = Path(spec.extend)
    while True:
        try:
            prev = json.loads((src / "summary.json").read_text())["spec"]["extend"]
        except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError):
            return out
        if not isinstance(prev, str) or not prev or not (Path(prev) / "data").is_dir() or len(out) > 16:
            return out
        src = Path(prev)
        if (src / "data").resolve() in {d.resolve() for d in out}:
            return out
        out.append(src / "data")


# settings that change only how fast a run goes: resuming with other values is allowed
_SPEED = ("n_seq",)

# settings that fix the drafter's shape and inputs: a run started from another (init) must share them
_SHAPE = ("taps", "n_layer", "block_size", "mask_token_id", "n_ff", "selector_rank", "selector_top_k",
          "conv_kernel_size", "conv_group_size", "whiten_features")


def _init_source(spec: RunSpec, t: dict) -> tuple[dict, dict]:
    """The finished run `spec.init` (what the summary records of it) and its final weights,
    checked to be this drafter shape for the same target before any data is made; or a drafter
    GGUF (`_init_gguf`)."""
    src = Path(spec.init)
    if src.suffix == ".gguf" or src.is_file():
        return _init_gguf(spec, src, t)
    prev, pspec = _other_run(src, "init", spec)
    if "gguf" not in prev:
        raise ValueError(f"init {src}: that run has not finished (no drafter written yet)")
    other = [k for k in _SHAPE if pspec[k] != getattr(spec, k)]
    if other:
        theirs = ", ".join(f"{k}={pspec[k]}" for k in other)
        raise ValueError(f"init {src}: trained with other settings ({theirs})")
    _check_target(src, "init", pspec, spec)
    stage, state, steps = final_weights(src, pspec, what="init ")
    held = (prev.get("held_out", {}).get(stage) or [{}])[-1]
    # its responses and features serve this run too when they were made the same way
    same_data = all(pspec[k] == getattr(spec, k) for k in ("max_new", "seed")) and (src / "data").is_dir()
    info = {"run": str(src.resolve()), "stage": stage, "steps": steps, "held_out_there": held,
            "data": prev.get("data", {}), "wall_s": prev.get("wall_s", {}),
            "reuse_data": str((src / "data").resolve()) if same_data else None,
            "draft_vocab": _run_vocab(src, prev, spec.draft_vocab)}
    return info, state


def _run_vocab(src: Path, prev: dict, draft_vocab: int):
    """A finished run's draft vocabulary (d2t) when it had one of this size: continued training keeps it
    (the selector rows of tokens outside it were never trained), else None (chosen from this run's data)."""
    g = prev.get("gguf", {})
    if not draft_vocab or not isinstance(g, dict) or g.get("draft_vocab") != draft_vocab:
        return None
    path = Path(str(g.get("before_final_type") or g.get("path", "")))
    if not path.is_file():  # (recorded relative to another directory, or the run has moved)
        path = src / path.name
    try:
        d2t = read_tensors(path, ["d2t"]).get("d2t") if path.is_file() else None
    except Exception:  # noqa: BLE001 - a damaged file: the one-line error below
        d2t = None
    if d2t is None or d2t.size != draft_vocab:
        raise ValueError(f"init {src}: the draft vocabulary of that run ({path}) cannot be read")
    return d2t.astype(np.int64)


def _init_gguf(spec: RunSpec, src: Path, t: dict) -> tuple[dict, dict]:
    """A drafter file as the starting point: a shipped or converted DFlash2 drafter (dequantized;
    its feature scale is folded into fc, ``run`` unfolds it with this run's).  It must be the
    drafter this spec would train for this target; a reduced one keeps its draft vocabulary (its
    selector rows outside it were never trained)."""
    from ..formats.check import check_drafter

    try:
        have = check_drafter(src)  # the loader's own checks: a missing or corrupt file ends here
    except Exception as e:
        raise ValueError(f"init {src}: {e}") from None
    if not have.is_v2:
        raise ValueError(f"init {src}: a DFlash v1 drafter; the tuning stage trains DFlash2 (start from a DFlash2 "
                         "drafter or a run directory)")
    want = asdict(drafter_config(spec, 2, t))
    other = [k for k, v in asdict(have).items() if k != "n_vocab_draft" and v != want[k]]
    if other:
        theirs = ", ".join(f"{k}={getattr(have, k)}" for k in other)
        raise ValueError(f"init {src}: not the drafter this run trains for this target ({theirs}; "
                         f"this run: {', '.join(f'{k}={want[k]}' for k in other)})")
    reduced = 0 < have.n_vocab_draft < have.n_vocab
    if reduced and have.n_vocab_draft != spec.draft_vocab:
        raise ValueError(f"init {src}: its draft vocabulary has {have.n_vocab_draft} tokens (draft_vocab "
                         f"{spec.draft_vocab})")
    model = DFlashReference.from_gguf(src)
    state = {k: v.float() for k, v in model.state_dict().items()}
    info = {"drafter": str(src.resolve()), "bytes": src.stat().st_size, "stage": "gguf", "steps": 0,
            "reuse_data": None, "draft_vocab": model.d2t.numpy() if reduced else None}
    return info, state


def final_weights(src: Path, pspec: dict, what: str = "") -> tuple[str, dict, int]:
    """A finished run's last trained stage (run settings `pspec`): (stage, model state, steps)."""
    stage = "tune" if pspec["tune_steps"] else "v2"
    ckpt_path = src / f"ckpt-{stage}.pt"
    try:
        ckpt = torch.load(ckpt_path, weights_only=False)
        return stage, ckpt["model"], int(ckpt["step"])
    except FileNotFoundError:
        raise ValueError(f"{what}{src}: its final checkpoint {ckpt_path.name} is missing") from None
    except Exception as e:  # a truncated or foreign file: torch raises several kinds
        raise ValueError(f"{what}{src}: cannot read {ckpt_path.name} ({type(e).__name__}: {e})") from None


def drafter_config(spec: RunSpec, version: int, t: dict) -> DrafterConfig:
    """The drafter's shape for target config t (from _target_config)."""
    cfg = DrafterConfig(n_embd=t["n_embd"], n_layer=spec.n_layer, n_head=t["n_head"], n_head_kv=t["n_head_kv"],
                        head_dim=t["head_dim"], n_ff=spec.n_ff or t["n_ff"], target_layers=list(spec.taps),
                        block_size=spec.block_size, mask_token_id=spec.mask_token_id, rope_theta=t["rope_theta"],
                        rms_eps=t["rms_eps"], n_ctx_train=t["context_length"])
    if version == 2:
        cfg.conv_kernel_size, cfg.conv_group_size = spec.conv_kernel_size, spec.conv_group_size
        cfg.selector_rank, cfg.selector_top_k = spec.selector_rank, spec.selector_top_k
        cfg.n_vocab = t["n_vocab"]
    return cfg


def hf_config(cfg: DrafterConfig, t: dict) -> dict:
    """config.json in the z-lab schema (dflash_config nested, as the June 2026 revisions write it)."""
    dc = {"block_size": cfg.block_size, "mask_token_id": cfg.mask_token_id, "target_layer_ids": cfg.target_layers}
    if cfg.is_v2:
        dc.update(conv_kernel_size=cfg.conv_kernel_size, conv_group_size=cfg.conv_group_size,
                  selector_rank=cfg.selector_rank, selector_top_k=cfg.selector_top_k)
    return {"architectures": ["DFlash2DraftModel" if cfg.is_v2 else "DFlashDraftModel"], "model_type": "qwen3",
            "hidden_size": cfg.n_embd, "num_hidden_layers": cfg.n_layer, "num_attention_heads": cfg.n_head,
            "num_key_value_heads": cfg.n_head_kv, "head_dim": cfg.head_dim, "intermediate_size": cfg.n_ff,
            "hidden_act": "silu", "attention_bias": False, "rms_norm_eps": cfg.rms_eps, "vocab_size": t["n_vocab"],
            "num_target_layers": t["n_layer"], "max_position_embeddings": t["context_length"],
            "rope_parameters": {"rope_theta": cfg.rope_theta, "rope_type": "default"}, "is_causal": cfg.causal,
            "tie_word_embeddings": True, "dtype": "float32", "dflash_config": dc}


def export_hf(model: DFlashReference, t: dict, out: Path) -> Path:
    """The trained drafter as a HF checkpoint directory (config.json + model.safetensors, f32)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(hf_config(model.cfg, t), indent=1))
    write_safetensors(out / "model.safetensors", {k: v.numpy() for k, v in exported_state(model).items()}, "F32")
    return out


def _feature_sample(ds: Dataset, n_seq: int = 64) -> np.ndarray:
    """Feature rows of up to n_seq training sequences spread over the set (for the per-dimension std)."""
    ids = ds.train_ids[:: max(1, len(ds.train_ids) // n_seq)][:n_seq]
    return np.concatenate([np.asarray(ds.sequence(i)[1], np.float32) for i in ids])


def _init_v1(model: DFlashReference, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        if p.dim() > 1:
            with torch.no_grad():
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)


def _init_v2_from_v1(v2: DFlashReference, v1_state: dict, seed: int) -> None:
    missing, unexpected = v2.load_state_dict(v1_state, strict=False)
    assert not unexpected, unexpected
    g = torch.Generator().manual_seed(seed + 1)
    sel = v2.candidate_selector
    with torch.no_grad():  # convolutions keep their identity init; the selector starts at N(0, 0.02)
        for p in (sel.predecessor_codebook, sel.successor_codebook, sel.hidden_projection.weight):
            p.copy_(torch.randn(p.shape, generator=g) * 0.02)


def run(out: str | Path, spec: RunSpec, log=None) -> dict:
    """Run (or resume) the whole recipe into directory `out`; returns the summary."""
    out = Path(out)
    tinfo = _target_config(spec.target)
    if spec.taps is None:
        spec.taps = default_target_layer_ids(tinfo["n_layer"], 5)
    check_spec(spec, tinfo)
    init, init_state = _init_source(spec, tinfo) if spec.init else (None, None)
    init_vocab = init.pop("draft_vocab", None) if init else None
    if spec.extend:  # (recorded resolved: a chain of extended runs is followed from any directory)
        spec.extend = str(Path(spec.extend).resolve())
    if spec.data and spec.extend:
        raise ValueError("data and extend exclude each other: data trains on another run's data as it is, "
                         "extend copies it into this run's data and adds to it")
    shared = _data_source(spec) if spec.data else None
    extend = _extended(spec) if spec.extend else []
    out.mkdir(parents=True, exist_ok=True)
    logf = open(out / "train.log", "a", encoding="utf-8")

    def say(msg: str) -> None:
        line = f"[{time.strftime('%H:%M:%S')}] {msg}"
        logf.write(line + "\n")
        logf.flush()
        (log or (lambda m: print(m, file=sys.stderr)))(line)

    summary_path = out / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    # a setting added since the run was started (e.g. draft_vocab, a final stage) takes this call's value
    stored = {**asdict(spec), **summary.get("spec", {}), **{k: getattr(spec, k) for k in _SPEED}}
    if stored != asdict(spec):
        raise ValueError(f"{out} holds a run with other settings (see {summary_path}); use another directory")
    summary["spec"] = asdict(spec)
    walls = summary.setdefault("wall_s", {})

    def stage(name: str, fn):
        t0 = time.time()
        r = fn()
        walls[name] = round(walls.get(name, 0.0) + time.time() - t0, 1)
        summary_path.write_text(json.dumps(summary, indent=1))
        return r

    data_dir = shared or out / "data"
    dspec = DataSpec(target=spec.target, taps=spec.taps, max_new=spec.max_new, n_seq=spec.n_seq, seed=spec.seed,
                     max_sequences=spec.max_sequences, sampled_every=spec.sampled_every, samples=spec.samples,
                     temperatures=tuple(spec.temperatures),
                     feature_format=spec.feature_format, top_k=spec.top_k)
    prompts = training_prompts(seed=spec.seed, limit=spec.prompts or None,
                               sources=spec.prompt_sources or DEFAULT_SOURCES)
    reuse = [Path(init["reuse_data"])] if init and init["reuse_data"] and not shared else []
    # the extended run's data first (its responses start this run's, its store's statistics are taken), then
    # what that run extended in turn (rows it had not copied yet)
    reuse = [*extend, *(r for r in reuse if r.resolve() not in {e.resolve() for e in extend})]
    if reuse and not (data_dir / "responses.jsonl").is_file() and (reuse[0] / "responses.jsonl").is_file():
        data_dir.mkdir(parents=True, exist_ok=True)  # generation then adds the prompts the earlier run lacked
        shutil.copyfile(reuse[0] / "responses.jsonl", data_dir / "responses.jsonl")
        say(f"responses: starting from the {reuse[0]} ones")
    index = out / "index.npy" if shared else None
    if shared:  # another run's data, read only: this run's sample of it
        stage("features", lambda: index_shared(shared, dspec, prompts, index, log=say))
    else:  # both resume / no-op when done
        stage("data", lambda: generate_responses(data_dir, dspec, prompts, log=say, reuse=reuse))
        stage("features", lambda: build_features(data_dir, dspec, prompts, log=say, reuse=reuse))
    ds = Dataset(data_dir, index=index)
    resp = int(sum(ds.index[:, 1] - ds.index[:, 2]))
    summary["data"] = {"sequences": len(ds), "tokens": ds.n_tokens, "response_tokens": resp,
                       "train_sequences": len(ds.train_ids), "held_out_sequences": len(ds.val_ids),
                       "sampled_sequences": int((ds.index[:, 3] > 0).sum()),
                       "features_bytes": ds.n_tokens * ds.bytes_per_token,
                       "prompt_sources": sorted({p.source for p in prompts}),
                       "licences": prompt_licences(prompts)}
    if ds.top_k:
        summary["data"]["top_k_coverage"] = round(top_k_coverage(ds.store, ds.index), 4)
        if spec.distill and summary["data"]["top_k_coverage"] < 0.9:
            say(f"warning: distillation has the target's top-k rows at only "
                f"{100 * summary['data']['top_k_coverage']:.1f} % of the response positions (rows captured in a "
                "second pass have none): the rest trains on the sampled tokens alone")
    say(f"data: {summary['data']}")

    t = read_tensors(spec.target, ["token_embd.weight", "output.weight"])
    embed = torch.from_numpy(np.array(t["token_embd.weight"]))  # a writable copy of the reader's array
    head = torch.from_numpy(np.array(t["output.weight"])) if "output.weight" in t else embed

    reduce = 0 < spec.draft_vocab < tinfo["n_vocab"]
    keep = (init_vocab if init_vocab is not None else _draft_vocab(ds, spec, tinfo["n_vocab"])) if reduce else None
    results = summary.setdefault("held_out", {})
    states = {}
    feature_sample = _feature_sample(ds) if spec.whiten_features else None
    stages = [("v1", 1, spec.v1_steps, spec.v1_lr), ("v2", 2, spec.v2_steps, spec.v2_lr)]
    if init:  # the earlier run's final weights stand in for v1 and v2
        states["v2"] = init_state
        summary["init"] = {**init, "start": summary.get("init", {}).get("start")}
        stages = []
    if spec.tune_steps:
        stages.append(("tune", 2, spec.tune_steps, spec.tune_lr))
    for name, version, steps, lr in stages:
        seed = spec.seed + {"v1": 1, "v2": 2, "tune": 3}[name]
        model = DFlashReference(drafter_config(spec, version, tinfo))
        if feature_sample is not None:
            whiten_features(model, feature_sample)  # a loaded state brings its own scale
        if name == "v1":
            _init_v1(model, spec.seed)
        elif name == "v2":
            _init_v2_from_v1(model, states["v1"], spec.seed)
        else:
            model.load_state_dict(with_feature_scale(states["v2"], getattr(model, "feature_scale", None)))
        vocab = torch.as_tensor(keep) if keep is not None else None  # every stage scores in the draft vocabulary
        tc = TrainConfig(steps=steps, lr=lr, seqs_per_step=spec.seqs_per_step, anchors_per_seq=spec.anchors_per_seq,
                         seed=seed, eval_every=spec.eval_every, ckpt_every=spec.ckpt_every, distill=spec.distill)
        tr = Trainer(model, ds, ds.train_ids, embed, head, tc, checkpoint=out / f"ckpt-{name}.pt",
                     val_ids=ds.val_ids or ds.train_ids[:8], log=say, vocab=vocab)
        if init and tr.step == 0:  # where the earlier run's weights start on this run's held-out set
            summary["init"]["start"] = evaluate_source(model, ds, tr.val_ids, embed, tr.head, vocab=vocab)
            say(f"init {spec.init}: held-out {json.dumps(summary['init']['start'])}")
        if tr.step < steps:
            what = {"v1": "DFlash v1", "v2": "DFlash2", "tune": "DFlash2 (tuning)"}[name]
            say(f"training {what}: {sum(p.numel() for p in model.parameters())} "
                f"parameters, {steps} steps x {spec.seqs_per_step} sequences x {spec.anchors_per_seq} anchors")
            bar = Progress(steps, name, done=tr.step)
            stage(name, lambda tr=tr, bar=bar: tr.run(bar))
        results[name] = tr.history
        states[name] = {k: v.clone() for k, v in model.state_dict().items()}
        summary_path.write_text(json.dumps(summary, indent=1))

    hf_dir = stage("export", lambda: export_hf(model, tinfo, out / "hf"))
    stage("speculators", lambda: write_speculators(hf_dir, spec.target, out / "speculators"))  # vLLM's schema
    gguf = out / "drafter.gguf"
    requant = spec.final_type not in ("", spec.outtype)
    before = out / f"drafter-{spec.outtype}.gguf" if requant else gguf  # the drafter before re-encoding
    full = out / "drafter-fullvocab.gguf" if reduce else before
    conv = stage("convert", lambda: convert_hf_to_gguf(hf_dir, spec.target, full, outtype=spec.outtype))
    summary["gguf"] = {"path": str(gguf), "bytes": conv["bytes"], "outtype": spec.outtype, "draft_vocab": None,
                       "final_type": spec.final_type or spec.outtype}
    if reduce:
        summary["gguf"].update(stage("vocab", lambda: _reduce(ds, keep, spec.target, full, before)))
    if requant:
        q = stage("quantize", lambda: quantize_drafter(before, gguf, spec.final_type))
        summary["gguf"].update(bytes=q["bytes"], before_final_type=str(before))
    summary_path.write_text(json.dumps(summary, indent=1))
    say(f"done: {gguf} ({summary['gguf']['bytes'] / 2**20:.1f} MiB); wall times {walls}")
    logf.close()
    return summary


def _draft_vocab(ds: Dataset, spec: RunSpec, n_vocab: int) -> np.ndarray:
    """The draft vocabulary (d2t order): the draft_vocab tokens most frequent in the training
    sequences (prompts and responses; the target's end-of-generation ids always kept)."""
    from ..formats.vocab import choose_vocab, eog_ids, token_counts

    counts = token_counts(n_vocab, (ds.sequence(i)[0] for i in ds.train_ids))
    return choose_vocab(counts, spec.draft_vocab, eog_ids(spec.target))


def _reduce(ds: Dataset, keep: np.ndarray, target: str, full: Path, out: Path) -> dict:
    """The shipped drafter: the full-vocabulary conversion cut to the draft vocabulary `keep`.
    Coverage is measured on the held-out responses."""
    from ..formats.vocab import reduce_vocab

    reduce_vocab(full, target, out, keep)
    held = [toks[start:] for toks, _, start in map(ds.sequence, ds.val_ids)]  # held-out responses
    held = np.concatenate(held or [np.zeros(0, np.int64)])
    covered = float(np.isin(held, keep).mean()) if held.size else None
    return {"bytes": out.stat().st_size, "draft_vocab": int(keep.size), "held_out_coverage": covered,
            "full_vocab_path": str(full)}


def run_dataset(run_dir: str | Path) -> Dataset:
    """A run directory's training set: its own data, or its sample of another run's (``data``)."""
    run_dir = Path(run_dir)
    data = json.loads((run_dir / "summary.json").read_text()).get("spec", {}).get("data")
    return Dataset(Path(data) / "data", index=run_dir / "index.npy") if data else Dataset(run_dir / "data")


def summary_of(out: str | Path) -> dict:
    return json.loads((Path(out) / "summary.json").read_text())
