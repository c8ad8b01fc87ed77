"""Training DFlash drafters on the target's own generations (docs/architecture.md §6).

Data: prompts -> the target's responses (plain decoding through our loop) -> target
features of every position, captured by the package's C capture.  Training: random
anchors in the response; for each, the block [x_a, mask x (B-1)] attends to the context
strictly before the anchor and to its own block (the inference pattern, as one masked
forward over all anchors of a sequence); slot k predicts x_{a+k}, cross-entropy with
weights exp(-(k-1)/gamma).  The trained drafter is written as a GGUF drafter directly
(``export_gguf``), or as a HF checkpoint for the converter.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..formats.gguf import DrafterConfig, write_drafter
from ..formats.hf import gguf_name
from ..verify.reference import DFlashReference


@dataclass
class Sample:
    tokens: np.ndarray    # [L] prompt + response
    features: np.ndarray  # [L, n_taps * H] target features of every position
    start: int            # first response position (loss only on response tokens)


def generate_samples(generator, prompts: Sequence[str], n_tokens: int) -> list[Sample]:
    """The target's greedy responses to prompts, with its features (a SpeculativeGenerator
    loaded with capture_layers = the drafter's taps)."""
    out = []
    for p in prompts:
        toks = generator.tokenize(p)
        res = generator.generate(toks, n_tokens, stop_on_eos=False)
        seq = toks + res.tokens
        out.append(Sample(np.asarray(seq, np.int64), generator.features(seq), len(toks)))
    return out


def block_mask(anchors: torch.Tensor, n_ctx: int, block: int, cfg: DrafterConfig, il: int) -> torch.Tensor:
    """Additive mask [A*B, n_ctx + A*B]: block j sees context positions < a_j and its own block."""
    A = anchors.shape[0]
    qpos = (anchors[:, None] + torch.arange(block)[None, :]).reshape(-1)         # [A*B]
    qblk = torch.arange(A).repeat_interleave(block)
    ctx_vis = torch.arange(n_ctx)[None, :] < anchors.repeat_interleave(block)[:, None]
    blk_vis = qblk[:, None] == qblk[None, :]
    kpos = torch.cat([torch.arange(n_ctx), qpos])
    vis = torch.cat([ctx_vis, blk_vis], dim=1)
    swa = cfg.is_swa(il)
    if cfg.is_causal(il):  # (per layer: a causal pattern)
        vis &= torch.cat([torch.ones_like(ctx_vis), kpos[None, n_ctx:] <= qpos[:, None]], dim=1)
    if swa:
        vis &= (qpos[:, None] - kpos[None, :]).abs() < cfg.n_swa
    return torch.zeros(vis.shape).masked_fill(~vis, float("-inf"))


def block_hidden(model: DFlashReference, features: torch.Tensor, tokens: torch.Tensor, anchors: torch.Tensor,
                 embed: torch.Tensor) -> torch.Tensor:
    """Final-normed slot states [A, B-1, H] of one block per anchor, in one forward."""
    c = model.cfg
    B = c.block_size
    scale = getattr(model, "feature_scale", None)  # training-time reparametrisation, folded into fc on export
    ctx = model.hidden_norm(model.fc(features if scale is None else features * scale))
    block_tokens = torch.full((anchors.shape[0], B), c.mask_token_id, dtype=torch.long)
    block_tokens[:, 0] = tokens[anchors]
    pos = (anchors[:, None] + torch.arange(B)[None, :]).reshape(-1)
    h = embed[block_tokens.reshape(-1)] * c.embedding_scale
    masks: dict[bool, torch.Tensor] = {}  # one mask per layer kind (full / sliding window), not per layer
    for il, layer in enumerate(model.layers):
        swa = c.is_swa(il)
        if swa not in masks:
            masks[swa] = block_mask(anchors, features.shape[0], B, c, il)
        h = layer(h, ctx, torch.arange(features.shape[0]), pos, masks[swa], block=B)
    return model.norm(h.view(-1, B, c.n_embd)[:, 1:])


def slot_weights(block: int, gamma: float | None = None) -> torch.Tensor:
    """exp(-(k-1)/gamma) for slots k = 1..B-1 (gamma 7 for B=16, 5 for B=10, 4 for B=8)."""
    gamma = gamma or {16: 7.0, 10: 5.0, 8: 4.0}.get(block, max(1.0, block / 2))
    return torch.exp(-torch.arange(block - 1, dtype=torch.float32) / gamma)


