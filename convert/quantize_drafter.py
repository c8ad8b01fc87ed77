#!/usr/bin/env python3
"""A drafter GGUF with its matrices re-encoded in another type (norms, conv bases, id maps kept).

A runnable entry point in the spirit of llama.cpp's convert_hf_to_gguf.py, thin over the
installed package: the same as `llama-dflash quantize` (`--help` lists the arguments)."""

import sys

from llama_dflash.api.cli import main

if __name__ == "__main__":
    sys.exit(main(["quantize", *sys.argv[1:]]))
