"""Training data on disk: feature capture is resumable and incremental (a grown set of
responses captures only its new sequences; the copied rows equal a fresh capture)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from llama_dflash import SpeculativeGenerator
from llama_dflash.train.data import Dataset, DataSpec, build_features


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
    """Counts the target forwards feature capture makes."""
    calls = []
    real = SpeculativeGenerator.features

    def features(self, ids):
        calls.append(list(ids))
        return real(self, ids)

    monkeypatch.setattr(SpeculativeGenerator, "features", features)
    return calls


def _by_key(d):
    """{tokens: features} for every sequence of a data directory."""
    ds = Dataset(d)
    return {ds.sequence(i)[0].tobytes(): np.array(ds.sequence(i)[1]) for i in range(len(ds))}


def test_added_responses_capture_only_the_new_sequences(artifacts, tmp_path, counted):
    spec = DataSpec(target=artifacts["llama"]["target"], taps=[0, 2, 4])
    a, fresh = tmp_path / "a", tmp_path / "fresh"
    a.mkdir()
    fresh.mkdir()
    first, more = _recs(5, 1), _recs(4, 2)
    _responses(a / "responses.jsonl", first)
    build_features(a, spec, log=lambda m: None)
    assert len(counted) == 5
    counted.clear()
    build_features(a, spec, log=lambda m: None)  # unchanged: nothing to do
    assert counted == []

    _responses(a / "responses.jsonl", more)
    msgs = []
    build_features(a, spec, log=msgs.append)
    assert sorted(map(tuple, counted)) == sorted(tuple(p + r) for _, p, r in more)
    assert any("5 of 9 sequences carried over" in m for m in msgs)

    counted.clear()
    _responses(fresh / "responses.jsonl", first + more)
    build_features(fresh, spec, log=lambda m: None)
    assert len(counted) == 9
    got, want = _by_key(a), _by_key(fresh)
    assert got.keys() == want.keys() and len(got) == 9
    for k in want:  # the carried-over rows equal a fresh capture (and so do the new ones)
        np.testing.assert_array_equal(got[k], want[k])
    assert np.abs(want[next(iter(want))]).max() > 0


def test_interrupted_capture_resumes_and_old_count_state_is_read(artifacts, tmp_path, counted):
    spec = DataSpec(target=artifacts["llama"]["target"], taps=[0, 2, 4])
    recs = _recs(6, 3)
    _responses(tmp_path / "responses.jsonl", recs)
    build_features(tmp_path, spec, log=lambda m: None)
    want = _by_key(tmp_path)
    # an interrupted capture: three sequences recorded as done, the rest's rows lost
    st = json.loads((tmp_path / "features.done").read_text())
    st["done"] = st["done"][:3]
    (tmp_path / "features.done").write_text(json.dumps(st))
    ds = Dataset(tmp_path)
    lost = [ds.sequence(i)[0].tobytes() for i in range(3, 6)]
    f = np.memmap(tmp_path / "features.f16", np.float16, "r+", shape=ds.features.shape)
    for i in range(3, 6):
        o, n = (int(x) for x in ds.index[i, :2])
        f[o:o + n] = 0
    f.flush()
    del f, ds
    counted.clear()
    build_features(tmp_path, spec, log=lambda m: None)
    assert sorted(np.asarray(c, np.int32).tobytes() for c in counted) == sorted(lost)
    got = _by_key(tmp_path)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k])

    # the state format of earlier runs (a count of leading sequences) is still understood
    (tmp_path / "features.done").write_text("4")
    counted.clear()
    build_features(tmp_path, spec, log=lambda m: None)
    assert len(counted) == 2
    assert json.loads((tmp_path / "features.done").read_text())["done"] == list(range(6))


def test_other_taps_or_a_corrupt_state_capture_everything_again(artifacts, tmp_path, counted):
    spec = DataSpec(target=artifacts["llama"]["target"], taps=[0, 2, 4])
    _responses(tmp_path / "responses.jsonl", _recs(4, 4))
    build_features(tmp_path, spec, log=lambda m: None)
    counted.clear()
    build_features(tmp_path, DataSpec(target=spec.target, taps=[1, 3]), log=lambda m: None)
    assert len(counted) == 4 and Dataset(tmp_path).width == 2 * 64
    counted.clear()
    (tmp_path / "features.done").write_text("{not json")
    build_features(tmp_path, spec, log=lambda m: None)
    assert len(counted) == 4 and Dataset(tmp_path).width == 3 * 64


def test_more_sampled_responses_generate_only_the_missing_ones(artifacts, tmp_path):
    """Sampled responses per prompt (`samples`, `sampled_every`) grow a data set without redoing it:
    each (prompt, temperature, sample) is generated once; sample 0 keeps the seed it had before
    samples existed, so older files (no "sample" field) count as sample 0."""
    from llama_dflash.train.data import generate_responses
    from llama_dflash.train.prompts import training_prompts

    d = tmp_path / "d"
    prompts = training_prompts(limit=4)
    base = dict(target=artifacts["llama"]["target"], taps=[0, 2], max_new=8, n_seq=4, temperature=1.5)

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
    """The memory-mapped feature file would crash the process on a full disk: checked first."""
    import shutil
    from collections import namedtuple

    _responses(tmp_path / "responses.jsonl", _recs(3, 5))
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(1 << 30, 1 << 30, 1000))
    with pytest.raises(ValueError, match="GiB free"):
        build_features(tmp_path, DataSpec(target=artifacts["llama"]["target"], taps=[0, 2]), log=lambda m: None)
    assert not (tmp_path / "features.f16").exists() and not (tmp_path / "features.f16.tmp").exists()
