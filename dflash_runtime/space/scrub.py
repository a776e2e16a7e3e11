"""The server's file-system paths cut out of what a visitor reads: both processes scrub what they send (the GPU
worker its engine's problems, the web process its errors, /info and the page)."""

from __future__ import annotations

import re

# An absolute path (two or more components) that starts a word: /home/user/.cache/x.gguf -> x.gguf. Slashes inside
# words or after a colon (tok/s, 1/2, https://host/...) are left alone.
_PATH = re.compile(r"(?<![\w.~:/-])(?:/[^\s/'\"():,;<>`]+)+/([^\s/'\"():,;<>`]+)")


def scrub_paths(text: str) -> str:
    """`text` with the server's absolute file-system paths cut down to their file names, for anything a visitor
    reads (the info box, /info, error messages)."""
    return _PATH.sub(r"\1", text)
