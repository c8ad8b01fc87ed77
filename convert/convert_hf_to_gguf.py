#!/usr/bin/env python3
"""HF DFlash / DFlash2 drafter checkpoint (z-lab's or vLLM speculators' schema) -> a GGUF
drafter that our runtime and upstream llama.cpp load (--speculators DIR: a speculators checkpoint).

A runnable entry point in the spirit of llama.cpp's convert_hf_to_gguf.py, thin over the
installed package: the same as `llama-dflash convert` (`--help` lists the arguments)."""

import sys

from llama_dflash.api.cli import main

if __name__ == "__main__":
    sys.exit(main(["convert", *sys.argv[1:]]))