def _logits(model: DFlashReference, z: torch.Tensor, head: torch.Tensor) -> torch.Tensor:
    """Unary logits in fp32; a bf16 head runs the big matmul in bf16 (AMX on this CPU), fp32 accumulate."""
    if head.dtype != torch.float32:
        c = model.cfg
        logits = (z.to(head.dtype) @ head.T).float() * c.logit_scale
        return c.softcap * torch.tanh(logits / c.softcap) if c.softcap > 0 else logits
    return model.logits(z, head)


def block_losses(model: DFlashReference, tokens: torch.Tensor, features: torch.Tensor, anchors: torch.Tensor,
                 embed: torch.Tensor, head: torch.Tensor, vocab: torch.Tensor | None = None,
                 soft: tuple[np.ndarray, np.ndarray] | None = None) -> dict[str, torch.Tensor]:
    """Per-slot losses and hits of the blocks at `anchors` of one sequence (docs/architecture.md §6.2-6.3, §6.5).

    Unary: cross-entropy of slot k against x_{a+k}.  DFlash2 selector (teacher forced):
    predecessor = the true previous token, candidates = the slot's top-K with the label
    forced into the last place when missing, K-way cross-entropy over the edge scores.

    ``vocab``: the target ids of head's rows when head is a reduced draft vocabulary (the
    d2t order).  Softmax, top-K and argmax then run over those rows, as the drafter does at
    run time; a label outside them is not trained on and counts as a miss.

    ``soft``: the target's top-k next-token ids and log-probabilities per position ([L, k] each,
    ids -1 where none: ``Dataset.top``).  Then ``soft_ce`` is the cross-entropy of slot k against
    the target's distribution at position a + k - 1, renormalised over its top-k tokens (those in
    the draft vocabulary), the hard ``ce`` where a position has none: distillation.
    """
    B = model.cfg.block_size
    z = block_hidden(model, features, tokens, anchors, embed)                   # [A, B-1, H]
    logits = _logits(model, z, head)                                            # [A, B-1, V]
    labels = tokens[anchors[:, None] + torch.arange(1, B)[None, :]]             # [A, B-1] target ids
    if vocab is not None:  # target id -> row of the reduced head (-100: not in the draft vocabulary)
        t2d = torch.full((embed.shape[0],), -100, dtype=torch.long)
        t2d[vocab] = torch.arange(len(vocab))
        labels = t2d[labels]
    ce = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                           reduction="none").view_as(labels)
    out = {"ce": ce, "hit": logits.detach().argmax(-1) == labels}
    if soft is not None:
        rows = anchors[:, None] + torch.arange(0, B - 1)[None, :]              # position predicting slot k
        # (converted copies: the store's read-only memory maps are not handed to torch)
        sid = torch.from_numpy(np.asarray(soft[0], dtype=np.int64))[rows]      # [A, B-1, k] target ids
        p = torch.from_numpy(np.asarray(soft[1], dtype=np.float32))[rows].exp()
        valid = sid >= 0
        if vocab is not None:
            sid = torch.where(valid, t2d[sid.clamp_min(0)], -1)
            valid = sid >= 0
        p = torch.where(valid, p, torch.zeros_like(p))
        mass = p.sum(-1, keepdim=True)
        logq = torch.log_softmax(logits, -1).gather(-1, sid.clamp_min(0))
        soft_ce = -(p / mass.clamp_min(1e-20) * torch.where(valid, logq, torch.zeros_like(logq))).sum(-1)
        out["soft_ce"] = torch.where(mass[..., 0] > 0, soft_ce, ce)
    sel = getattr(model, "candidate_selector", None)
    if sel is not None:
        K = sel.top_k
        cand = logits.detach().topk(K, dim=-1).indices                          # [A, B-1, K] head rows
        match = cand == labels[..., None]
        in_top = match.any(-1)
        known = labels >= 0
        cand[..., K - 1] = torch.where(in_top | ~known, cand[..., K - 1], labels)
        target = torch.where(in_top, match.float().argmax(-1), torch.full_like(labels, K - 1))
        target = torch.where(known, target, torch.full_like(labels, -100))
        prev = tokens[anchors[:, None] + torch.arange(0, B - 1)[None, :]]       # true predecessors (target ids)
        gate = sel.hidden_projection(z)                                         # [A, B-1, r]
        succ = cand if vocab is None else vocab[cand]                           # codebooks are by target id
        edge = torch.einsum("asr,asr,askr->ask", sel.predecessor_codebook[prev], gate, sel.successor_codebook[succ])
        scores = logits.gather(-1, cand) + edge                                 # [A, B-1, K]
        out["sel_ce"] = torch.nn.functional.cross_entropy(scores.reshape(-1, K), target.reshape(-1),
                                                          reduction="none").view_as(labels)
        out["recall"] = in_top
        out["sel_hit"] = (scores.detach().argmax(-1) == target) & in_top
    return out


