"""llama.cpp's own llama-server, the reference of the comparisons: its path in DFLASH_LLAMA_SERVER. Without it the
comparisons are reported as not run (a skip that says so), never passed; where the run asks for it
(DFLASH_REQUIRE_LLAMA_SERVER=1, as .ci/run does after building it) a missing binary fails them instead."""

from __future__ import annotations

import os

import pytest

BINARY = os.environ.get("DFLASH_LLAMA_SERVER", "")
REQUIRED = os.environ.get("DFLASH_REQUIRE_LLAMA_SERVER") == "1"

if REQUIRED and not (BINARY and os.access(BINARY, os.X_OK)):
    raise RuntimeError(f"DFLASH_REQUIRE_LLAMA_SERVER=1, but DFLASH_LLAMA_SERVER={BINARY!r} is not an executable")

needs_llama_server = pytest.mark.skipif(not BINARY, reason="not run: set DFLASH_LLAMA_SERVER to a llama-server binary "
                                        "built from the same vendored llama.cpp (tools/build_llama_server.py)")
