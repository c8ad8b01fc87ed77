"""`llama-dflash train --smoke`: the whole training pipeline end to end on tiny settings (data
generation with feature capture, the three training stages, export, conversion, the draft
vocabulary, re-encoding), timed as a user runs it -- the CLI in a fresh process, so the time
includes starting Python and importing torch.  Each run in a new directory; the median of --runs,
and each stage's wall time from the run's summary.

Usage: python3 bench/bench_train_smoke.py [--runs 3] [--out bench/results/train_smoke.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out", default="bench/results/train_smoke.json")
    a = ap.parse_args()
    if a.runs < 1:
        ap.error("--runs takes 1 or more")
    cli = shutil.which("llama-dflash")
    cmd = [cli] if cli else [sys.executable, "-m", "llama_dflash"]
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(a.runs):
            out = Path(tmp) / f"run{i}"
            t0 = time.perf_counter()
            p = subprocess.run([*cmd, "train", "--out", str(out), "--smoke"], capture_output=True, text=True)
            wall = time.perf_counter() - t0
            if p.returncode != 0:
                sys.exit(f"train --smoke failed ({p.returncode}): {p.stderr.strip()[-400:]}")
            s = json.loads((out / "summary.json").read_text())
            runs.append({"wall_s": round(wall, 2), "stages_s": s.get("wall_s", {}),
                         "drafter_bytes": (out / "drafter.gguf").stat().st_size})
            print(f"run {i + 1}: {wall:.1f} s (stages {s.get('wall_s', {})})", flush=True)
    res = {"command": "python3 " + " ".join(sys.argv), "date": datetime.datetime.now().isoformat(timespec="seconds"),
           "median_wall_s": round(statistics.median(r["wall_s"] for r in runs), 2), "runs": runs}
    print(f"median {res['median_wall_s']:.1f} s")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=1))
    print("saved", a.out)


if __name__ == "__main__":
    main()
