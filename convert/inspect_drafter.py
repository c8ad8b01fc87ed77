#!/usr/bin/env python3
"""What a drafter GGUF is, as the loader reads it; with --target T.gguf, whether the pair
will speculate and, if not, why.

A runnable entry point in the spirit of llama.cpp's convert_hf_to_gguf.py, thin over the
installed package: the same as `llama-dflash inspect` (`--help` lists the arguments)."""

import sys

from llama_dflash.api.cli import main

if __name__ == "__main__":
    sys.exit(main(["inspect", *sys.argv[1:]]))
