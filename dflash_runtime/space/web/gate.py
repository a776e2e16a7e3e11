"""The HTTP gate: every request passes here before Gradio (plain ASGI, Gradio-free). It parses and asks the policy
(calls.py): bodies bounded before anything parses them, every route's values checked as Gradio would refuse them,
each refusal a 4xx in its route's own shape with one bounded log line, engine calls and the page's other events
admitted by client, and each result stream watched for its reader (docs/public-space.md, "The door")."""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import Awaitable, Callable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs

from pydantic import TypeAdapter, ValidationError

from ...openai_api.errors import ApiError
from ...openai_api.server import WRITE_WATCHERS
from .calls import ADMITTED, Calls
from .clients import client_of_scope
from .policy import Call, FairShare, padding_room
from .probes import TrafficFloor, call_heartbeat, comment_heartbeat, queue_heartbeat, tighten

log = logging.getLogger(__name__)
Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

_CALL = re.compile(r"/gradio_api/call/(v2/)?([^/]+)/?$")
_RESULT = re.compile(r"/gradio_api/call/(?:v2/)?([^/]+)/([^/]+)/?$")
_ROUTES = {name: re.compile(rf"/gradio_api/{name}/?$") for name in ("queue/join", "queue/data", "upload", "cancel")}
_RUN = re.compile(r"/gradio_api/run/([^/]+)/?$")
_EVENT_ID = re.compile(rb'"event_id":\s*"([0-9a-f]+)"')
_COMPLETED = re.compile(rb'"msg":\s*"process_completed",\s*"event_id":\s*"([0-9a-f]+)"')  # Gradio's field order
_V1_CODES = {400: "invalid_json", 404: "not_found", 413: "body_too_long", 422: "invalid_value",
             429: "rate_limit_exceeded"}  # fmt: skip
MAX_DEPTH = 32  # JSON nesting a body may have (the API's deepest is 3: data, history, a message)
EXCERPT_CHARS = 60  # of a refused value an error quotes at most
LOGGED_CHARS = 160  # of a refusal's detail its log line keeps
_OPTIONAL_INT = TypeAdapter(int | None)
# What a page function's input of each kind may be sent (Gradio fails on anything else with `error: null`).
KINDS: dict[str, Callable[[Any], bool]] = {
    "slider": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
    "number": lambda v: v is None or (isinstance(v, int | float) and not isinstance(v, bool)),
    "checkbox": lambda v: isinstance(v, bool),
    "textbox": lambda v: v is None or isinstance(v, str),
    "dropdown": lambda v: v is None or isinstance(v, str | int | float | list),
    "checkboxgroup": lambda v: v is None or isinstance(v, list),
    "chatbot": lambda v: v is None or isinstance(v, list),
}


@dataclass(frozen=True)
class Endpoints:
    """The app's functions as Gradio numbers them (a dependency's "id"): each engine function's weight (the answers a
    call runs, asked when the call comes), the API names callable over plain HTTP, each function's inputs' kinds,
    and the checked API endpoints' parameters and value checks (what is wrong with a list of values, or None)."""

    weights: Mapping[int, Callable[[], int]]
    api_names: Mapping[str, int] = field(default_factory=dict)
    inputs: Mapping[int, tuple[str, ...]] = field(default_factory=dict)
    parameters: Mapping[str, Sequence[str]] = field(default_factory=dict)
    checks: Mapping[str, Callable[[list[Any]], str | None]] = field(default_factory=dict)

    @classmethod
    def of(cls, config: Mapping[str, Any], weights: Mapping[int, Callable[[], int]], **checked: Any) -> Endpoints:
        """From a Blocks' config (its dependencies and components)."""
        kinds = {c["id"]: c.get("type", "") for c in config.get("components", [])}
        dependencies = config.get("dependencies", [])
        public = {d["api_name"]: d["id"] for d in dependencies
                  if d.get("api_name") and d.get("api_visibility", "public") == "public"}  # fmt: skip
        inputs = {d["id"]: tuple(kinds.get(i, "") for i in d.get("inputs", [])) for d in dependencies}
        return cls(weights, public, inputs, **checked)

    def problem(self, fn_index: int, data: Any, name: str | None = None, values: bool = True) -> str | None:
        """What is wrong with a call's values (a list of one value per input), or None; without `values`, an API
        endpoint's values are left to its handler (gradio_client reads its refusal as the handler sends it)."""
        if not isinstance(data, list):
            return None  # Gradio answers that itself (422)
        name = name or next((n for n, i in self.api_names.items() if i == fn_index), "")
        if name in self.parameters:
            expected = tuple(self.parameters[name])
            named = f"in this order: {', '.join(expected)}" if expected else "none"
        else:
            expected, named = self.inputs.get(fn_index, ()), f"one per input of function {fn_index}"
        if len(data) != len(expected):
            return f"data must hold {len(expected)} values, {named} (got {len(data)})"
        if name in self.checks:
            return self.checks[name](data) if values else None
        for index, (kind, value) in enumerate(zip(expected, data, strict=True)):
            if kind in KINDS and not KINDS[kind](value):
                return f"data[{index}] must be a {kind}'s value, got {excerpt(value)}"
        return None


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
    """A POST body as JSON: `value` (None when it is not JSON: Gradio answers that) or `problem` (HTTP 400)."""

    value: Any = None
    problem: str | None = None

    @classmethod
    def parse(cls, body: bytes) -> Body:
        nested = f"the JSON body is nested too deeply (this server accepts {MAX_DEPTH} levels)"
        try:
            value = json.loads(body)
        except RecursionError:
            return cls(problem=nested)
        except ValueError:
            return cls()
        return cls(problem=nested) if json_depth(value) > MAX_DEPTH else cls(value)

    def field(self, name: str) -> Any:
        return self.value.get(name) if isinstance(self.value, dict) else None


