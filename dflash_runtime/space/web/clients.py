"""Who a caller is: its network address as the platform gives it, never the session hash a client mints freely, as
a digest with a secret of the process (docs/public-space.md, "Who a client is")."""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
import secrets
from collections.abc import Iterable, Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

_SECRET = secrets.token_bytes(32)  # per process: client keys cannot be matched to addresses elsewhere
UVICORN_TRUSTED_PROXIES = "FORWARDED_ALLOW_IPS"  # the peers whose X-Forwarded-For uvicorn would believe


def servers_forward_nothing(env: MutableMapping[str, str] | None = None) -> str | None:
    """Make uvicorn trust no proxy header (by default it believes 127.0.0.1's: a client on the same machine could pick
    a new identity per request); call before `launch()`. The value replaced."""
    env = os.environ if env is None else env
    before = env.get(UVICORN_TRUSTED_PROXIES)
    env[UVICORN_TRUSTED_PROXIES] = ""
    return before or None


@dataclass(frozen=True)
class ClientIdentity:
    """One client: `key` (opaque, what limits and shares count by) and where its address came from (`source`)."""

    key: str
    source: str  # "forwarded" (the trusted proxy's header), "socket" (the connection's peer) or "none"


def client_identity(headers: Iterable[tuple[Any, Any]], peer: str | None, hops: int = 0) -> ClientIdentity:
    """The client of a request (headers: pairs of bytes or str): the `hops`-th address from the end of X-Forwarded-For
    (the one a trusted proxy appended), or without `hops` the socket's peer."""
    address, source = peer, "socket"
    forwarded = [hop.strip() for name, value in headers if _text(name).lower() == "x-forwarded-for"
                 for hop in _text(value).split(",") if hop.strip()] if hops else []  # fmt: skip
    if hops and len(forwarded) >= hops:
        address, source = forwarded[-hops], "forwarded"
    if not address:
        address, source = "unknown", "none"  # an in-process call: one client, limited as one
    return ClientIdentity(hmac.new(_SECRET, _network(address).encode(), hashlib.sha256).hexdigest()[:24], source)


def client_of_scope(scope: Mapping[str, Any] | None, hops: int = 0) -> ClientIdentity:
    scope = scope if isinstance(scope, Mapping) else {}
    peer = scope.get("client")
    return client_identity(scope.get("headers") or (), peer[0] if peer else None, hops)


def _text(value: Any) -> str:
    return value.decode("latin-1") if isinstance(value, bytes) else str(value)


def _network(hop: str) -> str:
    """A hop as a client, in the shapes proxies write it (quotes, an IPv6 address's brackets, a port): IPv4 as is,
    IPv6 as its /64, an IPv4-mapped address as its IPv4; anything unparsable as the text it is."""
    address = hop.strip().strip('"').strip()
    if address.startswith("["):
        address = address[1:address.find("]")] if address.find("]") > 0 else address
    elif address.count(":") == 1:
        address = address.split(":", 1)[0]
    try:
        parsed = ipaddress.ip_address(address)
    except ValueError:
        return address[:64]
    if isinstance(parsed, ipaddress.IPv6Address):
        if parsed.ipv4_mapped is not None:
            return str(parsed.ipv4_mapped)
        return str(ipaddress.ip_network(f"{parsed}/64", strict=False))
    return str(parsed)
