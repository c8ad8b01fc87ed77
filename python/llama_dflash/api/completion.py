"""The completion loop behind ``llama_dflash.Llama.create_completion``.

It returns what ``llama_cpp.Llama._create_completion`` (0.3.36) returns -- the same text, stream
chunks, ``usage``, ``finish_reason`` and ``logprobs`` -- with two differences that matter for
speculative decoding:

* the text grows one token at a time: llama-cpp-python re-detokenizes the whole completion
  after every token (about a millisecond per token at 2,000 tokens), which would eat much of
  a speculative speedup; here each token costs a dictionary lookup and a bounded stop search;
* ``logprobs`` come from each token's own logits row, summarised as it is produced, so they
  need no ``logits_all`` and no ``n_ctx x n_vocab`` buffer.
"""

from __future__ import annotations

import random
import time
import uuid
import warnings
from collections.abc import Iterator

import llama_cpp
import numpy as np


class TokenLogprobs:
    """One generated token's log-probabilities: its own and the row's n best (ids, values),
    in llama-cpp-python's order (value descending, then id descending)."""

    __slots__ = ("logprob", "top_ids", "top_values")

    def __init__(self, row: np.ndarray, token: int, n: int) -> None:
        lp = llama_cpp.Llama.logits_to_logprobs(row)
        self.logprob = float(lp[token])
        if n <= 0:
            self.top_ids, self.top_values = np.empty(0, np.int64), np.empty(0, np.float32)
            return
        n = min(n, lp.size)
        kth = np.partition(lp, lp.size - n)[lp.size - n]
        ids = np.flatnonzero(lp >= kth)  # every tie at the boundary, so the order below is exact
        order = np.lexsort((-ids, -lp[ids]))[:n]
        self.top_ids, self.top_values = ids[order], lp[ids[order]]


class _Pieces:
    """Token pieces, cached: llama-cpp-python's detokenize without the per-call C round trips."""

    def __init__(self, llm: llama_cpp.Llama) -> None:
        self.llm, self.bos, self.cache = llm, llm.token_bos(), {}

    def piece(self, t: int) -> bytes:
        p = self.cache.get(t)
        if p is None:
            p = self.cache[t] = self.llm.detokenize([t])
        return p

    def text(self, tokens) -> bytes:
        """== llm.detokenize(tokens) (pieces joined; a leading space dropped after a BOS)."""
        out = b"".join([self.piece(t) for t in tokens])
        if tokens and tokens[0] == self.bos and out[:1] == b" ":
            return out[1:]
        return out


def _multibyte_pending(tail: bytes, pending: int) -> int:
    """llama-cpp-python's look at the last three bytes for an unfinished UTF-8 character:
    how many more tokens to take before looking at the text again."""
    for i, byte in enumerate(tail):
        back = 3 - i
        for need, lead in ((2, 0xC0), (3, 0xE0), (4, 0xF0)):
            if need > back and byte & lead == lead:
                pending = need - back
    return pending


