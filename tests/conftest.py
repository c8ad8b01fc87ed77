"""Session fixtures: tiny targets of several architectures and matching drafters."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

# The suite's own cache (exact-mode verdicts, cost models, calibrations), fresh each session, so that no
# result depends on what an earlier run or the user left there; the downloaded and derived files
# (models checked against their hashes, test drafters keyed by their bytes, rpc-server, wheels) are
# shared with the user's cache.  Subprocesses inherit both.
if "LLAMA_DFLASH_FILES" not in os.environ:
    from llama_dflash.cache import files_dir  # noqa: E402

    os.environ["LLAMA_DFLASH_FILES"] = str(files_dir())
    import atexit  # noqa: E402
    import shutil  # noqa: E402
    import tempfile  # noqa: E402

    os.environ["LLAMA_DFLASH_CACHE"] = tempfile.mkdtemp(prefix="llama-dflash-tests-")
    atexit.register(shutil.rmtree, os.environ["LLAMA_DFLASH_CACHE"], True)

import llama_cpp  # noqa: E402
from llama_cpp import _logger  # noqa: E402

from llama_dflash import _native  # noqa: E402,F401

from models import TargetSpec, drafter_config, write_random_drafter, write_target  # noqa: E402

_logger.set_verbose(False)

TARGETS = {
    # llama: layer-input capture, tied embeddings
    "llama": TargetSpec(arch="llama", tied=True, seed=0),
    # qwen3: layer-input capture, separate Q8_0 output head
    "qwen3": TargetSpec(arch="qwen3", tied=False, output_type="q8_0", seed=1),
    # qwen2: its graph builder records no layer inputs -> cb_eval capture
    "qwen2": TargetSpec(arch="qwen2", tied=True, seed=2),
}


@pytest.fixture(scope="session")
def artifacts(tmp_path_factory):
    d = tmp_path_factory.mktemp("models")
    out = {}
    for name, spec in TARGETS.items():
        tp = write_target(str(d / f"target-{name}.gguf"), spec)
        dp = write_random_drafter(str(d / f"drafter-{name}.gguf"), tp, drafter_config(spec), seed=spec.seed + 10)
        out[name] = {"target": tp, "drafter": dp, "spec": spec, "dir": d}
    return out


@pytest.fixture(scope="session")
def v2_drafter(artifacts, tmp_path_factory):
    """A DFlash2 drafter for the llama target, converted (f32) from the synthetic HF checkpoint."""
    from llama_dflash.formats import convert_hf_to_gguf

    from hf_fixtures import make_variant

    d = tmp_path_factory.mktemp("v2")
    hf, _, _ = make_variant(d, "v2")
    out = d / "v2.gguf"
    convert_hf_to_gguf(hf, artifacts["llama"]["target"], out, outtype="f32")
    return out


@pytest.fixture(scope="session")
def load_model():
    """Load a bare llama_model* (no context); freed at session end."""
    models = []

    def _load(path):
        llama_cpp.llama_backend_init()
        m = llama_cpp.llama_model_load_from_file(path.encode(), llama_cpp.llama_model_default_params())
        assert m, path
        models.append(m)
        return m

    yield _load
    for m in models:
        llama_cpp.llama_model_free(m)
