"""The web process's door: every HTTP request passes here before Gradio does anything with it (plain ASGI,
Gradio-free).

- **Bodies are bounded before anything parses them.** A POST whose declared or actual length passes `max_body_bytes`
  is answered 413 at once (a 34 MB JSON history is never read whole, let alone parsed); uploads are off (the Space
  takes no files): 413.
- **Missing values.** A raw call whose `data` does not hold one value per parameter would fail in Gradio with an
  error it does not show (`{"error": null}`); it is answered here, HTTP 422, with the parameters in order.
- **Limits on queued answers.** A call of an engine endpoint (the API's /chat and /generate, the page's answer and
  A/B run) is admitted against three limits, counted in generations (an A/B run counts as the answers it runs):
  per session, for all session-less raw calls together, and for everybody. Over one: HTTP 429 saying which.
- **Nobody reads, nothing runs.** An admitted call runs only while somebody reads its result. Its readers are the
  result streams of its session: `GET /gradio_api/queue/data?session_hash=…` (the page, gradio_client) and
  `GET /gradio_api/call/<name>/<event id>` (plain HTTP). A call is abandoned when its session has no reader and
  either the last one left after the call was made, or none came within `reader_timeout_s` of it; a reader whose
  stream has not taken a write for `reader_timeout_s` (a client that stopped reading) counts as gone. The GPU job
  asks `alive` at every engine step and stops (see jobs.py); a call abandoned while it waited never asks for a GPU.
  Gradio alone stops a streaming answer only when it next writes to a closed stream, and a one-shot answer
  (/generate) or an unread one never. (Cancelling Gradio's task from outside, through its own cancel route, can
  catch the queue between two of its steps and leave it stuck: the job stops itself instead.)

A call counts against the limits until its handler ends, or until Gradio drops it from the queue unstarted: its
client cancelled it, or its session's last reader left (Gradio then drops the session's waiting events).

Over plain HTTP a call is two requests: `POST /gradio_api/call/<name>` queues it and answers its event id, then
`GET /gradio_api/call/<name>/<event id>` streams the result. A POST without `session_hash` is session-less: Gradio
gives it a session of its own, named by its event id.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs

from .requests import _env_number

log = logging.getLogger(__name__)
Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

STATE_KEY = "dflash_call"
_CALL = re.compile(r"/gradio_api/call/(v2/)?([^/]+)/?$")
_RESULT = re.compile(r"/gradio_api/call/(?:v2/)?[^/]+/([0-9a-f]+)/?$")
_JOIN = re.compile(r"/gradio_api/queue/join/?$")
_QUEUE_DATA = re.compile(r"/gradio_api/queue/data/?$")
_UPLOAD = re.compile(r"/gradio_api/upload/?$")
_CANCEL = re.compile(r"/gradio_api/cancel/?$")
REMEMBERED = 4096  # event ids kept: far more than the queue holds


@dataclass(frozen=True)
class GateSettings:
    """| variable | meaning | default |
    | `DFLASH_READER_TIMEOUT_S` | how long an answer may run (or wait) with nobody reading it | 3 |
    | `DFLASH_SESSION_JOBS` | generations one session may have queued or running | 3 |
    | `DFLASH_SESSIONLESS_JOBS` | the same, for all session-less raw calls together | 8 |
    | `DFLASH_TOTAL_JOBS` | the same, for everybody (at most the queue's size) | 64 |
    | `DFLASH_MAX_BODY_BYTES` | the longest request body | 1 MiB |
    | `DFLASH_BUSY_TIMEOUT_S` | the one wait for the engine: a job for the web process's engine slot, a GPU call for the
      worker's engine lock, a stream for a consumer that stopped taking chunks | 120 |"""

    reader_timeout_s: float = 3.0
    session_jobs: int = 3
    sessionless_jobs: int = 8
    total_jobs: int = 64
    max_body_bytes: int = 1 << 20
    busy_timeout_s: float = 120.0

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, queue_size: int | None = None) -> GateSettings:
        env = os.environ if env is None else env
        total = int(_env_number(env, "DFLASH_TOTAL_JOBS", cls.total_jobs))
        return cls(
            reader_timeout_s=_env_number(env, "DFLASH_READER_TIMEOUT_S", cls.reader_timeout_s),
            session_jobs=int(_env_number(env, "DFLASH_SESSION_JOBS", cls.session_jobs)),
            sessionless_jobs=int(_env_number(env, "DFLASH_SESSIONLESS_JOBS", cls.sessionless_jobs)),
            total_jobs=min(total, queue_size) if queue_size else total,
            max_body_bytes=int(_env_number(env, "DFLASH_MAX_BODY_BYTES", cls.max_body_bytes)),
            busy_timeout_s=_env_number(env, "DFLASH_BUSY_TIMEOUT_S", cls.busy_timeout_s),
        )

    def describe(self) -> dict[str, Any]:
        return {"reader_timeout_s": self.reader_timeout_s, "session_jobs": self.session_jobs,
                "sessionless_jobs": self.sessionless_jobs, "total_jobs": self.total_jobs,
                "max_body_bytes": self.max_body_bytes, "busy_timeout_s": self.busy_timeout_s}  # fmt: skip


