"""The fuzz test's worker (tests/test_fuzz.py runs it in a child process, so that a crash or an
abort is seen as one rather than killing the suite).

Seeded mutations of a small drafter GGUF (byte flips in its metadata, truncations, scalar
hyper-parameters set to out-of-range values in place), of a small HF checkpoint (config.json
values, safetensors header bytes) and of CLI values.  Before each case it prints "CASE category i
description", after it "DONE category i outcome"; a last line "SUMMARY {json}" gives per category
tried / clean / wrong (a crash or a hang leaves a CASE without its DONE).

clean: refused with a fitting exception (DFlashError, ValueError, OSError) or a one-line CLI error
(exit 2), or accepted and then generating without error.  wrong: any other exception (a
traceback), a CLI exit other than 0 / 2, a known-bad CLI value accepted, or the loader and the
checker disagreeing about a file.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import random
import shutil
import sys
from pathlib import Path

import numpy as np

CLEAN = ("DFlashError", "ValueError", "OSError", "FileNotFoundError", "ConvertError", "IsADirectoryError",
         "PermissionError", "UnicodeDecodeError", "NotADirectoryError")


class Counts:
    def __init__(self) -> None:
        self.d: dict[str, dict[str, int]] = {}
        self.wrong: list[str] = []

    def run(self, cat: str, i: int, desc: str, fn) -> None:
        print(f"CASE {cat} {i} {desc}", flush=True)
        c = self.d.setdefault(cat, {"tried": 0, "clean": 0, "wrong": 0})
        c["tried"] += 1
        try:
            why = fn()
        except Exception as e:  # noqa: BLE001 - classified here
            name = type(e).__name__
            why = None if name in CLEAN or isinstance(e, (ValueError, OSError)) else f"{name}: {e}"
        if why:
            c["wrong"] += 1
            self.wrong.append(f"{cat} {i} {desc}: {why}")
            print(f"DONE {cat} {i} wrong {why}", flush=True)
        else:
            c["clean"] += 1
            print(f"DONE {cat} {i} clean", flush=True)


def gguf_cases(counts: Counts, rng: random.Random, target: str, drafter: str, work: Path, n: int) -> None:
    import gguf

    from llama_dflash import SpeculativeGenerator
    from llama_dflash.formats.check import check_drafter

    data = Path(drafter).read_bytes()
    meta_end = min(len(data), 8192)  # header, key-values and tensor infos of the small drafter

    def accepted_runs(path: Path):
        """Either both the checker (against the target, as `inspect --target` asks) and the loader
        refuse, or both accept and it generates."""
        try:
            check_drafter(path, target)
            checked = None
        except Exception as e:  # noqa: BLE001
            checked = e
        try:
            with SpeculativeGenerator(target, path, n_ctx=64) as g:
                g.generate("Hello", 6, draft_len=min(3, g.max_draft_len))
                g.generate("Hello", 6)
            loaded = None
        except Exception as e:  # noqa: BLE001
            loaded = e
        for e in (checked, loaded):
            if e is not None and type(e).__name__ not in CLEAN and not isinstance(e, (ValueError, OSError)):
                raise e
        if (checked is None) != (loaded is None):
            return f"checker and loader disagree: check {checked!r}, load {loaded!r}"
        return None

    for i in range(n):
        p = work / f"m{i}.gguf"
        kind = rng.choice(["flip", "flip", "truncate", "scalar"])
        if kind == "flip":
            b = bytearray(data)
            offs = [rng.randrange(0, meta_end) for _ in range(rng.randint(1, 4))]
            for o in offs:
                b[o] = rng.randrange(256)
            p.write_bytes(bytes(b))
            desc = f"bytes {offs}"
        elif kind == "truncate":
            cut = rng.randrange(0, len(data))
            p.write_bytes(data[:cut])
            desc = f"truncated to {cut}"
        else:
            shutil.copyfile(drafter, p)
            r = gguf.GGUFReader(p, "r+")
            scalars = [f for f in r.fields.values() if f.name.startswith("dflash.") and len(f.types) == 1
                       and len(f.data) == 1]
            f = rng.choice(scalars)
            part = f.parts[f.data[0]]
            if part.dtype.kind == "f":
                v = rng.choice([math.nan, math.inf, -math.inf, -1.0, 0.0, 1e30, 1e-30])
            elif part.dtype.kind in "iu":
                info = np.iinfo(part.dtype)
                v = rng.choice([0, 1, info.max, info.max // 2, 100000, 3] + ([-1, info.min] if info.min < 0 else []))
            else:
                v = rng.choice([0, 1])
            part[0] = v
            del r
            desc = f"{f.name} = {v}"
        counts.run("drafter-gguf", i, f"{kind}: {desc}", lambda p=p: accepted_runs(p))
        p.unlink(missing_ok=True)


def hf_cases(counts: Counts, rng: random.Random, target: str, work: Path, n: int) -> None:
    from llama_dflash.formats import convert_hf_to_gguf

    from hf_fixtures import make_variant

    base, _, _ = make_variant(work / "hf", "v1_toplevel")
    bad_values = [None, -1, 0, 10**12, 1.5, "x", [], {}, True, float("nan")]

    for i in range(n):
        d = work / f"hf{i}"
        shutil.copytree(base, d)
        cfg_path = d / "config.json"
        if rng.random() < 0.6:
            cfg = json.loads(cfg_path.read_text())
            sub = cfg.get("dflash_config") if isinstance(cfg.get("dflash_config"), dict) else {}
            keys = list(cfg) + [f"dflash_config.{k}" for k in sub]
            k = rng.choice(keys)
            v = rng.choice(bad_values)
            if k.startswith("dflash_config."):
                cfg["dflash_config"][k.split(".", 1)[1]] = v
            else:
                cfg[k] = v
            cfg_path.write_text(json.dumps(cfg))
            desc = f"config {k} = {v!r}"
        else:
            st = rng.choice(sorted(d.glob("*.safetensors")))
            b = bytearray(st.read_bytes())
            header = int.from_bytes(b[:8], "little")
            offs = [rng.randrange(0, min(len(b), 8 + header)) for _ in range(rng.randint(1, 3))]
            for o in offs:
                b[o] = rng.randrange(256)
            st.write_bytes(bytes(b))
            desc = f"{st.name} bytes {offs}"

        def convert(d=d, i=i):
            out = work / f"hf{i}.gguf"
            convert_hf_to_gguf(d, target, out, outtype="f32")  # validates what it wrote (check_drafter)
            from llama_dflash import SpeculativeGenerator

            with SpeculativeGenerator(target, out, n_ctx=64) as g:
                g.generate("Hello", 6)
            return None

        counts.run("hf-checkpoint", i, desc, convert)
        shutil.rmtree(d, ignore_errors=True)


BAD_CLI = {
    "--threads": ["0", "-1", "abc", "1e3", "", "99999999999999999999"],
    "--max-tokens": ["0", "-3", "2**63", "nan", "9223372036854775808"],
    "--draft-len": ["-1", "65", "2147483648", "x"],
    "--n-ctx": ["0", "-5", "2147483648", "1.5"],
    "--temperature": ["nan", "inf", "-1", "abc", "1e400"],
    "--top-p": ["-0.5", "nan", "1.5"],
    "--top-k": ["-5", "1.5"],
    "--min-p": ["2", "-1", "nan"],
    "--repeat-penalty": ["0", "-1", "nan", "inf"],
    "--seed": ["-2", "18446744073709551616", "x"],
    "--speculation": ["maybe", ""],
    "--mode": ["fast"],
}
GOOD_CLI = {"--threads": ["1", "2"], "--max-tokens": ["1", "5"], "--draft-len": ["0", "2"], "--temperature": ["0",
            "0.7"], "--seed": ["-1", "7"], "--speculation": ["auto", "on", "off"], "--top-k": ["0", "40"]}


def cli_cases(counts: Counts, rng: random.Random, target: str, drafter: str, work: Path, n: int) -> None:
    from llama_dflash.api import cli

    def run(argv: list[str], want: int) -> str | None:
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            try:
                rc = cli.main(argv)
            except SystemExit as e:  # argparse
                rc = e.code if isinstance(e.code, int) else 2
        text = err.getvalue()
        if "Traceback" in text:
            return "traceback: " + text[-300:]
        if rc != want:
            return f"exit {rc} (wanted {want}): {text.strip()[-200:]}"
        if want == 2 and len([ln for ln in text.strip().splitlines() if ln.strip()]) != 1:
            return "not one line: " + text[-300:]
        return None

    base = ["generate", "--model", target, "--drafter", drafter, "--prompt", "Hi", "--max-tokens", "4",
            "--n-ctx", "128"]
    missing = str(work / "missing.gguf")
    paths = [missing, str(work), "/dev/null", str(work / "junk.gguf")]
    (work / "junk.gguf").write_bytes(b"GGUF" + bytes(100))
    for i in range(n):
        r = rng.random()
        if r < 0.6:
            flag = rng.choice(sorted(BAD_CLI))
            v = rng.choice(BAD_CLI[flag])
            argv, want, desc = [*base, flag, v], 2, f"{flag} {v!r}"
        elif r < 0.8:
            flag = rng.choice(sorted(GOOD_CLI))
            v = rng.choice(GOOD_CLI[flag])
            argv, want, desc = [*base, flag, v], 0, f"{flag} {v!r} (valid)"
        else:
            which = rng.choice(["--model", "--drafter", "inspect"])
            pth = rng.choice(paths)
            if which == "inspect":
                argv, desc = ["inspect", pth], f"inspect {pth}"
            else:
                argv = list(base)
                argv[argv.index(which) + 1] = pth
                desc = f"{which} {pth}"
            want = 2
        counts.run("cli", i, desc, lambda argv=argv, want=want: run(argv, want))


def main() -> int:
    target, drafter, work, seed, n = sys.argv[1], sys.argv[2], Path(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from llama_cpp import _logger

    _logger.set_verbose(False)
    rng = random.Random(seed)
    counts = Counts()
    gguf_cases(counts, rng, target, drafter, work, n)
    hf_cases(counts, rng, target, work, max(1, n // 4))
    cli_cases(counts, rng, target, drafter, work, max(1, n // 2))
    print("SUMMARY " + json.dumps({"counts": counts.d, "wrong": counts.wrong}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
