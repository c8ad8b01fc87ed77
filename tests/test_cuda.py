"""CUDA: our CUDA sources compile (everywhere nvcc is), the host walk matches a reference, and, on a
machine with a CUDA device and a CUDA build (scripts/setup.sh --cuda), the device twins, the drafter
and the engine on the GPU (marked ``gpu``; skipped with the reason elsewhere)."""

from __future__ import annotations

import math
import os
import shutil
import subprocess
from pathlib import Path

import llama_cpp
import numpy as np
import pytest

from llama_dflash import SpeculativeGenerator
from llama_dflash.core.drafter import Drafter, cuda_devices, walk_lattice
from llama_dflash.errors import DFlashError

from models import MASK_ID, growing_context

ROOT = Path(__file__).resolve().parents[1]
CUDA_SOURCES = sorted((ROOT / "csrc" / "cuda").glob("*.cu"))
# C sources with code that only a CUDA build compiles
CUDA_GUARDED = sorted(p for p in (ROOT / "csrc").rglob("*.c") if "DFLASH_CUDA" in p.read_text())


def _no_gpu_reason() -> str | None:
    if cuda_devices() > 0:
        return None
    if not llama_cpp.llama_supports_gpu_offload():
        return "no CUDA: this build is CPU-only (scripts/setup.sh --cuda builds the CUDA one)"
    return "this build has CUDA but no CUDA device is visible"


gpu = pytest.mark.gpu
needs_gpu = pytest.mark.skipif(_no_gpu_reason() is not None, reason=str(_no_gpu_reason()))


# ---- everywhere: compile checks and the host twin -----------------------------------------------

def _llama_include() -> Path:
    return Path(llama_cpp.__file__).resolve().parent.parent / "include"


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_cuda_sources_compile(arch, tmp_path):
    """Every CUDA source of ours compiles (no GPU needed), warnings as errors, and the C code a CUDA
    build adds compiles too: a broken kernel cannot land."""
    assert CUDA_SOURCES, "no CUDA sources found"
    for src in CUDA_SOURCES:
        r = subprocess.run(["nvcc", "-c", "-O2", f"-arch={arch}", "-Werror", "all-warnings",
                            "-Xcompiler", "-Wall,-Wextra,-Werror", f"-I{ROOT / 'csrc'}", str(src),
                            "-o", str(tmp_path / (src.stem + ".o"))], capture_output=True, text=True)
        assert r.returncode == 0, f"{src.name} ({arch}):\n{r.stderr}"
    cc = os.environ.get("CC", "cc")
    for src in CUDA_GUARDED:
        r = subprocess.run([cc, "-std=gnu11", "-fsyntax-only", "-Wall", "-Wextra", "-Wno-unused-parameter", "-Werror",
                            "-DDFLASH_CUDA", f"-I{ROOT / 'csrc'}", f"-I{ROOT / 'csrc' / 'drafter'}",
                            f"-I{_llama_include()}", str(src)], capture_output=True, text=True)
        assert r.returncode == 0, f"{src.name} with -DDFLASH_CUDA:\n{r.stderr}"


_M = (1 << 64) - 1


class _Xoshiro:
    """The core's generator (common.h: xoshiro256** seeded through splitmix64), in Python."""

    def __init__(self, seed: int) -> None:
        x, self.s = seed & _M, []
        for _ in range(4):
            x = (x + 0x9E3779B97F4A7C15) & _M
            z = x
            z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M
            z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M
            self.s.append(z ^ (z >> 31))

    def uniform(self) -> float:
        s = self.s
        rotl = lambda x, k: ((x << k) | (x >> (64 - k))) & _M  # noqa: E731
        out = (rotl((s[1] * 5) & _M, 7) * 9) & _M
        t = (s[1] << 17) & _M
        s[2] ^= s[0]
        s[3] ^= s[1]
        s[1] ^= s[2]
        s[0] ^= s[3]
        s[2] ^= t
        s[3] = rotl(s[3], 45)
        return (out >> 11) * 2.0 ** -53


def _reference_walk(cand, scores, temperature=0.0, seed=0, p_min=0.0):
    """dflash.h's walk, written from its definition: each slot's row is the one after the previous
    slot's choice; greedy takes the first maximum and stops below p_min; sampling draws from
    softmax(row / T) with one uniform per slot."""
    rng, prev, toks, extra = _Xoshiro(seed), 0, [], []
    for k in range(cand.shape[0]):
        row = scores[k, prev].astype(np.float64)
        if temperature > 0:
            e = np.exp((row - row.max()) / temperature)
            cum = np.cumsum(e)
            pick = int(np.searchsorted(cum, rng.uniform() * cum[-1], side="right"))
            extra.append(e / cum[-1])
        else:
            pick = int(np.argmax(row))
            conf = math.exp(row[pick] - row.max()) / np.exp(row - row.max()).sum()
            if conf < p_min:
                break
            extra.append(conf)
        toks.append(int(cand[k, pick]))
        prev = pick
    return toks, np.array(extra)


