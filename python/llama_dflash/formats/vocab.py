"""Reduced draft vocabularies: a drafter that proposes only the target's most used tokens.

On a small target the output head dominates drafting: SmolLM2's 49152 x 576 head costs
more per drafted slot than the rest of a 2-layer drafter.  A reduced vocabulary keeps the
head rows of the N most frequent tokens (copied byte for byte from the target's head, so
their logits are unchanged) and a ``d2t`` map from those rows to target ids — upstream
llama.cpp's layout (``src/models/dflash.cpp``: I64 absolute ids, the drafter's own
``output.weight`` of N rows).  Verification is untouched, so outputs stay exact; a token
outside the set can only be produced by the target itself (the bonus token).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter

from .gguf import ARCH, copy_fields


def token_counts(n_vocab: int, sources: Iterable[np.ndarray]) -> np.ndarray:
    """How often each id occurs in the given id arrays (ids outside the vocabulary are an error)."""
    counts = np.zeros(n_vocab, np.int64)
    for ids in sources:
        ids = np.asarray(ids, np.int64).ravel()
        if ids.size and (ids.min() < 0 or ids.max() >= n_vocab):
            raise ValueError(f"token ids must lie in 0..{n_vocab - 1}")
        counts += np.bincount(ids, minlength=n_vocab)
    return counts


def choose_vocab(counts: np.ndarray, size: int, always: Sequence[int] = ()) -> np.ndarray:
    """The `size` ids to keep, ascending: `always` first, then by count (ties: lower id, which
    in a BPE vocabulary is the earlier, more frequent merge)."""
    n_vocab = len(counts)
    if not 0 < size <= n_vocab:
        raise ValueError(f"the draft vocabulary size must lie in 1..{n_vocab}, got {size}")
    always = sorted({int(t) for t in always if 0 <= int(t) < n_vocab})
    if len(always) > size:
        raise ValueError(f"{len(always)} tokens must be kept, more than the size {size}")
    order = np.lexsort((np.arange(n_vocab), -np.asarray(counts)))  # count desc, then id asc
    keep = set(always)
    for t in order:
        if len(keep) == size:
            break
        keep.add(int(t))
    return np.array(sorted(keep), np.int64)


def _target_head(target: GGUFReader):
    for name in ("output.weight", "token_embd.weight"):  # tied heads reuse the embedding
        for t in target.tensors:
            if t.name == name:
                return t
    raise ValueError("the target GGUF has neither output.weight nor token_embd.weight")


def reduce_vocab(drafter: str | os.PathLike, target: str | os.PathLike, out: str | os.PathLike,
                 keep: np.ndarray) -> Path:
    """Write `out`: the drafter with its own head over the target ids `keep` and a d2t map.

    The drafter must borrow the target's head (no output.weight of its own, no d2t yet);
    the head rows are copied in the target's own encoding.
    """
    from ..errors import check_file

    check_file(drafter, "drafter")
    d = GGUFReader(os.fspath(drafter))
    arch = d.fields.get("general.architecture")
    if arch is None or arch.contents() != ARCH:
        raise ValueError(f"{drafter} is not a DFlash drafter GGUF")
    names = {t.name for t in d.tensors}
    if "d2t" in names or "output.weight" in names:
        raise ValueError(f"{drafter} already has its own output head; reduce the original drafter")
    head = _target_head(GGUFReader(os.fspath(target)))
    n_vocab = int(head.shape[1])  # ggml order: [n_embd, n_vocab]
    keep = np.asarray(keep, np.int64)
    if keep.ndim != 1 or keep.size == 0 or keep.min() < 0 or keep.max() >= n_vocab or \
            np.unique(keep).size != keep.size:
        raise ValueError(f"keep must be distinct ids in 0..{n_vocab - 1}")
    k = d.fields.get(f"{ARCH}.selector_top_k")
    if k is not None and int(k.contents()) > keep.size:
        raise ValueError(f"the draft vocabulary ({keep.size}) is smaller than the selector's top-K ({k.contents()})")

    out = Path(out)
    tmp = out.with_name(out.name + ".part")
    w = GGUFWriter(os.fspath(tmp), ARCH)
    copy_fields(d, w)
    for t in d.tensors:
        w.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    rows = np.ascontiguousarray(np.asarray(head.data)[keep])  # quantized rows are self-contained blocks
    w.add_tensor("output.weight", rows, raw_dtype=head.tensor_type)
    w.add_tensor("d2t", keep, raw_dtype=GGMLQuantizationType.I64)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(tmp, out)
    return out


def read_token_sources(target: str | os.PathLike, paths: Sequence[str | os.PathLike]) -> np.ndarray:
    """Token counts over the target's vocabulary from .npy id arrays and text files (tokenized
    with the target's own tokenizer)."""
    from .._native import Tokenizer
    from ..errors import check_file

    check_file(target, "target model")
    with Tokenizer(target) as tok:
        def load(p: Path) -> np.ndarray:
            if not p.is_file():
                raise FileNotFoundError(f"token source not found: {p}")
            if p.suffix == ".npy":
                return np.load(p)
            return np.asarray(tok.tokenize(p.read_bytes(), add_bos=False, special=False), np.int64)

        return token_counts(tok.n_vocab, (load(Path(p)) for p in paths))


def eog_ids(target: str | os.PathLike) -> list[int]:
    """End-of-generation ids a draft must be able to propose (eos, eot, im_end-like tokens)."""
    r = GGUFReader(os.fspath(target))
    ids = []
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        f = r.fields.get(key)
        if f is not None:
            ids.append(int(f.contents()))
    return ids
