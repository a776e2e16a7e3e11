"""The web process's door: every HTTP request passes here before Gradio does anything with it (plain ASGI,
Gradio-free).

- **Bodies are bounded before anything parses them.** A POST whose declared or actual length passes `max_body_bytes`
  is answered 413 at once (a 34 MB JSON history is never read whole, let alone parsed); uploads are off (the Space
  takes no files): 413.
- **Missing values.** A raw call whose `data` does not hold one value per parameter would fail in Gradio with an
  error it does not show (`{"error": null}`); it is answered here, HTTP 422, with the parameters in order.
- **Malformed bodies.** A JSON body nested deeper than `MAX_DEPTH` levels is answered 400 before anything else
  parses it; a join naming no function or one the app does not have, 422. An error quotes at most an excerpt of what
  it refuses.
- **Limits on queued answers, by client.** A call of an engine endpoint (the API's /chat and /generate, the page's
  answer and A/B run) is admitted against three limits, counted in generations (an A/B run counts as the answers it
  runs): per client (clients.py: its address as the platform gives it, never the session hash, which a client mints
  freely), per session, and for everybody. Over one: HTTP 429 saying which. A join is read as Gradio reads it
  (`"fn_index": "12"`, `12.0` and `12` are one function), so whatever Gradio would run is counted; and the service
  admits any engine call that reached it without passing here (see SpaceService.reply).
- **Limits on the queue's other events, by client.** A join of any other queued function (the page's load, its
  timer) holds a place in Gradio's queue too: one client may have `client_events` of them waiting (429 over it), each
  counted until Gradio says it completed, its client withdraws it, or nobody reads its session (see
  Callers.admit_event).
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
client cancelled it, or its session's last reader hung up (Gradio then drops the session's waiting events).

A result stream that the server ends (Gradio closes a session's stream once none of its events is pending) is not a
hang-up: the client opens a new one for its next call, and a call it posted just before the old one ended (the page's
next message, sent as the previous answer's last frame arrived) gets `reader_timeout_s` for its reader to come, like
any new call, and is neither dropped nor stopped at once.

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
from functools import partial
from typing import Any
from urllib.parse import parse_qs

from pydantic import TypeAdapter, ValidationError

from ...errors import RequestError
from ...openai_api.errors import ApiError
from ..setup.settings import BUSY_TIMEOUT_S, busy_timeout_from_env, env_number
from .clients import ClientSettings, client_of_scope
from .probes import PaddingBudget, TrafficFloor, call_heartbeat, queue_heartbeat, tighten

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
_RUN = re.compile(r"/gradio_api/run/([^/]+)/?$")
_EVENT_ID = re.compile(rb'"event_id":\s*"([0-9a-f]+)"')
_V1 = re.compile(r"/v1(/|$)")
_V1_CODES = {400: "invalid_json", 413: "body_too_long", 422: "invalid_value", 429: "rate_limit_exceeded"}
MAX_DEPTH = 32  # JSON nesting a body may have (the API's deepest is 3: data, history, a message)
EXCERPT_CHARS = 60  # of a refused value an error quotes at most
_OPTIONAL_INT = TypeAdapter(int | None)
REMEMBERED = 4096  # event ids kept: far more than the queue holds


@dataclass(frozen=True)
class GateSettings:
    """| variable | meaning | default |
    | `DFLASH_READER_TIMEOUT_S` | how long an answer may run (or wait) with nobody reading it | 3 |
    | `DFLASH_CLIENT_JOBS` | generations one client (clients.py) may have queued or running | 8 |
    | `DFLASH_SESSION_JOBS` | the same, for one session | 3 |
    | `DFLASH_TOTAL_JOBS` | the same, for everybody (at most the queue's size) | 64 |
    | `DFLASH_CLIENT_EVENTS` | waiting events of the page's other queued functions one client may have | 4 |
    | `DFLASH_MAX_BODY_BYTES` | the longest request body | 1 MiB |
    | `DFLASH_READER_PROBE_BYTES_S` | the least traffic of a result stream while its answer runs (probes.py) | 48 KiB |
    | `DFLASH_READER_PROBE_CLIENT_BYTES_S` | the most padding a second for all streams of one client | 96 KiB |
    | `DFLASH_READER_PROBE_TOTAL_BYTES_S` | the most padding a second for all streams | 512 KiB |
    | `DFLASH_BUSY_TIMEOUT_S` | the one wait for the engine: a job for the web process's engine slot, a GPU call for the
      worker's engine lock, a stream for a consumer that stopped taking chunks | 120 |"""

    reader_timeout_s: float = 3.0
    client_jobs: int = 8
    session_jobs: int = 3
    total_jobs: int = 64
    client_events: int = 4
    max_body_bytes: int = 1 << 20
    probe_bytes_s: float = 48 * 1024
    probe_client_bytes_s: float = 96 * 1024
    probe_total_bytes_s: float = 512 * 1024
    busy_timeout_s: float = BUSY_TIMEOUT_S
    clients: ClientSettings = field(default_factory=ClientSettings)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, queue_size: int | None = None) -> GateSettings:
        env = os.environ if env is None else env
        total = int(env_number(env, "DFLASH_TOTAL_JOBS", cls.total_jobs))
        return cls(
            reader_timeout_s=env_number(env, "DFLASH_READER_TIMEOUT_S", cls.reader_timeout_s),
            client_jobs=int(env_number(env, "DFLASH_CLIENT_JOBS", cls.client_jobs)),
            session_jobs=int(env_number(env, "DFLASH_SESSION_JOBS", cls.session_jobs)),
            total_jobs=min(total, queue_size) if queue_size else total,
            client_events=int(env_number(env, "DFLASH_CLIENT_EVENTS", cls.client_events)),
            max_body_bytes=int(env_number(env, "DFLASH_MAX_BODY_BYTES", cls.max_body_bytes)),
            probe_bytes_s=env_number(env, "DFLASH_READER_PROBE_BYTES_S", cls.probe_bytes_s),
            probe_client_bytes_s=env_number(env, "DFLASH_READER_PROBE_CLIENT_BYTES_S", cls.probe_client_bytes_s),
            probe_total_bytes_s=env_number(env, "DFLASH_READER_PROBE_TOTAL_BYTES_S", cls.probe_total_bytes_s),
            busy_timeout_s=busy_timeout_from_env(env),
            clients=ClientSettings.from_env(env),
        )

    def describe(self) -> dict[str, Any]:
        return {"reader_timeout_s": self.reader_timeout_s, "client_jobs": self.client_jobs,
                "session_jobs": self.session_jobs, "total_jobs": self.total_jobs, "client_events": self.client_events,
                "max_body_bytes": self.max_body_bytes, "busy_timeout_s": self.busy_timeout_s,
                "reader_probe_bytes_s": self.probe_bytes_s, "reader_probe_client_bytes_s": self.probe_client_bytes_s,
                "reader_probe_total_bytes_s": self.probe_total_bytes_s,
                "client_from": "X-Forwarded-For" if self.clients.trusted_proxy_hops else "socket"}  # fmt: skip


