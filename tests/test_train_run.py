"""The training pipeline end to end (smoke mode), its resumability, batched data generation
and the held-out HumanEval set."""

from __future__ import annotations

import json
import re
import shutil
import sys
import time

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader

from llama_dflash import SpeculativeGenerator
from llama_dflash.api.cli import main
from llama_dflash.core.batchgen import BatchGenerator, Job
from llama_dflash.formats.safetensors import read_header
from llama_dflash.train import loop as T
from llama_dflash.train.data import Dataset
from llama_dflash.train.prompts import (
    _held_out_markers,
    chatml,
    humaneval_problems,
    humaneval_prompts,
    overlaps_humaneval,
    training_prompts,
)
from llama_dflash.train.run import run_dataset
from llama_dflash.verify.reference import DFlashReference

from models import drafter_config


@pytest.fixture(scope="module")
def smoke_run(artifacts, tmp_path_factory):
    """One finished smoke run, made once for the tests that start from a run (--init, --data,
    --extend); each works on its own copy (some damage it on purpose)."""
    out = tmp_path_factory.mktemp("smoke") / "a"
    assert main(["train", "--smoke", "--target", artifacts["llama"]["target"], "--out", str(out), "--json"]) == 0
    return out


def _earlier_run(smoke_run, tmp_path):
    """The smoke run, copied to tmp_path / "a"."""
    return shutil.copytree(smoke_run, tmp_path / "a")


