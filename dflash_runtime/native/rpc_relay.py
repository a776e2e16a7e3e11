"""A relay between ggml's RPC client and one rpc-server: a server that goes away fails a request, not the process.

ggml's RPC client (ggml/src/ggml-rpc/ggml-rpc.cpp of the pinned llama.cpp) aborts the process when its socket fails:
a connection refused, a server that closes it, a short read, all end in `GGML_ABORT`. So the client never talks to
a server directly. It talks to this relay on 127.0.0.1, which forwards every command to the server and its reply
back. When the server goes away (its socket closes or errs, a reply does not come within the reply timeout, or its
host stops answering TCP keepalives), the relay records why, naming the endpoint, and from then on answers each
command itself with a well-formed reply that harms nothing: an allocation fails, data reads as zeros, a copy or a
cached upload is reported done. The native call in flight returns, and the runtime, which checks the relay after
every decode (`dflash_runtime.native.rpc`), raises `RemoteDeviceError` before any of those numbers is used. Freeing the
engine's buffers then completes too, so the engine closes cleanly.

The protocol (RPC_PROTO 7.0): a command is | cmd (1 byte) | payload size (8 bytes, little-endian) | payload |, and
the commands that expect a reply get | reply size (8 bytes) | reply |. Which commands have replies, and their sizes,
is what the client's `send_rpc_cmd` calls ask for (REPLY_SIZES; GET_TENSOR's is the size its request ends with).
"""

from __future__ import annotations

import contextlib
import select
import socket
import struct
import threading
from collections import Counter
from dataclasses import dataclass, field

PROTO_MAJOR, PROTO_MINOR = 7, 0  # ggml/include/ggml-rpc.h of the pinned llama.cpp
CONN_CAPS_SIZE = 24  # ggml/src/ggml-rpc/transport.h: the transport capabilities a HELLO carries (RDMA); zero = TCP
(ALLOC_BUFFER, GET_ALIGNMENT, GET_MAX_SIZE, BUFFER_GET_BASE, FREE_BUFFER, BUFFER_CLEAR, SET_TENSOR, SET_TENSOR_HASH,
 GET_TENSOR, COPY_TENSOR, GRAPH_COMPUTE, GET_DEVICE_MEMORY, INIT_TENSOR, GET_ALLOC_SIZE, HELLO, DEVICE_COUNT,
 GRAPH_RECOMPUTE, MEMSET_TENSOR) = range(18)  # fmt: skip
COMMAND_NAMES = ("alloc_buffer", "get_alignment", "get_max_size", "buffer_get_base", "free_buffer", "buffer_clear",
                 "set_tensor", "set_tensor_hash", "get_tensor", "copy_tensor", "graph_compute", "get_device_memory",
                 "init_tensor", "get_alloc_size", "hello", "device_count", "graph_recompute", "memset_tensor")
REPLY_SIZES = {ALLOC_BUFFER: 16, GET_ALIGNMENT: 8, GET_MAX_SIZE: 8, BUFFER_GET_BASE: 8, SET_TENSOR_HASH: 1,
               COPY_TENSOR: 1, GET_DEVICE_MEMORY: 16, GET_ALLOC_SIZE: 8, HELLO: 4 + CONN_CAPS_SIZE, DEVICE_COUNT: 4}
# Replies worth keeping from a live server, for the stand-ins (ggml divides by the alignment, asserts a non-NULL base).
CACHED = (GET_ALIGNMENT, GET_MAX_SIZE, BUFFER_GET_BASE, HELLO, DEVICE_COUNT)
SMALL_PAYLOAD = 1 << 16  # payloads up to this size are read whole; larger ones (weights) are streamed
CHUNK = 1 << 20
_U64 = struct.Struct("<Q")


class ServerLost(Exception):
    """The server side failed; the message says how."""


def reply_size(cmd: int, payload: bytes | None) -> int | None:
    """Bytes of the command's reply, None when it has none."""
    if cmd == GET_TENSOR:
        return _U64.unpack(payload[-8:])[0] if payload and len(payload) >= 8 else 0
    return REPLY_SIZES.get(cmd)


