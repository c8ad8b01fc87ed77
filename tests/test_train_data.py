"""Training data on disk: one target pass per sequence (the generation's decodes capture the
features and top-k log-probabilities), a row store that survives interruption, and a second pass
only for responses without rows (older directories, added responses), copied where an earlier
capture of the same sequence exists."""

from __future__ import annotations

import json
import os

import llama_cpp
import numpy as np
import pytest

from llama_dflash import SpeculativeGenerator
from llama_dflash.train.data import Dataset, DataSpec, build_features, generate_responses, wanted
from llama_dflash.train.prompts import training_prompts
from llama_dflash.train.store import RowStore, dequantize_q8, quantize_q8


def _responses(path, recs):
    with open(path, "a", encoding="utf-8") as f:
        for key, prompt, response in recs:
            f.write(json.dumps({"key": key, "source": "test", "temperature": 0.0, "prompt": prompt,
                                "response": response}) + "\n")


def _recs(n, seed):
    rng = np.random.default_rng(seed)
    return [(f"p{seed}-{i}", rng.integers(20, 200, int(rng.integers(4, 9))).tolist(),
             rng.integers(20, 200, int(rng.integers(6, 15))).tolist()) for i in range(n)]


@pytest.fixture
def counted(monkeypatch):
    """Counts the second-pass target forwards (SpeculativeGenerator.features)."""
    calls = []
    real = SpeculativeGenerator.features

    def features(self, ids):
        calls.append(list(ids))
        return real(self, ids)

    monkeypatch.setattr(SpeculativeGenerator, "features", features)
    return calls


def _by_key(d):
    """{tokens: features} for every sequence of a data directory's training set."""
    ds = Dataset(d)
    return {np.asarray(ds.sequence(i)[0], np.int32).tobytes(): ds.sequence(i)[1] for i in range(len(ds))}


def _rel(a, b) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_one_pass_rows_match_a_second_pass(artifacts, tmp_path, counted, monkeypatch, name):
    """Generation (12 sequences through 4 slots, greedy and sampled, ending at different lengths:
    prefills and last-token feeds happen while other slots generate) stores every position's
    features: each sequence's rows equal a separate capture of its tokens up to batch rounding (and
    are far from any other sequence's: rows are not mixed up across the joint decodes), on
    layer-input (llama) and cb_eval (qwen2) capture; the top-k rows are the target's next-token
    log-probabilities; the training set then needs no second pass."""
    from llama_dflash.core.batchgen import BatchGenerator

    monkeypatch.setattr(BatchGenerator, "is_eog", lambda self, tok: tok % 5 == 0)  # early, staggered ends
    target = artifacts[name]["target"]
    spec = DataSpec(target=target, taps=[0, 2, 4], max_new=12, n_seq=4, sampled_every=2, temperatures=(1.0,), top_k=8,
                    feature_format="f16")
    generate_responses(tmp_path, spec, training_prompts(limit=8), log=lambda m: None)
    build_features(tmp_path, spec, training_prompts(limit=8), log=lambda m: None)
    assert counted == []
    ds = Dataset(tmp_path)
    assert len(ds) == 12 and ds.top_k == 8
    seqs = [ds.sequence(i) for i in range(len(ds))]
    lengths = {len(t) - st for t, _, st in seqs}
    assert len(lengths) > 3 and min(lengths) < 12 and any(t[-1] % 5 == 0 for t, _, _ in seqs)
    with SpeculativeGenerator(target, n_ctx=512, capture_layers=spec.taps) as g:
        fresh = [g.features(t.tolist()) for t, _, _ in seqs]
    plain = llama_cpp.Llama(target, n_ctx=512, logits_all=True, verbose=False)
    try:
        for i, ((toks, f, start), want) in enumerate(zip(seqs, fresh, strict=True)):
            assert _rel(f, want) < 1e-2, i
            for j, w in enumerate(fresh):  # another sequence's rows would be far off
                if j != i and len(w) >= len(want) and not np.array_equal(seqs[j][0][:len(toks)], toks):
                    assert _rel(w[start:len(want)], want[start:]) > 0.2, (i, j)
            ids, logp = ds.top(i)
            assert (ids[: start - 1] == -1).all() and (ids[len(toks) - 1] == -1).all()
            rows = slice(start - 1, len(toks) - 1)
            assert (ids[rows] >= 0).all() and (np.diff(logp[rows], axis=1) <= 1e-3).all()
            assert (np.exp(logp[rows]).sum(1) <= 1.001).all()
            if ds.index[i, 3] == 0:  # greedy: the most likely next token is the one generated
                assert (ids[rows, 0] == toks[start:]).all()
            # the top-k log-probabilities are the target's at that position (up to another context's
            # rounding: a random-weight target's logits span tens of units)
            plain.reset()  # decoded as the generation did: the prompt in one batch, then row by row
            plain.eval(toks[:start].tolist())
            for t in toks[start:]:
                plain.eval([int(t)])
            z = np.asarray(plain.scores[: len(toks)], np.float64)
            lz = z - (z.max(1, keepdims=True) + np.log(np.exp(z - z.max(1, keepdims=True)).sum(1, keepdims=True)))
            r = np.arange(start - 1, len(toks) - 1)
            d = np.abs(logp[r] - np.take_along_axis(lz[r], ids[r], 1))
            assert d.mean() < 0.15 and d.max() < 1.0, (d.mean(), d.max())
            if len(r) > 1:
                off = np.abs(logp[r[:-1]] - np.take_along_axis(lz[r[1:]], ids[r[:-1]], 1))
                assert off.mean() > 4 * d.mean(), (off.mean(), d.mean())  # the next row's: far off
    finally:
        plain.close()


