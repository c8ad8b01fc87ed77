"""Checking the output: certification of near-ties by replay, replay draft sources, upstream
llama.cpp's own DFlash graph as an oracle, and the PyTorch reference of the drafter."""
