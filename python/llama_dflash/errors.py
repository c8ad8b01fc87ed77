"""The errors users see, and the file check every entry point does first."""

from __future__ import annotations

import os


class DFlashError(RuntimeError):
    """A user-facing error from llama-dflash (bad file, mismatch, bad parameter)."""


def printable(text: str) -> str:
    """`text` with its non-printable characters escaped as Python does (\\n, \\x1b): names read from
    a file stay on one line in a message and cannot drive the terminal."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def check_file(path: str | os.PathLike, what: str) -> bytes:
    """The path as bytes for the C core, or FileNotFoundError naming `what` when it is no file."""
    p = os.fspath(path)
    if not os.path.exists(p):
        raise FileNotFoundError(f"{what} file not found: {p!r}")
    if not os.path.isfile(p):  # a directory, a FIFO (reading it would block), a device
        raise FileNotFoundError(f"{what} {p!r} is not a regular file")
    return os.fsencode(p)  # any path the OS takes (undecodable bytes included)