def test_smoke_run_end_to_end(artifacts, tmp_path, capsys):
    """`llama-dflash train --smoke`: data -> features -> v1 -> DFlash2 -> DFlash2 tuned in the draft
    vocabulary -> HF -> GGUF, then the GGUF drafts with our loop (greedy output identical to plain);
    a second call resumes (no-op)."""
    target = artifacts["llama"]["target"]
    out = tmp_path / "run"
    t0 = time.time()
    assert main(["train", "--smoke", "--target", target, "--out", str(out), "--json"]) == 0
    wall = time.time() - t0
    s = json.loads(capsys.readouterr().out)
    with capsys.disabled():
        print(f"\n[train --smoke] {wall:.1f} s end to end; stages {s['wall_s']}")
    assert s["data"]["sequences"] == 12 and s["data"]["sampled_sequences"] == 6  # 6 prompts, each also sampled
    assert set(s["data"]["prompt_sources"]) <= {"stdlib-code", "authored-code", "authored-general"}
    assert s["data"]["licences"] and set(s["data"]["licences"].items()) <= {("python-stdlib", "PSF-2.0"),
                                                                             ("llama-dflash (authored)", "MIT")}
    for v in ("v1", "v2", "tune"):
        assert [h["step"] for h in s["held_out"][v]] == [3, 6]
        assert len(s["held_out"][v][-1]["per_slot_accuracy"]) == 7
    for v in ("v2", "tune"):
        assert "selector_accuracy" in s["held_out"][v][-1] and "path_tau" in s["held_out"][v][-1]
    assert set(s["wall_s"]) >= {"v1", "v2", "tune", "vocab"}
    cfg = json.loads((out / "hf" / "config.json").read_text())
    assert cfg["architectures"] == ["DFlash2DraftModel"] and cfg["dflash_config"]["block_size"] == 8
    assert (out / "hf" / "model.safetensors").is_file() and (out / "ckpt-tune.pt").is_file()
    # the same weights in vLLM speculators' schema (tests/test_speculators.py loads that schema in speculators)
    spec = json.loads((out / "speculators" / "config.json").read_text())
    assert spec["speculators_model_type"] == "dflash2" and spec["block_size"] == 8
    assert spec["aux_hidden_state_layer_ids"] == [i + 1 for i in cfg["dflash_config"]["target_layer_ids"]]
    assert (out / "speculators" / "model.safetensors").read_bytes() == (out / "hf" / "model.safetensors").read_bytes()
    # the exported weights are the tuned ones (the v2 stage's differ)
    tuned = torch.load(out / "ckpt-tune.pt", weights_only=False)["model"]
    v2 = torch.load(out / "ckpt-v2.pt", weights_only=False)["model"]
    assert not torch.equal(tuned["layers.0.mlp.up_proj.weight"], v2["layers.0.mlp.up_proj.weight"])
    hf = read_header(out / "hf" / "model.safetensors")["layers.0.mlp.up_proj.weight"].load()
    torch.testing.assert_close(torch.as_tensor(hf), tuned["layers.0.mlp.up_proj.weight"])
    # the shipped file proposes the 256 most frequent tokens; the full-vocabulary conversion is kept
    assert s["gguf"]["draft_vocab"] == 256
    assert s["data"]["held_out_sequences"] == 0 and s["gguf"]["held_out_coverage"] is None  # nothing to measure on
    assert (out / "drafter-fullvocab.gguf").is_file()
    with SpeculativeGenerator(target, out / "drafter.gguf", n_ctx=256) as g:
        assert g.drafter_info.version == 2 and g.drafter_info.block_size == 8
        assert g.drafter_info.n_vocab_draft == 256 < g.drafter_info.n_vocab
        toks = g.tokenize(chatml("Write a Python function that reverses a list."))
        plain = g.generate(toks, 24, draft_len=0, stop_on_eos=False)
        spec = g.generate(toks, 24, draft_len=7, stop_on_eos=False)
    assert spec.tokens == plain.tokens
    # everything is done: a second call resumes every stage and trains nothing
    assert main(["train", "--smoke", "--target", target, "--out", str(out), "--json"]) == 0
    s2 = json.loads(capsys.readouterr().out)
    assert s2["held_out"] == s["held_out"] and s2["data"] == s["data"]
    assert "resumed from" in (out / "train.log").read_text()
    # other settings in the same directory are refused, in one line
    assert main(["train", "--smoke", "--target", target, "--out", str(out), "--v1-steps", "9"]) == 2
    assert "other settings" in capsys.readouterr().err
    # ... but not a speed setting: sequences per decode may change between calls (recorded as the last one)
    sp = json.loads((out / "summary.json").read_text())
    sp["spec"]["n_seq"] = 7
    (out / "summary.json").write_text(json.dumps(sp))
    assert main(["train", "--smoke", "--target", target, "--out", str(out), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["spec"]["n_seq"] == 4
    # a run recorded before a setting existed resumes with this call's value (here: reduces the vocabulary)
    sp = json.loads((out / "summary.json").read_text())
    del sp["spec"]["draft_vocab"]
    (out / "summary.json").write_text(json.dumps(sp))
    (out / "drafter.gguf").unlink()
    assert main(["train", "--smoke", "--target", target, "--out", str(out), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["gguf"]["draft_vocab"] == 256 and (out / "drafter.gguf").is_file()


def _files_state(d) -> dict:
    """Every file below d with its size and modification time (to show a run left them alone)."""
    return {p: (p.stat().st_size, p.stat().st_mtime_ns) for p in d.rglob("*") if p.is_file()}


def _d2t(path) -> np.ndarray:
    """A drafter file's draft vocabulary (its d2t map)."""
    return next(np.array(t.data) for t in GGUFReader(str(path)).tensors if t.name == "d2t")


def test_a_run_can_start_from_an_earlier_run(artifacts, smoke_run, tmp_path, capsys):
    """`--init RUN`: the earlier run's final weights replace v1 and v2 and only the tuning stage
    trains, on this run's (larger) data; incompatible or unfinished runs are refused in one line."""
    target = artifacts["llama"]["target"]
    a, b = _earlier_run(smoke_run, tmp_path), tmp_path / "b"
    capsys.readouterr()
    assert main(["train", "--smoke", "--target", target, "--out", str(b), "--prompts", "10", "--tune-steps", "4",
                 "--init", str(a), "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["data"]["sequences"] == 20 and set(s["held_out"]) == {"tune"}
    assert [h["step"] for h in s["held_out"]["tune"]] == [3, 4]
    assert s["init"]["run"] == str(a.resolve()) and s["init"]["stage"] == "tune" and s["init"]["steps"] == 6
    assert len(s["init"]["start"]["per_slot_accuracy"]) == 7 and "path_tau" in s["init"]["start"]
    assert not (b / "ckpt-v1.pt").exists() and not (b / "ckpt-v2.pt").exists()
    # a's responses and rows were reused: only the 4 new prompts' 8 sequences were generated (and captured in
    # the same pass)
    log = (b / "train.log").read_text()
    assert "responses: starting from" in log and "generating 8 responses (12 already done)" in log
    assert "12 of 20 sequences carried over" in log and "(0 captured in a second pass)" in log
    fa, fb = Dataset(a / "data"), Dataset(b / "data")
    rows = {fa.sequence(i)[0].tobytes(): np.array(fa.sequence(i)[1]) for i in range(len(fa))}
    shared = [i for i in range(len(fb)) if fb.sequence(i)[0].tobytes() in rows]
    assert len(shared) == 12
    for i in shared:
        np.testing.assert_array_equal(np.array(fb.sequence(i)[1]), rows[fb.sequence(i)[0].tobytes()])
    # started from a's weights: the feature scale (a fixed buffer) is a's, not one measured on b's data
    ta = torch.load(a / "ckpt-tune.pt", weights_only=False)["model"]
    tb = torch.load(b / "ckpt-tune.pt", weights_only=False)["model"]
    assert torch.equal(ta["feature_scale"], tb["feature_scale"])
    assert not torch.equal(ta["layers.0.mlp.up_proj.weight"], tb["layers.0.mlp.up_proj.weight"])
    # and a's draft vocabulary (the selector rows of tokens outside it were never trained), not one chosen
    # from b's larger data
    assert np.array_equal(_d2t(b / "drafter.gguf"), _d2t(a / "drafter.gguf"))
    with SpeculativeGenerator(target, b / "drafter.gguf", n_ctx=256) as g:
        toks = g.tokenize(chatml("Sort a list of numbers."))
        assert g.generate(toks, 16, draft_len=7).tokens == g.generate(toks, 16, draft_len=0).tokens
    for extra, msg in [(["--block-size", "4"], "trained with other settings (block_size=8)"),
                       (["--tune-steps", "0"], "trains the tuning stage only: tune_steps must be >= 1")]:
        assert main(["train", "--smoke", "--target", target, "--out", str(tmp_path / "c"), "--init", str(a),
                     *extra]) == 2
        err = capsys.readouterr().err
        assert msg in err and err.count("\n") == 1, err
    (a / "ckpt-tune.pt").write_bytes(b"not a checkpoint")
    assert main(["train", "--smoke", "--target", target, "--out", str(tmp_path / "c"), "--init", str(a)]) == 2
    err = capsys.readouterr().err
    assert "cannot read ckpt-tune.pt" in err and err.count("\n") == 1, err
    for summary, msg in [({"spec": {}}, "has not finished"), ([1, 2], "holds no run settings")]:
        (a / "summary.json").write_text(json.dumps(summary))
        assert main(["train", "--smoke", "--target", target, "--out", str(tmp_path / "c"), "--init", str(a)]) == 2
        err = capsys.readouterr().err
        assert msg in err and err.count("\n") == 1, err
    assert not (tmp_path / "c").exists()  # refused before any data was made


def test_a_run_can_train_on_another_runs_data(artifacts, smoke_run, tmp_path, capsys):
    """`--data RUN`: a sample (--max-sequences) of another run's finished data, which is only read;
    data made otherwise, or not all there, is refused in one line."""
    target = artifacts["llama"]["target"]
    a, b = _earlier_run(smoke_run, tmp_path), tmp_path / "b"
    capsys.readouterr()
    before = _files_state(a / "data")
    assert main(["train", "--smoke", "--target", target, "--out", str(b), "--data", str(a), "--max-sequences", "6",
                 "--final-type", "q4_0", "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["data"]["sequences"] == 6 and "data" not in s["wall_s"]  # (no generation stage)
    assert not (b / "data").exists() and (b / "index.npy").is_file() and (b / "drafter.gguf").is_file()
    # --final-type: drafter.gguf is the converted, reduced drafter (kept as drafter-f16.gguf) re-encoded
    types = {t.name: t.tensor_type for t in GGUFReader(str(b / "drafter.gguf")).tensors}
    before_q = {t.name: t.tensor_type for t in GGUFReader(str(b / "drafter-f16.gguf")).tensors}
    assert s["gguf"]["final_type"] == "q4_0" and "quantize" in s["wall_s"] and types.keys() == before_q.keys()
    assert types["blk.0.attn_q.weight"] == GGMLQuantizationType.Q4_0 == types["output.weight"]
    assert before_q["blk.0.attn_q.weight"] == GGMLQuantizationType.F16
    with SpeculativeGenerator(target, b / "drafter.gguf", n_ctx=256) as g:
        toks = g.tokenize(chatml("Write a Python function that reverses a list."))
        assert g.generate(toks, 16, draft_len=7, stop_on_eos=False).tokens == \
            g.generate(toks, 16, draft_len=0, stop_on_eos=False).tokens
    assert _files_state(a / "data") == before  # a's data untouched
    fa, fb = Dataset(a / "data"), run_dataset(b)
    assert len(fa) == 12 and len(fb) == 6
    for i in range(6):  # the first 6 of a's fixed order: the same tokens and rows
        np.testing.assert_array_equal(fb.sequence(i)[0], fa.sequence(i)[0])
        np.testing.assert_array_equal(fb.sequence(i)[1], fa.sequence(i)[1])
    for extra, msg in [(["--max-new", "12"], "made with other settings (max_new=24)"),
                       (["--prompts", "10"], "8 of the 20 sequences this run trains on are not there yet")]:
        assert main(["train", "--smoke", "--target", target, "--out", str(tmp_path / "c"), "--data", str(a),
                     *extra]) == 2
        err = capsys.readouterr().err
        assert msg in err and err.count("\n") == 1, err
    assert main(["train", "--smoke", "--target", target, "--out", str(tmp_path / "c"), "--data",
                 str(tmp_path / "nowhere")]) == 2
    assert "not a training run directory" in capsys.readouterr().err
    assert not (tmp_path / "c").exists() or not any((tmp_path / "c").glob("*.pt"))


def test_a_run_can_extend_another_runs_data(artifacts, smoke_run, tmp_path, capsys):
    """`--extend RUN`: this run's data starts as a copy of another run's (its responses and rows, byte
    for byte) and generation adds only what it lacks, e.g. for more prompts; the other run's files are
    not touched; data made otherwise, a directory without responses, or --extend with --data are refused
    in one line."""
    target = artifacts["llama"]["target"]
    a, b = _earlier_run(smoke_run, tmp_path), tmp_path / "b"
    capsys.readouterr()
    before = _files_state(a / "data")
    assert main(["train", "--smoke", "--target", target, "--out", str(b), "--extend", str(a), "--prompts", "10",
                 "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["data"]["sequences"] == 20 and set(s["held_out"]) == {"v1", "v2", "tune"}
    log = (b / "train.log").read_text()
    assert "generating 8 responses (12 already done)" in log
    assert "12 of 20 sequences carried over" in log and "(0 captured in a second pass)" in log
    assert _files_state(a / "data") == before  # a's data untouched
    fa, fb = Dataset(a / "data"), Dataset(b / "data")
    rows = {fa.sequence(i)[0].tobytes(): fa.sequence(i)[1] for i in range(len(fa))}
    shared = [i for i in range(len(fb)) if fb.sequence(i)[0].tobytes() in rows]
    assert len(shared) == 12 and len(fb) == 20
    for i in shared:  # the same statistics: the q8 rows and their scales copied as they are
        np.testing.assert_array_equal(np.array(fb.sequence(i)[1]), np.array(rows[fb.sequence(i)[0].tobytes()]))
    np.testing.assert_array_equal(np.fromfile(b / "data" / "rows" / "norm.f32", np.float32),
                                  np.fromfile(a / "data" / "rows" / "norm.f32", np.float32))
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "summary.json").write_text((a / "summary.json").read_text())
    other = tmp_path / "other"  # a run of another target: its responses are that target's token ids
    (other / "data").mkdir(parents=True)
    (other / "data" / "responses.jsonl").write_text((a / "data" / "responses.jsonl").read_text())
    summary = json.loads((a / "summary.json").read_text())
    summary["spec"]["target"] = str(b / "drafter.gguf")
    (other / "summary.json").write_text(json.dumps(summary))
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "summary.json").write_text("{not json")
    for extra, msg in [(["--extend", str(a), "--max-new", "12"], "made with other settings (max_new=24)"),
                       (["--extend", str(a), "--data", str(a)], "data and extend exclude each other"),
                       (["--extend", str(tmp_path / "empty")], "no responses there yet"),
                       (["--extend", str(other)], "its data was made for another target"),
                       (["--extend", str(tmp_path / "bad")], "summary.json cannot be read"),
                       (["--extend", str(tmp_path / "nowhere")], "not a training run directory")]:
        assert main(["train", "--smoke", "--target", target, "--out", str(tmp_path / "c"), *extra]) == 2
        err = capsys.readouterr().err
        assert msg in err and err.count("\n") == 1, err
    assert not (tmp_path / "c").exists()


def test_extend_follows_what_the_extended_run_extended(artifacts, tmp_path):
    """A run stopped before its features stage holds the responses of the run it extended but not
    their rows: extending it copies them from there (the chain, without cycles)."""
    from llama_dflash.train.run import RunSpec, _extended

    runs = {n: tmp_path / n for n in "abc"}
    spec = RunSpec(target=artifacts["llama"]["target"], taps=[1, 2])
    for n, ext in (("a", ""), ("b", "a"), ("c", "b")):
        (runs[n] / "data").mkdir(parents=True)
        (runs[n] / "data" / "responses.jsonl").write_text("")
        (runs[n] / "summary.json").write_text(json.dumps({"spec": {**spec.__dict__, "extend": str(runs[ext]) if ext
                                                                   else ""}}))
    spec.extend = str(runs["c"])
    assert _extended(spec) == [runs["c"] / "data", runs["b"] / "data", runs["a"] / "data"]
    (runs["a"] / "summary.json").write_text(json.dumps({"spec": {**spec.__dict__, "extend": str(runs["c"])}}))
    assert _extended(spec) == [runs["c"] / "data", runs["b"] / "data", runs["a"] / "data"]  # (a cycle ends it)


def test_a_run_can_start_from_a_drafter_file(artifacts, smoke_run, tmp_path, capsys):
    """`--init DRAFTER.gguf`: a drafter file (the shipped one, a converted one) as the starting point:
    dequantized, its feature scale unfolded with this run's (the same function), its draft vocabulary
    kept, only the tuning stage trained (here on another run's data, --data); a file that is not the
    drafter this run would train is refused in one line, before any data is made."""
    from llama_dflash.formats.gguf import read_tensors
    from llama_dflash.train.run import RunSpec, _init_source, _target_config

    target = artifacts["llama"]["target"]
    a, b = _earlier_run(smoke_run, tmp_path), tmp_path / "b"
    capsys.readouterr()
    src = a / "drafter.gguf"  # f16 matrices (smoke), a 256-token draft vocabulary
    assert main(["train", "--smoke", "--target", target, "--out", str(b), "--data", str(a), "--init", str(src),
                 "--tune-steps", "4", "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    assert set(s["held_out"]) == {"tune"} and [h["step"] for h in s["held_out"]["tune"]] == [3, 4]
    assert s["init"]["stage"] == "gguf" and s["init"]["drafter"] == str(src.resolve())
    assert not (b / "ckpt-v1.pt").exists() and not (b / "ckpt-v2.pt").exists()

    np.testing.assert_array_equal(_d2t(b / "drafter.gguf"), _d2t(src))  # the file's vocabulary, not re-chosen
    # the start computes a's tuned function: a's checkpoint (its own feature scale) against the file's
    # weights unfolded with another scale, on the same features and blocks
    ta = torch.load(a / "ckpt-tune.pt", weights_only=False)["model"]
    spec = RunSpec.smoke(target)
    spec.init, spec.taps = str(src), json.loads((a / "summary.json").read_text())["spec"]["taps"]
    _, state = _init_source(spec, _target_config(target))
    scale = ta["feature_scale"] * torch.linspace(0.5, 2.0, ta["feature_scale"].numel())
    ma, mb = DFlashReference.from_gguf(src), DFlashReference.from_gguf(src)
    for m in (ma, mb):
        T.whiten_features(m, np.ones((2, m.fc.in_features)))
    ma.load_state_dict(ta)
    mb.load_state_dict(T.with_feature_scale(state, scale))
    assert torch.equal(mb.feature_scale, scale) and not torch.equal(mb.fc.weight, ma.fc.weight)
    ds = Dataset(a / "data")
    toks, feats, _ = ds.sequence(0)
    feats, toks = torch.as_tensor(np.asarray(feats, np.float32)), torch.as_tensor(np.asarray(toks, np.int64))
    embed = torch.as_tensor(np.array(read_tensors(target, ["token_embd.weight"])["token_embd.weight"]))
    anchors = torch.arange(1, len(toks) - 8, 3)
    ha, hb = (T.block_hidden(m, feats, toks, anchors, embed) for m in (ma, mb))
    torch.testing.assert_close(hb, ha, atol=2e-2, rtol=2e-2)  # f16 matrices in the file
    # refused in one line: another shape, another draft vocabulary size, not a drafter
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 64)
    for extra, msg in [(["--block-size", "4"], "not the drafter this run trains for this target (block_size=8"),
                       (["--draft-vocab", "128"], "its draft vocabulary has 256 tokens (draft_vocab 128)"),
                       (["--init", str(bad)], f"init {bad}:"),
                       (["--init", str(tmp_path / "no.gguf")], "no.gguf")]:
        args = ["train", "--smoke", "--target", target, "--out", str(tmp_path / "c"), "--init", str(src), *extra]
        assert main(args) == 2
        err = capsys.readouterr().err
        assert msg in err and err.count("\n") == 1, err
    assert not (tmp_path / "c").exists()


def test_train_cli_errors(artifacts, tmp_path, capsys):
    assert main(["train", "--smoke", "--target", str(tmp_path / "missing.gguf"), "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("llama-dflash: error:") and err.count("\n") == 1
    for bad in (["--max-sequences", "-1"], ["--max-new", "0"], ["--v1-steps", "0"], ["--draft-vocab", "-1"],
                ["--tune-steps", "-1"], ["--sampled-every", "-1"], ["--samples", "0"], ["--top-k", "-1"]):
        assert main(["train", "--smoke", "--target", artifacts["llama"]["target"], "--out", str(tmp_path / "r"),
                     *bad]) == 2, bad
        err = capsys.readouterr().err
        assert "must be >= " in err and err.count("\n") == 1
    for bad, msg in ((["--distill", "1.5"], "distill must be >= 0 and <= 1"),
                     (["--feature-format", "q4"], "invalid choice: 'q4'"),  # argparse's usage error
                     (["--temperatures", "0.7,0"], "a temperature must be > 0"),
                     (["--temperatures", "1.0,1"], "expected distinct comma-separated temperatures")):
        with pytest.raises(SystemExit):
            main(["train", "--smoke", "--target", artifacts["llama"]["target"], "--out", str(tmp_path / "r"), *bad])
        assert msg in capsys.readouterr().err


def test_bad_settings_are_refused_before_any_data(artifacts, tmp_path, capsys):
    """What conversion or loading would refuse at the end is refused at the start (no run directory)."""
    from llama_dflash.train.run import RunSpec, run

    target = artifacts["llama"]["target"]  # 6 layers, hidden 64, vocabulary 1024
    out = tmp_path / "r"
    assert main(["train", "--smoke", "--target", target, "--out", str(out), "--draft-vocab", "3"]) == 2
    assert "smaller than selector_top_k 4" in capsys.readouterr().err and not out.exists()
    for kw, msg in [(dict(taps=[1, 5]), "tap 5 is not a usable layer of the target (0..4 of 6)"),
                    (dict(selector_top_k=8), "selector_top_k 8 needs a hidden size >= K(K+1) = 72 (target: 64)"),
                    (dict(conv_group_size=24), "conv_group_size 24 does not divide the hidden size 64"),
                    (dict(mask_token_id=5000), "mask token 5000 lies outside the target vocabulary"),
                    (dict(distill=0.5, top_k=0), "top_k must be >= 1"),
                    (dict(prompt_sources=["stdlib-code", "web"]), "unknown prompt source 'web'"),
                    (dict(feature_format="q4"), "feature_format must be q8 or f16"),
                    (dict(final_type="q3_k"), "got 'f16' / 'q3_k'")]:
        spec = RunSpec.smoke(target)
        for k, v in kw.items():
            setattr(spec, k, v)
        with pytest.raises(ValueError, match=re.escape(msg)):
            run(out, spec)
        assert not out.exists()


def test_interrupted_training_resumes_to_the_same_weights(artifacts, tmp_path):
    """A run stopped after a checkpoint and restarted ends with exactly the weights of an
    uninterrupted run (model, optimiser, schedule, data order and random states restored)."""
    spec = artifacts["llama"]["spec"]
    cfg = drafter_config(spec, block_size=4, n_ff=64)
    rng = np.random.default_rng(0)
    samples = [T.Sample(rng.integers(20, 1000, 60), rng.standard_normal((60, 3 * 64)).astype(np.float32), 10)
               for _ in range(5)]
    embed = torch.randn(1024, 64)

    def fresh():
        torch.manual_seed(0)
        return DFlashReference(cfg)

    tc = T.TrainConfig(steps=8, lr=1e-3, seqs_per_step=2, anchors_per_seq=4, ckpt_every=3, bf16_head=False)
    full = fresh()
    T.Trainer(full, T._Samples(samples), range(5), embed, embed, tc).run()

    ck = tmp_path / "ck.pt"
    part = fresh()
    t = T.Trainer(part, T._Samples(samples), range(5), embed, embed, tc, checkpoint=ck)
    for _ in range(3):  # "killed" right after the step-3 checkpoint
        t.train_step()
    t.save()
    t.train_step()  # work after the checkpoint is lost
    resumed = fresh()
    t2 = T.Trainer(resumed, T._Samples(samples), range(5), embed, embed, tc, checkpoint=ck)
    assert t2.step == 3
    t2.run()
    for (n, a), (_, b) in zip(full.state_dict().items(), resumed.state_dict().items(), strict=True):
        assert torch.equal(a, b), n
    with pytest.raises(ValueError, match="checkpoint of a 8-step run"):
        T.Trainer(fresh(), T._Samples(samples), range(5), embed, embed, T.TrainConfig(steps=9), checkpoint=ck)


def test_batched_generation_matches_single_sequence_decoding(artifacts):
    """Continuous batching (8 requests through 3 slots, prompts of different lengths) gives each
    sequence the greedy output of plain one-sequence decoding; sampled rows follow their seed."""
    target = artifacts["llama"]["target"]
    prompts = [[1, 20 + i, 300 + 7 * i, 45][: 2 + i % 3] for i in range(8)]
    with BatchGenerator(target, n_seq=3, max_len=64) as bg:
        outs = {c.key: c.response for c in bg.run([Job(i, p) for i, p in enumerate(prompts)], 20)}
        alone = [c.response for c in bg.run([Job(0, prompts[0], 1.0, seed=5)], 20)][0]
        both = {c.key: c.response for c in bg.run([Job(0, prompts[0], 1.0, seed=5), Job(1, prompts[1], 1.0, seed=6)],
                                                  20)}
        eog = [bg.is_eog(t) for t in range(1024)]
    assert both[0] == alone  # a sampled row depends on its seed only, not on its batch mates
    with SpeculativeGenerator(target, n_ctx=128) as g:
        for i, p in enumerate(prompts):
            want = g.generate(p, 20, draft_len=0, stop_on_eos=False).tokens
            got = outs[i]
            assert got == want[: len(got)], i
            assert len(got) == 20 or eog[got[-1]]
    with BatchGenerator(target, n_seq=2, max_len=16) as bg, pytest.raises(ValueError, match="exceed the slot"):
        list(bg.run([Job(0, list(range(20, 30)))], 10))


def test_training_prompts_hold_out_humaneval():
    problems = humaneval_problems()
    assert len(problems) == 164 and len(humaneval_prompts()) == 164
    names, lines = _held_out_markers()
    train = training_prompts()
    assert len(train) > 2000 and len({p.text for p in train}) == len(train)
    assert not any(overlaps_humaneval(p.text, names, lines) for p in train)
    # the check would catch HumanEval text itself
    assert all(overlaps_humaneval(p["prompt"], names, lines) for p in problems)
    assert {p.source for p in train} == {"stdlib-code", "authored-code", "authored-general"}
    assert not any(re.search(r" at 0x[0-9a-fA-F]+", p.text) for p in train)  # the same text in every process
    assert not any(sys.executable in p.text for p in train)  # ... and on every machine
    assert any("def architecture(executable=sys.executable," in p.text for p in train)


def test_package_and_raw_completion_prompt_sources(artifacts):
    """More prompts, offline and licensed: documented functions of the BSD-licensed packages the
    training extra installs (each licence read from the package's metadata) as chat prompts, and
    stdlib + package functions as raw completion prompts (no chat template, tokenized as
    create_completion does); HumanEval stays held out; the default mix is unchanged."""
    from llama_dflash.core import Tokenizer
    from llama_dflash.train.data import prompt_ids
    from llama_dflash.train.prompts import DEFAULT_SOURCES, package_licences, prompt_licences

    lic = package_licences()
    assert {"numpy", "sympy"} <= lic.keys() and all("BSD" in v for v in lic.values()), lic
    more = training_prompts(sources=("package-code", "raw-code"))
    by = {s: [p for p in more if p.source == s] for s in ("package-code", "raw-code")}
    assert len(by["package-code"]) > 1000 and len(by["raw-code"]) > len(by["package-code"])
    names, lines = _held_out_markers()
    assert not any(overlaps_humaneval(p.text, names, lines) for p in more)
    assert {p.key.split(".")[0] for p in by["package-code"]} >= {"numpy", "sympy"}
    raw, chat = by["raw-code"][0], by["package-code"][0]
    assert raw.raw and raw.render() == raw.text and raw.text.startswith("def ") and '"""' in raw.text
    assert not chat.raw and chat.render().startswith("<|im_start|>system") and "```python" in chat.text
    with Tokenizer(artifacts["llama"]["target"]) as tok:
        assert prompt_ids(tok, chat) == tok.tokenize(chat.render().encode(), add_bos=False, special=True)
        assert prompt_ids(tok, raw) == tok.tokenize(raw.text.encode(), add_bos=True, special=False)
    assert [p.key for p in training_prompts(sources=DEFAULT_SOURCES)] == [p.key for p in training_prompts()]
    # package-more / raw-more: the same packages' functions package-code left out, none of them again
    extra = training_prompts(sources=("package-more", "raw-more"))
    ex = {s: [p for p in extra if p.source == s] for s in ("package-more", "raw-more")}
    assert len(ex["package-more"]) > 1000 and abs(len(ex["raw-more"]) - len(ex["package-more"])) < 100
    assert not {p.key for p in ex["package-more"]} & {p.key for p in by["package-code"]}
    assert {p.key.split(".")[0] for p in ex["package-more"]} >= {"scipy", "sympy"}
    assert not any(overlaps_humaneval(p.text, names, lines) for p in extra)
    assert all(p.raw and p.key.startswith("raw:") for p in ex["raw-more"])
    # a run records where its prompts come from and under which licence
    assert prompt_licences(by["raw-code"]) == {**{k: lic[k] for k in lic if k in
                                                  {p.key[4:].split(".")[0] for p in by["raw-code"]}},
                                               "python-stdlib": "PSF-2.0"}
    with pytest.raises(ValueError, match="unknown prompt source"):
        training_prompts(sources=("nope",))
