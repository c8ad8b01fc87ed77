"""The speculative options' one definition (llama_dflash.options) and what derives from it:
Llama's signature and checks, the server's settings, the CLI's flags."""

from __future__ import annotations

import argparse
import inspect
import math
import pickle

import pytest

import llama_dflash
from llama_dflash import options
from llama_dflash.options import SpecOptions

BAD = [("draft_n_max", -1), ("draft_n_max", 2.5), ("draft_n_max", True), ("draft_n_min", -3),
       ("draft_p_min", 1.5), ("draft_p_min", math.nan), ("draft_p_min", "0.5"), ("verify", "greedy"),
       ("speculation", "always"), ("grammar_aware_drafting", "yes"), ("exact", 1), ("exact", "on"),
       ("parallel", 0), ("parallel", options.MAX_PARALLEL + 1), ("kernels", 0), ("draft_model_path", 5),
       ("rpc_servers", "localhost"), ("rpc_servers", "h:0"), ("rpc_servers", ""), ("rpc_servers", 5)]


def test_defaults_and_checks():
    o = SpecOptions()
    assert o.exact == "auto" and o.speculation == "auto" and o.parallel == 1 and o.draft_n_max is None
    for name, value in BAD:
        with pytest.raises(ValueError, match=f"^{name} must be"):
            SpecOptions(**{name: value})
        with pytest.raises(ValueError, match=f"^{name} must be"):
            options.check(name, value)
    kw = {"draft_n_max": 3, "n_ctx": 64}
    assert SpecOptions.take(kw).draft_n_max == 3 and kw == {"n_ctx": 64}


def test_llama_takes_the_options_with_their_checks(tmp_path):
    sig = inspect.signature(llama_dflash.Llama.__init__)
    for n, f in options.FIELDS.items():
        assert sig.parameters[n].default == f.default and sig.parameters[n].kind is inspect.Parameter.KEYWORD_ONLY
        assert f"{n} (default {f.default!r})" in llama_dflash.Llama.__doc__
    assert "n_ctx" in sig.parameters and "speculative" in sig.parameters  # llama_cpp.Llama's own too
    for name, value in BAD:  # checked before anything loads (the file does not exist)
        with pytest.raises(ValueError, match=f"^{name} must be"):
            llama_dflash.Llama(str(tmp_path / "missing.gguf"), **{name: value})
    with pytest.raises(TypeError, match="speculative options are"):
        llama_dflash.Llama(str(tmp_path / "missing.gguf"), draft_n_maximum=3)
    assert options.check("rpc_servers", " a:1, [::1]:2 ") == "a:1,[::1]:2"
    with pytest.raises(ValueError, match="needs n_gpu_layers"):  # (nothing would go to the servers)
        llama_dflash.Llama(str(tmp_path / "missing.gguf"), rpc_servers="127.0.0.1:1")


def test_llama_options_round_trip(artifacts):
    a = artifacts["llama"]
    llm = llama_dflash.Llama(a["target"], draft_model_path=a["drafter"], draft_n_max=3, draft_p_min=0.25,
                             speculation="on", exact=False, n_ctx=256, verbose=False)
    try:
        o = llm.options
        assert (o.draft_model_path, o.draft_n_max, o.draft_p_min, o.speculation, o.exact) == (
            a["drafter"], 3, 0.25, "on", False)
        again = pickle.loads(pickle.dumps(llm))  # __getstate__: the base's arguments plus the options
        try:
            assert again.options == o
        finally:
            again.close()
    finally:
        llm.close()


def test_server_settings_derive_from_the_options():
    server = pytest.importorskip("llama_dflash.api.server")
    fields = server.DFlashModelSettings.model_fields
    for n, f in options.FIELDS.items():
        assert fields[n].description == f.metadata["doc"]
        assert fields[n].default == f.metadata.get("server_default", f.default)
    assert fields["parallel"].default == 4 and fields["exact"].default == "auto"
    s = server.DFlashModelSettings(model="m.gguf", exact="false", parallel=2, kernels="0")
    assert s.exact is False and s.parallel == 2 and s.kernels is False and s.rpc_servers is None
    assert server.DFlashModelSettings(model="m.gguf", rpc_servers="h:1,h:2").rpc_servers == "h:1,h:2"
    assert server.DFlashModelSettings(model="m.gguf", exact="auto").exact == "auto"
    for name, value in [("parallel", 0), ("draft_p_min", 2.0), ("speculation", "x"), ("exact", "sometimes"),
                        ("rpc_servers", "h")]:
        with pytest.raises(server.ValidationError) as e:
            server.DFlashModelSettings(model="m.gguf", **{name: value})
        assert e.value.errors()[0]["loc"] == (name,)
    # `llama-dflash serve --help` lists every option, with its help from the definition
    p = argparse.ArgumentParser()
    server.add_args_from_model(p, server.DFlashSettings)
    dests = {a.dest: a for a in p._actions}
    for n in options.NAMES:
        assert options.doc(n)[:40] in dests[n].help


def test_cli_flags_follow_the_options(capsys):
    from llama_dflash.api import cli

    assert cli.SPECULATION == list(options.choices("speculation"))
    p = argparse.ArgumentParser()
    cli._add_exact(p)
    assert p.parse_args([]).exact == "auto"
    assert p.parse_args(["--exact"]).exact is True
    assert p.parse_args(["--default-mode"]).exact is False
    with pytest.raises(SystemExit):
        p.parse_args(["--exact", "--default-mode"])
    capsys.readouterr()