@dataclass(frozen=True)
class EngineCalls:
    """The engine's endpoints as Gradio numbers them (a dependency's "id"): the weight of a call of each (the
    generations it runs, asked when the call comes), and the API names of those callable over plain HTTP."""

    weights: Mapping[int, Callable[[], int]]
    api_names: Mapping[str, int] = field(default_factory=dict)


@dataclass
class Call:
    """One admitted engine call, from its POST until its handler ends (or it is cancelled)."""

    id: str
    fn_index: int
    weight: int
    sessionless: bool
    session: str | None  # known at once, or (session-less) from the event id Gradio answers
    posted: float
    event_id: str | None = None
    started: bool = False


@dataclass
class Reader:
    session: str
    sending_since: float | None = None  # a write to the client that has not returned yet


class Callers:
    """Engine calls, result-stream readers by session, and the rules that admit and abandon calls (thread-safe:
    handlers ask from Gradio's threads and loop alike)."""

    def __init__(self, settings: GateSettings | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings or GateSettings()
        self._clock = clock
        self._lock = threading.Lock()
        self._calls: dict[str, Call] = {}
        self._readers: dict[str, list[Reader]] = {}
        self._left: dict[str, float] = {}  # session -> when its last reader left
        self._session_of_event: OrderedDict[str, str] = OrderedDict()

    # -- admission ---------------------------------------------------------------------------------------------------

    def admit(self, fn_index: int, weight: int, session: str | None) -> Call | str:
        """A new call (session None: session-less), or why it is refused. A call over a limit on its own (an A/B run
        of many methods) is let in when nothing else counts against that limit."""
        s = self.settings
        with self._lock:
            live = list(self._calls.values())
            total = sum(c.weight for c in live) + weight
            if total > s.total_jobs and total > weight:
                return (f"the server has {total - weight} answers queued or running, its limit is {s.total_jobs}: "
                        "retry in a minute")  # fmt: skip
            if session is None:
                used = sum(c.weight for c in live if c.sessionless)
                if used and used + weight > s.sessionless_jobs:
                    return (f"calls without a session_hash have {used} answers queued or running together, their "
                            f"limit is {s.sessionless_jobs}: retry later, or send a session_hash")  # fmt: skip
            else:
                used = sum(c.weight for c in live if c.session == session)
                if used and used + weight > s.session_jobs:
                    return (f"this session has {used} answers queued or running and this call would add {weight}; "
                            f"the limit is {s.session_jobs} (an A/B run counts as the answers it runs): wait for "
                            "them, or stop them")  # fmt: skip
            call = Call(secrets.token_hex(8), fn_index, weight, session is None, session, self._clock())
            self._calls[call.id] = call
            return call

    def queued(self, call: Call, event_id: str | None) -> None:
        """Gradio answered the POST: with the call's event id, or (None) refused it."""
        with self._lock:
            if event_id is None:
                self._calls.pop(call.id, None)
                return
            call.event_id = event_id
            if call.session is None:
                call.session = event_id
            self._session_of_event[event_id] = call.session
            while len(self._session_of_event) > REMEMBERED:
                self._session_of_event.popitem(last=False)

    def withdrawn(self, event_id: Any) -> None:
        """The client cancelled its event (Stop, Clear, `job.cancel()`): one still queued leaves Gradio's queue and
        no handler will end it, so its place is free now (a running one's handler ends it)."""
        with self._lock:
            for call in [c for c in self._calls.values() if c.event_id == event_id and not c.started]:
                del self._calls[call.id]

    def start(self, call_id: str | None) -> bool:
        """The call's handler starts: False when the call was abandoned meanwhile (then it must not run)."""
        if call_id is None:
            return True
        with self._lock:
            call = self._calls.get(call_id)
            if call is None:
                return False
            call.started = True
            return not self._abandoned(call, self._clock())

    def end(self, call_id: str | None) -> None:
        if call_id is not None:
            with self._lock:
                self._calls.pop(call_id, None)

    def sessionless(self, call_id: str | None) -> bool:
        with self._lock:
            call = self._calls.get(call_id) if call_id is not None else None
            return call is not None and call.sessionless

    # -- readers -----------------------------------------------------------------------------------------------------

    def session_of_event(self, event_id: str) -> str:
        with self._lock:
            return self._session_of_event.get(event_id, event_id)

    def opened(self, session: str) -> Reader:
        reader = Reader(session)
        with self._lock:
            self._readers.setdefault(session, []).append(reader)
        return reader

    def closed(self, reader: Reader) -> None:
        with self._lock:
            readers = self._readers.get(reader.session, [])
            if reader not in readers:
                return
            readers.remove(reader)
            if not readers:
                self._readers.pop(reader.session, None)
                self._left[reader.session] = self._clock()
                for call in [c for c in self._calls.values() if c.session == reader.session and not c.started]:
                    del self._calls[call.id]  # Gradio drops a session's waiting events when its reader leaves

    def sending(self, reader: Reader, busy: bool) -> None:
        with self._lock:
            reader.sending_since = self._clock() if busy else None

    def _reading(self, session: str | None, now: float) -> bool:
        limit = self.settings.reader_timeout_s
        return any(r.sending_since is None or now - r.sending_since <= limit
                   for r in self._readers.get(session or "", ()))  # fmt: skip

    def _abandoned(self, call: Call, now: float) -> bool:
        if call.session is None or self._reading(call.session, now):
            return False
        left = self._left.get(call.session)
        if left is not None and left >= call.posted:
            return True  # its reader went away after the call was made
        return now - max(call.posted, left or 0.0) > self.settings.reader_timeout_s

    def alive(self, call_id: str | None) -> bool:
        """Whether somebody still reads the call (asked by its GPU job at every step; True for a call the gate did
        not admit). Also forgets readers' departures nobody needs any more."""
        if call_id is None:
            return True
        now = self._clock()
        with self._lock:
            call = self._calls.get(call_id)
            sessions = {c.session for c in self._calls.values()}
            for session in [s for s in self._left if s not in sessions]:
                del self._left[session]
            return call is not None and not self._abandoned(call, now)

    def describe(self) -> dict[str, Any]:
        return self.settings.describe()


def call_of(request: Any) -> str | None:
    """The engine call the gate admitted for a handler's `gr.Request` (None for a call that did not pass it)."""
    starlette_request = getattr(request, "request", None)
    scope = getattr(starlette_request, "scope", None)
    state = scope.get("state") if isinstance(scope, dict) else None
    return state.get(STATE_KEY) if isinstance(state, dict) else None


def missing_values(body: bytes, parameters: Sequence[str]) -> str | None:
    """What is wrong with a list-form call body for an endpoint of these parameters, or None (also when it is not
    JSON at all: Gradio answers that itself)."""
    try:
        data = json.loads(body).get("data")
    except (ValueError, AttributeError):
        return None
    if not isinstance(data, list) or len(data) == len(parameters):
        return None
    return f"data must hold {len(parameters)} values, in this order: {', '.join(parameters)} (got {len(data)})"


async def _answer(send: Send, status: int, detail: str) -> None:
    payload = json.dumps({"detail": detail}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()),
                            (b"connection", b"close")]})  # fmt: skip
    await send({"type": "http.response.body", "body": payload})


