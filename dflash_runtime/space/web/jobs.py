"""One GPU call as a job of the web process: the blocking chunk stream runs in a thread of its own and reaches an
asyncio consumer (a Gradio event handler); the consumer leaving cancels it. The job takes its seat on the engine
from the policy (calls.Calls.seat: clients in turn, one answer per conversation at a time), gives it up when asked
to (its answer resumes exactly: Resumable), and stops at its next chunk when nobody reads its call any more or its
consumer takes no chunk for `orphan_timeout_s`. A seat is held until its stream's close returns (on ZeroGPU: the
worker has stopped)."""

from __future__ import annotations

import asyncio
import contextvars
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any, Generic, Protocol, TypeVar

from .calls import Calls
from .policy import Call, FairShare

log = logging.getLogger(__name__)

T = TypeVar("T")
CHUNK, ERROR, END = "chunk", "error", "end"


class Resumable(Protocol[T]):
    """How a job's answer comes back after it yielded its turn: it sees every chunk handed over, and `rest()` opens
    the stream of the rest of the answer (exactly what the answer would have gone on with), or None when it cannot."""

    def seen(self, chunk: T) -> None: ...

    def rest(self) -> Callable[[], Iterator[T]] | None: ...


class ReplyJob(Generic[T]):
    """Runs `open_stream()` (a blocking iterator of chunks) in a thread and yields its chunks to one async consumer."""

    def __init__(self, open_stream: Callable[[], Iterator[T]], calls: Calls, call: Call, *,
                 is_final: Callable[[T], bool] = lambda _chunk: False, fold: Callable[[T, T], T] | None = None,
                 orphan_timeout_s: float = 120.0, owner: str | None = None,
                 resumable: Resumable[T] | None = None) -> None:  # fmt: skip
        self._open_stream = open_stream
        self._calls, self._call = calls, call
        self._owner = owner  # the conversation it answers (its cache owner): one answer of it runs at a time
        self._resumable = resumable  # how its answer comes back after it yielded its turn
        self._is_final = is_final
        self._fold = fold
        self._orphan_timeout_s = orphan_timeout_s
        self._cancelled = threading.Event()
        self._done = threading.Event()
        self._counts = threading.Lock()
        self._pending = 0  # chunks handed over and not yet taken
        self._pending_since = 0.0
        self.chunks_delivered = 0

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def cancel(self) -> None:
        """Stop at the next chunk (thread-safe; the consumer also calls it when it leaves)."""
        self._cancelled.set()

    def wait_done(self, timeout_s: float) -> bool:
        """Whether the stream was closed (and the slot freed) within `timeout_s`."""
        return self._done.wait(timeout_s)

    async def chunks(self, latest_only: bool = False) -> AsyncIterator[T]:
        """The chunks as they come; with `latest_only`, chunks that a newer one replaced while the consumer was busy
        are skipped (never a final one), folded into the newer one by `fold` if given (for what a chunk carries that
        the next one does not repeat). Leaving the loop, by any path, cancels the job."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()

        def hand_over(kind: str, value: Any) -> None:
            try:
                loop.call_soon_threadsafe(queue.put_nowait, (kind, value))
            except RuntimeError:  # the event loop is closed: nobody will read
                self.cancel()

        # The copied context carries Gradio's request into the thread (ZeroGPU reads the visitor's token from it).
        context = contextvars.copy_context()
        threading.Thread(target=context.run, args=(self._pump, hand_over), name="dflash-reply", daemon=True).start()
        try:
            while True:
                items = [await queue.get()]
                while not queue.empty():
                    items.append(queue.get_nowait())
                for kind, value in self._select(items, latest_only):
                    if kind == CHUNK:
                        yield value
                    elif kind == ERROR:
                        raise value
                    else:
                        return
        finally:
            self.cancel()

    def _select(self, items: list[tuple[str, Any]], latest_only: bool) -> list[tuple[str, Any]]:
        with self._counts:  # the consumer made progress: an orphan is one that makes none for orphan_timeout_s
            self._pending -= sum(1 for kind, _ in items if kind == CHUNK)
            self._pending_since = time.monotonic()
        if not latest_only:
            return items
        kept = []
        skipped: Any = None
        for index, (kind, value) in enumerate(items):
            if kind == CHUNK and skipped is not None and self._fold is not None:
                value = self._fold(skipped, value)
            skipped = None
            newer = index + 1 < len(items) and items[index + 1][0] == CHUNK
            if kind == CHUNK and newer and not self._is_final(value):
                skipped = value
                continue
            kept.append((kind, value))
        return kept

    def _orphaned(self) -> bool:
        with self._counts:
            return self._pending > 0 and time.monotonic() - self._pending_since > self._orphan_timeout_s

    def _pump(self, hand_over: Callable[[str, Any], None]) -> None:
        calls, call = self._calls, self._call
        try:
            if not calls.seat(call, self._owner, can_yield=self._resumable is not None):
                log.info("an answer nobody reads any more left the wait for the engine")
                return
            open_stream: Callable[[], Iterator[T]] | None = self._open_stream
            try:
                while open_stream is not None and calls.alive(call):
                    open_stream = self._run(open_stream(), hand_over)
                    if open_stream is not None and not calls.yield_turn(call):  # the rest comes at its next turn
                        log.info("an answer nobody reads any more left the wait for its next turn")
                        return
            finally:
                calls.apply(FairShare.release, call)
        except BaseException as error:  # the consumer raises it in the web request
            hand_over(ERROR, error)
        finally:
            self._done.set()
            hand_over(END, None)

    def _run(self, stream: Iterator[T], hand_over: Callable[[str, Any], None]) -> Callable[[], Iterator[T]] | None:
        """Hand `stream`'s chunks over until it ends, the job stops, or (asked to yield) a chunk that is not the
        answer's last: then the stream of the rest of the answer, opened at the job's next turn."""
        try:
            for chunk in stream:
                if self._cancelled.is_set():
                    return None
                gone = ("its reader takes nothing" if self._orphaned()
                        else None if self._calls.alive(self._call) else "nobody reads it any more")  # fmt: skip
                if gone is not None:
                    log.info("an answer stopped after %d chunks: %s", self.chunks_delivered, gone)
                    return None
                with self._counts:
                    if self._pending == 0:
                        self._pending_since = time.monotonic()
                    self._pending += 1
                self.chunks_delivered += 1
                if self._resumable is not None:
                    self._resumable.seen(chunk)
                hand_over(CHUNK, chunk)
                if self._call.yield_asked and not self._is_final(chunk) and self._resumable is not None:
                    rest = self._resumable.rest()
                    if rest is not None:
                        return rest
                    self._calls.apply(FairShare.cannot_yield, self._call)  # nothing left to resume: it runs to its end
            return None
        finally:
            close = getattr(stream, "close", None)
            if close is not None:
                close()  # stops the engine; on ZeroGPU returns once the worker has stopped
