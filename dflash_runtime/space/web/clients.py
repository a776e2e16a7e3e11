"""Who a caller is, as the platform tells it: the identity the Space's limits, turns and shares are keyed to, never
the session hash a client mints freely (docs/public-space.md, "Who a client is"). A client is its network address:
behind Hugging Face's proxy the last hop of `X-Forwarded-For` (the one the proxy appended), elsewhere the socket's
peer; `DFLASH_TRUSTED_PROXY_HOPS` says how many hops trusted proxies added. An IPv6 client is its /64 network. The
key is a digest with a secret of the process: nothing that carries it tells the address."""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
import secrets
from collections.abc import Iterable, Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any, Protocol

_SECRET = secrets.token_bytes(32)  # per process: client keys cannot be matched to addresses elsewhere
UVICORN_TRUSTED_PROXIES = "FORWARDED_ALLOW_IPS"  # the peers whose X-Forwarded-For uvicorn would believe
UNKNOWN = "unknown"  # no address at all (an in-process call): one client, so limited as one


def servers_forward_nothing(env: MutableMapping[str, str] | None = None) -> str | None:
    """Make the HTTP server under Gradio take no proxy header: uvicorn's proxy-headers middleware (on by default,
    trusting 127.0.0.1 and ::1) would rewrite a request's peer from `X-Forwarded-For` before the Space sees it, so that
    a client on the same machine could pick a new identity per request. Uvicorn reads its trusted list from
    `FORWARDED_ALLOW_IPS` when Gradio builds the server's configuration: empty, it trusts nobody, and the header is
    read here alone (`DFLASH_TRUSTED_PROXY_HOPS`). Call before `launch()`. Returns the value it replaced, if any."""
    env = os.environ if env is None else env
    before = env.get(UVICORN_TRUSTED_PROXIES)
    env[UVICORN_TRUSTED_PROXIES] = ""
    return before or None


class Trusting(Protocol):
    trusted_proxy_hops: int  # (setup.settings.PublicSettings)


@dataclass(frozen=True)
class Hops:
    trusted_proxy_hops: int = 0


@dataclass(frozen=True)
class ClientIdentity:
    """One client: `key` (opaque, what limits and shares count by) and `source`, where the address came from
    ("forwarded": the trusted proxy's header; "socket": the connection's peer; "none")."""

    key: str
    source: str

    @property
    def short(self) -> str:
        """A short form of the key for logs."""
        return self.key[:8]


def client_identity(headers: Iterable[tuple[Any, Any]], peer: str | None,
                    settings: Trusting | None = None) -> ClientIdentity:  # fmt: skip
    """The client of a request, from its headers (ASGI pairs of bytes, or of str) and its socket's peer address:
    the one function every route asks (see the module doc)."""
    settings = settings or Hops()
    address, source = peer, "socket"
    if settings.trusted_proxy_hops:
        hops = _forwarded_hops(headers)
        if len(hops) >= settings.trusted_proxy_hops:
            address, source = hops[-settings.trusted_proxy_hops], "forwarded"
    if not address:
        return ClientIdentity(_digest(UNKNOWN), "none")
    return ClientIdentity(_digest(_network(address)), source)


def client_of_scope(scope: Mapping[str, Any], settings: Trusting | None = None) -> ClientIdentity:
    """The client of an ASGI request (its `headers` and `client`)."""
    peer = scope.get("client")
    return client_identity(scope.get("headers") or (), peer[0] if peer else None, settings)


def client_of_request(request: Any, settings: Trusting | None = None) -> ClientIdentity:
    """The client of a Gradio handler's `gr.Request` (the Starlette request it wraps)."""
    scope = getattr(getattr(request, "request", None), "scope", None)
    return client_of_scope(scope if isinstance(scope, Mapping) else {}, settings)


def _forwarded_hops(headers: Iterable[tuple[Any, Any]]) -> list[str]:
    """The addresses of every X-Forwarded-For header, in order (several headers count as one list)."""
    hops: list[str] = []
    for name, value in headers:
        name = name.decode("latin-1") if isinstance(name, bytes) else str(name)
        if name.lower() == "x-forwarded-for":
            value = value.decode("latin-1") if isinstance(value, bytes) else str(value)
            hops.extend(hop.strip() for hop in value.split(",") if hop.strip())
    return hops


def _host(hop: str) -> str:
    """A hop's address without what proxies may write around it: quotes, an IPv6 address's brackets, a port
    (`203.0.113.9:4711`, `[2001:db8::1]:443`); a bare IPv6 address (several colons) keeps all it has."""
    hop = hop.strip().strip('"').strip()
    if hop.startswith("["):
        end = hop.find("]")
        return hop[1:end] if end > 0 else hop
    if hop.count(":") == 1:
        return hop.split(":", 1)[0]
    return hop


def _network(address: str) -> str:
    """The address as a client: IPv4 as is, IPv6 as its /64; anything unparsable as the text it is."""
    address = _host(address)
    try:
        parsed = ipaddress.ip_address(address)
    except ValueError:
        return address[:64]
    if isinstance(parsed, ipaddress.IPv6Address) and parsed.ipv4_mapped is None:
        return str(ipaddress.ip_network(f"{parsed}/64", strict=False))
    return str(parsed.ipv4_mapped or parsed) if isinstance(parsed, ipaddress.IPv6Address) else str(parsed)


def _digest(text: str) -> str:
    return hmac.new(_SECRET, text.encode(), hashlib.sha256).hexdigest()[:24]
