"""The /v1 routes as an ASGI application over a `Backend` (what answers: one engine, or the Space's service).

A client that hangs up stops its answer: while an answer is prepared (its first token, or the whole of a
non-streamed one) and while it streams, the connection is watched, and its end cancels the backend's iterator, which
stops the engine between two steps. Bodies are bounded before they are parsed. With an API key set, every /v1 route
asks for it (`Authorization: Bearer <key>`), compared in constant time.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import aclosing, suppress
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from ..errors import DFlashError
from . import shapes
from .errors import ApiError, from_runtime, unauthorized, unknown_model
from .fields import CHAT, CHAT_FIELDS, COMPLETION, COMPLETION_FIELDS, ApiRequest, check_request, parse_body
from .thinking import ThinkingSplitter

log = logging.getLogger(__name__)
T = TypeVar("T")
MAX_BODY_BYTES = 1 << 20
# Where a request's scope state keeps the watchers of writes to its connection (its Caller's `on_write`): a server in
# front that writes to the same connection (a stream's padding) tells them too.
WRITE_WATCHERS = "dflash_write_watchers"


@dataclass(frozen=True)
class Progress:
    """What an answer grew by: text, and on its last step the engine's finish reason and statistics (with what the
    backend adds to `dflash_stats`)."""

    delta: str
    finish_reason: str | None = None
    stats: Mapping[str, Any] = field(default_factory=dict)
    extra: Mapping[str, Any] | None = None


@dataclass
class Caller:
    """Who asks: the client's address and headers, and the watchers told when a write to it starts and ends (a
    client that takes no write for long counts as gone where the backend says so)."""

    address: str | None
    headers: Mapping[str, str]
    on_write: list[Callable[[bool], None]] = field(default_factory=list)

    def writing(self, busy: bool) -> None:
        for watcher in self.on_write:
            watcher(busy)


class Backend(Protocol):
    def models(self) -> list[str]:
        """The model ids served; the first is used when a request names none."""
        ...

    def answer(self, request: ApiRequest, caller: Caller) -> AsyncIterator[Progress]:
        """The answer, step by step (a chat's text with the thinking tag the template opened, if any, at its start);
        raises ApiError or DFlashError before its first step for what is wrong. Leaving the loop stops it."""
        ...


class ClientGone(Exception):
    """The client hung up before the answer was ready."""


async def until_hang_up(receive: Receive, work: Awaitable[T]) -> T:
    """`work`'s result, or ClientGone (with `work` cancelled) once the client hangs up first."""

    async def hang_up() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(hang_up())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
            with suppress(asyncio.CancelledError, Exception):
                await task
        watcher.cancel()
        with suppress(asyncio.CancelledError):
            await watcher
    if task.cancelled():
        raise ClientGone
    return task.result()


def error_response(error: ApiError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status)


def sse(data: Any) -> bytes:
    return b"data: " + (data if isinstance(data, bytes) else json.dumps(data).encode()) + b"\n\n"


class EventStream(Response):
    """Server-sent events from chunks, ending with `data: [DONE]`; the client hanging up cancels the chunks. An error
    after the first chunk is sent as an event of its own (`data: {"error": ...}`), as llama-server does."""

    def __init__(self, first: dict[str, Any], chunks: AsyncIterator[dict[str, Any]], caller: Caller) -> None:
        # No Response.__init__: it would declare a content length (of an empty body)
        self.status_code, self.background = 200, None
        self.raw_headers = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
                            (b"x-accel-buffering", b"no")]  # fmt: skip
        self.first, self.chunks, self.caller = first, chunks, caller

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def write(body: bytes, more: bool = True) -> None:
            self.caller.writing(True)
            try:
                await send({"type": "http.response.body", "body": body, "more_body": more})
            finally:
                self.caller.writing(False)

        async def stream() -> None:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            async with aclosing(self.chunks) as chunks:
                await write(sse(self.first))
                try:
                    async for chunk in chunks:
                        await write(sse(chunk))
                except ApiError as error:
                    await write(sse(error.body()))
                except DFlashError as error:
                    await write(sse(from_runtime(error).body()))
            await write(sse(b"[DONE]"), more=False)

        with suppress(ClientGone, OSError):
            await until_hang_up(receive, stream())


