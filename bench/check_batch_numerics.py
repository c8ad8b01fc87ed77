"""Is a greedy divergence llama.cpp's batch-size numerics?  (No DFlash code involved.)

Plain llama-cpp-python evaluates the same tokens either one per llama_decode or in chunks of
2 / 4 / 8 (as a verify batch does); if the logits row at the divergence changes its argmax
with the chunk size, the speculative output differs from plain decoding because of the
target's batched kernels, not the acceptance logic.

Usage: python bench/check_batch_numerics.py [--problem HumanEval/6] [--tokens 128]
"""

from __future__ import annotations

import argparse

import llama_cpp
import numpy as np

from llama_dflash import SpeculativeGenerator
from llama_dflash.api.models import default_target, shipped_drafter
from llama_dflash.train.prompts import chatml, humaneval_prompts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--problem", default="HumanEval/6")
    ap.add_argument("--tokens", type=int, default=128)
    a = ap.parse_args()
    p = next(x for x in humaneval_prompts() if x.key == a.problem)
    target = str(default_target())
    with SpeculativeGenerator(target, shipped_drafter(), n_ctx=1024) as g:
        toks = g.tokenize(chatml(p.text))
        plain = g.generate(toks, a.tokens, draft_len=0)
        spec = g.generate(toks, a.tokens, draft_len=3)
    i = next((k for k, (x, y) in enumerate(zip(plain.tokens, spec.tokens, strict=False)) if x != y), None)
    if i is None:
        print(f"{a.problem}: speculative output identical to plain for {len(plain.tokens)} tokens")
        return
    print(f"{a.problem}: first divergence at generated token {i}: plain {plain.tokens[i]}, "
          f"speculative {spec.tokens[i]}")
    for chunk in (1, 2, 4, 8):
        llm = llama_cpp.Llama(target, n_ctx=1024, logits_all=True, verbose=False)
        llm.eval(toks)
        for j in range(0, i, chunk):
            llm.eval(plain.tokens[j:min(j + chunk, i)])
        row = np.array(llm.scores[len(toks) + i - 1])
        top2 = np.sort(row)[-2:]
        print(f"  plain llama-cpp-python, {chunk} token(s) per llama_decode: argmax {int(np.argmax(row))}, "
              f"top-1/top-2 margin {float(top2[1] - top2[0]):.4f}")
        llm.close()


if __name__ == "__main__":
    main()