def _json_object(body: bytes) -> dict[str, Any]:
    try:
        value = json.loads(body)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


class HttpGate:
    """The ASGI middleware (see the module doc). `callers` is shared with the service; `engine` names the engine's
    endpoints; `parameters` names each checked API endpoint's parameters."""

    def __init__(self, app: ASGIApp, callers: Callers, engine: EngineCalls | None = None,
                 parameters: Mapping[str, Sequence[str]] | None = None) -> None:  # fmt: skip
        self.app = app
        self.callers = callers
        self.engine = engine
        self.parameters = dict(parameters or {})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope.get("type") != "http":
            await self.app(scope, receive, send)
            return
        path, method = scope.get("path", ""), scope.get("method")
        if method == "GET":
            if match := _RESULT.search(path):
                await self._read(self.callers.session_of_event(match.group(1)), scope, receive, send)
            elif _QUEUE_DATA.search(path) and (session := _query(scope, "session_hash")):
                await self._read(session, scope, receive, send)
            else:
                await self.app(scope, receive, send)
            return
        if method != "POST":
            await self.app(scope, receive, send)
            return
        if _UPLOAD.search(path):
            await _answer(send, 413, "uploads are off: this Space takes no files (maximum allowed size: 0 bytes)")
            return
        body = await self._body(scope, receive, send)
        if body is None:
            return
        replay = _replay(body, receive)
        if _CANCEL.search(path):
            self.callers.withdrawn(_json_object(body).get("event_id"))
        if (match := _CALL.search(path)) and not match.group(1) and match.group(2) in self.parameters:
            problem = missing_values(body, self.parameters[match.group(2)])
            if problem is not None:
                await _answer(send, 422, problem)
                return
        engine = self.engine
        fn_index = None
        request = _json_object(body) if engine is not None and (_JOIN.search(path) or match) else {}
        if engine is not None and match:
            fn_index = engine.api_names.get(match.group(2))
        elif engine is not None and _JOIN.search(path):
            index = request.get("fn_index")
            fn_index = index if isinstance(index, int) and index in engine.weights else None
        if engine is None or fn_index is None:
            await self.app(scope, replay, send)
            return
        session = request.get("session_hash")
        session = session if isinstance(session, str) and session else None
        if session is None and not match:  # a join names its session (Gradio refuses one that does not)
            await self.app(scope, replay, send)
            return
        call = self.callers.admit(fn_index, engine.weights[fn_index](), session)
        if isinstance(call, str):
            await _answer(send, 429, call)
            return
        scope.setdefault("state", {})[STATE_KEY] = call.id
        await self._queue(call, scope, replay, send)

    async def _body(self, scope: Scope, receive: Receive, send: Send) -> bytes | None:
        """The whole body, or None once a too long one was refused (by its declared length, or as it came)."""
        limit = self.callers.settings.max_body_bytes
        declared = dict(scope.get("headers") or []).get(b"content-length")
        too_long = f"the request body is longer than this server accepts ({limit} bytes)"
        if declared is not None and declared.isdigit() and int(declared) > limit:
            await _answer(send, 413, too_long)
            return None
        parts: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return b"".join(parts)
            part = message.get("body", b"")
            size += len(part)
            if size > limit:
                await _answer(send, 413, too_long)
                return None
            parts.append(part)
            if not message.get("more_body"):
                return b"".join(parts)

    async def _queue(self, call: Call, scope: Scope, receive: Receive, send: Send) -> None:
        """Pass the call on and note the event id Gradio answers (or that it refused the call)."""
        status, answer = 0, bytearray()

        async def noting(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body" and len(answer) < 4096:
                answer.extend(message.get("body", b""))
            await send(message)

        event_id = None
        try:
            await self.app(scope, receive, noting)
            event = _json_object(bytes(answer)).get("event_id") if status == 200 else None
            event_id = event if isinstance(event, str) else None
        finally:
            self.callers.queued(call, event_id)

    async def _read(self, session: str, scope: Scope, receive: Receive, send: Send) -> None:
        """Stream a result to one of `session`'s readers, watching for its hang-up and for writes it does not take."""
        reader = self.callers.opened(session)
        early: list[Message] = []  # what the watcher read before the app asked (a GET's empty body, the hang-up)
        wanted = asyncio.Event()

        async def watch() -> None:
            while True:
                message = await receive()
                early.append(message)
                wanted.set()
                if message["type"] == "http.disconnect":
                    self.callers.closed(reader)
                    return

        async def app_receive() -> Message:
            while not early:
                wanted.clear()
                await wanted.wait()
            return early.pop(0) if early[0]["type"] != "http.disconnect" else early[0]

        async def app_send(message: Message) -> None:
            self.callers.sending(reader, True)
            try:
                await send(message)
            finally:
                self.callers.sending(reader, False)

        watcher = asyncio.create_task(watch())
        try:
            await self.app(scope, app_receive, app_send)
        finally:
            watcher.cancel()
            self.callers.closed(reader)



def _query(scope: Scope, name: str) -> str | None:
    values = parse_qs(scope.get("query_string", b"").decode("latin-1")).get(name)
    return values[0] if values and values[0] else None


def _replay(body: bytes, receive: Receive) -> Receive:
    """A `receive` that hands the body on once, then whatever comes (the hang-up)."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def replay() -> Message:
        return pending.pop(0) if pending else await receive()

    return replay
