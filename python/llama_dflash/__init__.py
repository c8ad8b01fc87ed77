"""llama-dflash: DFlash speculative decoding on llama.cpp."""

from __future__ import annotations

import llama_cpp  # noqa: F401  (load libllama first: the C core binds to that copy)

from .api.llama import DFlashDraftModel, Llama
from .core import GenerationResult, SamplingParams, SpecStats, SpeculativeGenerator
from .core import kernels as _kernels
from .errors import DFlashError

__all__ = ["DFlashDraftModel", "DFlashError", "GenerationResult", "Llama", "SamplingParams", "SpecStats",
           "SpeculativeGenerator"]
__version__ = "0.1.0"

_kernels.register()  # before any model loads: contexts made earlier never see the backend
