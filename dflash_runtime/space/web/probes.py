"""Whether a connected client still reads its result stream, told by the server's own write progress.

A client that stays connected but stops reading (a stopped process, a stuck tab) is seen only when a write to it does
not return: until then its kernel, and ours, take the bytes in. Two things make that come within seconds rather than
after megabytes (or never, for a one-shot answer that writes nothing until its end):

- **small buffers**: the stream's socket gets a small send buffer (`SO_SNDBUF`, which also ends the kernel's
  autotuning of it) and its transport a low write-buffer mark, so little waits on our side;
- **a floor of traffic**: while the stream's answer runs, the stream carries at least `DFLASH_READER_PROBE_BYTES_S`
  bytes a second, what the answer did not send made up with Gradio's own heartbeat message padded with JSON
  whitespace (`data: {"msg": "heartbeat"   …}` on the queue's stream, `event: heartbeat` / `data: null   …` on a
  call's: every client skips heartbeats, and gradio_client refuses any other line, comments included), so that a
  client that stopped reading has its window full within seconds; a write that then does not return for
  `DFLASH_READER_TIMEOUT_S` is a reader gone (callers.py).

**The floor is bounded per client and in total** (`PaddingBudget`): the padding of all the streams of one client comes
out of `DFLASH_READER_PROBE_CLIENT_BYTES_S` a second, that of all streams out of `DFLASH_READER_PROBE_TOTAL_BYTES_S`,
so that a client holding many streams it reads costs the server a bounded share of its time however many it opens
(one or two streams of a client get the whole floor each; more share it, and a stopped reader among them is noticed
later in proportion).

Behind a proxy that buffers whole streams (as Hugging Face's may), the socket faces the proxy, not the client: there
it is the proxy that notices a client gone (its hang-up reaches us), and the floor of traffic costs only the proxy's
bandwidth. 0 turns the floor off.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Message = MutableMapping[str, Any]
Send = Callable[[Message], Awaitable[None]]

SEND_BUFFER_BYTES = 16 * 1024  # the kernel doubles it
TRANSPORT_HIGH_WATER = 16 * 1024
TICK_S = 0.25


def queue_heartbeat(size: int) -> bytes:
    """The queue stream's heartbeat (`/gradio_api/queue/data`), padded to about `size` bytes."""
    return b'data: {"msg": "heartbeat"' + b" " * max(0, size - 30) + b"}\n\n"


def call_heartbeat(size: int) -> bytes:
    """A call's result stream's heartbeat (`/gradio_api/call/<name>/<event id>`), padded to about `size` bytes."""
    return b"event: heartbeat\ndata: null" + b" " * max(0, size - 30) + b"\n\n"


def comment_heartbeat(size: int) -> bytes:
    """A plain server-sent-event stream's heartbeat (the /v1 routes'): a comment line, which every client skips,
    padded to about `size` bytes."""
    return b":" + b" " * max(0, size - 3) + b"\n\n"


def transport_of(send: Any, depth: int = 8) -> Any:
    """The asyncio transport under an ASGI `send` (uvicorn's request cycle holds it; middlewares wrap `send` in
    closures), or None where none is found."""
    seen: set[int] = set()
    layer = [send]
    for _ in range(depth):
        following = []
        for item in layer:
            if id(item) in seen:
                continue
            seen.add(id(item))
            transport = getattr(item, "transport", None)
            if transport is not None and hasattr(transport, "get_extra_info"):
                return transport
            owner = getattr(item, "__self__", None)
            if owner is not None:
                following.append(owner)
            for cell in getattr(item, "__closure__", None) or ():
                with contextlib.suppress(ValueError):  # an empty cell
                    following.append(cell.cell_contents)
        layer = following
    return None


def tighten(send: Any) -> bool:
    """Give the stream under `send` small buffers (see the module doc); False where its socket was not found."""
    transport = transport_of(send)
    if transport is None:
        return False
    sock = transport.get_extra_info("socket")
    if sock is None:
        return False
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
    with contextlib.suppress(AttributeError, NotImplementedError, ValueError):
        transport.set_write_buffer_limits(high=TRANSPORT_HIGH_WATER)
    return True