def _lattice(rng, n=7, K=16, spread=3.0):
    cand = rng.integers(0, 50000, (n, K)).astype(np.int32)
    return cand, (rng.standard_normal((n, K, K)) * spread).astype(np.float32)


def test_host_walk_matches_reference():
    """The host walk (the CUDA walk's twin) against the walk's definition: greedy, cut at p_min,
    sampled (the same generator's draws)."""
    rng = np.random.default_rng(3)
    cuts = 0
    for trial in range(40):
        cand, scores = _lattice(rng, n=int(rng.integers(1, 16)), K=int(rng.choice([4, 8, 16, 32])))
        toks, conf = walk_lattice(cand, scores)
        want, wconf = _reference_walk(cand, scores)
        assert toks == want and np.allclose(conf, wconf, rtol=1e-6, atol=1e-7)
        toks, _ = walk_lattice(cand, scores, p_min=0.5)
        want, _ = _reference_walk(cand, scores, p_min=0.5)
        assert toks == want
        cuts += len(want) < cand.shape[0]
        for T in (0.7, 1.0, 1.5):
            toks, q = walk_lattice(cand, scores, temperature=T, seed=trial)
            want, wq = _reference_walk(cand, scores, temperature=T, seed=trial)
            assert toks == want and np.allclose(q, wq, rtol=1e-5, atol=1e-7)
    assert cuts >= 10  # the p_min cut-off was exercised


def test_cuda_walk_reports_a_missing_device():
    if cuda_devices() > 0:
        pytest.skip("a CUDA device is present (test_walk_twins_agree covers it)")
    cand, scores = _lattice(np.random.default_rng(1))
    with pytest.raises(DFlashError, match="CUDA"):
        walk_lattice(cand, scores, on_cuda=True)


# ---- on a CUDA device ---------------------------------------------------------------------------

@gpu
@needs_gpu
def test_walk_twins_agree():
    """The device walk and its host twin on the same lattices: greedy ids and cut-offs identical,
    confidences and q to float rounding, sampled ids identical (same draws)."""
    rng = np.random.default_rng(11)
    for trial in range(200):
        cand, scores = _lattice(rng, n=int(rng.integers(1, 16)), K=int(rng.choice([4, 8, 16, 32])))
        for kw in ({}, {"p_min": 0.5}, {"temperature": 0.8, "seed": trial}, {"temperature": 1.3, "seed": 7}):
            host, hx = walk_lattice(cand, scores, **kw)
            dev, dx = walk_lattice(cand, scores, on_cuda=True, **kw)
            assert dev == host, (trial, kw)
            assert np.allclose(dx, hx, rtol=1e-5, atol=1e-7), (trial, kw)


def _model(path, gpu_layers: int):
    p = llama_cpp.llama_model_default_params()
    p.n_gpu_layers = gpu_layers
    m = llama_cpp.llama_model_load_from_file(str(path).encode(), p)
    assert m, path
    return m


@pytest.fixture
def cpu_and_gpu_models():
    llama_cpp.llama_backend_init()
    made = []

    def load(path):
        pair = _model(path, 0), _model(path, 999)
        made.extend(pair)
        return pair

    yield load
    for m in made:
        llama_cpp.llama_model_free(m)


@gpu
@needs_gpu
@pytest.mark.parametrize("which", ["v1", "v2"])
def test_gpu_drafts_match_cpu(which, artifacts, v2_drafter, cpu_and_gpu_models):
    """The drafter on a CUDA target (it follows the head's device) drafts what the CPU core drafts:
    logits within tolerance, ids (and DFlash2's confidences) equal wherever the CPU's choice is
    clear; DFlash2 walks on the device (its scores stay there)."""
    path = v2_drafter if which == "v2" else artifacts["qwen3"]["drafter"]
    target = artifacts["llama" if which == "v2" else "qwen3"]["target"]
    m_cpu, m_gpu = cpu_and_gpu_models(target)
    cpu, dev = Drafter(str(path), m_cpu, n_ctx=512, n_threads=2), Drafter(str(path), m_gpu, n_ctx=512, n_threads=2)
    width = len(cpu.info.target_layers) * cpu.info.n_embd
    feats = np.random.default_rng(5).standard_normal((300, width)).astype(np.float32)
    compared = 0
    n_max = cpu.info.block_size - 1
    for _, anchor, n in growing_context([cpu, dev], feats, [(12, n_max), (3, 3), (90, n_max), (4, 1)],
                                        np.random.default_rng(6)):
        ids_c, lg_c = cpu.draft(anchor, n, return_logits=True)
        ids_g, lg_g = dev.draft(anchor, n, return_logits=True)
        lim = 1e-3 + 1e-3 * np.abs(lg_c).max()
        assert np.abs(lg_g - lg_c).max() < lim
        if which == "v2":
            with pytest.raises(DFlashError, match="CUDA"):
                dev.last_lattice()  # walked on the device
            cand, scores = cpu.last_lattice()
            prev, clear = 0, 0
            for k in range(n):  # equal along the path while the CPU's choice is clear
                row = np.sort(scores[k, prev])
                if row[-1] - row[-2] < 1e-2:
                    break
                assert ids_g[k] == ids_c[k]
                prev = int(np.argmax(scores[k, prev]))
                clear += 1
            compared += clear
            # the confidences adaptive steps calibrate (the device walk's, capped by the unary
            # probability read back from the device) agree along that path too
            conf_c = cpu.draft(anchor, n, return_conf=True)[1]
            conf_g = dev.draft(anchor, n, return_conf=True)[1]
            np.testing.assert_allclose(conf_g[:clear], conf_c[:clear], rtol=1e-2, atol=1e-3)
        else:
            top2 = np.sort(lg_c, axis=1)[:, -2:]
            clear = (top2[:, 1] - top2[:, 0]) > 2 * lim
            assert (np.asarray(ids_g)[clear] == np.asarray(ids_c)[clear]).all()
            compared += int(clear.sum())
    assert compared >= 8
    cpu.close()
    dev.close()