def create_completion(llm, prompt, suffix=None, max_tokens=16, temperature=0.8, top_p=0.95, min_p=0.05,
                      typical_p=1.0, logprobs=None, echo=False, stop=None, frequency_penalty=0.0,
                      presence_penalty=0.0, repeat_penalty=1.0, top_k=40, stream=False, seed=None, tfs_z=1.0,
                      mirostat_mode=0, mirostat_tau=5.0, mirostat_eta=0.1, model=None, stopping_criteria=None,
                      logits_processor=None, grammar=None, logit_bias=None) -> Iterator[dict]:
    """llama_cpp.Llama._create_completion's contract for prompts without a suffix and without
    echoed logprobs (those go through the base class)."""
    completion_id = f"cmpl-{uuid.uuid4()}"
    created = int(time.time())
    bos = llm.token_bos()
    m = llm._model
    pieces = _Pieces(llm)

    # the prompt's tokens, as the base class builds them when there is no suffix
    lead = [m.token_cls() if m.token_cls() != -1 else bos]
    trail = [m.token_sep() if m.token_sep() != -1 else llm.token_eos()]
    if isinstance(prompt, list) or not m.add_bos_token() or lead[:1] == [-1]:
        lead = []
    if isinstance(prompt, list) or (not m.add_eos_token() and m.token_sep() == -1):
        trail = []
    if isinstance(prompt, str):
        body = llm.tokenize(prompt.encode("utf-8"), add_bos=False, special=True) if prompt != "" else []
    else:
        body = prompt
    prompt_tokens = lead + body + trail
    completion_tokens: list[int] = [] if len(prompt) > 0 else [bos]
    stop = stop if isinstance(stop, list) else [stop] if isinstance(stop, str) else []
    stop_sequences = [s.encode("utf-8") for s in stop]
    longest_stop = max((len(s) for s in stop_sequences), default=0)
    model_name = model if model is not None else llm.model_path

    if prompt_tokens[:2] == [bos] * 2:
        warnings.warn(f'Detected duplicate leading "{m.token_get_text(bos)}" in prompt, this will likely '
                      "reduce response quality, consider removing it...", RuntimeWarning, stacklevel=3)
    if logit_bias is not None:
        bias = {int(k): float(v) for k, v in logit_bias.items()}

        def logit_bias_processor(input_ids, scores):
            out = np.copy(scores)
            for tok, b in bias.items():
                out[tok] = b + scores[tok]
            return out

        # (llama-cpp-python 0.3.36 assigns list.extend's None here, dropping the processors and the
        # bias when both are given; both apply here)
        logits_processor = [*(logits_processor or []), logit_bias_processor]
    if llm.verbose:
        llm._ctx.reset_timings()
    if len(prompt_tokens) >= llm._n_ctx:
        raise ValueError(f"Requested tokens ({len(prompt_tokens)}) exceed context window of "
                         f"{llama_cpp.llama_n_ctx(llm.ctx)}")
    if max_tokens is None or max_tokens <= 0:
        max_tokens = llm._n_ctx - len(prompt_tokens)
    max_tokens = min(max_tokens, llm._n_ctx - len(prompt_tokens))

    if llm.cache:
        try:
            item = llm.cache[prompt_tokens]
            if (llama_cpp.Llama.longest_token_prefix(item.input_ids.tolist(), prompt_tokens)
                    > llama_cpp.Llama.longest_token_prefix(llm._input_ids.tolist(), prompt_tokens)):
                llm.load_state(item)
        except KeyError:
            pass
    llm.set_seed(seed if seed is not None else random.Random(llm._seed).randint(0, 2**32))

    def chunk(text: str, lp=None, finish=None) -> dict:
        return {"id": completion_id, "object": "text_completion", "created": created, "model": model_name,
                "choices": [{"text": text, "index": 0, "logprobs": lp, "finish_reason": finish}]}

    rows: list[TokenLogprobs] = []  # one per completion token, when logprobs are asked for

    first = len(completion_tokens)  # an empty prompt's completion starts with a BOS that has no row

    def token_logprobs(j: int, token: int, token_str: str, offset: int) -> dict:
        r = rows[j - first]
        top = {pieces.piece(int(i)).decode("utf-8", errors="ignore"): float(v)
               for i, v in zip(r.top_ids, r.top_values, strict=True)}
        top[token_str] = r.logprob
        return {"tokens": [token_str], "text_offset": [offset], "token_logprobs": [r.logprob], "top_logprobs": [top]}

    text = b""
    raw = bytearray()   # pieces of completion_tokens, joined
    skip = 0            # bytes dropped at the front (a BOS's leading space)
    checked = 0         # text length at the last stop search (no stop string before it)
    returned_tokens = 0
    finish_reason = "length"
    multibyte_fix = 0
    try:
        for token in llm.generate(prompt_tokens, top_k=top_k, top_p=top_p, min_p=min_p, typical_p=typical_p,
                                  temp=temperature, tfs_z=tfs_z, mirostat_mode=mirostat_mode,
                                  mirostat_tau=mirostat_tau, mirostat_eta=mirostat_eta,
                                  frequency_penalty=frequency_penalty, presence_penalty=presence_penalty,
                                  repeat_penalty=repeat_penalty, stopping_criteria=stopping_criteria,
                                  logits_processor=logits_processor, grammar=grammar, draft_budget=max_tokens,
                                  logprob_rows=(rows, logprobs) if logprobs is not None else None):
            if llama_cpp.llama_vocab_is_eog(m.vocab, token):
                text = bytes(raw[skip:])
                finish_reason = "stop"
                break
            completion_tokens.append(token)
            raw += pieces.piece(token)
            skip = 1 if completion_tokens[0] == bos and raw[:1] == b" " else 0
            n_text = len(raw) - skip  # the text is raw[skip:]

            multibyte_fix = _multibyte_pending(bytes(raw[max(skip, len(raw) - 3):]), multibyte_fix)
            if multibyte_fix > 0:
                multibyte_fix -= 1
                continue

            if stop_sequences:  # only a stop string that ends in the new bytes can be new
                # (an empty stop string matches at 0, as in the base class: the text is then "")
                base = max(0, checked - longest_stop + 1) if longest_stop and all(stop_sequences) else 0
                window = bytes(raw[skip + base:])
                hits = [s for s in stop_sequences if s in window]
                if hits:
                    text = bytes(raw[skip:skip + base + window.index(hits[0])])
                    finish_reason = "stop"
                    break
            checked = n_text

            if stream:
                returned_tokens = yield from _stream_pending(pieces, prompt, completion_tokens, stop_sequences,
                                                             logprobs, chunk, token_logprobs, returned_tokens)

            if len(completion_tokens) >= max_tokens:
                text = bytes(raw[skip:])
                finish_reason = "length"
                break
        else:  # the generator ended first: the context is full
            text = bytes(raw[skip:])
            finish_reason = "length"
    finally:
        llm._dflash_rows = None

    if stopping_criteria is not None and stopping_criteria(*llm._stop_state()):
        text = bytes(raw[skip:])
        finish_reason = "stop"
    if llm.verbose:
        llm._ctx.print_timings()

    if stream:
        remaining = completion_tokens[returned_tokens:]
        remaining_text = pieces.text(remaining)
        hits = [s for s in stop_sequences if s in remaining_text]
        end = min(remaining_text.index(s) for s in hits) if hits else len(remaining_text)
        token_end = 0
        for token in remaining:
            token_end += len(pieces.piece(token))
            lp = None
            if logprobs is not None:
                if token == bos:
                    continue
                offset = len(prompt) + len(pieces.text(completion_tokens[:returned_tokens]))
                lp = token_logprobs(returned_tokens, token, pieces.piece(token).decode("utf-8", errors="ignore"),
                                    offset)
            if token_end >= end:
                last = pieces.piece(token)
                returned_tokens += 1
                yield chunk(last[:len(last) - (token_end - end)].decode("utf-8", errors="ignore"), lp)
                break
            returned_tokens += 1
            yield chunk(pieces.piece(token).decode("utf-8", errors="ignore"), lp)
        yield chunk("", None, finish_reason)
        if llm.cache:
            llm.cache[prompt_tokens + completion_tokens] = llm.save_state()
        return

    if llm.cache:
        llm.cache[prompt_tokens + completion_tokens] = llm.save_state()
    text_str = text.decode("utf-8", errors="ignore")
    if echo:
        text_str = prompt + text_str

    logprobs_or_none = None
    if logprobs is not None:
        offsets, strs, values, tops = [], [], [], []
        before = bytearray()  # pieces of completion_tokens[:idx]
        for idx, token in enumerate(completion_tokens[:first + len(rows)]):
            piece = pieces.piece(token)
            if token == bos:
                before += piece
                continue
            token_str = piece.decode("utf-8", errors="ignore")
            lead = 1 if completion_tokens[0] == bos and before[:1] == b" " else 0
            offsets.append(len(prompt) + len(before[lead:].decode("utf-8", errors="ignore")))
            before += piece
            d = token_logprobs(idx, token, token_str, 0)
            strs.append(token_str)
            values.append(d["token_logprobs"][0])
            tops.append(d["top_logprobs"][0])
        logprobs_or_none = {"tokens": strs, "text_offset": offsets, "token_logprobs": values, "top_logprobs": tops}

    out = chunk(text_str, logprobs_or_none, finish_reason)
    out["usage"] = {"prompt_tokens": len(prompt_tokens), "completion_tokens": len(completion_tokens),
                    "total_tokens": len(prompt_tokens) + len(completion_tokens)}
    yield out