@dataclass(frozen=True)
class EngineCalls:
    """The engine's endpoints as Gradio numbers them (a dependency's "id"): the weight of a call of each (the
    generations it runs, asked when the call comes), the API names of those callable over plain HTTP, and every
    function the app has (a join naming another is refused)."""

    weights: Mapping[int, Callable[[], int]]
    api_names: Mapping[str, int] = field(default_factory=dict)
    functions: frozenset[int] = frozenset()


@dataclass
class Call:
    """One admitted engine call, from its POST until its handler ends (or it is cancelled)."""

    id: str
    fn_index: int
    weight: int
    sessionless: bool
    session: str | None  # known at once, or (session-less) from the event id Gradio answers
    client: str  # the client's key (clients.py)
    posted: float
    event_id: str | None = None
    started: bool = False
    engine: bool = True  # an engine call (counted in generations), or a waiting event of another function


@dataclass
class Reader:
    session: str
    sending_since: float | None = None  # a write to the client that has not returned yet


@dataclass(frozen=True)
class Departure:
    """When a session's last reader went, and whether the client hung up (or the server ended the stream)."""

    at: float
    hung_up: bool


class Callers:
    """Engine calls, result-stream readers by session, and the rules that admit and abandon calls (thread-safe:
    handlers ask from Gradio's threads and loop alike)."""

    def __init__(self, settings: GateSettings | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings or GateSettings()
        self._clock = clock
        self._lock = threading.Lock()
        self._calls: dict[str, Call] = {}
        self._readers: dict[str, list[Reader]] = {}
        self._left: dict[str, Departure] = {}  # session -> when (and how) its last reader left
        self._session_of_event: OrderedDict[str, str] = OrderedDict()
        self._taken: OrderedDict[str, None] = OrderedDict()  # calls whose place another client took (_make_room)
        self.padding = PaddingBudget(self.settings.probe_client_bytes_s, self.settings.probe_total_bytes_s)

    # -- admission ---------------------------------------------------------------------------------------------------

    def admit(self, fn_index: int, weight: int, session: str | None, client: str = "") -> Call | str:
        """A new call (session None: session-less) of `client` (its key), or why it is refused. A call over a limit on
        its own (an A/B run of many methods) is let in when nothing else counts against that limit."""
        s = self.settings
        with self._lock:
            live = [c for c in self._calls.values() if c.engine]
            total = sum(c.weight for c in live) + weight
            if total > s.total_jobs and total > weight:
                live = self._make_room(live, total - s.total_jobs, weight, client)
                total = sum(c.weight for c in live) + weight
            if total > s.total_jobs and total > weight:
                return (f"the server has {total - weight} answers queued or running, its limit is {s.total_jobs}: "
                        "retry in a minute")  # fmt: skip
            used = sum(c.weight for c in live if c.client == client)
            if used and used + weight > s.client_jobs:
                return (f"you have {used} answers queued or running (in all your sessions) and this call would add "
                        f"{weight}; the limit is {s.client_jobs} (an A/B run counts as the answers it runs): wait for "
                        "them, or stop them")  # fmt: skip
            if session is not None:
                used = sum(c.weight for c in live if c.session == session)
                if used and used + weight > s.session_jobs:
                    return (f"this session has {used} answers queued or running and this call would add {weight}; "
                            f"the limit is {s.session_jobs} (an A/B run counts as the answers it runs): wait for "
                            "them, or stop them")  # fmt: skip
            call = Call(secrets.token_hex(8), fn_index, weight, session is None, session, client, self._clock())
            self._calls[call.id] = call
            return call

    def _make_room(self, live: list[Call], needed: int, weight: int, client: str) -> list[Call]:
        """Max–min shares of the total: a client with fewer answers gets in by taking places from the client with
        the most (its newest answers are refused, or cut if they run: `taken`), as long as that client keeps more
        than the newcomer will have. Call with the lock held; the calls left."""
        mine = sum(c.weight for c in live if c.client == client) + weight
        while needed > 0:
            held: dict[str, int] = {}
            for c in live:
                held[c.client] = held.get(c.client, 0) + c.weight
            most = max((c for c in held if c != client), key=lambda c: held[c], default=None)
            if most is None:
                break
            # the newest: the latest posted, and of calls posted at one instant the last admitted
            newest = max(reversed([c for c in live if c.client == most]), key=lambda c: c.posted)
            if held[most] - newest.weight < mine:
                break
            del self._calls[newest.id]
            self._taken[newest.id] = None
            while len(self._taken) > REMEMBERED:
                self._taken.popitem(last=False)
            live = [c for c in live if c is not newest]
            needed -= newest.weight
        return live

    def taken(self, call_id: str | None) -> bool:
        """Whether the call's place went to a client with fewer answers (see _make_room)."""
        with self._lock:
            return call_id is not None and call_id in self._taken

    def admit_event(self, fn_index: int, session: str, client: str = "") -> Call | str:
        """A join of one of the page's other queued functions (not an engine call: the page's load, its timer) by
        `client`, or why it is refused: a client may have `client_events` of them waiting, so that no client holds
        more than a small share of Gradio's queue. An event counts until Gradio says it completed (on its session's
        stream), its client withdraws it, its session's reader hangs up, or nobody reads its session for
        `reader_timeout_s` (Gradio runs such events in milliseconds)."""
        limit = self.settings.client_events
        with self._lock:
            now = self._clock()
            for stale in [c for c in self._calls.values() if not c.engine and self._abandoned(c, now)]:
                del self._calls[stale.id]
            used = sum(1 for c in self._calls.values() if not c.engine and c.client == client)
            if used >= limit:
                return (f"you have {used} events of this page waiting in the queue (in all your sessions); the limit "
                        f"is {limit}: wait for them")  # fmt: skip
            call = Call(secrets.token_hex(8), fn_index, 0, False, session, client, now, engine=False)
            self._calls[call.id] = call
            return call

    def completed(self, event_id: str) -> None:
        """Gradio says an event completed (on its session's stream): a waiting event of the page's own frees its
        place (an engine call's handler ends it)."""
        with self._lock:
            for call in [c for c in self._calls.values() if c.event_id == event_id and not c.engine]:
                del self._calls[call.id]

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

    def closed(self, reader: Reader, hung_up: bool = True) -> None:
        """The reader's stream ended: the client hung up, or (`hung_up` False) the server sent the stream's end."""
        with self._lock:
            readers = self._readers.get(reader.session, [])
            if reader not in readers:
                return
            readers.remove(reader)
            if not readers:
                self._readers.pop(reader.session, None)
                now = self._clock()
                self._left[reader.session] = Departure(now, hung_up)
                if not hung_up:
                    return  # the server ended it: the session's waiting calls stay queued in Gradio
                for call in [c for c in self._calls.values()
                             if c.session == reader.session and not c.started and c.posted <= now]:  # fmt: skip
                    del self._calls[call.id]  # Gradio drops a session's waiting events when its reader hangs up

    def running_for(self, session: str) -> bool:
        """Whether an engine call of `session` has started (its answer runs, or waits for the engine)."""
        with self._lock:
            return any(c.session == session and c.started for c in self._calls.values())

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
        if left is not None and left.hung_up and left.at >= call.posted:
            return True  # its reader hung up after the call was made
        return now - max(call.posted, left.at if left else 0.0) > self.settings.reader_timeout_s

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


class AdmissionError(RequestError):
    """A call refused by the limits on queued answers (a route answers it HTTP 429)."""


def excerpt(value: Any, limit: int = EXCERPT_CHARS) -> str:
    """A value as an error quotes it: its repr, cut to `limit` characters."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + f"… ({len(text)} characters)"


def json_depth(value: Any) -> int:
    """How deeply lists and objects nest in a parsed JSON value (without recursion: any depth is measured)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict | list):
            deepest = max(deepest, depth)
            stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