def gradio_int(value: Any) -> int | ValueError | None:
    """An integer field as Gradio reads it (pydantic's lax mode: "12", 12.0 and 12 are 12), None when absent, or
    the ValueError Gradio's own check would answer (then Gradio refuses the request itself)."""
    try:
        return _OPTIONAL_INT.validate_python(value)
    except ValidationError as error:
        return ValueError(str(error))


def call_of(request: Any) -> Call | None:
    """The engine call the gate admitted for a handler's `gr.Request` (None for a call that did not pass it)."""
    scope = getattr(getattr(request, "request", None), "scope", None)
    state = scope.get("state") if isinstance(scope, dict) else None
    return state.get(ADMITTED) if isinstance(state, dict) else None


class Refused(Exception):
    def __init__(self, status: int, detail: str) -> None:
        super().__init__(detail)
        self.status, self.detail = status, detail


async def refuse(send: Send, scope: Scope, status: int, detail: str) -> None:
    """A refusal in its route's shape (/v1: OpenAI's; else Gradio's `detail`), and one bounded log line."""
    path = str(scope.get("path", ""))
    log.info("refused %s %s: %d %s", scope.get("method"), excerpt(path), status, detail[:LOGGED_CHARS])
    if path == "/v1" or path.startswith("/v1/"):
        kind = "rate_limit_error" if status == 429 else "invalid_request_error"
        body = ApiError(status, detail, type=kind, code=_V1_CODES.get(status, "invalid_request")).body()
    else:
        body = {"detail": detail}
    payload = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()),
                            (b"connection", b"close")]})  # fmt: skip
    await send({"type": "http.response.body", "body": payload})