def _stream_pending(pieces, prompt, completion_tokens, stop_sequences, logprobs, chunk, token_logprobs,
                    returned_tokens):
    """Stream what can be sent now: whole UTF-8 characters, nothing that may be the start of
    a stop string (llama-cpp-python's rules; with logprobs, one chunk per token).  Returns
    how many completion tokens have been sent."""
    remaining = completion_tokens[returned_tokens:]
    remaining_text = pieces.text(remaining)
    hold = 0  # bytes at the end that may start a stop string
    for s in stop_sequences:
        for i in range(min(len(s), len(remaining_text)), 0, -1):
            if remaining_text.endswith(s[:i]):
                hold = max(hold, i)
                break
    limit = len(remaining_text) - hold
    token_end = 0
    if logprobs is not None:
        for token in remaining:
            if token == pieces.bos:
                continue
            token_end += len(pieces.piece(token))
            if token_end > limit:
                break
            token_str = pieces.piece(token).decode("utf-8", errors="ignore")
            sent = pieces.text(completion_tokens[:returned_tokens])
            offset = len(prompt) + len(sent.decode("utf-8", errors="ignore"))
            lp = token_logprobs(returned_tokens, token, token_str, offset)
            returned_tokens += 1
            yield chunk(token_str, lp)
    else:
        while remaining:
            for i in range(1, len(remaining) + 1):
                bs = pieces.text(remaining[:i])
                try:
                    ts = bs.decode("utf-8")
                    break
                except UnicodeError:
                    pass
            else:
                break
            token_end += len(bs)
            if token_end > limit:
                break
            remaining = remaining[i:]
            returned_tokens += i
            yield chunk(ts)
    return returned_tokens
