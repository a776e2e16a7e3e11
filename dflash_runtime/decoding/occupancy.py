"""Requests' streams and the engine's occupancy: who may run now, who steps the engine, and what cancel and close mean.

The contract, which cannot deadlock:
- The engine has `parallel` sequences. A request holds one from its first `next()` until its last event (released
  before that event is returned), an error, `close()`, or garbage collection. A request that finds every sequence
  held waits, in order of arrival, up to the engine's busy timeout; a thread whose own suspended streams hold every
  sequence raises `EngineBusyError` at once (waiting would wait for itself).
- The engine steps every running request at once (steps.py), on the thread of whichever consumer asks for an event
  while no step runs; the others wait for that step's end and find their events queued. A request whose reader is
  a few events behind (request.EVENTS_AHEAD) takes no part in a step: a suspended stream soon costs nothing, and
  keeps its sequence. So a cancel lands at the next step the request takes part in; with other requests running,
  events it made ahead of its reader still come first.
- A cancel belongs to one request: `RequestStream.cancel()` to that stream; `Engine.cancel()` to every stream that
  exists when it is called (started or not), never to one created later. A stream cancelled before its first step
  ends at once with finish_reason "cancelled", without decoding.
- `Engine.close()` returns at once. The native handles are freed when no step is running: right away if the engine
  is idle or its streams are suspended, else by the running step as it ends. A started stream then ends with one
  final "cancelled" event; a stream that never started raises `EngineClosedError`.
- Native work outside requests (`park`, `reset`) takes the stepping role (`native()`), or the whole engine
  (`exclusive()`: no request holds a sequence), under the same timeout.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

from ..errors import EngineBusyError, EngineClosedError
from ..results.events import StreamEvent

CLOSED_MESSAGE = "this engine was closed; open a new one with load_pair(...)"


class Occupancy:
    """Which streams hold the engine's sequences, who steps, and whether the engine is closing. One lock (`cond`)
    guards this object and the flags of every stream; `free` runs once, when the engine is closing and no step is
    running; `step(runs)` runs one engine step for the ready runs, outside the lock."""

    def __init__(self, free: Callable[[], None], busy_timeout_s: float | None, slots: int = 1,
                 step: Callable[[list[Any]], None] | None = None) -> None:
        self.cond = threading.Condition()
        self.holders: list[RequestStream | _Exclusive] = []
        self.slots = slots
        self.stepping = False
        self.closing = False
        self._freed = False
        self._free = free
        self._step = step
        self._arrivals: deque[object] = deque()
        self.busy_timeout_s = busy_timeout_s
        self.streams: weakref.WeakSet[RequestStream] = weakref.WeakSet()

    def enter(self, stream: RequestStream | _Exclusive, *, whole: bool = False) -> None:
        """Take a sequence for `stream` (all of them and no step running for `whole`), in order of arrival."""
        with self.cond:
            if self.closing:
                raise EngineClosedError(CLOSED_MESSAGE)
            me = threading.get_ident()
            if self._full(whole) and self.holders and all(h.thread == me for h in self.holders):
                raise EngineBusyError(
                    "this thread holds a suspended stream of this engine: read it to the end or close() it before "
                    "starting another request"
                )
            ticket = object()
            self._arrivals.append(ticket)
            try:
                admitted = self.cond.wait_for(
                    lambda: self.closing or (self._arrivals[0] is ticket and not self._full(whole)),
                    self.busy_timeout_s)
            finally:
                self._arrivals.remove(ticket)
                self.cond.notify_all()
            if not admitted:
                raise EngineBusyError(f"the engine stayed busy for {self.busy_timeout_s:g} s with other requests")
            if self.closing:
                raise EngineClosedError(CLOSED_MESSAGE)
            self.holders.append(stream)
            stream.holding = True

    def _full(self, whole: bool) -> bool:
        if whole:
            return bool(self.holders) or self.stepping
        return len(self.holders) >= self.slots or any(isinstance(h, _Exclusive) for h in self.holders)

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        """Hold the whole engine for work outside a request (e.g. a reset): no request holds a sequence meanwhile."""
        holder = _Exclusive()
        self.enter(holder, whole=True)
        try:
            yield
        finally:
            with self.cond:
                self.leave(holder)

    @contextlib.contextmanager
    def native(self) -> Iterator[None]:
        """Hold the stepping role for native work outside a request (e.g. parking a state): no step runs meanwhile,
        the requests keep their sequences."""
        with self.cond:
            if self.closing:
                raise EngineClosedError(CLOSED_MESSAGE)
            if not self.cond.wait_for(lambda: not self.stepping or self.closing, self.busy_timeout_s):
                raise EngineBusyError(f"an engine step ran for more than {self.busy_timeout_s:g} s")
            if self.closing:
                raise EngineClosedError(CLOSED_MESSAGE)
            self.stepping = True
        try:
            yield
        finally:
            with self.cond:
                self._end_step()

    def leave(self, stream: RequestStream | _Exclusive) -> None:
        """Called with `cond` held."""
        if stream in self.holders:
            self.holders.remove(stream)
            self.cond.notify_all()
        stream.holding = False
        if self.closing and not self.stepping:
            self._close_holders()

    def next_event(self, stream: RequestStream) -> StreamEvent:
        """The stream's next event: queued by an earlier step, or made by a step this thread runs. Called without
        `cond` held; the stream holds a sequence and its run exists."""
        run = stream.run
        assert run is not None and self._step is not None
        cond = self.cond
        while True:  # a step may leave this run waiting (no token budget left for its prompt this step)
            with cond:
                while True:
                    if run.events or run.error is not None:
                        return self._take(stream)
                    if self.closing or stream.closed_by_engine:
                        raise _Closed
                    if not self.stepping:
                        self.stepping = True
                        runs = [h.run for h in self.holders if isinstance(h, RequestStream) and h.run is not None
                                and h.run.ready and not h.close_requested]
                        break
                    if not cond.wait(self.busy_timeout_s):
                        raise EngineBusyError(f"an engine step ran for more than {self.busy_timeout_s:g} s")
            try:
                self._step(runs)
            finally:
                with cond:
                    self._end_step()

    def _take(self, stream: RequestStream) -> StreamEvent:
        """Called with `cond` held: the run's next event (or its error), the sequence released after the last."""
        run = stream.run
        assert run is not None
        if run.error is not None:
            error, run.error = run.error, None
            stream.done = True
            self.leave(stream)
            raise error
        event = run.events.popleft()
        if event.finish_reason is not None:
            stream.done = True
            self.leave(stream)  # before the caller sees the last event
        return event

    def _end_step(self) -> None:
        """Called with `cond` held, by the thread that stepped."""
        self.stepping = False
        for holder in list(self.holders):
            if isinstance(holder, RequestStream) and holder.close_requested:
                holder.stop_decoding()
                self.leave(holder)
        if self.closing:
            self._close_holders()
        self.cond.notify_all()

    def _close_holders(self) -> None:
        """Called with `cond` held, no step running: end every holder's decoding, free the native handles."""
        for holder in list(self.holders):
            if isinstance(holder, RequestStream):
                holder.stop_decoding()
                holder.closed_by_engine = True
                self.holders.remove(holder)
                holder.holding = False
        if not any(isinstance(h, _Exclusive) for h in self.holders):
            self._free_once()

    def close(self) -> None:
        """Cancel every stream; free now unless a step is running (that step frees when it ends)."""
        with self.cond:
            self.closing = True
            for stream in list(self.streams):
                stream.cancelled.set()
            if not self.stepping:
                self._close_holders()
            self.cond.notify_all()

    def cancel_all(self) -> None:
        with self.cond:
            for stream in list(self.streams):
                stream.cancelled.set()

    def _free_once(self) -> None:
        if not self._freed:
            self._freed = True
            self._free()