def test_q8_rows_keep_massive_activation_channels_apart():
    """Per-channel standardisation before the per-row, per-tap int8 scale: a few channels far
    larger than the rest (as in real hidden states) do not wipe out the others' resolution."""
    rng = np.random.default_rng(0)
    x = rng.normal(0, 1, (600, 2 * 64)).astype(np.float32) * rng.uniform(0.5, 3, 128).astype(np.float32)
    x[:, 5] *= 2000  # massive activation channels
    x[:, 64 + 9] += 5000
    x[::50, 70] = 20000  # and a few rows with a huge value
    from llama_dflash.train.store import _channel_stats

    norm = _channel_stats(x, 2)
    q, s = quantize_q8(x, norm, 2)
    assert q.dtype == np.int8 and s.dtype == np.float16 and s.shape == (600, 2)
    err = (dequantize_q8(q, s, norm) - x) / x.std(0)
    ordinary = np.ones(600, bool)
    ordinary[::50] = False
    assert np.sqrt((err[ordinary] ** 2).mean()) < 0.015
    assert np.abs(err[ordinary]).max() < 0.05
    # per-row scales alone (no channel step) would be ~100x worse: the check can fail
    z = x.reshape(600, 2, 64)
    sc = np.abs(z).max(2, keepdims=True) / 127
    naive = (np.rint(z / sc) * sc).reshape(600, -1)
    assert np.sqrt((((naive - x) / x.std(0))[ordinary] ** 2).mean()) > 0.5


def test_store_survives_an_interrupted_append_and_other_settings_replace_it(tmp_path):
    cap = {"target": "t", "taps": [0, 1]}
    rng = np.random.default_rng(1)
    seqs = [(rng.integers(0, 100, n), rng.normal(0, 1, (n, 8)).astype(np.float32)) for n in (5, 7, 3)]
    st = RowStore(tmp_path / "rows", cap, 8, 2, "q8", top_k=2)
    for i, (t, f) in enumerate(seqs):
        st.add(("k", 0.0, i), t, f)
    st.flush()
    assert st.n_rows == 15 and len(st.refs) == 3
    want = st.features(*st.refs[("k", 0.0, 2)])
    # an append cut short: part of a fourth sequence's rows written, its reference never
    with open(tmp_path / "rows" / "feat.q8", "ab") as f:
        f.write(b"\x01" * 8 * 4)
    with open(tmp_path / "rows" / "tokens.i32", "ab") as f:
        f.write(b"\x00" * 4 * 6)
    with open(tmp_path / "rows" / "refs.jsonl", "a") as f:
        f.write('{"rid": ["k", 0.0, 3], "row": 15, "n": 6}\n{"rid": ["k"')
    again = RowStore.open(tmp_path / "rows", readonly=False)  # a writer reopening: the cut rows go
    assert again.n_rows == 15 and sorted(again.refs) == [("k", 0.0, i) for i in range(3)]
    np.testing.assert_array_equal(again.features(*again.refs[("k", 0.0, 2)]), want)
    np.testing.assert_array_equal(again.top(0, 5)[0], -1)  # added without top-k: none
    assert os.path.getsize(tmp_path / "rows" / "feat.q8") == 15 * 8
    np.testing.assert_allclose(again.features(0, 5), seqs[0][1], atol=0.05)
    with pytest.raises(ValueError, match="other settings"):
        RowStore(tmp_path / "rows", cap, 8, 2, "f16", top_k=2)
    fresh = RowStore.replace(tmp_path / "rows", cap, 8, 2, "f16", top_k=2)
    assert fresh.n_rows == 0 and not fresh.refs