def sequence_losses(model: DFlashReference, source, i: int, n_anchors: int, rng: np.random.Generator,
                    embed: torch.Tensor, head: torch.Tensor, vocab: torch.Tensor | None = None,
                    soft: bool = False) -> dict[str, torch.Tensor] | None:
    """block_losses at up to n_anchors random anchors of sequence i of a source (None: too short);
    with `soft`, against the source's top-k log-probabilities where it has them."""
    toks, feats, start = source.sequence(i)
    a = _anchors(len(toks), start, model.cfg.block_size, n_anchors, rng)
    if len(a) == 0:
        return None
    top = source.top(i) if soft and hasattr(source, "top") else None
    return block_losses(model, torch.as_tensor(np.asarray(toks, np.int64)),
                        torch.as_tensor(np.asarray(feats, np.float32)), torch.as_tensor(a), embed, head, vocab, top)


def _anchors(length: int, start: int, block: int, n: int, rng: np.random.Generator) -> np.ndarray:
    """Up to n distinct sorted anchors whose whole block lies inside the sequence; the anchor may be
    the last prompt token (its block then predicts the first response tokens)."""
    lo, hi = max(start - 1, 1), length - block
    if hi < lo:
        return np.zeros(0, np.int64)
    return np.sort(rng.choice(np.arange(lo, hi + 1), size=min(n, hi - lo + 1), replace=False))


def implied_tau(acc: torch.Tensor) -> float:
    """1 + sum_k prod_{i<=k} acc_i (per-slot accuracies as acceptance rates)."""
    return 1.0 + float(torch.cumprod(acc, 0).sum())


def _block_tau(hit: torch.Tensor) -> float:
    """Mean accepted length per block, greedy: 1 + the leading run of correct slots."""
    return 1.0 + float(torch.cumprod(hit.float(), 1).sum(1).mean()) if len(hit) else 1.0


class _Samples:
    """In-memory samples as a sequence source."""

    def __init__(self, samples: list[Sample]) -> None:
        self.samples = samples

    def __len__(self) -> int:
        return len(self.samples)

    def sequence(self, i: int) -> tuple[np.ndarray, np.ndarray, int]:
        s = self.samples[i]
        return s.tokens, s.features, s.start


@dataclass
class TrainConfig:
    steps: int
    lr: float = 1e-3
    seqs_per_step: int = 4
    anchors_per_seq: int = 32
    alpha_sel: float = 1.0       # weight of the DFlash2 selector loss
    warmup: float = 0.04
    weight_decay: float = 0.0
    seed: int = 0
    distill: float = 0.0         # weight of the soft (target top-k) cross-entropy; 1 - distill: the hard one
    eval_every: int = 0          # steps between held-out evaluations (0 = only at the end)
    ckpt_every: int = 0          # steps between checkpoints (0 = only at the end)
    bf16_head: bool = True


