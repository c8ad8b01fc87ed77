"""`llama-dflash inspect`: what a drafter GGUF is, as the loader reads it, and whether it will
speculate with a given target."""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import asdict
from pathlib import Path

from gguf import GGUFReader

from .._native import Tokenizer
from ..errors import DFlashError, check_file
from .check import check_drafter


def describe(path: str | os.PathLike) -> dict:
    """The drafter's hyper-parameters (validated by the C loader first: DFlashError if it would
    refuse the file) and its tensors."""
    c = check_drafter(path)  # before any other read: a FIFO or a corrupt file ends here
    p = Path(path)
    r = GGUFReader(str(p))
    cfg = asdict(c)
    return {
        "file": str(p), "bytes": p.stat().st_size, "version": c.version, **cfg,
        "dflash2": {k: cfg[k] for k in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")}
        if c.is_v2 else None,
        "draft_vocab": c.n_vocab_draft if c.n_vocab_draft != c.n_vocab else None,  # None: the target's vocabulary
        "n_tensors": len(r.tensors),
        "types": dict(Counter(t.tensor_type.name for t in r.tensors)),
        "tensors": [(t.name, [int(x) for x in t.shape], t.tensor_type.name) for t in r.tensors],
    }


def fit(drafter: str | os.PathLike, target: str | os.PathLike) -> dict:
    """Will this pair speculate?  ``{"ok": bool, "error": the one-line reason or None}`` from the
    very checks a load makes -- the loader's against the target (tokenizer, hidden size, taps)
    and the engine's refusal of a target that cannot roll back -- on a vocab-only load of the
    target (no weights read).  A target that is no readable model raises."""
    from ..core.engine import target_refusal

    check_file(target, "target model")
    with Tokenizer(target) as tok:
        try:
            check_drafter(drafter, tok.model)
        except DFlashError as e:
            return {"ok": False, "error": str(e)}
        why = target_refusal(tok.model)
    return {"ok": why is None, "error": why}
