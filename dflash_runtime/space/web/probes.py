"""Whether a connected client still reads its result stream, told by the server's own write progress: small buffers
on its socket, and a floor of traffic while its answer runs, padding the policy grants (docs/public-space.md,
"Readers")."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Callable
from typing import Any

from starlette.types import Message, Send

SEND_BUFFER_BYTES = 16 * 1024  # the kernel doubles it
TRANSPORT_HIGH_WATER = 16 * 1024
TICK_S = 0.25


def _heartbeat(head: bytes, tail: bytes) -> Callable[[int], bytes]:
    """A stream's heartbeat padded with whitespace (which every client skips) to about `size` bytes."""
    return lambda size: head + b" " * max(0, size - len(head) - len(tail)) + tail


queue_heartbeat = _heartbeat(b'data: {"msg": "heartbeat"', b"}\n\n")  # /gradio_api/queue/data
call_heartbeat = _heartbeat(b"event: heartbeat\ndata: null", b"\n\n")  # /gradio_api/call/<name>/<event id>
comment_heartbeat = _heartbeat(b":", b"\n\n")  # a comment line: the /v1 routes'


def tighten(send: Any, depth: int = 8) -> None:
    """Give the stream under an ASGI `send` small buffers (its transport, found behind the middlewares' closures)."""
    seen: set[int] = set()
    layer = [send]
    for _ in range(depth):
        following = []
        for item in (item for item in layer if id(item) not in seen):
            seen.add(id(item))
            transport = getattr(item, "transport", None)
            if hasattr(transport, "get_extra_info"):  # None has none
                if (sock := transport.get_extra_info("socket")) is not None:
                    with contextlib.suppress(OSError):
                        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
                    with contextlib.suppress(AttributeError, NotImplementedError, ValueError):
                        transport.set_write_buffer_limits(high=TRANSPORT_HIGH_WATER)
                return
            following += [owner] if (owner := getattr(item, "__self__", None)) is not None else []
            for cell in getattr(item, "__closure__", None) or ():
                with contextlib.suppress(ValueError):  # an empty cell
                    following.append(cell.cell_contents)
        layer = following


class TrafficFloor:
    """Pads a server-sent-event stream to `bytes_per_s` while `running()` with `padding(size)`, as much as `grant(owed,
    items, idle, padded)` allows (the policy's share); `send` carries each write, the app's and the padding's."""

    def __init__(self, send: Send, bytes_per_s: float, running: Callable[[], bool], padding: Callable[[int], bytes],
                 grant: Callable[[int, int, int, int], int] | None = None) -> None:  # fmt: skip
        self._send, self._bytes_per_s, self._running, self._padding = send, bytes_per_s, running, padding
        self._grant = grant or (lambda owed, *_: owed)
        self._lock = asyncio.Lock()
        self._events = False  # the response is an event stream, not encoded, and has started
        self._between_events = True  # the last body written (if any) ended an event: padding may follow
        self.finished = False  # the app has written the response's end (set before that write goes out)
        self.items = self.idle = self.padded = 0  # bytes the app wrote; the floor's in ticks it wrote none; padding

    async def send(self, message: Message) -> None:  # the app's write
        async with self._lock:
            if message["type"] == "http.response.start":
                headers = {bytes(k).lower(): bytes(v).lower() for k, v in message.get("headers", [])}
                self._events = (headers.get(b"content-type", b"").startswith(b"text/event-stream")
                                and b"content-encoding" not in headers)  # fmt: skip
            elif message["type"] == "http.response.body":
                body = message.get("body", b"")
                self.items += len(body)
                self._between_events = body.endswith(b"\n\n") if body else self._between_events
                self.finished = not message.get("more_body", False)
            await self._send(message)

    async def run(self) -> None:
        """Pad until cancelled (or the response ends)."""
        if self._bytes_per_s <= 0:
            return
        loop = asyncio.get_running_loop()
        last, counted = loop.time(), 0  # the app's bytes counted at the last tick
        while not self.finished:
            await asyncio.sleep(TICK_S)  # a pacing clock, not a wait for another task
            now, sent, running = loop.time(), self.items - counted, self._running()
            owed = int(self._bytes_per_s * (now - last)) - sent
            self.idle += owed if sent == 0 and running else 0
            last, counted = now, self.items
            paddable = owed > 0 and running and self._events and self._between_events
            if paddable and (owed := self._grant(owed, self.items, self.idle, self.padded)) > 0:
                async with self._lock:
                    if not self.finished:
                        padding = self._padding(owed)
                        self.padded += len(padding)
                        await self._send({"type": "http.response.body", "body": padding, "more_body": True})
