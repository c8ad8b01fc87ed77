"""The data-size curve: one start, one tuning budget, growing samples of one data set.

Each point is `llama-dflash train --data DATA --init INIT --max-sequences N --tune-steps S` (the data
run's prompt and generation settings, so that it asks for sequences the data holds; a point already
trained is resumed or reused as it is), then scored on the data run's held-out sequences (every point on
the same anchors, in the draft vocabulary that --init keeps) and on the first P HumanEval problems,
greedy, in the chat template and as raw completions, at n = 3 and 7.  Only the data size differs
between the points, so the curve shows where more data stops paying at this budget (the shipped
drafter's chain of runs grows data and steps together and cannot).

Usage: python3 bench/bench_datasize.py --data RUN_DIR --init DRAFTER.gguf|RUN_DIR --out-dir DIR
           [--sizes 4980,10000,0] [--tune-steps 4000] [--distill 0.5] [--problems 20] [--tokens 128]
           [--smoke] [--out bench/results/datasize.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_drafters import humaneval_tau  # noqa: E402
from bench_heldout import score_run  # noqa: E402

from llama_dflash.train.run import run_dataset, summary_of  # noqa: E402

# the data run's settings a point must repeat to ask for the sequences that data holds
_SAME = ("prompts", "max_new", "sampled_every", "samples", "temperatures", "seed", "feature_format", "top_k")


def train_point(a, spec: dict, size: int) -> Path:
    out = Path(a.out_dir) / (f"n{size}" if size else "all")
    cmd = ["llama-dflash", "train", "--out", str(out), "--target", spec["target"], "--data", str(a.data),
           "--init", str(a.init), "--max-sequences", str(size), "--distill", str(a.distill)]
    if a.tune_steps is not None:  # (under --smoke: its own few steps unless given)
        cmd += ["--tune-steps", str(a.tune_steps)]
    if spec.get("prompt_sources"):  # (None: the default sources)
        cmd += ["--prompt-sources", ",".join(spec["prompt_sources"])]
    for k in _SAME:
        v = spec.get(k)
        if v is not None:
            cmd += [f"--{k.replace('_', '-')}", ",".join(map(str, v)) if isinstance(v, list) else str(v)]
    if a.smoke:
        cmd.append("--smoke")
    print(" ".join(cmd), file=sys.stderr, flush=True)
    subprocess.run(cmd, check=True)
    return out


def start_score(points: list[dict], n_scored: int) -> dict | None:
    """The common start's held-out metrics, as a point's trainer scored them before its first step on
    the same held-out sequences (a point whose sample holds them all: the held-out split is by prompt)."""
    for p in points:
        s = summary_of(p["run"])
        if s["data"].get("held_out_sequences") == n_scored and (s.get("init") or {}).get("start"):
            return s["init"]["start"]
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True, help="a finished run whose data every point samples")
    ap.add_argument("--init", required=True, help="the common start: a drafter GGUF or a finished run")
    ap.add_argument("--out-dir", required=True, help="where the points' run directories go")
    ap.add_argument("--sizes", default="4980,10000,0", help="--max-sequences of each point (0 = all)")
    ap.add_argument("--tune-steps", type=int, default=None, help="tuning steps of every point (default 4000; "
                    "--smoke's own with --smoke)")
    ap.add_argument("--distill", type=float, default=0.5)
    ap.add_argument("--problems", type=int, default=20, help="HumanEval problems (0: held-out metrics only)")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--smoke", action="store_true", help="the points train with --smoke's tiny settings")
    ap.add_argument("--out", default="bench/results/datasize.json")
    a = ap.parse_args()
    if a.tune_steps is None and not a.smoke:
        a.tune_steps = 4000
    spec = summary_of(a.data)["spec"]
    on = run_dataset(a.data)
    # (a smoke-sized data set may hold no held-out sequence: its first training ones then, as a run does)
    ids, scored_on = (on.val_ids, "held-out") if len(on.val_ids) else (on.train_ids[:8], "training (none held out)")
    points, steps = [], a.tune_steps
    for size in (int(x) for x in a.sizes.split(",")):
        t0 = time.time()
        run = train_point(a, spec, size)
        s = summary_of(run)
        steps = s["spec"]["tune_steps"]  # (under --smoke: its own)
        points.append({"max_sequences": size, "run": str(run), "data": s["data"], "wall_s": s["wall_s"],
                       "held_out": score_run(run, on, ids), "seconds": round(time.time() - t0, 1)})
        h = points[-1]["held_out"]
        print(f"{run}: {s['data'].get('train_sequences')} training sequences, "
              f"{s['data'].get('response_tokens')} response tokens; held-out block tau {h['block_tau']:.3f}, "
              f"path tau {h.get('path_tau', 0):.3f}", flush=True)
    if a.problems > 0:
        rows = humaneval_tau({f"p{i}": str(Path(p["run"]) / "drafter.gguf") for i, p in enumerate(points)},
                             a.problems, a.tokens, auto=False)
        for i, p in enumerate(points):
            p["humaneval"] = {k.split("/", 1)[1]: v for k, v in rows.items() if k.split("/", 1)[0] == f"p{i}"}
    res = {"command": "python3 " + " ".join(sys.argv), "date": datetime.datetime.now().isoformat(timespec="seconds"),
           "data": str(a.data), "init": str(a.init), "tune_steps": steps, "distill": a.distill,
           "scored_sequences": len(ids), "scored_on": scored_on, "problems": a.problems, "tokens": a.tokens,
           "start_held_out": start_score(points, len(ids)), "points": points}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=1))
    print(f"saved {a.out}")


if __name__ == "__main__":
    main()