@dataclass(frozen=True)
class Body:
    """A POST body as JSON: `value` (None when it is not JSON at all: Gradio answers that itself) or `problem`, why it
    is refused before anybody parses it further (HTTP 400)."""

    value: Any = None
    problem: str | None = None

    @classmethod
    def parse(cls, body: bytes) -> Body:
        try:
            value = json.loads(body)
        except RecursionError:
            return cls(problem=f"the JSON body is nested too deeply (this server accepts {MAX_DEPTH} levels)")
        except ValueError:
            return cls()
        if json_depth(value) > MAX_DEPTH:
            return cls(problem=f"the JSON body is nested too deeply (this server accepts {MAX_DEPTH} levels)")
        return cls(value)

    def field(self, name: str) -> Any:
        return self.value.get(name) if isinstance(self.value, dict) else None


def missing_values(body: Body, parameters: Sequence[str]) -> str | None:
    """What is wrong with a list-form call body for an endpoint of these parameters, or None (also when it is not
    JSON at all: Gradio answers that itself)."""
    data = body.field("data")
    if not isinstance(data, list) or len(data) == len(parameters):
        return None
    named = f"in this order: {', '.join(parameters)}" if parameters else "none"
    return f"data must hold {len(parameters)} values, {named} (got {len(data)})"


