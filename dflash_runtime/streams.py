"""A request's stream and the engine's occupancy: who may decode now, and what cancel and close mean.

The contract, which cannot deadlock:
- A request holds the engine from its first `next()` until its last event (released before that event is
  returned), an error, `close()`, or garbage collection.
- A cancel belongs to one request: `RequestStream.cancel()` to that stream; `Engine.cancel()` to every stream that
  exists when it is called (started or not), never to one created later. A stream cancelled before its first step
  ends at once with finish_reason "cancelled", without decoding.
- Starting a request while the same thread holds a suspended stream of the engine raises `EngineBusyError` at once
  (waiting would wait for itself); another thread waits for the engine, up to the engine's busy timeout.
- `Engine.close()` returns at once. The native handles are freed when no step is running: right away if the engine
  is idle or its stream is suspended, else by the running step as it ends. A started stream then ends with one
  final "cancelled" event; a stream that never started raises `EngineClosedError`.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

from .errors import EngineBusyError, EngineClosedError
from .results import StreamEvent

CLOSED_MESSAGE = "this engine was closed; open a new one with load_pair(...)"


class Occupancy:
    """Which stream holds the engine, and whether the engine is closing. One lock (`cond`) guards this object and
    the flags of every stream; `free` runs once, when the engine is closing and no step is running."""

    def __init__(self, free: Callable[[], None], busy_timeout_s: float | None) -> None:
        self.cond = threading.Condition()
        self.holder: RequestStream | None = None
        self.closing = False
        self._freed = False
        self._free = free
        self.busy_timeout_s = busy_timeout_s
        self.streams: weakref.WeakSet[RequestStream] = weakref.WeakSet()

    def enter(self, stream: RequestStream) -> None:
        with self.cond:
            if self.closing:
                raise EngineClosedError(CLOSED_MESSAGE)
            holder = self.holder
            if holder is not None and holder.thread == threading.get_ident():
                raise EngineBusyError(
                    "this thread holds a suspended stream of this engine: read it to the end or close() it before "
                    "starting another request"
                )
            if not self.cond.wait_for(lambda: self.holder is None or self.closing, self.busy_timeout_s):
                raise EngineBusyError(f"the engine stayed busy for {self.busy_timeout_s:g} s with another request")
            if self.closing:
                raise EngineClosedError(CLOSED_MESSAGE)
            self.holder = stream
            stream.holding = True

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        """Hold the engine for work outside a request (e.g. a reset), under the same rules as a request."""
        holder = _Exclusive()
        self.enter(holder)  # type: ignore[arg-type]
        try:
            yield
        finally:
            with self.cond:
                self.leave(holder)  # type: ignore[arg-type]

    def leave(self, stream: RequestStream) -> None:
        """Called with `cond` held."""
        if self.holder is stream:
            self.holder = None
            self.cond.notify_all()
        stream.holding = False
        if self.closing and self.holder is None:
            self._free_once()

    def close(self) -> None:
        """Cancel every stream; free now unless a step is running (that step frees when it ends)."""
        with self.cond:
            self.closing = True
            for stream in list(self.streams):
                stream.cancelled.set()
            holder = self.holder
            if holder is not None and not holder.running:
                holder.stop_decoding()  # suspended: nothing runs inside its decoding, so close it here
                holder.closed_by_engine = True
                self.leave(holder)
            if self.holder is None:
                self._free_once()
            self.cond.notify_all()

    def cancel_all(self) -> None:
        with self.cond:
            for stream in list(self.streams):
                stream.cancelled.set()

    def _free_once(self) -> None:
        if not self._freed:
            self._freed = True
            self._free()


class RequestStream(Iterator[StreamEvent]):
    """An iterator of `StreamEvent`s for one request, with `cancel()` and `close()`.

    `decoding` builds the request's decoding generator (run while the stream holds the engine); `final(detail)`
    builds the last event of a request that ends without decoding further (cancelled before it started, or the
    engine closed under it); `on_error()` runs when the decoding raised."""

    def __init__(self, occupancy: Occupancy, decoding: Callable[[RequestStream], Iterator[StreamEvent]],
                 final: Callable[[str], StreamEvent], on_error: Callable[[], None]) -> None:
        self._occupancy = occupancy
        self._decoding_factory = decoding
        self._final = final
        self._on_error = on_error
        self._decoding: Iterator[StreamEvent] | None = None
        self.cancelled = threading.Event()
        self.thread: int | None = None  # the thread that last advanced this stream
        self.running = False
        self.holding = False
        self.closed_by_engine = False
        self._done = False
        self._close_requested = False
        with occupancy.cond:
            occupancy.streams.add(self)

    def cancel(self) -> None:
        """Stop this request between two steps (or before its first): it ends with finish_reason "cancelled"."""
        self.cancelled.set()

    def __iter__(self) -> RequestStream:
        return self

    def __next__(self) -> StreamEvent:
        cond = self._occupancy.cond
        with cond:
            if self._done:
                raise StopIteration
            if self.closed_by_engine:
                self._done = True
                return self._final("the engine was closed")
            start = not self.holding
        if start:
            if self.cancelled.is_set():
                with cond:
                    self._done = True
                return self._final("cancelled before it started")
            self._occupancy.enter(self)
        with cond:
            if self.closed_by_engine:  # closed between enter() and here
                self._done = True
                return self._final("the engine was closed")
            self.running, self.thread = True, threading.get_ident()
            if self._decoding is None:
                self._decoding = self._decoding_factory(self)
        try:
            event = next(self._decoding)
        except BaseException as error:
            with cond:
                self.running = False
                self._done = True
                if not isinstance(error, StopIteration):
                    self._on_error()  # the caches may hold a half-done step: start the next request clean
                self._occupancy.leave(self)
            raise
        with cond:
            self.running = False
            if event.finish_reason is not None or self._close_requested:
                self._done = True
                if self._close_requested:
                    self.stop_decoding()
                self._occupancy.leave(self)  # before the caller sees the last event
        return event

    def close(self) -> None:
        """Stop the request between steps and release the engine; idempotent, callable from any thread."""
        with self._occupancy.cond:
            if self._done:
                return
            self.cancelled.set()
            if self.running:  # another thread is inside a step: it closes when the step ends
                self._close_requested = True
                return
            self._done = True
            self.stop_decoding()
            if self.holding:
                self._occupancy.leave(self)

    def stop_decoding(self) -> None:
        """Close the decoding generator (its cleanup runs here); only while no step is running."""
        decoding, self._decoding = self._decoding, None
        if decoding is not None and hasattr(decoding, "close"):
            decoding.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # a finalizer must not raise
            self.close()

    def __enter__(self) -> RequestStream:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class _Exclusive:
    """The holder of an exclusive section: it runs from start to end in the thread that entered it."""

    def __init__(self) -> None:
        self.thread = threading.get_ident()
        self.running = True
        self.holding = False
