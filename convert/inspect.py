"""`llama-dflash inspect`: what a drafter GGUF is and whether it fits a target."""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

from gguf import GGUFReader

from ..gguf_io import read_drafter_config


def describe(path: str | os.PathLike) -> dict:
    p = Path(path)
    r = GGUFReader(str(p))
    arch = r.fields["general.architecture"].contents() if "general.architecture" in r.fields else None
    if arch != "dflash":
        raise ValueError(f"{p}: architecture {arch!r}, not a DFlash drafter")
    c = read_drafter_config(p)
    names = {t.name for t in r.tensors}
    version = 2 if "selector_hidden.weight" in names else 1
    d2t = next((t for t in r.tensors if t.name == "d2t"), None)
    return {
        "file": str(p), "bytes": p.stat().st_size, "version": version, "block_size": c.block_size,
        "target_layers": c.target_layer_ids, "mask_token_id": c.mask_token_id, "n_embd": c.n_embd,
        "n_layer": c.n_layer, "n_head": c.n_head, "n_head_kv": c.n_head_kv, "head_dim": c.head_dim, "n_ff": c.n_ff,
        "causal": c.causal, "sliding_window": c.sliding_window, "logit_scale": c.logit_scale, "softcap": c.softcap,
        "embedding_scale": c.embedding_scale, "rope_theta": c.rope_theta,
        "dflash2": {"conv_kernel_size": c.conv_kernel_size, "conv_group_size": c.conv_group_size,
                    "selector_rank": c.selector_rank, "selector_top_k": c.selector_top_k} if version == 2 else None,
        "draft_vocab": int(d2t.shape[0]) if d2t is not None else None,  # None: the target's whole vocabulary
        "n_tensors": len(r.tensors),
        "types": dict(Counter(t.tensor_type.name for t in r.tensors)),
        "tensors": [(t.name, [int(x) for x in t.shape], t.tensor_type.name) for t in r.tensors],
    }
