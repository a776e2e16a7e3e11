"""The HTTP gate: every request passes here before Gradio (plain ASGI). It checks what Gradio would refuse, asks the
policy to admit what queues, and watches each result stream for its reader (docs/public-space.md, "The door")."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import traceback
from collections.abc import Callable, Mapping, Sequence
from contextlib import suppress
from dataclasses import dataclass, field
from typing import Any

from pydantic import TypeAdapter, ValidationError
from starlette.datastructures import QueryParams
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ...openai_api.errors import ApiError
from ...openai_api.server import WRITE_WATCHERS
from .calls import ADMITTED, Calls
from .clients import client_of_scope
from .policy import Call, FairShare, padding_room
from .probes import TrafficFloor, call_heartbeat, comment_heartbeat, queue_heartbeat, tighten

log = logging.getLogger(__name__)

# Every route to a function: a queued call, a page's join, and the direct runs (`run/` and its twin `api/`).
_QUEUED = re.compile(r"/gradio_api/(?:call/(?P<v2>v2/)?(?P<call>[^/]+)|(?:run|api)/(?P<run>[^/]+)"
                     r"|queue/(?P<join>join))/?$")
_RESULT = re.compile(r"/gradio_api/call/(?:v2/)?([^/]+)/([^/]+)/?$")
_ROUTES = {name: re.compile(rf"/gradio_api/{name}/?$") for name in ("queue/data", "upload", "cancel")}
_EVENT_ID = re.compile(rb'"event_id":\s*"([0-9a-f]+)"')
_COMPLETED = re.compile(rb'"msg":\s*"process_completed",\s*"event_id":\s*"([0-9a-f]+)"')  # Gradio's field order
_V1_CODES = {400: "invalid_json", 404: "not_found", 413: "body_too_long", 422: "invalid_value",
             429: "rate_limit_exceeded"}  # fmt: skip
MAX_DEPTH = 32  # JSON nesting a body may have (the API's deepest is 3: data, history, a message)
EXCERPT_CHARS = 60  # of a refused value an error quotes at most
LOGGED_CHARS = 160  # of a refusal's detail its log line keeps
_INT = TypeAdapter(int)  # as Gradio reads an integer field (pydantic's lax mode: "12", 12.0 and 12 are 12)
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


class Refused(Exception):
    def __init__(self, status: int, detail: str) -> None:
        super().__init__(detail)
        self.status, self.detail = status, detail


@dataclass(frozen=True)
class Endpoints:
    """The app's functions as Gradio numbers them: each engine function's weight (the answers a call runs), the public
    API names, each function's inputs' kinds, and the checked endpoints' parameters and value checks."""

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

    def named(self, name: str) -> int:
        if (fn_index := self.api_names.get(name)) is None:
            names = ", ".join(f"/{n}" for n in self.api_names)
            raise Refused(404, f"no endpoint {excerpt('/' + name, 40)} here; this server has {names}")
        return fn_index

    def function(self, body: Any) -> int:
        """The function a body's `fn_index` names, read as Gradio reads it."""
        with suppress(ValidationError):
            if (fn_index := _INT.validate_python(body.get("fn_index"))) in self.inputs:
                return fn_index
        raise Refused(422, f"fn_index must name one of the app's functions (got {excerpt(body.get('fn_index'))})")

    def check(self, fn_index: int, data: Any, values: bool = True) -> None:
        """Refused when a call's values are not what its function takes; without `values`, an API endpoint's values
        are left to its handler (gradio_client reads its refusal as the handler sends it)."""
        if not isinstance(data, list):
            return  # Gradio answers that itself (422)
        name = next((n for n, i in self.api_names.items() if i == fn_index), "")
        expected = tuple(self.parameters.get(name, self.inputs.get(fn_index, ())))  # names, or the inputs' kinds
        if len(data) != len(expected):
            listed = f"in this order: {', '.join(expected)}" if expected else "none"
            named = listed if name in self.parameters else f"one per input of function {fn_index}"
            raise Refused(422, f"data must hold {len(expected)} values, {named} (got {len(data)})")
        if name in self.checks:
            problem = self.checks[name](data) if values else None
        else:
            problem = next((f"data[{index}] must be a {kind}'s value, got {excerpt(value)}"
                            for index, (kind, value) in enumerate(zip(expected, data, strict=True))
                            if kind in KINDS and not KINDS[kind](value)), None)  # fmt: skip
        if problem is not None:
            raise Refused(422, problem)


