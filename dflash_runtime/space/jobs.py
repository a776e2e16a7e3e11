"""One GPU call as a job of the web process: the blocking chunk stream runs in a thread of its own and reaches an
asyncio consumer (a Gradio event handler), and the consumer leaving cancels it.

Gradio cancels an async handler at once (Stop, Clear, a closed tab or a dropped client), where a blocking handler
would run on in its thread to the end of the answer for nobody. When the consumer leaves, the thread closes the stream
at the next chunk: the engine stops between two steps (on ZeroGPU `spaces` tells the worker to stop, and keeps it).
The web process's engine slot admits as many jobs at once as the engine runs sequences (`DFLASH_PARALLEL`; 1 on
ZeroGPU), one per cache owner at a time, and a job's seat is held until its close returns, so a job starts on a
worker that has finished (on ZeroGPU: one that is back in `spaces`' pool, with its engine loaded). A consumer that
stops reading without leaving is treated as gone after `orphan_timeout_s`, so no work outlives its reader by long;
and `alive` (asked at every chunk) says whether anybody still reads the answer at all (see callers.py): when not, the
job stops itself.
"""

from __future__ import annotations

import asyncio
import contextvars
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from ..errors import RequestError

T = TypeVar("T")
CHUNK, ERROR, END = "chunk", "error", "end"


@dataclass(eq=False)
class Seat:
    """One job's place in the slot (compared by identity): the cache owner it runs for, or None for nobody's."""

    owner: str | None = None


class EngineSlot:
    """The web process's gate to the engine: up to `capacity` GPU jobs at once (the engine's parallel sequences), in
    the order they came, never two of one cache owner at once (a conversation's turns and its A/B run share one
    parked cache, so they take turns); others may wait for it to be idle or busy."""

    def __init__(self, timeout_s: float = 120.0, capacity: int = 1) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity}")
        self.timeout_s = timeout_s
        self.capacity = capacity
        self._state = threading.Condition()
        self._running: list[Seat] = []
        self._waiting: list[Seat] = []

    def acquire(self, owner: str | None = None) -> Seat:
        """A seat for a job of `owner` (None or "": a fresh owner, that waits for nobody's turn), once one is free,
        or RequestError after `timeout_s`."""
        seat = Seat(owner or None)
        with self._state:
            self._waiting.append(seat)
            try:
                if not self._state.wait_for(lambda: self._admits(seat), self.timeout_s):
                    own = " (this session's previous answer was still running)" if self._owner_runs(seat.owner) else ""
                    raise RequestError(f"the engine stayed busy for {self.timeout_s:.0f} s{own}; retry")
                self._running.append(seat)
            finally:
                self._waiting.remove(seat)
                self._state.notify_all()  # a later waiter may go now (or could all along, were it not for this one)
        return seat

    def resize(self, capacity: int) -> None:
        """Admit up to `capacity` jobs from now on (the loaded engine's sequences); jobs running stay."""
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity}")
        with self._state:
            self.capacity = capacity
            self._state.notify_all()

    def release(self, seat: Seat | None = None) -> None:
        """Free `seat` (None: the oldest one taken)."""
        with self._state:
            if seat is None and self._running:
                seat = self._running[0]
            if seat in self._running:
                self._running.remove(seat)
            self._state.notify_all()

    def _owner_runs(self, owner: str | None) -> bool:
        return owner is not None and any(seat.owner == owner for seat in self._running)

    def _admits(self, seat: Seat) -> bool:
        """Whether `seat` may go: a place is free, its owner runs nothing, and no earlier waiter could go instead.
        Call with the condition held."""
        if len(self._running) >= self.capacity or self._owner_runs(seat.owner):
            return False
        for earlier in self._waiting:
            if earlier is seat:
                return True
            if not self._owner_runs(earlier.owner):
                return False
        return True

    def busy(self) -> bool:
        return bool(self._running)

    def running(self) -> int:
        """How many jobs hold a seat now (answers running, or being stopped)."""
        return len(self._running)

    def wait(self, busy: bool, timeout_s: float) -> bool:
        """Wait until the slot is busy (some job runs) or idle (none does); False when `timeout_s` passed first."""
        with self._state:
            return self._state.wait_for(lambda: bool(self._running) == busy, timeout_s)


class ReplyJob(Generic[T]):
    """Runs `open_stream()` (a blocking iterator of chunks) in a thread and yields its chunks to one async consumer."""

    def __init__(
        self,
        open_stream: Callable[[], Iterator[T]],
        slot: EngineSlot,
        *,
        is_final: Callable[[T], bool] = lambda _chunk: False,
        fold: Callable[[T, T], T] | None = None,
        orphan_timeout_s: float = 120.0,
        alive: Callable[[], bool] = lambda: True,
        owner: str | None = None,
    ) -> None:
        self._open_stream = open_stream
        self._owner = owner  # the cache owner the job runs for (see EngineSlot)
        self._alive = alive
        self._slot = slot
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
        try:
            seat = self._slot.acquire(self._owner)
            try:
                if not self._alive():
                    return
                stream = self._open_stream()
                try:
                    for chunk in stream:
                        if self._cancelled.is_set() or self._orphaned() or not self._alive():
                            break
                        with self._counts:
                            if self._pending == 0:
                                self._pending_since = time.monotonic()
                            self._pending += 1
                        self.chunks_delivered += 1
                        hand_over(CHUNK, chunk)
                finally:
                    close = getattr(stream, "close", None)
                    if close is not None:
                        close()  # stops the engine; on ZeroGPU returns once the worker has stopped
            finally:
                self._slot.release(seat)
        except BaseException as error:  # the consumer raises it in the web request
            hand_over(ERROR, error)
        finally:
            self._done.set()
            hand_over(END, None)
