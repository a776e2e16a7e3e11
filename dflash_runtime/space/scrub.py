"""What a visitor may read of the server: its file-system paths cut to file names, its RPC servers' addresses, and
nothing of the engine's cache state. Both processes scrub what they send (the GPU worker its engine's description
and errors, the web process its errors, /info and the page)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

# An absolute path (two or more components) that starts a word: /home/user/.cache/x.gguf -> x.gguf. Slashes inside
# words or after a colon (tok/s, 1/2, https://host/...) are left alone.
_PATH = re.compile(r"(?<![\w.~:/-])(?:/[^\s/'\"():,;<>`]+)+/([^\s/'\"():,;<>`]+)")
# The cache's state (what somebody's requests left) and how many answers run.
PRIVATE_ENGINE_KEYS = ("n_cached", "n_cached_by_sequence", "checkpoints", "sessions", "running")


def scrub_paths(text: str) -> str:
    """`text` with the server's absolute file-system paths cut down to their file names, for anything a visitor
    reads (the info box, /info, error messages)."""
    return _PATH.sub(r"\1", text)


def public_engine_info(info: dict[str, Any]) -> dict[str, Any]:
    """An engine's description without the server's paths (file names only), the cache's state, or the RPC servers'
    addresses and traffic (which follows requests)."""
    public = {k: Path(v).name if k in ("target", "draft") and isinstance(v, str) else v
              for k, v in info.items() if k not in PRIVATE_ENGINE_KEYS}  # fmt: skip
    if isinstance(public.get("placement"), dict):
        placement = {k: v for k, v in public["placement"].items() if k != "rpc"}
        placement["devices"] = [{**d, "where": "local" if d.get("where") == "local" else "remote"}
                                for d in placement.get("devices", [])]  # fmt: skip
        public["placement"] = placement
    return public


def without_endpoints(text: str, endpoints: tuple[str, ...]) -> str:
    """`text` with the RPC servers' addresses (as given and as parsed) replaced by "<DFLASH_RPC>"."""
    from ..native.rpc import parse_endpoint

    for endpoint in endpoints:
        host, port = parse_endpoint(endpoint)
        for spelling in (endpoint, f"{host}:{port}"):
            text = text.replace(spelling, "<DFLASH_RPC>")
    return text
