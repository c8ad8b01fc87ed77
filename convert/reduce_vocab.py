#!/usr/bin/env python3
"""A drafter that proposes only the N most frequent target tokens (its own head and a d2t map).

A runnable entry point in the spirit of llama.cpp's convert_hf_to_gguf.py, thin over the
installed package: the same as `llama-dflash reduce-vocab` (`--help` lists the arguments)."""

import sys

from llama_dflash.api.cli import main

if __name__ == "__main__":
    sys.exit(main(["reduce-vocab", *sys.argv[1:]]))