def excerpt(value: Any, limit: int = EXCERPT_CHARS) -> str:
    """A value as an error quotes it: its repr, cut to `limit` characters."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + f"… ({len(text)} characters)"


def json_body(body: bytes) -> Any:
    """A POST body as JSON, None when it is not JSON (Gradio answers that); Refused when nested too deeply."""
    nested = Refused(400, f"the JSON body is nested too deeply (this server accepts {MAX_DEPTH} levels)")
    try:
        value = json.loads(body)
    except RecursionError:
        raise nested from None
    except ValueError:
        return None
    layer = [value]  # the values at one depth, from the top
    for _ in range(MAX_DEPTH):
        layer = [child for item in layer if isinstance(item, dict | list)
                 for child in (item.values() if isinstance(item, dict) else item)]  # fmt: skip
    if any(isinstance(item, dict | list) for item in layer):
        raise nested
    return value


def call_of(request: Any) -> Call | None:
    """The engine call the gate admitted for a handler's `gr.Request` (None for a call that did not pass it)."""
    scope = getattr(getattr(request, "request", None), "scope", None)
    state = scope.get("state") if isinstance(scope, dict) else None
    return state.get(ADMITTED) if isinstance(state, dict) else None


async def refuse(scope: Scope, receive: Receive, send: Send, status: int, detail: str) -> None:
    """A refusal in its route's shape (/v1: OpenAI's; else Gradio's `detail`), and one bounded log line."""
    path = str(scope.get("path", ""))
    log.info("refused %s %s: %d %s", scope.get("method"), excerpt(path), status, detail[:LOGGED_CHARS])
    if path == "/v1" or path.startswith("/v1/"):
        kind = "rate_limit_error" if status == 429 else "invalid_request_error"
        body = ApiError(status, detail, type=kind, code=_V1_CODES.get(status, "invalid_request")).body()
    else:
        body = {"detail": detail}
    await JSONResponse(body, status, headers={"connection": "close"})(scope, receive, send)