MIN_PADDING = 64  # bytes: a grant smaller than this waits for the next tick
REMEMBERED_CLIENTS = 4096  # buckets kept before the full ones are forgotten


class PaddingBudget:
    """Bytes of padding a second, per client and in total: token buckets of one second's worth, refilled by the
    clock. Used from the event loop only (every stream's padding runs there)."""

    def __init__(self, client_bytes_s: float, total_bytes_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:  # fmt: skip
        self.client_bytes_s = client_bytes_s
        self.total_bytes_s = total_bytes_s
        self._clock = clock
        self._total = (total_bytes_s, clock())
        self._clients: dict[str, tuple[float, float]] = {}

    def _level(self, bucket: tuple[float, float], rate: float, now: float) -> float:
        level, at = bucket
        return min(rate, level + rate * (now - at))

    def take(self, client: str, wanted: int) -> int:
        """Up to `wanted` bytes of padding for a stream of `client`, as its and everybody's buckets allow."""
        now = self._clock()
        total = self._level(self._total, self.total_bytes_s, now)
        own = self._level(self._clients.get(client, (self.client_bytes_s, now)), self.client_bytes_s, now)
        granted = int(min(wanted, total, own))
        if granted < MIN_PADDING:
            granted = 0
        self._total = (total - granted, now)
        self._clients[client] = (own - granted, now)
        if len(self._clients) > REMEMBERED_CLIENTS:
            rate = self.client_bytes_s
            self._clients = {key: bucket for key, bucket in self._clients.items()
                             if self._level(bucket, rate, now) < rate}  # fmt: skip
        return granted


class TrafficFloor:
    """Pads a server-sent-event stream to `bytes_per_s` while `running()` says its answer runs (see the module doc),
    with `padding(size)` (queue_heartbeat or call_heartbeat), as much as `grant(owed)` allows (a PaddingBudget's
    share). `send` is the stream's own (each write of it, the app's and the padding's, one at a time)."""

    def __init__(self, send: Send, bytes_per_s: float, running: Callable[[], bool],
                 padding: Callable[[int], bytes], grant: Callable[[int], int] | None = None) -> None:  # fmt: skip
        self._send = send
        self._grant = grant  # how much of what is owed may be sent (a PaddingBudget's share), all when None
        self._padding = padding
        self._bytes_per_s = bytes_per_s
        self._running = running
        self._lock = asyncio.Lock()
        self._events = False  # the response is an event stream, not encoded, and has started
        self._between_events = False  # the last body written ended an event: a comment may follow
        self._finished = False
        self._sent = 0  # bytes written since the last tick

    @property
    def finished(self) -> bool:
        """Whether the app has written the response's end (set before that write goes out)."""
        return self._finished

    async def send(self, message: Message) -> None:
        """The app's write."""
        async with self._lock:
            if message["type"] == "http.response.start":
                headers = {bytes(k).lower(): bytes(v).lower() for k, v in message.get("headers", [])}
                self._events = (headers.get(b"content-type", b"").startswith(b"text/event-stream")
                                and b"content-encoding" not in headers)  # fmt: skip
                self._between_events = True
            elif message["type"] == "http.response.body":
                body = message.get("body", b"")
                self._sent += len(body)
                if body:
                    self._between_events = body.endswith(b"\n\n")
                self._finished = not message.get("more_body", False)
            await self._send(message)

    async def run(self) -> None:
        """Pad until cancelled (or the response ends)."""
        if self._bytes_per_s <= 0:
            return
        loop = asyncio.get_running_loop()
        last = loop.time()
        while not self._finished:
            await asyncio.sleep(TICK_S)  # a pacing clock, not a wait for another task
            now = loop.time()
            owed = int(self._bytes_per_s * (now - last)) - self._sent
            last, self._sent = now, 0
            if owed <= 0 or not self._events or not self._between_events or not self._running():
                continue
            if self._grant is not None and (owed := self._grant(owed)) <= 0:
                continue
            async with self._lock:
                if self._finished:
                    return
                padding = self._padding(owed)
                await self._send({"type": "http.response.body", "body": padding, "more_body": True})