def test_store_write_failures_leave_it_as_it_was_and_reads_change_nothing(tmp_path, monkeypatch):
    """An error while rows are written (a full disk, an interrupt) leaves the files as they were
    and drops the queued sequences; appends after a recovered cut line land on lines of their own;
    a read-only open changes no file."""
    import llama_dflash.train.store as S

    cap = {"target": "t"}
    rng = np.random.default_rng(2)
    st = RowStore(tmp_path / "rows", cap, 8, 2, "q8", top_k=2)
    for i in range(2):
        st.add(("k", 0.0, i), rng.integers(0, 9, 4), rng.normal(0, 1, (4, 8)))
    st.flush()
    sizes = {p.name: p.stat().st_size for p in (tmp_path / "rows").iterdir()}
    calls = []
    real = S.quantize_q8

    def failing(*a):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*a)

    monkeypatch.setattr(S, "quantize_q8", failing)
    for i in range(2, 4):
        st._pending.append({"rid": ("k", 0.0, i), "tokens": np.arange(3, dtype=np.int32),
                            "feats": rng.normal(0, 1, (3, 8)).astype(np.float32),
                            "ids": np.full((3, 2), -1, np.int32), "logp": np.zeros((3, 2), np.float32)})
    with pytest.raises(KeyboardInterrupt):
        st.flush()
    assert {p.name: p.stat().st_size for p in (tmp_path / "rows").iterdir()} == sizes
    assert st.n_rows == 8 and sorted(st.refs) == [("k", 0.0, 0), ("k", 0.0, 1)]
    st.flush()  # nothing queued any more: the caller's final flush writes nothing twice
    assert {p.name: p.stat().st_size for p in (tmp_path / "rows").iterdir()} == sizes
    monkeypatch.setattr(S, "quantize_q8", real)
    with open(tmp_path / "rows" / "refs.jsonl", "rb+") as f:  # a last line cut before its newline
        f.seek(-1, os.SEEK_END)
        f.truncate()
    before = {p.name: p.read_bytes() for p in (tmp_path / "rows").iterdir()}
    ro = RowStore.open(tmp_path / "rows")
    assert ro.n_rows == 8 and len(ro.refs) == 2
    assert {p.name: p.read_bytes() for p in (tmp_path / "rows").iterdir()} == before
    with pytest.raises(ValueError, match="read-only"):
        ro.add(("k", 0.0, 9), [1], np.zeros((1, 8)))
    rw = RowStore.open(tmp_path / "rows", readonly=False)
    rw.add(("k", 0.0, 5), [1, 2], rng.normal(0, 1, (2, 8)))
    rw.flush()
    again = RowStore.open(tmp_path / "rows")
    assert sorted(again.refs) == [("k", 0.0, 0), ("k", 0.0, 1), ("k", 0.0, 5)] and again.n_rows == 10