@gpu
@needs_gpu
def test_gpu_same_as_upstream_graph(artifacts, cpu_and_gpu_models):
    """Ours and upstream's `dflash` graph, both on the GPU, on the same features."""
    from llama_dflash.verify.upstream import UpstreamDrafter

    a = artifacts["qwen3"]
    _, m_gpu = cpu_and_gpu_models(a["target"])
    ours = Drafter(a["drafter"], m_gpu, n_ctx=512, n_threads=2)
    up = UpstreamDrafter(a["drafter"], m_gpu, n_ctx=512)
    width = len(ours.info.target_layers) * ours.info.n_embd
    feats = np.random.default_rng(7).standard_normal((300, width)).astype(np.float32)
    for _, anchor, n in growing_context([ours, up], feats, [(12, 7), (3, 15), (90, 5)], np.random.default_rng(8)):
        _, logits = ours.draft(anchor, n, return_logits=True)
        exp = up.draft(anchor, MASK_ID, n)
        assert np.abs(logits - exp).max() < 1e-3 + 1e-3 * np.abs(exp).max()
    up.close()
    ours.close()


def _prompts(g) -> list[list[int]]:
    return [g.tokenize(p) for p in ("The capital of France", "def fib(n):", "1, 2, 3, 4,", "Once upon a time")]


@gpu
@needs_gpu
def test_gpu_greedy_identical_or_certified(artifacts):
    """Speculative decoding on the GPU: greedy output equal to plain decoding, or the divergence
    certified as batch numerics (the default mode)."""
    from llama_dflash.verify.certify import certify

    a = artifacts["llama"]
    checker = None
    with SpeculativeGenerator(a["target"], a["drafter"], n_ctx=512, n_gpu_layers=999) as g:
        for toks in _prompts(g):
            plain = g.generate(toks, 48, draft_len=0, stop_on_eos=False).tokens
            steps: list[dict] = []
            spec = g.generate(toks, 48, draft_len=7, stop_on_eos=False, on_step=steps.append).tokens
            if spec != plain:
                if checker is None:
                    checker = llama_cpp.Llama(a["target"], n_ctx=512, logits_all=True, n_gpu_layers=999,
                                              verbose=False)
                rep = certify(checker, toks + plain, toks + spec, len(toks), steps)
                assert rep is not None and rep["certified"], rep


@gpu
@needs_gpu
def test_gpu_exact_mode_is_exact_or_refuses(artifacts):
    """Exact mode on the GPU: the self-check either refuses with its cause or the output is
    bit-identical to plain decoding (no certification allowed)."""
    a = artifacts["llama"]
    try:
        g = SpeculativeGenerator(a["target"], a["drafter"], n_ctx=512, n_gpu_layers=999, exact=True)
    except DFlashError as e:
        assert "exact" in str(e)
        print(f"exact mode refused on the GPU: {e}")
        return
    with g:
        print(f"exact mode on the GPU: verify batches of up to {g.max_draft_len + 1} rows are invariant")
        for toks in _prompts(g):
            assert g.generate(toks, 48, draft_len=g.max_draft_len, stop_on_eos=False).tokens == \
                g.generate(toks, 48, draft_len=0, stop_on_eos=False).tokens


def _gpu_mem_used_mib() -> int:
    out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, check=True).stdout
    return int(out.split()[0])


@gpu
@needs_gpu
@pytest.mark.skipif(shutil.which("nvidia-smi") is None, reason="nvidia-smi is not installed")
def test_gpu_memory_stays_bounded(artifacts):
    """Repeated long generations do not grow device memory (graphs and scratch are reused)."""
    a = artifacts["llama"]
    with SpeculativeGenerator(a["target"], a["drafter"], n_ctx=1024, n_gpu_layers=999) as g:
        toks = g.tokenize("Count with me: one, two, three")
        g.generate(toks, 200, draft_len=7, stop_on_eos=False)
        base = _gpu_mem_used_mib()
        for _ in range(4):
            g.generate(toks, 400, draft_len=7, stop_on_eos=False)
            g.generate(toks, 100, draft_len=3, stop_on_eos=False)
        assert _gpu_mem_used_mib() - base < 64