class V1Api:
    """The routes, over one backend."""

    def __init__(self, backend: Backend, api_key: str | None = None, max_body_bytes: int = MAX_BODY_BYTES) -> None:
        self.backend = backend
        self.api_key = api_key or None
        self.max_body_bytes = max_body_bytes

    def routes(self) -> list[Route]:
        return [
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/models/{model:path}", self.model, methods=["GET"]),
            Route("/v1/chat/completions", self.chat, methods=["POST"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
        ]

    def app(self) -> Starlette:
        """The /v1 routes on their own, any other /v1 path a 404 in OpenAI's shape."""

        async def not_found(request: Request, _error: Exception) -> Response:
            return error_response(ApiError(404, f"no route {request.method} {request.url.path}", code="not_found"))

        async def wrong_method(request: Request, _error: Exception) -> Response:
            return error_response(ApiError(405, f"{request.url.path} does not take {request.method}",
                                           code="method_not_allowed"))  # fmt: skip

        return Starlette(routes=self.routes(), exception_handlers={404: not_found, 405: wrong_method})

    # -- routes -------------------------------------------------------------------------------------------------

    def _authorized(self, request: Request) -> bool:
        if self.api_key is None:
            return True
        given = request.headers.get("authorization", "")
        scheme, _, key = given.partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(key.strip().encode(), self.api_key.encode())

    async def models(self, request: Request) -> Response:
        if not self._authorized(request):
            return error_response(unauthorized())
        return JSONResponse(shapes.model_list(self.backend.models()))

    async def model(self, request: Request) -> Response:
        if not self._authorized(request):
            return error_response(unauthorized())
        name = request.path_params["model"]
        served = self.backend.models()
        if name not in served:
            return error_response(unknown_model(name, served))
        return JSONResponse(shapes.model_list([name])["data"][0])

    async def chat(self, request: Request) -> Response:
        return await self._answer(request, CHAT)

    async def completions(self, request: Request) -> Response:
        return await self._answer(request, COMPLETION)

    async def _answer(self, request: Request, kind: str) -> Response:
        watchers = request.scope.setdefault("state", {}).setdefault(WRITE_WATCHERS, [])
        caller = Caller(request.client.host if request.client else None, request.headers, watchers)
        try:
            if not self._authorized(request):
                raise unauthorized()
            checked = check_request(parse_body(await self._body(request)), kind)
            served = self.backend.models()
            if checked.model and checked.model not in served:
                raise unknown_model(checked.model, served)
            ids = shapes.ResponseIds.new(checked.model or served[0], chat=kind == CHAT)
            frames = self._frames(ids, checked, caller)
            if checked.stream:
                first = await until_hang_up(request.receive, anext(frames))
                return EventStream(first, frames, caller)
            async with aclosing(frames):
                return JSONResponse(await until_hang_up(request.receive, anext(frames)))
        except ClientGone:
            return Response(status_code=499)  # nobody reads it
        except ApiError as error:
            return error_response(error)
        except DFlashError as error:
            return error_response(from_runtime(error, tuple(CHAT_FIELDS | COMPLETION_FIELDS)))

    async def _body(self, request: Request) -> bytes:
        declared = request.headers.get("content-length")
        too_long = ApiError(413, f"the request body is longer than this server accepts ({self.max_body_bytes} "
                            "bytes)", code="body_too_long")  # fmt: skip
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            raise too_long
        parts, size = [], 0
        async for part in request.stream():
            size += len(part)
            if size > self.max_body_bytes:
                raise too_long
            parts.append(part)
        return b"".join(parts)

    async def _frames(self, ids: shapes.ResponseIds, request: ApiRequest, caller: Caller
                      ) -> AsyncIterator[dict[str, Any]]:  # fmt: skip
        """The response: its chunks when streamed (the first once the answer has started), else one object."""
        chat = request.kind == CHAT
        splitter = ThinkingSplitter() if chat else None
        reasoning: list[str] = []
        content: list[str] = []
        obj = "chat.completion.chunk" if chat else "text_completion"
        usage_slot: dict[str, Any] = {"usage": None} if request.include_usage else {}
        async with aclosing(self.backend.answer(request, caller)) as steps:
            started = False
            async for step in steps:
                if splitter is not None:
                    thought, said = splitter.feed(step.delta)
                    if step.finish_reason is not None:
                        more_thought, more_said = splitter.finish()
                        thought, said = thought + more_thought, said + more_said
                else:
                    thought, said = "", step.delta
                reasoning.append(thought)
                content.append(said)
                if not request.stream:
                    if step.finish_reason is None:
                        continue
                    if chat:
                        yield shapes.chat_response(ids, "".join(reasoning), "".join(content), step.finish_reason,
                                                   step.stats, step.extra)  # fmt: skip
                    else:
                        yield shapes.completion_response(ids, "".join(content), step.finish_reason, step.stats,
                                                         step.extra)  # fmt: skip
                    return
                if chat and not started:
                    yield {**shapes.chat_chunk(ids, {"role": "assistant", "content": ""}), **usage_slot}
                started = True
                if thought:
                    yield {**shapes.chat_chunk(ids, {"reasoning_content": thought}), **usage_slot}
                if said:
                    chunk = shapes.chat_chunk(ids, {"content": said}) if chat else shapes.completion_chunk(ids, said)
                    yield {**chunk, **usage_slot}
                if step.finish_reason is not None:
                    last = shapes.chat_chunk(ids, {}, step.finish_reason) if chat else \
                        shapes.completion_chunk(ids, "", step.finish_reason)  # fmt: skip
                    yield {**shapes.last_chunk(last, step.stats, step.extra), **usage_slot}
                    if request.include_usage:
                        yield shapes.usage_chunk(ids, obj, step.stats)
                    return
        raise ApiError(503, "the answer ended before it finished (the server stopped it); retry",
                       type="server_error", code="answer_dropped")  # fmt: skip
