"""Raw HTTP calls: an ASGI middleware that refuses a call with missing values in words, and stops the answer of a
caller who closes its result stream.

Over plain HTTP a call is two requests: `POST /gradio_api/call/<name>` queues it and answers its event id, then
`GET /gradio_api/call/<name>/<event id>` streams the result. Gradio notices a closed result stream only when it next
writes to it, and then stops a streaming handler but not a one-shot one (/generate), so an answer would run to its
end for nobody. This middleware tags each POST with a caller id (in the request's ASGI `state`, which the handler
reads through `gr.Request`) and links the event id of its response to that id; when the client of the GET closes
the connection before the result is complete, every job of that caller is cancelled at once (the engine stops
between two steps). A POST whose `data` does not hold one value per parameter would fail in Gradio with an error
it does not show (`{"error": null}`); it is answered here, HTTP 422, with the parameters in order.
Gradio-free: plain ASGI.
"""

from __future__ import annotations

import asyncio
import json
import re
import secrets
import threading
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping, MutableMapping, Sequence
from typing import Any

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

STATE_KEY = "dflash_caller"
_CALL = re.compile(r"/gradio_api/call/(v2/)?([^/]+)/?$")
MAX_CHECKED_BODY = 1 << 20  # bodies up to this size are checked for their values; larger ones go through as they are
_RESULT = re.compile(r"/gradio_api/call/(?:v2/)?[^/]+/([0-9a-f]+)/?$")
REMEMBERED = 4096  # event ids (and callers that left) kept: far more than the queue holds


class Callers:
    """Jobs by caller id, event ids by caller id, and the callers that hung up (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._jobs: dict[str, set[Any]] = {}
        self._caller_of_event: OrderedDict[str, str] = OrderedDict()
        self._left: OrderedDict[str, None] = OrderedDict()

    def link(self, event_id: str, caller: str) -> None:
        with self._lock:
            self._caller_of_event[event_id] = caller
            while len(self._caller_of_event) > REMEMBERED:
                self._caller_of_event.popitem(last=False)

    def attach(self, caller: str, job: Any) -> None:
        """`job` (anything with cancel()) now runs for `caller`; cancelled at once if the caller already left."""
        with self._lock:
            left = caller in self._left
            if not left:
                self._jobs.setdefault(caller, set()).add(job)
        if left:
            job.cancel()

    def detach(self, caller: str, job: Any) -> None:
        with self._lock:
            jobs = self._jobs.get(caller)
            if jobs is not None:
                jobs.discard(job)
                if not jobs:
                    del self._jobs[caller]

    def result_stream_closed(self, event_id: str) -> int:
        """The client of `event_id`'s result stream hung up: cancel its caller's jobs; how many were cancelled."""
        with self._lock:
            caller = self._caller_of_event.pop(event_id, None)
            if caller is None:
                return 0
            self._left[caller] = None
            while len(self._left) > REMEMBERED:
                self._left.popitem(last=False)
            jobs = list(self._jobs.pop(caller, ()))
        for job in jobs:
            job.cancel()
        return len(jobs)


def caller_of(request: Any) -> str | None:
    """The caller id the middleware gave a raw HTTP call, from its `gr.Request` (None for other callers)."""
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


class HangUpWatch:
    """The ASGI middleware (see the module doc); `callers` is shared with the service, `parameters` names each
    checked endpoint's parameters in order."""

    def __init__(self, app: ASGIApp, callers: Callers, parameters: Mapping[str, Sequence[str]] | None = None) -> None:
        self.app = app
        self.callers = callers
        self.parameters = dict(parameters or {})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope.get("type") != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        if scope.get("method") == "POST" and (match := _CALL.search(path)):
            if not match.group(1) and match.group(2) in self.parameters:
                receive = await self._checked(self.parameters[match.group(2)], receive, send)
                if receive is None:
                    return
            await self._queued(scope, receive, send)
        elif scope.get("method") == "GET" and (match := _RESULT.search(path)):
            await self._streamed(match.group(1), scope, receive, send)
        else:
            await self.app(scope, receive, send)

    @staticmethod
    async def _checked(parameters: Sequence[str], receive: Receive, send: Send) -> Receive | None:
        """Read the body; refuse it (None) if values are missing, else a `receive` that hands it on unchanged."""
        messages: list[Message] = []
        size = 0
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                break
            size += len(message.get("body", b""))
            if not message.get("more_body") or size > MAX_CHECKED_BODY:
                break
        complete = messages[-1]["type"] == "http.request" and not messages[-1].get("more_body")
        problem = missing_values(b"".join(m.get("body", b"") for m in messages), parameters) if complete else None
        if problem is not None:
            payload = json.dumps({"detail": problem}).encode()
            await send({"type": "http.response.start", "status": 422,
                        "headers": [(b"content-type", b"application/json"),
                                    (b"content-length", str(len(payload)).encode())]})  # fmt: skip
            await send({"type": "http.response.body", "body": payload})
            return None

        async def replay() -> Message:
            return messages.pop(0) if messages else await receive()

        return replay

    async def _queued(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Tag the call with a caller id and link the event id Gradio answers with to it."""
        caller = secrets.token_hex(16)
        state = scope.setdefault("state", {})
        state[STATE_KEY] = caller
        body = bytearray()

        async def send_and_link(message: Message) -> None:
            if message["type"] == "http.response.body" and len(body) < 4096:
                body.extend(message.get("body", b""))
                if not message.get("more_body"):
                    try:
                        event_id = json.loads(bytes(body)).get("event_id")
                    except (ValueError, AttributeError):
                        event_id = None
                    if isinstance(event_id, str):
                        self.callers.link(event_id, caller)
            await send(message)

        await self.app(scope, receive, send_and_link)

    async def _streamed(self, event_id: str, scope: Scope, receive: Receive, send: Send) -> None:
        """Stream the result; a disconnect before its last byte cancels the caller's jobs."""
        complete = asyncio.Event()
        early: list[Message] = []  # what the watcher read before the app asked (a GET's empty body)
        wanted = asyncio.Event()

        async def watch() -> None:
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    if not complete.is_set():
                        self.callers.result_stream_closed(event_id)
                    early.append(message)
                    wanted.set()
                    return
                early.append(message)
                wanted.set()

        async def app_receive() -> Message:
            while not early:
                wanted.clear()
                await wanted.wait()
            return early.pop(0) if early[0]["type"] != "http.disconnect" else early[0]

        async def app_send(message: Message) -> None:
            if message["type"] == "http.response.body" and not message.get("more_body"):
                complete.set()
            await send(message)

        watcher = asyncio.create_task(watch())
        try:
            await self.app(scope, app_receive, app_send)
        finally:
            watcher.cancel()
