"""The engine core: the only layer above the binding that holds native handles (target
context, capture, drafter, engine); everything above it goes through EngineCore,
SpeculativeGenerator or Drafter.  (llama_dflash.Llama's own target model and context are
llama-cpp-python's, made by its base class.)"""

from .._native import Tokenizer
from .drafter import Drafter
from .engine import EngineCore, EngineRequest
from .generator import GenerationResult, SpeculativeGenerator
from .sampling import SamplingParams
from .stats import SpecStats

__all__ = ["Drafter", "EngineCore", "EngineRequest", "GenerationResult", "SamplingParams", "SpecStats",
           "SpeculativeGenerator", "Tokenizer"]