class Trainer:
    """AdamW, warm-up + cosine decay, grad clip 1.0; the target's embedding and head stay frozen.

    ``checkpoint`` (a path) makes the run resumable: model, optimiser, schedule, step and
    random states are saved atomically every ``ckpt_every`` steps and loaded on start.
    ``vocab`` (target ids, d2t order) trains in a reduced draft vocabulary: only those rows of
    the head are scored (see ``block_losses``).
    """

    def __init__(self, model: DFlashReference, source, train_ids: Sequence[int], embed: torch.Tensor,
                 head: torch.Tensor, tc: TrainConfig, checkpoint: str | os.PathLike | None = None,
                 val_ids: Sequence[int] = (), log=None, vocab: torch.Tensor | None = None) -> None:
        self.model, self.source, self.tc = model, source, tc
        self.train_ids, self.val_ids = list(train_ids), list(val_ids)
        self.embed, self.vocab = embed, vocab
        head = head if vocab is None else head[vocab]
        self.head = head.to(torch.bfloat16) if tc.bf16_head else head
        self.ckpt = Path(checkpoint) if checkpoint else None
        self.log = log or (lambda _msg: None)
        torch.manual_seed(tc.seed)
        self.rng = np.random.default_rng(tc.seed)
        self.opt = torch.optim.AdamW(model.parameters(), lr=tc.lr, weight_decay=tc.weight_decay, fused=True)
        warm = max(1, int(tc.steps * tc.warmup))
        self.sched = torch.optim.lr_scheduler.LambdaLR(
            self.opt, lambda i: min(1.0, (i + 1) / warm) * 0.5 * (1 + math.cos(math.pi * min(i, tc.steps) / tc.steps)))
        self.step = 0
        self.history: list[dict] = []
        self.order: list[int] = []
        if self.ckpt and self.ckpt.is_file():
            self._load()

    # -- checkpoints ---------------------------------------------------------

    def _state(self) -> dict:
        return {"model": self.model.state_dict(), "opt": self.opt.state_dict(), "sched": self.sched.state_dict(),
                "step": self.step, "rng": self.rng.bit_generator.state, "torch_rng": torch.get_rng_state(),
                "history": self.history, "order": self.order, "tc": self.tc.__dict__}

    def save(self) -> None:
        if not self.ckpt:
            return
        tmp = self.ckpt.with_name(self.ckpt.name + ".tmp")
        torch.save(self._state(), tmp)
        tmp.replace(self.ckpt)

    def _load(self) -> None:
        st = torch.load(self.ckpt, weights_only=False)
        if st["tc"].get("steps") != self.tc.steps:
            raise ValueError(f"{self.ckpt}: checkpoint of a {st['tc'].get('steps')}-step run, this run has "
                             f"{self.tc.steps} steps (use another output directory)")
        self.model.load_state_dict(st["model"])
        self.opt.load_state_dict(st["opt"])
        self.sched.load_state_dict(st["sched"])
        self.step, self.history, self.order = st["step"], st["history"], st["order"]
        self.rng.bit_generator.state = st["rng"]
        torch.set_rng_state(st["torch_rng"])
        self.log(f"resumed from {self.ckpt} at step {self.step}")

    # -- steps ---------------------------------------------------------------

    def _next_ids(self) -> list[int]:
        out = []
        while len(out) < self.tc.seqs_per_step:
            if not self.order:
                self.order = [int(i) for i in self.rng.permutation(self.train_ids)]
            out.append(self.order.pop())
        return out

    def train_step(self) -> dict:
        B = self.model.cfg.block_size
        w = slot_weights(B)
        total = None
        hits, sel_hits, recall, n_blocks = [], [], [], 0
        lam = self.tc.distill
        for i in self._next_ids():
            r = sequence_losses(self.model, self.source, i, self.tc.anchors_per_seq, self.rng, self.embed, self.head,
                                self.vocab, soft=lam > 0)
            if r is None:
                continue
            ce = r["ce"] if "soft_ce" not in r else (1 - lam) * r["ce"] + lam * r["soft_ce"]
            loss = (ce * w).sum()
            if "sel_ce" in r:
                loss = loss + self.tc.alpha_sel * (r["sel_ce"] * w).sum()
                sel_hits.append(r["sel_hit"])
                recall.append(r["recall"])
            total = loss if total is None else total + loss
            hits.append(r["hit"])
            n_blocks += len(r["hit"])
        self.step += 1
        if total is None:
            return {}
        total = total / (w.sum() * n_blocks)
        self.opt.zero_grad()
        total.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        self.sched.step()
        hit = torch.cat(hits)
        m = {"loss": float(total.detach()), "acc": hit.float().mean(0), "block_tau": _block_tau(hit)}
        if sel_hits:
            sh = torch.cat(sel_hits)
            m.update(sel_acc=sh.float().mean(0), path_tau=_block_tau(sh), recall=torch.cat(recall).float().mean())
        return m

    def run(self, progress=None) -> list[dict]:
        tc = self.tc
        while self.step < tc.steps:
            m = self.train_step()
            if progress and m:
                extra = f"loss {m['loss']:.3f} tau(blk) {m['block_tau']:.2f}"
                if "path_tau" in m:
                    extra += f" tau(path) {m['path_tau']:.2f}"
                progress.update(1, extra)
            last = self.step == tc.steps
            if self.val_ids and ((tc.eval_every and self.step % tc.eval_every == 0) or last):
                ev = evaluate_source(self.model, self.source, self.val_ids, self.embed, self.head, vocab=self.vocab)
                ev["step"] = self.step
                self.history.append(ev)
                self.log(f"step {self.step}: held-out " + json.dumps(ev))
            if (tc.ckpt_every and self.step % tc.ckpt_every == 0) or last:
                self.save()
        return self.history