class _Closed(Exception):
    """The engine closed under a started stream: it ends with one final event."""


class RequestStream(Iterator[StreamEvent]):
    """An iterator of `StreamEvent`s for one request, with `cancel()` and `close()`.

    `decoding(stream)` builds the request's run (request.Decoding) once the stream holds a sequence; `final(detail)`
    builds the last event of a request that ends without decoding further (cancelled before it started, or the
    engine closed under it)."""

    def __init__(self, occupancy: Occupancy, decoding: Callable[[RequestStream], Any],
                 final: Callable[[str], StreamEvent]) -> None:
        self._occupancy = occupancy
        self._decoding_factory = decoding
        self._final = final
        self.run: Any = None
        self.cancelled = threading.Event()
        self.thread: int | None = None  # the thread that last advanced this stream
        self.holding = False
        self.closed_by_engine = False
        self.close_requested = False
        self.done = False
        with occupancy.cond:
            occupancy.streams.add(self)

    def cancel(self) -> None:
        """Stop this request between two steps (or before its first): it ends with finish_reason "cancelled"."""
        self.cancelled.set()

    def __iter__(self) -> RequestStream:
        return self

    def __next__(self) -> StreamEvent:
        occupancy = self._occupancy
        cond = occupancy.cond
        with cond:
            if self.done:
                raise StopIteration
            if self.closed_by_engine:
                self.done = True
                return self._final("the engine was closed")
            start = not self.holding
            self.thread = threading.get_ident()
        if start:
            if self.cancelled.is_set():
                with cond:
                    self.done = True
                return self._final("cancelled before it started")
            occupancy.enter(self)
            with cond:
                if self.closed_by_engine:  # closed between enter() and here
                    self.done = True
                    return self._final("the engine was closed")
                self.run = self._decoding_factory(self)
        try:
            return occupancy.next_event(self)
        except _Closed:
            with cond:
                self.done = True
                occupancy.leave(self)
            return self._final("the engine was closed")

    def close(self) -> None:
        """Stop the request between steps and release its sequence; idempotent, callable from any thread."""
        occupancy = self._occupancy
        with occupancy.cond:
            if self.done:
                return
            self.cancelled.set()
            self.done = True
            if occupancy.stepping and self.holding:
                self.close_requested = True  # a step may be inside this request: it ends when the step ends
                return
            self.stop_decoding()
            if self.holding:
                occupancy.leave(self)

    def stop_decoding(self) -> None:
        """End the run (its sequence and resources go back); only while no step is inside it."""
        run, self.run = self.run, None
        if run is not None:
            run.release()

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
        self.holding = False