def stand_in(cmd: int, size: int, payload: bytes | None, cache: dict[tuple[int, bytes], bytes]) -> bytes:
    """The reply to `cmd` once the server is lost: the live server's where one was kept, else one that lets the
    native call finish without doing anything (see the module doc)."""
    kept = cache.get((cmd, payload or b""))
    if kept is not None:
        return kept
    if cmd == GET_ALIGNMENT:
        return _U64.pack(32)
    if cmd == GET_MAX_SIZE:
        return _U64.pack(1 << 62)
    if cmd == BUFFER_GET_BASE:
        return _U64.pack(1 << 40)
    if cmd in (SET_TENSOR_HASH, COPY_TENSOR):
        return b"\x01"
    if cmd == HELLO:
        return bytes((PROTO_MAJOR, PROTO_MINOR, 0, 0)) + bytes(CONN_CAPS_SIZE)
    if cmd == DEVICE_COUNT:
        return struct.pack("<I", 1)
    return bytes(size)  # an allocation at address 0 (it fails), zero memory, zero data


def recv_exact(sock: socket.socket, n: int) -> bytes:
    """Exactly n bytes, or ServerLost / EOFError (closed before they came)."""
    view = memoryview(bytearray(n))
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise EOFError("closed the connection")
        got += k
    return view.tobytes()


@dataclass
class Traffic:
    """What went through a relay: commands by name, round trips (commands that wait for a reply), bytes each way
    (payloads and replies with their headers)."""

    commands: Counter[str] = field(default_factory=Counter)
    round_trips: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0

    def to_dict(self) -> dict[str, object]:
        return {"round_trips": self.round_trips, "bytes_sent": self.bytes_sent,
                "bytes_received": self.bytes_received, "commands": dict(self.commands)}


def tune_upstream(sock: socket.socket, idle_s: int = 2, interval_s: int = 1, count: int = 3) -> None:
    """No Nagle delay; and a host that stops answering is noticed within about idle + interval × count seconds,
    even while a long graph runs (the server's kernel answers keepalives; an unreachable host does not)."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", idle_s), ("TCP_KEEPINTVL", interval_s), ("TCP_KEEPCNT", count),
                        ("TCP_USER_TIMEOUT", (idle_s + interval_s * count) * 1000)):
        if hasattr(socket, name):
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


class Session:
    """One connection of ggml's client, relayed to the server over a connection of its own."""

    def __init__(self, relay: Relay, client: socket.socket) -> None:
        self.relay = relay
        self.client = client
        self.upstream: socket.socket | None = None
        self.lost: str | None = None  # why the server is gone, once it is
        self.open = True
        self.ended = threading.Event()  # ggml closed its end (the relay noticed)
        self.cache: dict[tuple[int, bytes], bytes] = {}
        self._piped = 0

    def lose(self, why: str) -> None:
        if self.lost is None:
            self.lost = self.relay.last_loss = why
        self._close_upstream()

    def _close_upstream(self) -> None:
        if self.upstream is not None:
            with contextlib.suppress(OSError):
                self.upstream.close()
            self.upstream = None

    def run(self) -> None:
        relay = self.relay
        try:
            self.upstream = socket.create_connection((relay.host, relay.port), timeout=relay.connect_timeout_s)
            tune_upstream(self.upstream)
        except OSError as error:
            self.lose(f"cannot connect: {error.strerror or error}")
        try:
            self.client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            while self._client_ready():
                try:
                    header = recv_exact(self.client, 9)
                except (EOFError, OSError):
                    break
                self._exchange(header[0], _U64.unpack(header[1:])[0], header)
        finally:
            self.open = False
            self._close_upstream()
            self.ended.set()
            with contextlib.suppress(OSError):
                self.client.close()

    def _client_ready(self) -> bool:
        """Wait for the client's next command; meanwhile a server that closes its end is noticed at once (it never
        sends anything unasked)."""
        while True:
            watched = [self.client] + ([self.upstream] if self.upstream is not None else [])
            readable, _, _ = select.select(watched, [], [])
            if self.upstream is not None and self.upstream in readable:
                self.lose("closed the connection between two commands")
            if self.client in readable:
                return True

    def _exchange(self, cmd: int, size: int, header: bytes) -> None:
        traffic = self.relay.traffic
        self._piped = 0  # of a large payload, the bytes read from the client so far
        traffic.commands[COMMAND_NAMES[cmd] if cmd < len(COMMAND_NAMES) else str(cmd)] += 1
        traffic.bytes_sent += 9 + size
        payload = recv_exact(self.client, size) if size <= SMALL_PAYLOAD else None
        if cmd == HELLO and payload is not None:
            payload = bytes(len(payload))  # TCP only: the relay cannot carry an RDMA upgrade
        n_reply = reply_size(cmd, payload)
        reply = None
        if self.upstream is not None:
            try:
                reply = self._forward(cmd, size, header, payload, n_reply)
            except (ServerLost, EOFError, OSError) as error:
                self.lose(_reason(error, n_reply is not None))
        if self.lost is not None:
            self.relay.stand_ins += 1  # a command the server did not carry out: the engine's numbers are void
        if reply is None and payload is None:
            self._drain(size - self._piped)
        if n_reply is None:
            return
        if reply is None:
            reply = stand_in(cmd, n_reply, payload, self.cache)
        elif cmd in CACHED:
            self.cache[(cmd, payload or b"")] = reply
        traffic.round_trips += 1
        traffic.bytes_received += 8 + n_reply
        self.client.sendall(_U64.pack(n_reply) + reply)

    def _forward(self, cmd: int, size: int, header: bytes, payload: bytes | None, n_reply: int | None) -> bytes | None:
        up = self.upstream
        assert up is not None
        up.settimeout(self.relay.reply_timeout_s)
        if payload is not None:
            up.sendall(header + payload)
        else:
            up.sendall(header)
            self._pipe(up, size)
        if n_reply is None:
            return None
        got = _U64.unpack(recv_exact(up, 8))[0]
        if got != n_reply:
            raise ServerLost(f"answered {COMMAND_NAMES[cmd]} with {got} bytes, not {n_reply}")
        reply = recv_exact(up, n_reply)
        if cmd == HELLO:
            if reply[0] != PROTO_MAJOR or reply[1] > PROTO_MINOR:
                raise ServerLost(f"speaks RPC protocol {reply[0]}.{reply[1]}, this build {PROTO_MAJOR}.{PROTO_MINOR}")
            reply = reply[:4] + bytes(CONN_CAPS_SIZE)
        return reply

    def _pipe(self, up: socket.socket, size: int) -> None:
        """Stream a large payload from the client to the server (weights at load)."""
        buffer = bytearray(min(CHUNK, size))
        view = memoryview(buffer)
        while self._piped < size:
            k = self.client.recv_into(view, min(len(buffer), size - self._piped))
            if k == 0:
                raise EOFError("the engine closed its connection")
            self._piped += k
            up.sendall(view[:k])

    def _drain(self, left: int) -> None:
        buffer = bytearray(min(CHUNK, max(left, 1)))
        while left > 0:
            k = self.client.recv_into(buffer, min(len(buffer), left))
            if k == 0:
                return
            left -= k


