"""The backend of `python -m dflash_runtime serve`: one loaded engine in this process.

Each answer's blocking event stream runs in a thread of its own and reaches the asyncio side through a queue; the
consumer leaving (the client hung up) cancels the request, which the engine honours between two steps, and the
thread closes the stream. Up to `max_waiting` answers wait for one of the engine's sequences, more are refused (429);
one that waits longer than the engine's busy timeout is refused with 503.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import suppress
from typing import Any

from ..results.events import StreamEvent
from .errors import bad_field, over_limit
from .fields import CHAT, ApiRequest
from .server import Caller, Progress
from .thinking import THINK_OPEN, opens_thinking

EVENT, ERROR, END = "event", "error", "end"


class OpenStreams:
    """How many answers' streams are open (a stream is closed once the engine has ended its request); waitable."""

    def __init__(self) -> None:
        self._count = 0
        self._changed = threading.Condition()

    def opened(self) -> None:
        with self._changed:
            self._count += 1
            self._changed.notify_all()

    def closed(self) -> None:
        with self._changed:
            self._count -= 1
            self._changed.notify_all()

    def count(self) -> int:
        return self._count

    def wait_idle(self, timeout_s: float) -> bool:
        """Whether no stream was open within `timeout_s`."""
        with self._changed:
            return self._changed.wait_for(lambda: self._count == 0, timeout_s)


async def events_in_thread(open_stream: Callable[[], Any], streams: OpenStreams | None = None
                           ) -> AsyncIterator[StreamEvent]:  # fmt: skip
    """The events of `open_stream()` (a RequestStream, opened and read in a thread); leaving the loop cancels it.
    `streams` counts it open until the thread has closed it."""
    streams = streams or OpenStreams()
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
    leaving = threading.Event()
    opened: list[Any] = []
    lock = threading.Lock()

    def hand_over(kind: str, value: Any) -> None:
        with suppress(RuntimeError):  # the loop is closed: nobody reads
            loop.call_soon_threadsafe(queue.put_nowait, (kind, value))

    def pump() -> None:
        try:
            stream = open_stream()
            with lock:
                opened.append(stream)
                if leaving.is_set():
                    stream.cancel()
            with stream as events:
                for event in events:
                    if leaving.is_set():
                        break
                    hand_over(EVENT, event)
        except BaseException as error:
            hand_over(ERROR, error)
        finally:
            streams.closed()
            hand_over(END, None)

    streams.opened()
    threading.Thread(target=pump, name="dflash-openai", daemon=True).start()
    try:
        while True:
            kind, value = await queue.get()
            if kind == EVENT:
                yield value
            elif kind == ERROR:
                raise value
            else:
                return
    finally:
        with lock:
            leaving.set()
            for stream in opened:
                stream.cancel()  # the engine stops at its next step; the thread then closes the stream


class EngineBackend:
    """Answers with `engine` (an Engine), named `model` in the API."""

    def __init__(self, engine: Any, model: str, *, max_waiting: int = 16) -> None:
        self.engine = engine
        self.model = model
        self.max_waiting = max_waiting
        self.defaults = {"temperature": 0.0, "top_p": 1.0, "top_k": 40, "min_p": 0.0, **engine.sampling_defaults()}
        self._admitted = 0
        self.streams = OpenStreams()

    def models(self) -> list[str]:
        return [self.model]

    def _prompt(self, request: ApiRequest) -> tuple[list[int], str]:
        """The prompt's tokens, and the thinking tag its template opened (the answer starts inside it)."""
        engine = self.engine
        if request.kind != CHAT:
            if not request.prompt:
                raise bad_field("prompt", "prompt is empty")
            return engine.tokenize(request.prompt), ""
        messages = [dict(m) for m in request.messages]
        opened = opens_thinking(engine.render_chat(messages, enable_thinking=request.enable_thinking))
        tokens = engine.chat_tokens(messages, enable_thinking=request.enable_thinking)
        return tokens, THINK_OPEN + "\n" if opened else ""

    def _kwargs(self, request: ApiRequest) -> dict[str, Any]:
        max_tokens = request.max_tokens or self.engine.n_ctx  # none asked: until the context is full
        return {**request.sampling(self.defaults), "max_tokens": max_tokens, "seed": request.seed,
                "stop": list(request.stop) or None}  # fmt: skip

    async def answer(self, request: ApiRequest, caller: Caller) -> AsyncIterator[Progress]:
        if self._admitted >= self.engine.parallel + self.max_waiting:
            raise over_limit(f"{self._admitted} answers are running or waiting, the most this server takes: retry "
                             "in a moment")  # fmt: skip
        self._admitted += 1
        try:
            tokens, opened = await asyncio.to_thread(self._prompt, request)
            kwargs = self._kwargs(request)

            def open_stream() -> Iterator[StreamEvent]:
                return self.engine.stream(tokens, **kwargs)

            async for event in events_in_thread(open_stream, self.streams):
                final = event.finish_reason is not None
                stats = event.stats.to_dict() if final else {}
                extra = {"finish_reason": event.finish_reason, "finish_detail": event.finish_detail} if final else None
                yield Progress(opened + event.delta, event.finish_reason, stats, extra)
                opened = ""
        finally:
            self._admitted -= 1