class HttpGate:
    """The ASGI middleware; `calls` is shared with the service, `v1` serves the /v1 routes."""

    def __init__(self, app: ASGIApp, calls: Calls, endpoints: Endpoints | None = None,
                 v1: ASGIApp | None = None) -> None:  # fmt: skip
        self.app, self.calls, self.endpoints, self.v1 = app, calls, endpoints or Endpoints({}), v1

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        method = scope.get("method") if scope.get("type") == "http" else None
        path, started = scope.get("path", ""), False

        async def sent(message: Message) -> None:
            nonlocal started
            started = True
            await send(message)

        try:
            if self.v1 is not None and (path == "/v1" or path.startswith("/v1/")):
                await (self._v1 if method == "POST" else self.v1)(scope, receive, sent)
            else:
                await {"GET": self._get, "POST": self._post}.get(method, self.app)(scope, receive, sent)
        except Refused as refusal:
            await refuse(scope, receive, send, refusal.status, refusal.detail)
        except Exception as error:  # one bounded line, never a traceback a client can make the server write
            where = traceback.extract_tb(error.__traceback__)[-1]
            log.error("failed %s %s: %s at %s:%s: %s", method, excerpt(path), type(error).__name__,
                      where.filename.rsplit("/", 1)[-1], where.lineno, str(error)[:LOGGED_CHARS])  # fmt: skip
            if not started:
                await refuse(scope, receive, send, 500, "the server failed; retry")

    async def _v1(self, scope: Scope, receive: Receive, send: Send) -> None:
        """A /v1 POST: its body bounded, its answer's writes told to its call's reader."""
        assert self.v1 is not None
        _, replay = await self._body(scope, receive)
        watchers = scope.setdefault("state", {}).setdefault(WRITE_WATCHERS, [])
        await self._watched(self.v1, scope, replay, send,
                            lambda busy, _body=b"": [w(busy) for w in watchers], lambda: True, comment_heartbeat)

    async def _get(self, scope: Scope, receive: Receive, send: Send) -> None:
        path, query = scope.get("path", ""), QueryParams(scope.get("query_string", b""))
        if result := _RESULT.search(path):
            name, event_id = result.groups()
            session = self.calls.apply(FairShare.session_of_event, event_id)
            if name not in self.endpoints.api_names or session is None:
                raise Refused(404, f"no event {excerpt(event_id, 40)} of endpoint {excerpt(name, 40)} here")
            await self._read(session, scope, receive, send, event_id)
        elif _ROUTES["queue/data"].search(path) and (session := query.get("session_hash")) is not None:
            self._check_session(session)
            if not self.calls.apply(FairShare.knows, session):
                raise Refused(404, "Session not found.")
            await self._read(session, scope, receive, send)
        else:
            await self.app(scope, receive, send)

    def _check_session(self, session: Any) -> None:
        limit = self.calls.settings.session_hash_chars
        if not isinstance(session, str) or not 0 < len(session) <= limit:
            raise Refused(422, f"session_hash must be a non-empty string of at most {limit} characters")

    async def _post(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if _ROUTES["upload"].search(path):
            raise Refused(413, "uploads are off: this Space takes no files (maximum allowed size: 0 bytes)")
        body, replay = await self._body(scope, receive)
        if _ROUTES["cancel"].search(path) and isinstance(body, dict):
            self.calls.apply(FairShare.withdraw, body.get("event_id"))
        if (call := self._admitted(path, body, scope)) is None:
            await self.app(scope, replay, send)
            return
        scope.setdefault("state", {})[ADMITTED] = call
        status, answer = 0, bytearray()  # Gradio's answer to the call (its first 4 KB)

        async def noting(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body" and len(answer) < 4096:
                answer.extend(message.get("body", b""))
            await send(message)

        found = None  # Gradio refused the call, unless it answers its event id
        try:
            await self.app(scope, replay, noting)
            found = _EVENT_ID.search(bytes(answer)) if status == 200 else None
        finally:
            self.calls.apply(FairShare.queued, call, found.group(1).decode() if found else None)

    def _admitted(self, path: str, body: Any, scope: Scope) -> Call | None:
        """The call a POST queues, admitted; None for one that queues nothing or that Gradio refuses itself. One rule
        for every route: the function is the path's name or `fn_index`, its values and session are checked."""
        if (route := _QUEUED.search(path)) is None:
            return None
        endpoints, name = self.endpoints, route["call"] or (route["run"] if route["run"] != "predict" else None)
        fn_index = endpoints.named(name) if name is not None else None
        if not isinstance(body, dict):
            return None
        fn_index = endpoints.function(body) if fn_index is None else fn_index
        if not route["v2"]:  # gradio_client's join leaves an API endpoint's values to its handler
            endpoints.check(fn_index, body.get("data"), values=not route["join"])
        if not (session := body.get("session_hash")) and route["call"]:
            session = None  # a raw call without one is session-less
        if session is not None or route["join"]:
            self._check_session(session)
        if route["run"]:
            return None  # it queues nothing (Gradio keeps a page's state by its session)
        client = client_of_scope(scope, self.calls.settings.trusted_proxy_hops).key
        weight = endpoints.weights.get(fn_index)
        call = (self.calls.apply(FairShare.admit, client, session, weight()) if weight
                else self.calls.apply(FairShare.admit_event, client, session))  # fmt: skip
        if isinstance(call, str):
            raise Refused(429, call)
        return call

    async def _body(self, scope: Scope, receive: Receive) -> tuple[Any, Receive]:
        """The whole body as `json_body` reads it (Refused once longer than the limit: by its declared length, or as it
        comes), and a `receive` that hands it on once, then whatever comes (the hang-up)."""
        limit = self.calls.settings.max_body_bytes
        declared = dict(scope.get("headers") or []).get(b"content-length", b"")
        too_long = Refused(413, f"the request body is longer than this server accepts ({limit} bytes)")
        if declared.isdigit() and int(declared) > limit:
            raise too_long
        parts: list[bytes] = []
        while (message := await receive())["type"] == "http.request":
            parts.append(message.get("body", b""))
            if sum(map(len, parts)) > limit:
                raise too_long
            if not message.get("more_body"):
                break
        pending = [{"type": "http.request", "body": b"".join(parts), "more_body": False}]

        async def replay() -> Message:
            return pending.pop(0) if pending else await receive()

        return json_body(pending[0]["body"]), replay

    async def _read(self, session: str, scope: Scope, receive: Receive, send: Send,
                    event_id: str | None = None) -> None:  # fmt: skip
        """Stream a result to one of `session`'s readers, watching for its hang-up (the app reads nothing while it
        writes) and for writes it does not take; Gradio's word that an event completed ends its call."""
        calls, inbox = self.calls, asyncio.Queue[Message]()
        reader = calls.apply(FairShare.opened, session)
        floors: list[TrafficFloor] = []  # the stream's, once made: whether the app wrote the stream's end

        async def watch() -> None:
            while (message := await receive())["type"] != "http.disconnect":
                inbox.put_nowait(message)
            inbox.put_nowait(message)  # also the server's own, once it sent the stream's end
            calls.apply(FairShare.closed, reader, hung_up=not (floors and floors[0].finished))

        async def app_receive() -> Message:
            if (message := await inbox.get())["type"] == "http.disconnect":
                inbox.put_nowait(message)  # every later ask gets it too
            return message

        def sending(busy: bool, body: bytes = b"") -> None:
            for found in _COMPLETED.finditer(body):
                calls.apply(FairShare.completed, found.group(1).decode())
            calls.apply(FairShare.sending, reader, busy)

        watcher = asyncio.create_task(watch())
        try:
            await self._watched(self.app, scope, app_receive, send, sending, lambda: calls.apply(
                FairShare.running_for, session), call_heartbeat if event_id else queue_heartbeat, floors.append)
        finally:
            watcher.cancel()
            finished = bool(floors) and floors[0].finished
            calls.apply(FairShare.closed, reader, hung_up=not finished)
            if event_id is not None and finished:
                calls.apply(FairShare.completed, event_id)

    async def _watched(self, app: ASGIApp, scope: Scope, receive: Receive, send: Send,
                       sending: Callable[..., Any], running: Callable[[], bool], heartbeat: Callable[[int], bytes],
                       made: Callable[[TrafficFloor], None] = lambda _floor: None) -> None:  # fmt: skip
        """Run `app` with small buffers and a floor of traffic while `running()` (probes.py), each write told to
        `sending(busy, body)`; `made` gets the floor before the app runs (it tells whether the app wrote its end)."""

        async def told(message: Message) -> None:
            sending(True, message.get("body", b""))
            try:
                await send(message)
            finally:
                sending(False)

        tighten(send)
        calls, settings = self.calls, self.calls.settings
        client = client_of_scope(scope, settings.trusted_proxy_hops).key

        def grant(owed: int, items: int, idle: int, padded: int) -> int:
            return calls.apply(FairShare.padding, client, min(owed, padding_room(settings, items, idle, padded)))

        made(floor := TrafficFloor(told, settings.probe_bytes_s, running, heartbeat, grant))
        padder = asyncio.create_task(floor.run())
        try:
            await app(scope, receive, floor.send)
        finally:
            padder.cancel()