def train(model: DFlashReference, samples: list[Sample], embed: torch.Tensor, head: torch.Tensor, steps: int,
          lr: float = 3e-3, anchors_per_sample: int = 16, seed: int = 0, log_every: int = 0) -> list[dict]:
    """Train on in-memory samples, one sample per step (fp32 head: small test targets)."""
    tc = TrainConfig(steps=steps, lr=lr, seqs_per_step=1, anchors_per_seq=anchors_per_sample, seed=seed,
                     bf16_head=False)
    t = Trainer(model, _Samples(samples), range(len(samples)), embed, head, tc)
    log = []
    while t.step < steps:
        m = t.train_step()
        if log_every and m and t.step % log_every == 0:
            log.append({"step": t.step, "loss": m["loss"], "acc": [round(float(x), 3) for x in m["acc"]],
                        "implied_tau": implied_tau(m["acc"])})
    return log


@torch.no_grad()
def evaluate_source(model: DFlashReference, source, ids: Sequence[int], embed: torch.Tensor, head: torch.Tensor,
                    anchors_per_seq: int = 32, seed: int = 1, vocab: torch.Tensor | None = None) -> dict:
    """Held-out metrics: per-slot accuracy, implied tau (from the per-slot means), block tau (mean
    leading run, what greedy verification accepts on these data) and, for DFlash2, top-K recall,
    teacher-forced selector accuracy per slot and the self-conditioned path tau (the greedy walk
    follows its own choices; up to the first miss they equal the teacher-forced ones)."""
    rng = np.random.default_rng(seed)
    hits, sel, rec = [], [], []
    for i in ids:
        r = sequence_losses(model, source, i, anchors_per_seq, rng, embed, head, vocab)
        if r is None:
            continue
        hits.append(r["hit"])
        if "sel_hit" in r:
            sel.append(r["sel_hit"])
            rec.append(r["recall"])
    if not hits:
        return {}
    hit = torch.cat(hits)
    acc = hit.float().mean(0)
    out = {"per_slot_accuracy": [round(float(x), 3) for x in acc], "implied_tau": round(implied_tau(acc), 3),
           "block_tau": round(_block_tau(hit), 3), "blocks": len(hit)}
    if sel:
        sh = torch.cat(sel)
        out.update(selector_accuracy=[round(float(x), 3) for x in sh.float().mean(0)],
                   path_tau=round(_block_tau(sh), 3), topk_recall=round(float(torch.cat(rec).float().mean()), 3))
    return out


@torch.no_grad()
def evaluate(model: DFlashReference, samples: list[Sample], embed: torch.Tensor, head: torch.Tensor,
             seed: int = 1) -> dict:
    return evaluate_source(model, _Samples(samples), range(len(samples)), embed, head, seed=seed)


def whiten_features(model: DFlashReference, features: np.ndarray, floor: float = 1e-2) -> torch.Tensor:
    """Train fc on per-dimension standardised features (x / std).

    Target hidden states carry a few massive activations (SmolLM2: one channel with std ~1750
    where the median is ~5); with plain features the fused context is that channel's direction
    whatever the position, and Adam's per-step jitter on its fc weights keeps it so.  The scale
    is a fixed buffer and is folded into fc.weight by ``exported_state``, so the drafter's
    architecture and files are unchanged."""
    std = torch.as_tensor(np.asarray(features, np.float32).std(0)).clamp_min(floor)
    model.register_buffer("feature_scale", 1.0 / std)
    return model.feature_scale


def exported_state(model: DFlashReference) -> dict[str, torch.Tensor]:
    """The parameters as the published format holds them (feature scale folded into fc)."""
    st = {k: v.detach().float() for k, v in model.state_dict().items()}
    scale = st.pop("feature_scale", None)
    if scale is not None:
        st["fc.weight"] = st["fc.weight"] * scale[None, :]
    return st


def with_feature_scale(state: dict[str, torch.Tensor], scale: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """A state for a model that trains on scaled features: ``exported_state``'s inverse for an
    exported (folded) state, which has no scale of its own, so it computes the same function.  A
    state with its own scale (a checkpoint), or a model without one, takes the state as it is."""
    if scale is None or "feature_scale" in state:
        return state
    return {**state, "fc.weight": state["fc.weight"] / scale[None, :], "feature_scale": scale.clone()}


def export_gguf(model: DFlashReference, path: str | os.PathLike, target_gguf: str | os.PathLike,
                outtype: str = "f32") -> None:
    """Write the trained drafter in upstream's GGUF layout (names through the converter's map)."""
    tensors = {gguf_name(k): v.numpy() for k, v in exported_state(model).items()}
    write_drafter(path, model.cfg, tensors, target_gguf, outtype=outtype)