def test_q8_rows_copy_byte_for_byte_between_stores_with_the_same_statistics(tmp_path):
    """A new q8 store that adopts another's statistics copies its rows as they are (what --init's
    data reuse does); without them the rows are decoded and encoded again (close, not equal); a
    larger top-k keeps its first columns."""
    cap = {"target": "t"}
    rng = np.random.default_rng(3)
    a = RowStore(tmp_path / "a", cap, 8, 2, "q8", top_k=4)
    ids = np.tile(np.arange(4, dtype=np.int32), (5, 1))
    a.add(("k", 0.0, 0), np.arange(5), rng.normal(0, 3, (5, 8)), ids, -np.arange(20, dtype=np.float32).reshape(5, 4))
    a.flush()
    b = RowStore(tmp_path / "b", cap, 8, 2, "q8", top_k=2)
    assert b.adopt_statistics(a) and not b.adopt_statistics(a)
    b.add_rows(a, ("k", 0.0, 0), *a.refs[("k", 0.0, 0)])
    b.flush()
    assert (tmp_path / "a" / "feat.q8").read_bytes() == (tmp_path / "b" / "feat.q8").read_bytes()
    np.testing.assert_array_equal(b.features(0, 5), a.features(0, 5))
    np.testing.assert_array_equal(b.top(0, 5)[0], ids[:, :2])
    c = RowStore(tmp_path / "c", cap, 8, 2, "q8")
    c.add(("other", 0.0, 0), np.arange(9), rng.normal(5, 1, (9, 8)))  # other statistics
    c.add_rows(a, ("k", 0.0, 0), 0, 5)
    c.flush()
    got = c.features(*c.refs[("k", 0.0, 0)])
    assert not np.array_equal(got, a.features(0, 5))
    np.testing.assert_allclose(got, a.features(0, 5), atol=0.1)


def test_responses_without_rows_get_a_second_pass_or_a_copy(artifacts, tmp_path, counted):
    """Responses on file without rows (a directory from before one-pass capture, or added by hand)
    are captured once; grown sets capture only their new sequences; another directory's capture of
    the same sequence is copied; the copied rows equal a fresh capture."""
    spec = DataSpec(target=artifacts["llama"]["target"], taps=[0, 2, 4], feature_format="f16")
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    first, more = _recs(5, 1), _recs(4, 2)
    _responses(a / "responses.jsonl", first)
    build_features(a, spec, log=lambda m: None)
    assert len(counted) == 5
    counted.clear()
    build_features(a, spec, log=lambda m: None)  # unchanged: nothing to do
    assert counted == []
    _responses(a / "responses.jsonl", more)
    build_features(a, spec, log=lambda m: None)
    assert sorted(map(tuple, counted)) == sorted(tuple(p + r) for _, p, r in more)

    counted.clear()
    _responses(b / "responses.jsonl", first + more + _recs(2, 3))
    msgs = []
    build_features(b, spec, log=msgs.append, reuse=[a])
    assert len(counted) == 2 and any("9 of 11 sequences carried over" in m for m in msgs)
    got = _by_key(b)
    counted.clear()
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    _responses(fresh / "responses.jsonl", first + more + _recs(2, 3))
    build_features(fresh, spec, log=lambda m: None)
    want = _by_key(fresh)
    assert got.keys() == want.keys() and len(got) == 11
    for k in want:
        np.testing.assert_array_equal(got[k], want[k])
    assert np.abs(want[next(iter(want))]).max() > 0

    # other taps: a store of their own, everything captured again
    counted.clear()
    build_features(a, DataSpec(target=spec.target, taps=[1, 3], feature_format="f16"), log=lambda m: None)
    assert len(counted) == 9 and Dataset(a).width == 2 * 64


