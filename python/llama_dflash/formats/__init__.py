"""Drafter files: the format table, DrafterConfig, GGUF reading/writing, reduced vocabularies,
the HF checkpoint converter and `inspect`."""

from .config import DrafterConfig
from .hf import ConvertError, convert_hf_to_gguf, default_target_layer_ids, read_target
from .inspect import describe

__all__ = ["ConvertError", "DrafterConfig", "convert_hf_to_gguf", "default_target_layer_ids", "describe",
           "read_target"]