def gradio_int(value: Any) -> int | ValueError | None:
    """An integer field of Gradio's request bodies as Gradio reads it (pydantic's lax mode: "12", 12.0 and 12 are 12),
    None when absent, or the ValueError Gradio's own check would answer (then Gradio refuses the request itself)."""
    try:
        return _OPTIONAL_INT.validate_python(value)
    except ValidationError as error:
        return ValueError(str(error))


def _v1_error(status: int, detail: str) -> dict[str, Any]:
    """A refusal of a /v1 request, in OpenAI's shape (what its clients parse) rather than Gradio's `detail`."""
    code = _V1_CODES.get(status, "invalid_request")
    kind = "rate_limit_error" if status == 429 else "invalid_request_error"
    return ApiError(status, detail, type=kind, code=code).body()


async def _answer(send: Send, status: int, detail: str, scope: Scope | None = None) -> None:
    v1 = scope is not None and _V1.match(scope.get("path", "")) is not None
    payload = json.dumps(_v1_error(status, detail) if v1 else {"detail": detail}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()),
                            (b"connection", b"close")]})  # fmt: skip
    await send({"type": "http.response.body", "body": payload})


def _json_object(body: bytes) -> dict[str, Any]:
    try:
        value = json.loads(body)
    except (ValueError, RecursionError):
        return {}
    return value if isinstance(value, dict) else {}