def test_the_layout_before_row_stores_is_carried_over(artifacts, tmp_path, counted):
    """A data directory of the earlier layout (tokens.npy / index.npy / features.f16 / features.done,
    its count-state form too) is read by Dataset as it is, and packing moves its rows into the store
    without a second pass."""
    spec = DataSpec(target=artifacts["llama"]["target"], taps=[0, 2, 4], feature_format="f16")
    recs = _recs(4, 4)
    _responses(tmp_path / "responses.jsonl", recs)
    tokens = np.concatenate([np.asarray(p + r, np.int32) for _, p, r in recs])
    lengths = [len(p) + len(r) for _, p, r in recs]
    offs = np.concatenate([[0], np.cumsum(lengths)])
    index = np.array([[offs[i], lengths[i], len(recs[i][1]), 0, 0] for i in range(4)], np.int64)
    with SpeculativeGenerator(spec.target, n_ctx=64, capture_layers=spec.taps) as g:
        feats = np.concatenate([g.features(tokens[offs[i]:offs[i + 1]].tolist()) for i in range(4)])
    np.save(tmp_path / "tokens.npy", tokens)
    np.save(tmp_path / "index.npy", index)
    feats.astype(np.float16).tofile(tmp_path / "features.f16")
    (tmp_path / "features.done").write_text("3")  # three sequences complete (the earlier count form)
    old = Dataset(tmp_path)
    np.testing.assert_array_equal(old.sequence(1)[1], feats[offs[1]:offs[2]].astype(np.float16).astype(np.float32))
    counted.clear()
    build_features(tmp_path, spec, log=lambda m: None)
    assert len(counted) == 1 and not (tmp_path / "features.f16").exists()
    new = Dataset(tmp_path)
    got = {np.asarray(new.sequence(i)[0], np.int32).tobytes(): new.sequence(i)[1] for i in range(4)}
    for i in range(4):
        np.testing.assert_allclose(got[tokens[offs[i]:offs[i + 1]].tobytes()], feats[offs[i]:offs[i + 1]],
                                   rtol=1e-3, atol=1e-3)


def test_more_sampled_responses_generate_only_the_missing_ones(artifacts, tmp_path):
    """Sampled responses per prompt (`samples`, `sampled_every`) grow a data set without redoing it:
    each (prompt, temperature, sample) is generated once; sample 0 keeps the seed it had before
    samples existed, so older files (no "sample" field) count as sample 0."""
    d = tmp_path / "d"
    prompts = training_prompts(limit=4)
    base = dict(target=artifacts["llama"]["target"], taps=[0, 2], max_new=8, n_seq=4, temperatures=(1.5,))

    def lines():
        return [json.loads(x) for x in (d / "responses.jsonl").read_text().splitlines()]

    generate_responses(d, DataSpec(**base, sampled_every=2), prompts, log=lambda m: None)
    first = lines()
    assert sorted((r["temperature"], r.get("sample", 0)) for r in first) == [(0.0, 0)] * 4 + [(1.5, 0)] * 2
    # an older file: no sample numbers -> nothing is generated again
    (d / "responses.jsonl").write_text("".join(
        json.dumps({k: v for k, v in r.items() if k != "sample"}) + "\n" for r in first))
    generate_responses(d, DataSpec(**base, sampled_every=2), prompts, log=lambda m: None)
    assert len(lines()) == 6
    generate_responses(d, DataSpec(**base, sampled_every=1, samples=2), prompts, log=lambda m: None)
    recs = lines()
    assert recs[:6] == [{k: v for k, v in r.items() if k != "sample"} for r in first]  # appended, not redone
    ids = [(r["key"], r["temperature"], r.get("sample", 0)) for r in recs]
    assert len(ids) == len(set(ids)) == 4 + 4 * 2
    # the sample-0 responses made now used the seed the earlier scheme gives them: regenerating the
    # whole set in one go from nothing yields the same sequences
    whole = tmp_path / "whole"
    generate_responses(whole, DataSpec(**base, sampled_every=1, samples=2), prompts, log=lambda m: None)
    got = {(r["key"], r["temperature"], r.get("sample", 0)): r["response"] for r in recs}
    redo = {(r["key"], r["temperature"], r["sample"]): r["response"]
            for r in map(json.loads, (whole / "responses.jsonl").read_text().splitlines())}
    assert got == redo
    sampled = {k: v for k, v in got.items() if k[1] > 0}
    assert len({tuple(v) for v in sampled.values()}) > len(prompts)  # samples 0 and 1 of a prompt differ
    build_features(d, DataSpec(**base, sampled_every=1, samples=2), log=lambda m: None)
    ds = Dataset(d)
    assert len(ds) == 12 and sorted(ds.index[:, 3].tolist()) == [0] * 4 + [1500] * 8
    # a run asking for fewer responses than the directory holds packs only the ones it asks for
    build_features(d, DataSpec(**base, sampled_every=2), prompts, log=lambda m: None)
    ds = Dataset(d)
    assert len(ds) == 6 and sorted(ds.index[:, 3].tolist()) == [0] * 4 + [1500] * 2


