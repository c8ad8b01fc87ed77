"""Distillation against the target's top-32 distribution vs the generated tokens alone, side by side.

One data set (the default target's one-pass data: greedy + one T = 0.7 sample per prompt, 8-bit
rows, top-32 log-probabilities) and, for each distillation weight, the same short recipe from
the same seed: DFlash v1 then DFlash2 (v1 weights, identity convolutions, fresh selector), in
the 8192-token draft vocabulary, as ``llama-dflash train`` runs it.  Each arm is scored on the
same held-out sequences with the same anchors: block tau, path tau (the DFlash2 greedy walk),
first-slot accuracy.  A short recipe ranks the losses; it does not measure the shipped
drafter's tau.

Usage: python bench/bench_distill.py --data DIR [--prompts 400] [--distill 0,0.5,1]
                                     [--v1-steps 400] [--v2-steps 600] [--out bench/results/distill.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

from llama_dflash.api.models import default_target
from llama_dflash.formats.gguf import read_tensors
from llama_dflash.formats.hf import default_target_layer_ids
from llama_dflash.train.data import Dataset, DataSpec, build_features, generate_responses
from llama_dflash.train.loop import TrainConfig, Trainer, evaluate_source, whiten_features
from llama_dflash.train.prompts import training_prompts
from llama_dflash.train.run import (
    RunSpec,
    _draft_vocab,
    _feature_sample,
    _init_v1,
    _init_v2_from_v1,
    _target_config,
    drafter_config,
)
from llama_dflash.verify.reference import DFlashReference


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True, help="data directory (made once, reused)")
    ap.add_argument("--prompts", type=int, default=400)
    ap.add_argument("--distill", default="0,0.5,1")
    ap.add_argument("--v1-steps", type=int, default=400)
    ap.add_argument("--v2-steps", type=int, default=600)
    ap.add_argument("--out", default="bench/results/distill.json")
    a = ap.parse_args()
    target = str(default_target())
    tinfo = _target_config(target)
    spec = RunSpec(target=target, taps=default_target_layer_ids(tinfo["n_layer"], 5), prompts=a.prompts)
    data = Path(a.data)
    dspec = DataSpec(target=target, taps=spec.taps, max_new=spec.max_new, n_seq=spec.n_seq, seed=spec.seed,
                     sampled_every=spec.sampled_every, samples=spec.samples, top_k=32)
    prompts = training_prompts(seed=spec.seed, limit=a.prompts)
    t0 = time.time()
    generate_responses(data, dspec, prompts)
    build_features(data, dspec, prompts)
    data_s = time.time() - t0
    ds = Dataset(data)
    t = read_tensors(target, ["token_embd.weight", "output.weight"])
    embed = torch.from_numpy(np.array(t["token_embd.weight"]))
    head = torch.from_numpy(np.array(t["output.weight"])) if "output.weight" in t else embed
    vocab = torch.as_tensor(_draft_vocab(ds, spec, tinfo["n_vocab"]))
    sample = _feature_sample(ds)
    out = Path(a.out)
    res = json.loads(out.read_text()) if out.is_file() else {}
    res.update(command="python " + " ".join(sys.argv), date=time.strftime("%Y-%m-%d %H:%M"), target=Path(target).name,
               sequences=len(ds), held_out=len(ds.val_ids), response_tokens=int(sum(ds.index[:, 1] - ds.index[:, 2])),
               data_s=round(data_s, 1), v1_steps=a.v1_steps, v2_steps=a.v2_steps, arms=res.get("arms", {}))
    for lam in (float(x) for x in a.distill.split(",")):
        t1 = time.time()
        torch.manual_seed(spec.seed)
        states = {}
        for name, version, steps, lr in (("v1", 1, a.v1_steps, spec.v1_lr), ("v2", 2, a.v2_steps, spec.v2_lr)):
            model = DFlashReference(drafter_config(spec, version, tinfo))
            whiten_features(model, sample)
            if name == "v1":
                _init_v1(model, spec.seed)
            else:
                _init_v2_from_v1(model, states["v1"], spec.seed)
            tc = TrainConfig(steps=steps, lr=lr, seqs_per_step=spec.seqs_per_step, anchors_per_seq=spec.anchors_per_seq,
                             seed=spec.seed + version, distill=lam)
            tr = Trainer(model, ds, ds.train_ids, embed, head, tc, val_ids=[], vocab=vocab)
            tr.run()
            states[name] = {k: v.clone() for k, v in model.state_dict().items()}
        m = evaluate_source(model, ds, ds.val_ids, embed, tr.head, vocab=vocab)
        res["arms"][f"{lam:g}"] = {**m, "train_s": round(time.time() - t1, 1)}
        print(f"distill {lam:g}: path tau {m.get('path_tau')}  block tau {m['block_tau']}  "
              f"per-slot {m['per_slot_accuracy']}  ({time.time() - t1:.0f} s)", flush=True)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