class HttpGate:
    """The ASGI middleware (see the module doc); `calls` is shared with the service, `v1` serves the /v1 routes."""

    def __init__(self, app: ASGIApp, calls: Calls, endpoints: Endpoints | None = None,
                 v1: ASGIApp | None = None) -> None:  # fmt: skip
        self.app, self.calls, self.endpoints, self.v1 = app, calls, endpoints or Endpoints({}), v1
        self.settings = calls.settings

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        method = scope.get("method") if scope.get("type") == "http" else None
        path, started = scope.get("path", ""), False

        async def sent(message: Message) -> None:
            nonlocal started
            started = True
            await send(message)

        try:
            if self.v1 is not None and (path == "/v1" or path.startswith("/v1/")):
                await self._v1(scope, receive, sent)
            elif method == "GET":
                await self._get(scope, receive, sent)
            elif method == "POST":
                await self._post(scope, receive, sent)
            else:
                await self.app(scope, receive, sent)
        except Refused as refusal:
            await refuse(send, scope, refusal.status, refusal.detail)
        except Exception as error:  # one bounded line, never a traceback a client can make the server write
            where = error.__traceback__
            while where is not None and where.tb_next is not None:
                where = where.tb_next
            origin = f"{where.tb_frame.f_code.co_filename.rsplit('/', 1)[-1]}:{where.tb_lineno}" if where else "?"
            log.error("failed %s %s: %s at %s: %s", method, excerpt(path), type(error).__name__, origin,
                      str(error)[:LOGGED_CHARS])  # fmt: skip
            if not started:
                await refuse(send, scope, 500, "the server failed; retry")

    async def _v1(self, scope: Scope, receive: Receive, send: Send) -> None:
        """A /v1 request: its body bounded, its answer's writes told to its call's reader (the backend opens it)."""
        assert self.v1 is not None
        if scope.get("method") != "POST":
            await self.v1(scope, receive, send)
            return
        raw = await self._body(scope, receive)
        if (body := Body.parse(raw)).problem is not None:
            raise Refused(400, body.problem)
        watchers = scope.setdefault("state", {}).setdefault(WRITE_WATCHERS, [])
        await self._watched(self.v1, scope, _replay(raw, receive), send,
                            lambda busy, _body=b"": [w(busy) for w in watchers], lambda: True, comment_heartbeat)

    async def _get(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if result := _RESULT.search(path):
            name, event_id = result.groups()
            session = self.calls.apply(FairShare.session_of_event, event_id)
            if name not in self.endpoints.api_names or session is None:
                raise Refused(404, f"no event {excerpt(event_id, 40)} of endpoint {excerpt(name, 40)} here")
            await self._read(session, scope, receive, send, event_id)
        elif _ROUTES["queue/data"].search(path) and (session := _query(scope, "session_hash")) is not None:
            self._check_session(session)
            if not self.calls.apply(FairShare.knows, session):
                raise Refused(404, "Session not found.")
            await self._read(session, scope, receive, send)
        else:
            await self.app(scope, receive, send)

    def _check_session(self, session: Any) -> None:
        if not isinstance(session, str) or not session:
            raise Refused(422, "session_hash must be a non-empty string")
        if len(session) > self.settings.session_hash_chars:
            raise Refused(422, f"session_hash must be at most {self.settings.session_hash_chars} characters")

    async def _post(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if _ROUTES["upload"].search(path):
            raise Refused(413, "uploads are off: this Space takes no files (maximum allowed size: 0 bytes)")
        raw = await self._body(scope, receive)
        body = Body.parse(raw)
        if body.problem is not None:
            raise Refused(400, body.problem)
        replay = _replay(raw, receive)
        if _ROUTES["cancel"].search(path):
            self.calls.apply(FairShare.withdraw, body.field("event_id"))
        call = self._admitted(path, body, scope)
        if call is None:
            await self.app(scope, replay, send)
            return
        scope.setdefault("state", {})[ADMITTED] = call
        await self._queue(call, scope, replay, send)

    def _admitted(self, path: str, body: Body, scope: Scope) -> Call | None:
        """The call a POST queues, admitted (Refused when its values or a limit refuse it); None for a request that
        queues nothing (or that Gradio refuses itself)."""
        endpoints = self.endpoints
        if called := _CALL.search(path):
            fn_index = self._named(called.group(2), body, versioned=bool(called.group(1)))
            session = body.field("session_hash") or None  # "" or none: session-less
            if session is not None:
                self._check_session(session)
        elif run := _RUN.search(path):
            if run.group(1) != "predict":
                self._named(run.group(1), body)
            elif (fn := gradio_int(body.field("fn_index"))) is None or isinstance(fn, int):
                self._function(fn, body)
                if body.field("session_hash") is not None:  # Gradio keeps a page's state by it
                    self._check_session(body.field("session_hash"))
            return None
        elif _ROUTES["queue/join"].search(path):
            fn_index, session = gradio_int(body.field("fn_index")), body.field("session_hash")
            if isinstance(fn_index, ValueError) or session is None:
                return None  # Gradio refuses it (422)
            self._function(fn_index, body, values=False)  # gradio_client's route
            self._check_session(session)
        else:
            return None
        if body.value is None:
            return None  # not JSON: Gradio refuses it (422)
        client = client_of_scope(scope, self.settings).key
        weight = endpoints.weights.get(fn_index)
        call = (self.calls.apply(FairShare.admit, client, session, weight()) if weight
                else self.calls.apply(FairShare.admit_event, client, session))  # fmt: skip
        if isinstance(call, str):
            raise Refused(429, call)
        return call

    def _named(self, name: str, body: Body, versioned: bool = False) -> int:
        fn_index = self.endpoints.api_names.get(name)
        if fn_index is None:
            names = ", ".join(f"/{n}" for n in self.endpoints.api_names)
            raise Refused(404, f"no endpoint {excerpt('/' + name, 40)} here; this server has {names}")
        if not versioned and (problem := self.endpoints.problem(fn_index, body.field("data"), name)):
            raise Refused(422, problem)
        return fn_index

    def _function(self, fn_index: int | None, body: Body, values: bool = True) -> None:
        if fn_index is None or fn_index not in self.endpoints.inputs:
            raise Refused(422, f"fn_index must name one of the app's functions (got {excerpt(body.field('fn_index'))})")
        if problem := self.endpoints.problem(fn_index, body.field("data"), values=values):
            raise Refused(422, problem)

    async def _body(self, scope: Scope, receive: Receive) -> bytes:
        """The whole body (Refused once it is longer than the limit: by its declared length, or as it comes)."""
        limit = self.settings.max_body_bytes
        declared = dict(scope.get("headers") or []).get(b"content-length")
        too_long = Refused(413, f"the request body is longer than this server accepts ({limit} bytes)")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise too_long
        parts: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return b"".join(parts)
            parts.append(message.get("body", b""))
            size += len(parts[-1])
            if size > limit:
                raise too_long
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
            found = _EVENT_ID.search(bytes(answer)) if status == 200 else None
            event_id = found.group(1).decode() if found else None
        finally:
            self.calls.apply(FairShare.queued, call, event_id)

    async def _read(self, session: str, scope: Scope, receive: Receive, send: Send,
                    event_id: str | None = None) -> None:  # fmt: skip
        """Stream a result to one of `session`'s readers, watching for its hang-up and for writes it does not take;
        Gradio's word that an event completed ends its call."""
        calls, early, wanted = self.calls, [], asyncio.Event()
        reader = calls.apply(FairShare.opened, session)
        floor: TrafficFloor | None = None

        async def watch() -> None:  # what it reads before the app asks: a GET's empty body, the hang-up
            while (message := await receive())["type"] != "http.disconnect":
                early.append(message)
                wanted.set()
            early.append(message)  # also the server's own, once it sent the stream's end
            wanted.set()
            calls.apply(FairShare.closed, reader, hung_up=floor is None or not floor.finished)

        async def app_receive() -> Message:
            while not early:
                wanted.clear()
                await wanted.wait()
            return early.pop(0) if early[0]["type"] != "http.disconnect" else early[0]

        def sending(busy: bool, body: bytes = b"") -> None:
            for found in _COMPLETED.finditer(body) if busy else ():
                calls.apply(FairShare.completed, found.group(1).decode())
            calls.apply(FairShare.sending, reader, busy)

        watcher = asyncio.create_task(watch())
        try:
            floor = await self._watched(self.app, scope, app_receive, send, sending, lambda: calls.apply(
                FairShare.running_for, session), call_heartbeat if event_id else queue_heartbeat)
        finally:
            watcher.cancel()
            calls.apply(FairShare.closed, reader, hung_up=floor is None or not floor.finished)
            if event_id is not None and floor is not None and floor.finished:
                calls.apply(FairShare.completed, event_id)

    async def _watched(self, app: ASGIApp, scope: Scope, receive: Receive, send: Send,
                       sending: Callable[..., Any], running: Callable[[], bool],
                       heartbeat: Callable[[int], bytes]) -> TrafficFloor:  # fmt: skip
        """Run `app` with small buffers under its stream and a floor of traffic while `running()` (probes.py), each
        write told to `sending(busy, body)`; the floor, once the app is done."""

        async def told(message: Message) -> None:
            sending(True, message.get("body", b""))
            try:
                await send(message)
            finally:
                sending(False)

        tighten(send)
        client, calls, settings = client_of_scope(scope, self.settings).key, self.calls, self.settings
        def grant(owed: int, items: int, idle: int, padded: int) -> int:
            return calls.apply(FairShare.padding, client, min(owed, padding_room(settings, items, idle, padded)))

        floor = TrafficFloor(told, settings.probe_bytes_s, running, heartbeat, grant)
        padder = asyncio.create_task(floor.run())
        try:
            await app(scope, receive, floor.send)
        finally:
            padder.cancel()
        return floor


def _query(scope: Scope, name: str) -> str | None:
    values = parse_qs(scope.get("query_string", b"").decode("latin-1"), keep_blank_values=True).get(name)
    return values[0] if values else None


def _replay(body: bytes, receive: Receive) -> Receive:
    """A `receive` that hands the body on once, then whatever comes (the hang-up)."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def replay() -> Message:
        return pending.pop(0) if pending else await receive()

    return replay