def _reason(error: BaseException, waiting_reply: bool) -> str:
    if isinstance(error, TimeoutError):
        return "did not answer within the reply timeout" if waiting_reply else "stopped taking data"
    if isinstance(error, (ServerLost, EOFError)):
        return str(error)
    if isinstance(error, OSError):
        return error.strerror or str(error)
    return repr(error)


class Relay:
    """Listens on 127.0.0.1 (an ephemeral port) for ggml's client and relays each of its connections to the server
    at host:port. One per server and process, for the process's lifetime (ggml keeps the devices it registered)."""

    def __init__(self, host: str, port: int, *, connect_timeout_s: float = 5.0, reply_timeout_s: float = 60.0) -> None:
        self.host, self.port = host, port
        self.connect_timeout_s = connect_timeout_s
        self.reply_timeout_s = reply_timeout_s
        self.traffic = Traffic()
        self.sessions: list[Session] = []
        self.stand_ins = 0  # commands answered or dropped by the relay because the server was gone
        self.last_loss: str | None = None
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        threading.Thread(target=self._accept, name=f"rpc relay {self.endpoint}", daemon=True).start()

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"

    def live_session(self) -> Session | None:
        """The connection ggml holds now (it keeps one per server while any of its buffers or backends lives)."""
        return next((s for s in reversed(self.sessions) if s.open), None)


    def _accept(self) -> None:
        while True:
            client, _ = self._listener.accept()
            session = Session(self, client)
            self.sessions = [s for s in self.sessions if s.open] + [session]
            threading.Thread(target=session.run, name=f"rpc relay session {self.endpoint}", daemon=True).start()
