"""Training DFlash drafters on the target's own generations (docs: dflash-architecture §6).

Data: prompts -> the target's responses (plain decoding through our loop) -> target
features of every position, captured by the package's C capture.  Training: random
anchors in the response; for each, the block [x_a, mask x (B-1)] attends to the context
strictly before the anchor and to its own block (the inference pattern, as one masked
forward over all anchors of a sequence); slot k predicts x_{a+k}, cross-entropy with
weights exp(-(k-1)/gamma).  The trained drafter is written as a GGUF drafter directly
(``export_gguf``), or as a HF checkpoint for the converter.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .convert.hf import gguf_name
from .gguf_io import DrafterConfig, write_drafter
from .reference import DFlashReference


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
    if cfg.causal:
        vis &= torch.cat([torch.ones_like(ctx_vis), kpos[None, n_ctx:] <= qpos[:, None]], dim=1)
    if swa:
        vis &= (qpos[:, None] - kpos[None, :]).abs() < cfg.sliding_window
    return torch.zeros(vis.shape).masked_fill(~vis, float("-inf"))


def block_hidden(model: DFlashReference, features: torch.Tensor, tokens: torch.Tensor, anchors: torch.Tensor,
                 embed: torch.Tensor) -> torch.Tensor:
    """Final-normed slot states [A, B-1, H] of one block per anchor, in one forward."""
    c = model.cfg
    B = c.block_size
    ctx = model.hidden_norm(model.fc(features))
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


def loss_and_accuracy(model: DFlashReference, s: Sample, anchors: np.ndarray, embed: torch.Tensor,
                      head: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    B = model.cfg.block_size
    a = torch.as_tensor(anchors, dtype=torch.long)
    toks = torch.as_tensor(s.tokens)
    z = block_hidden(model, torch.as_tensor(s.features), toks, a, embed)      # [A, B-1, H]
    logits = model.logits(z, head)                                              # [A, B-1, V]
    labels = toks[a[:, None] + torch.arange(1, B)[None, :]]                     # [A, B-1]
    ce = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                           reduction="none").view_as(labels)
    w = slot_weights(B)
    loss = (ce * w).sum() / (w.sum() * len(anchors))
    return loss, (logits.argmax(-1) == labels).float().mean(0)


def sample_anchors(s: Sample, block: int, n: int, rng: np.random.Generator) -> np.ndarray:
    lo, hi = max(s.start - 1, 1), len(s.tokens) - block  # the anchor itself may be the last prompt token
    if hi < lo:
        return np.zeros(0, np.int64)
    return np.sort(rng.choice(np.arange(lo, hi + 1), size=min(n, hi - lo + 1), replace=False))


def implied_tau(acc: torch.Tensor) -> float:
    """1 + sum_k prod_{i<=k} acc_i (per-slot accuracies as acceptance rates)."""
    return 1.0 + float(torch.cumprod(acc, 0).sum())


def train(model: DFlashReference, samples: list[Sample], embed: torch.Tensor, head: torch.Tensor, steps: int,
          lr: float = 3e-3, anchors_per_sample: int = 16, seed: int = 0, log_every: int = 0) -> list[dict]:
    """AdamW with warm-up and cosine decay, grad clip 1.0; embedding and head stay frozen."""
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    warm = max(1, steps // 25)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda i: min(1.0, (i + 1) / warm) * 0.5 * (1 + math.cos(math.pi * min(i, steps) / steps)))
    log = []
    for step in range(steps):
        s = samples[step % len(samples)]
        a = sample_anchors(s, model.cfg.block_size, anchors_per_sample, rng)
        if len(a) == 0:
            continue
        loss, acc = loss_and_accuracy(model, s, a, embed, head)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if log_every and (step + 1) % log_every == 0:
            log.append({"step": step + 1, "loss": float(loss.detach()), "acc": [round(float(x), 3) for x in acc],
                        "implied_tau": implied_tau(acc.detach())})
    return log


@torch.no_grad()
def evaluate(model: DFlashReference, samples: list[Sample], embed: torch.Tensor, head: torch.Tensor,
             seed: int = 1) -> dict:
    rng = np.random.default_rng(seed)
    accs = [loss_and_accuracy(model, s, a, embed, head)[1] for s in samples
            if len(a := sample_anchors(s, model.cfg.block_size, 32, rng))]
    acc = torch.stack(accs).mean(0)
    return {"per_slot_accuracy": [round(float(x), 3) for x in acc], "implied_tau": implied_tau(acc)}


def export_gguf(model: DFlashReference, path: str | os.PathLike, target_gguf: str | os.PathLike,
                outtype: str = "f32") -> None:
    """Write the trained drafter in upstream's GGUF layout (names through the converter's map)."""
    tensors = {gguf_name(k): v.detach().float().numpy() for k, v in model.state_dict().items()}
    write_drafter(path, model.cfg, tensors, target_gguf, outtype=outtype)