class HttpGate:
    """The ASGI middleware (see the module doc). `callers` is shared with the service; `engine` names the engine's
    endpoints; `parameters` names each checked API endpoint's parameters (its raw calls and, for endpoints outside
    the queue, its /run route); `checks` says what is wrong with an endpoint's values (a list, in order), or None."""

    def __init__(self, app: ASGIApp, callers: Callers, engine: EngineCalls | None = None,
                 parameters: Mapping[str, Sequence[str]] | None = None,
                 checks: Mapping[str, Callable[[list[Any]], str | None]] | None = None) -> None:  # fmt: skip
        self.app = app
        self.callers = callers
        self.engine = engine
        self.parameters = dict(parameters or {})
        self.checks = dict(checks or {})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope.get("type") != "http":
            await self.app(scope, receive, send)
            return
        path, method = scope.get("path", ""), scope.get("method")
        if method == "GET":
            if match := _RESULT.search(path):
                await self._read(self.callers.session_of_event(match.group(1)), scope, receive, send, call_heartbeat)
            elif _QUEUE_DATA.search(path) and (session := _query(scope, "session_hash")):
                await self._read(session, scope, receive, send, queue_heartbeat)
            else:
                await self.app(scope, receive, send)
            return
        if method != "POST":
            await self.app(scope, receive, send)
            return
        if _UPLOAD.search(path):
            await _answer(send, 413, "uploads are off: this Space takes no files (maximum allowed size: 0 bytes)",
                          scope)  # fmt: skip
            return
        raw = await self._body(scope, receive, send)
        if raw is None:
            return
        body = Body.parse(raw)
        if body.problem is not None:
            await _answer(send, 400, body.problem, scope)
            return
        replay = _replay(raw, receive)
        if _CANCEL.search(path):
            self.callers.withdrawn(body.field("event_id"))
        call_match, run_match = _CALL.search(path), _RUN.search(path)
        named = call_match.group(2) if call_match and not call_match.group(1) else run_match and run_match.group(1)
        if named and (problem := self._values_problem(named, body)):
            await _answer(send, 422, problem, scope)
            return
        engine = self.engine
        if engine is None:
            await self.app(scope, replay, send)
            return
        if call_match:
            fn_index = engine.api_names.get(call_match.group(2))
            session = body.field("session_hash")
            session = session if isinstance(session, str) and session else None  # "" or none: session-less
        elif _JOIN.search(path):
            fn_index = gradio_int(body.field("fn_index"))
            session = body.field("session_hash")
            if isinstance(fn_index, ValueError) or not isinstance(session, str):
                await self.app(scope, replay, send)  # Gradio refuses it (422, 400): nothing runs
                return
            if fn_index is None or (engine.functions and fn_index not in engine.functions):
                await _answer(send, 422, f"fn_index must name one of the app's functions (got "
                                         f"{excerpt(body.field('fn_index'))})")  # fmt: skip
                return
            if not session:
                await _answer(send, 422, "session_hash must be a non-empty string", scope)
                return
        else:
            fn_index = None
        if fn_index is None or (fn_index not in engine.weights and not _JOIN.search(path)):
            await self.app(scope, replay, send)
            return
        client = client_of_scope(scope, self.callers.settings.clients)
        if fn_index in engine.weights:
            call = self.callers.admit(fn_index, engine.weights[fn_index](), session, client.key)
        else:  # a join of another queued function: it holds a place in Gradio's queue too
            call = self.callers.admit_event(fn_index, session, client.key)
        if isinstance(call, str):
            await _answer(send, 429, call, scope)
            return
        scope.setdefault("state", {})[STATE_KEY] = call.id
        await self._queue(call, scope, replay, send)

    def _values_problem(self, name: str, body: Body) -> str | None:
        """What is wrong with a raw call's values of a checked endpoint, or None."""
        if name not in self.parameters:
            return None
        problem = missing_values(body, self.parameters[name])
        data = body.field("data")
        if problem is None and isinstance(data, list) and name in self.checks:
            problem = self.checks[name](data)
        return problem

    async def _body(self, scope: Scope, receive: Receive, send: Send) -> bytes | None:
        """The whole body, or None once a too long one was refused (by its declared length, or as it came)."""
        limit = self.callers.settings.max_body_bytes
        declared = dict(scope.get("headers") or []).get(b"content-length")
        too_long = f"the request body is longer than this server accepts ({limit} bytes)"
        if declared is not None and declared.isdigit() and int(declared) > limit:
            await _answer(send, 413, too_long, scope)
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
                await _answer(send, 413, too_long, scope)
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

    async def _read(self, session: str, scope: Scope, receive: Receive, send: Send,
                    padding: Callable[[int], bytes]) -> None:  # fmt: skip
        """Stream a result to one of `session`'s readers, watching for its hang-up and for writes it does not take."""
        reader = self.callers.opened(session)
        early: list[Message] = []  # what the watcher read before the app asked (a GET's empty body, the hang-up)
        wanted = asyncio.Event()

        async def watch() -> None:
            while True:
                message = await receive()
                early.append(message)
                wanted.set()
                if message["type"] == "http.disconnect":  # also the server's own, once it sent the stream's end
                    self.callers.closed(reader, hung_up=not floor.finished)
                    return

        async def app_receive() -> Message:
            while not early:
                wanted.clear()
                await wanted.wait()
            return early.pop(0) if early[0]["type"] != "http.disconnect" else early[0]

        async def tracked_send(message: Message) -> None:
            if message["type"] == "http.response.body" and b"process_completed" in message.get("body", b""):
                for line in message["body"].split(b"\n"):
                    if b'"process_completed"' in line and (found := _EVENT_ID.search(line)):
                        self.callers.completed(found.group(1).decode())
            self.callers.sending(reader, True)
            try:
                await send(message)
            finally:
                self.callers.sending(reader, False)

        tighten(send)  # small buffers: a client that stops reading is seen within seconds (probes.py)
        client = client_of_scope(scope, self.callers.settings.clients).key
        floor = TrafficFloor(tracked_send, self.callers.settings.probe_bytes_s,
                             lambda: self.callers.running_for(session), padding,
                             partial(self.callers.padding.take, client))  # fmt: skip
        watcher, padder = asyncio.create_task(watch()), asyncio.create_task(floor.run())
        try:
            await self.app(scope, app_receive, floor.send)
        finally:
            watcher.cancel()
            padder.cancel()
            self.callers.closed(reader, hung_up=not floor.finished)



def _query(scope: Scope, name: str) -> str | None:
    values = parse_qs(scope.get("query_string", b"").decode("latin-1")).get(name)
    return values[0] if values and values[0] else None


def _replay(body: bytes, receive: Receive) -> Receive:
    """A `receive` that hands the body on once, then whatever comes (the hang-up)."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def replay() -> Message:
        return pending.pop(0) if pending else await receive()

    return replay
