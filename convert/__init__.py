"""HF DFlash / DFlash2 checkpoints -> GGUF drafters (installed as llama_dflash.convert)."""

from .hf import ConvertError, convert_hf_to_gguf, default_target_layer_ids, read_target
from .inspect import describe

__all__ = ["ConvertError", "convert_hf_to_gguf", "default_target_layer_ids", "describe", "read_target"]
