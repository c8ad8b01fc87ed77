"""The drafter format table, read from the C header that owns it (``dflash_format.h``).

The C loader expands the header's lists as X-macros; this module parses the same lines, so
the keys (type, presence, default, when written) and the tensors (name, presence, type, shape,
HF names) exist once.  Expressions in the table are C over ``hp->`` fields; they are
evaluated here over a :class:`~llama_dflash.formats.config.DrafterConfig` (integer division).
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from .._files import find

HEADER = "dflash_format.h"


@dataclass(frozen=True)
class Key:
    field: str
    key: str
    type: str     # U32 F32 BOOL STR ARR_INT ARR_BOOL
    need: str     # REQ OPT V2
    default: str  # C expression
    write: str    # ALWAYS NONDEF SCALED YARN SWA V2


@dataclass(frozen=True)
class Equal:
    key: str
    type: str
    field: str


@dataclass(frozen=True)
class Tensor:
    field: str
    name: str               # GGUF name (per-layer: without "blk.<i>.")
    need: str               # REQ OPT V2 D2T
    dtype: str              # F32 W I64
    ne: tuple[str, str, str]  # ggml shape expressions
    hf: tuple[str, ...]     # HF names, canonical first (per-layer: without "layers.<i>.")
    per_layer: bool

    def gguf_name(self, il: int | None = None) -> str:
        return f"blk.{il}.{self.name}" if self.per_layer else self.name

    def hf_name(self, il: int | None = None) -> str | None:
        if not self.hf:
            return None
        return f"layers.{il}.{self.hf[0]}" if self.per_layer else self.hf[0]

    def shape(self, cfg) -> tuple[int, ...]:
        """PyTorch-order shape (ggml's reversed, trailing 1s dropped) for a config."""
        ne = [int(evaluate(e, cfg)) for e in self.ne]
        while len(ne) > 1 and ne[-1] == 1:
            ne.pop()
        return tuple(reversed(ne))


@dataclass(frozen=True)
class Table:
    keys: tuple[Key, ...]
    equal: tuple[Equal, ...]
    alias: tuple[Equal, ...]
    refused: tuple[tuple[str, str, str, str], ...]
    top: tuple[Tensor, ...]
    layer: tuple[Tensor, ...]
    arch: str
    rope_scalings: tuple[str, ...]  # rope_scaling's names, numbered in this order in C
    max_draft: str                  # tokens one block drafts: an expression over hp->

    def key(self, field: str) -> Key:
        return next(k for k in self.keys if k.field == field)

    def tensors(self, n_layer: int):
        """(gguf name, Tensor, layer or None) for every tensor of an n_layer drafter."""
        for t in self.top:
            yield t.gguf_name(), t, None
        for il in range(n_layer):
            for t in self.layer:
                yield t.gguf_name(il), t, il

    def from_hf(self, hf_name: str) -> str | None:
        """GGUF name of a HF checkpoint tensor (any of its published names), or None."""
        n = hf_name.removeprefix("model.")
        m = re.fullmatch(r"layers\.(\d+)\.(.+)", n)
        rows, rest, il = (self.layer, m.group(2), int(m.group(1))) if m else (self.top, n, None)
        return next((t.gguf_name(il) for t in rows if rest in t.hf), None)

    def to_hf(self, gguf_name: str) -> str | None:
        """Canonical HF name (the PyTorch reference's parameter name) of a GGUF tensor, or None."""
        row = self.tensor(gguf_name)
        return row[0].hf_name(row[1]) if row else None

    def required(self, cfg) -> dict[str, tuple[int, ...]]:
        """GGUF name -> PyTorch-order shape of every tensor a drafter of cfg must have
        (the shared and per-layer ones; DFlash2's when cfg is DFlash2), in file order."""
        return {n: t.shape(cfg) for n, t, _ in self.tensors(cfg.n_layer)
                if t.need == "REQ" or (t.need == "V2" and cfg.is_v2)}

    def tensor(self, gguf_name: str) -> tuple[Tensor, int | None] | None:
        """The table row of a GGUF tensor name, with its layer."""
        m = re.fullmatch(r"blk\.(\d+)\.(.+)", gguf_name)
        if m:
            return next(((t, int(m.group(1))) for t in self.layer if t.name == m.group(2)), None)
        return next(((t, None) for t in self.top if t.name == gguf_name), None)


def _args(text: str) -> list[str]:
    """Split one X(...) argument list at top-level commas (strings and parentheses kept)."""
    out, depth, cur, in_str = [], 0, [], False
    for i, ch in enumerate(text):
        if in_str:
            cur.append(ch)
            if ch == '"' and text[i - 1] != "\\":
                in_str = False
            continue
        if ch == '"':
            in_str = True
        elif ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        elif ch == "," and depth == 0:
            out.append("".join(cur).strip())
            cur = []
            continue
        cur.append(ch)
    out.append("".join(cur).strip())
    return out


def _entries(src: str, name: str) -> list[list[str]]:
    m = re.search(r"#define " + name + r"\(X\)((?:[^\n]*\\\n)*[^\n]*)", src)
    if not m:
        raise ImportError(f"{HEADER}: list {name} not found")
    rows = []
    for line in m.group(1).split("\n"):
        line = line.strip().rstrip("\\").strip()
        if line.startswith("X(") and line.endswith(")"):
            rows.append(_args(line[2:-1]))
    return rows


def _string(s: str) -> str:
    return ast.literal_eval(s)


def parse(src: str) -> Table:
    """The table in a header's text."""
    keys = tuple(Key(f, _string(k), t, n, d, w) for f, k, t, n, d, w in _entries(src, "DFLASH_GGUF_KEYS"))
    equal = tuple(Equal(_string(k), t, f) for k, t, f in _entries(src, "DFLASH_GGUF_EQUAL"))
    alias = tuple(Equal(_string(k), t, f) for k, t, f in _entries(src, "DFLASH_GGUF_ALIAS"))
    refused = tuple((_string(k), t, a, _string(w)) for k, t, a, w in _entries(src, "DFLASH_GGUF_REFUSED"))

    def tensors(name: str, per_layer: bool) -> tuple[Tensor, ...]:
        rows = _entries(src, name)
        return tuple(Tensor(f, _string(n), need, dt, (e0, e1, e2), tuple(x for x in _string(hf).split("|") if x),
                            per_layer) for f, n, need, dt, e0, e1, e2, hf in rows)

    arch = re.search(r'#define DFLASH_ARCH "(\w+)"', src)
    max_draft = re.search(r"#define DFLASH_MAX_DRAFT_EXPR (.+)", src)
    if not max_draft:
        raise ImportError(f"{HEADER}: DFLASH_MAX_DRAFT_EXPR not found")
    return Table(keys, equal, alias, refused, tensors("DFLASH_TOP_TENSORS", False),
                 tensors("DFLASH_LAYER_TENSORS", True), arch.group(1) if arch else "",
                 tuple(_string(n) for _, n in _entries(src, "DFLASH_ROPE_SCALINGS")), max_draft.group(1).strip())


def header_path() -> Path:
    """The installed header (the source tree's csrc/ when run from a checkout)."""
    return find(HEADER)


@cache
def table() -> Table:
    """The installed package's format table."""
    return parse(header_path().read_text())


_TOKEN = re.compile(r"\s*(?:(hp->(\w+))|(\d+\.\d*(?:e[-+]?\d+)?f?|\d+e[-+]?\d+f?)|(\d+)|(\"[^\"]*\")|([-+*/()]))")


def evaluate(expr: str, cfg) -> int | float | str:
    """Value of a table expression (literals, hp->field, + - * / and parentheses) for a config.

    The derived fields the C struct holds are taken from the config: n_taps (its target
    layers) and n_vocab_draft (its reduced vocabulary, else n_vocab)."""
    out, pos = [], 0
    while pos < len(expr):
        m = _TOKEN.match(expr, pos)
        if not m or m.end() == pos:
            raise ValueError(f"bad table expression {expr!r}")
        pos = m.end()
        if m.group(1):
            out.append(repr(_field(cfg, m.group(2))))
        elif m.group(3):
            out.append(repr(float(m.group(3).rstrip("f"))))
        elif m.group(4):
            out.append(m.group(4))
        elif m.group(5):
            return _string(m.group(5))
        else:
            out.append("//" if m.group(6) == "/" else m.group(6))
    return eval(" ".join(out), {"__builtins__": {}})  # tokens checked above: numbers and operators only


def _field(cfg, name: str):
    if name == "n_taps":
        return len(cfg.target_layers)
    if name == "n_vocab_draft":
        return cfg.n_vocab_draft or cfg.n_vocab
    return getattr(cfg, name)
