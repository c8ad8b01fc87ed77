"""llama-dflash: DFlash speculative decoding on llama.cpp."""

from __future__ import annotations

import llama_cpp  # noqa: F401  (load libllama first: the C core binds to that copy)

from .engine import DFlashError, GenerationResult, SpeculativeGenerator
from .llama import DFlashDraftModel, Llama
from .sampling import SamplingParams
from .stats import SpecStats

__all__ = ["DFlashDraftModel", "DFlashError", "GenerationResult", "Llama", "SamplingParams", "SpecStats",
           "SpeculativeGenerator"]
__version__ = "0.1.0"