def test_too_little_disk_is_a_clear_error(artifacts, tmp_path, monkeypatch):
    """Checked before generating or capturing: a full disk would fail a run hours in."""
    import shutil
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(1 << 30, 1 << 30, 1000))
    spec = DataSpec(target=artifacts["llama"]["target"], taps=[0, 2])
    with pytest.raises(ValueError, match="GiB free"):
        generate_responses(tmp_path / "g", spec, training_prompts(limit=2), log=lambda m: None)
    assert not (tmp_path / "g" / "responses.jsonl").exists()
    _responses(tmp_path / "responses.jsonl", _recs(3, 5))
    with pytest.raises(ValueError, match="GiB free"):
        build_features(tmp_path, spec, log=lambda m: None)
    assert os.path.getsize(tmp_path / "rows" / "feat.q8") == 0


def test_another_runs_data_without_the_prompts_too_long_to_generate(artifacts, tmp_path):
    """Generation skips a prompt longer than max_prompt; a run training on that data (index_shared,
    `--data`) asks for the same responses, not for the skipped prompt's too (which would never come:
    "7 of the 3750 sequences ... are not there yet" on a finished data set)."""
    from llama_dflash.train.data import Tokenizer, index_shared, prompt_ids

    target = artifacts["llama"]["target"]
    with Tokenizer(target) as tok:  # the longest first: a sampled response belongs to a prompt by its place
        prompts = sorted(training_prompts(limit=4), key=lambda p: -len(prompt_ids(tok, p)))
        lens = [len(prompt_ids(tok, p)) for p in prompts]
    spec = DataSpec(target=target, taps=[0, 2], max_new=8, n_seq=4, sampled_every=2, max_prompt=max(lens) - 1)
    d = tmp_path / "d"
    generate_responses(d, spec, prompts, log=lambda m: None)
    fit = [i for i, n in enumerate(lens) if n < max(lens)]
    n_want = len(fit) + sum(1 for i in fit if i % 2 == 0)  # greedy each, sampled every 2nd
    assert len((d / "responses.jsonl").read_text().splitlines()) == n_want < 6
    index_shared(d, spec, prompts, tmp_path / "index.npy", log=lambda m: None)
    assert len(np.load(tmp_path / "index.npy")) == n_want


def test_sampled_responses_at_several_temperatures(artifacts, tmp_path, monkeypatch):
    """Each sampled prompt gets `samples` responses at every temperature, each its own seeded stream;
    the first temperature keeps the streams data made before temperatures were a list had (so an
    extended run's responses stay the ones it would make)."""
    from llama_dflash.train import data as data_mod

    seen: dict[str, list] = {}

    class Recorder:  # stands in for the batched generator: records the jobs, generates nothing
        def __init__(self, *a, **k):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def run(self, jobs, max_new):
            seen[tag] = [(tuple(j.prompt), j.temperature, j.seed) for j in jobs]
            return iter(())

    monkeypatch.setattr(data_mod, "BatchGenerator", Recorder)
    target = artifacts["llama"]["target"]
    prompts = training_prompts(limit=4)
    for tag, temps in (("one", (0.7,)), ("two", (0.7, 1.0))):
        spec = DataSpec(target=target, taps=[0, 2, 4], max_new=8, n_seq=4, sampled_every=2, samples=2,
                        temperatures=temps, top_k=0)
        want = {(p.key, 0.0, 0) for p in prompts} | {(p.key, t, k) for p in prompts[::2] for t in temps
                                                       for k in (0, 1)}
        assert wanted(spec, prompts) == want
        generate_responses(tmp_path / tag, spec, prompts, log=lambda m: None)
    one, two = seen["one"], seen["two"]
    assert len(one) == 4 + 2 * 2 and len(two) == 4 + 2 * 2 * 2
    assert set(one) <= set(two)  # T = 0.7's jobs (prompt, seed) unchanged by adding T = 1.0
    hot = [j for j in two if j[1] == 1.0]
    assert len(hot) == 4 and not {s for _, _, s in hot} & {s for _, t, s in two if t != 1.0}
