"""Training runs' final drafters scored on one run's held-out sequences (same anchors for all).

Each run's own summary says how it did on its own held-out set; sets differ between runs
(more prompts or more sampled responses add held-out sequences), so comparing two drafters
takes scoring both on the same one.  Every drafter is scored in the draft vocabulary it was
trained and shipped with (its drafter file's d2t; chosen again from its run's training data only
where the run wrote none).

Usage: python bench/bench_heldout.py --on RUN_DIR RUN_DIR [RUN_DIR ...]
                                     [--out bench/results/heldout.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, fields
from pathlib import Path

import numpy as np
import torch

from llama_dflash.formats.gguf import read_tensors
from llama_dflash.train.loop import evaluate_source
from llama_dflash.train.run import (
    RunSpec,
    _draft_vocab,
    _run_vocab,
    _target_config,
    drafter_config,
    final_weights,
    run_dataset,
)
from llama_dflash.verify.reference import DFlashReference


def final_drafter(run: Path) -> tuple[DFlashReference, str, RunSpec, dict]:
    """The run's last trained stage as a reference model (its feature scale included), the
    stage's name, the run's settings and its target's sizes."""
    raw = json.loads((run / "summary.json").read_text())["spec"]
    known = {f.name for f in fields(RunSpec)}
    spec = RunSpec(**{k: v for k, v in raw.items() if k in known})
    stage, state, _ = final_weights(run, asdict(spec))
    tinfo = _target_config(spec.target)
    model = DFlashReference(drafter_config(spec, 2, tinfo))
    if "feature_scale" in state:
        model.register_buffer("feature_scale", state["feature_scale"])
    model.load_state_dict(state)
    return model.eval(), stage, spec, tinfo


def score_run(run: Path, on, ids=None) -> dict:
    """The run's final drafter on the held-out sequences of the dataset `on` (or its sequences `ids`),
    in its own vocabulary."""
    t0 = time.time()
    model, stage, spec, tinfo = final_drafter(run)
    emb = torch.from_numpy(np.array(read_tensors(spec.target, ["token_embd.weight"])["token_embd.weight"]))
    vocab = None
    if 0 < spec.draft_vocab < tinfo["n_vocab"]:
        # the d2t of the run's own drafter file: a run continued with --init keeps its start's
        # vocabulary, which its own data would not choose again
        keep = _run_vocab(run, json.loads((run / "summary.json").read_text()), spec.draft_vocab)
        if keep is None:
            keep = _draft_vocab(run_dataset(run), spec, tinfo["n_vocab"])
        vocab = torch.as_tensor(keep)
    head = (emb if vocab is None else emb[vocab]).to(torch.bfloat16)  # as the Trainer scores it
    m = evaluate_source(model, on, on.val_ids if ids is None else ids, emb, head, vocab=vocab)
    return {"run": str(run), "stage": stage, "draft_vocab": spec.draft_vocab, **m,
            "seconds": round(time.time() - t0, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--on", required=True, help="the run whose held-out sequences score every drafter")
    ap.add_argument("runs", nargs="+", help="finished run directories")
    ap.add_argument("--out", default="bench/results/heldout.json")
    a = ap.parse_args()
    on = run_dataset(a.on)
    rows = []
    for run in map(Path, a.runs):
        m = score_run(run, on)
        rows.append(m)
        print(f"{run}: block tau {m['block_tau']:.3f}  path tau {m.get('path_tau', 0):.3f}  "
              f"per-slot {m['per_slot_accuracy']}")
    greedy = int((on.index[on.val_ids, 3] == 0).sum())
    res = {"command": "python3 " + " ".join(sys.argv), "date": time.strftime("%Y-%m-%d %H:%M"), "on": str(a.on),
           "held_out_sequences": len(on.val_ids),
           "greedy": greedy, "sampled": len(on.val_ids) - greedy, "results": rows}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=1))
    print(f"{len(on.val_ids)} held-out sequences of {a.on} ({greedy} greedy); saved {a.out}")


if __name__ == "__main__":
    main()
