"""One GPU call as a job of the web process: the blocking chunk stream runs in a thread of its own and reaches an
asyncio consumer (a Gradio event handler), and the consumer leaving cancels it.

Gradio cancels an async handler at once (Stop, Clear, a closed tab or a dropped client), where a blocking handler
would run on in its thread to the end of the answer for nobody. When the consumer leaves, the thread closes the stream
at the next chunk: the engine stops between two steps (on ZeroGPU `spaces` tells the worker to stop, and keeps it).
The web process's engine slot admits as many jobs at once as the engine runs sequences (`DFLASH_PARALLEL`; 1 on
ZeroGPU), one per cache owner at a time, clients in turn (see EngineSlot), and a job's seat is held until its close
returns, so a job starts on a worker that has finished (on ZeroGPU: one that is back in `spaces`' pool, with its
engine loaded). A consumer that
stops reading without leaving is treated as gone after `orphan_timeout_s`, so no work outlives its reader by long;
and `alive` (asked at every chunk) says whether anybody still reads the answer at all (see callers.py): when not, the
job stops itself.
"""

from __future__ import annotations

import asyncio
import contextvars
import itertools
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from ...errors import RequestError

log = logging.getLogger(__name__)

T = TypeVar("T")
SERVED_REMEMBERED = 1024  # clients whose last turn the slot remembers
CHUNK, ERROR, END = "chunk", "error", "end"


@dataclass(eq=False)
class Seat:
    """One job's place in the slot (compared by identity): the cache owner it runs for (None for nobody's), the client
    it runs for, whether anybody still waits for it, and (`shared`) whether it was asked to give its place up."""

    owner: str | None = None
    client: str = ""
    alive: Callable[[], bool] = lambda: True
    order: int = 0  # when it came (a counter)
    shared: threading.Event = field(default_factory=threading.Event)


class EngineSlot:
    """The web process's gate to the engine: up to `capacity` GPU jobs at once (the engine's parallel sequences), never
    two of one cache owner at once (a conversation's turns and its A/B run share one parked cache, so they take turns).

    Clients take turns: a free place goes to the waiting job whose client holds the fewest places now, then whose
    client was served least recently, then the one that came first, so one client's many calls never queue ahead of
    another's first. A client may use every place
    while nobody else waits; when another client's job waits and no place is free, a client holding at least two places
    more than the waiting job's client gives its newest one up (`Seat.shared`: that answer ends at its next step, see
    ReplyJob), so no client holds more than its share while others queue (a client's only answer is never cut: on one
    sequence clients take turns answer by answer). A job whose caller left (`alive`) leaves the wait."""

    POLL_S = 0.5  # how often a waiting job asks whether anybody still waits for it

    def __init__(self, timeout_s: float = 120.0, capacity: int = 1) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity}")
        self.timeout_s = timeout_s
        self.capacity = capacity
        self._state = threading.Condition()
        self._running: list[Seat] = []
        self._waiting: list[Seat] = []
        self._came = itertools.count()
        self._served: dict[str, int] = {}  # client -> when it last took a place (a counter)
        self.shares_asked = 0  # places given up for another client (a count, nothing of whose)

    def acquire(self, owner: str | None = None, client: str = "",
                alive: Callable[[], bool] = lambda: True) -> Seat | None:  # fmt: skip
        """A seat for a job of `owner` (None or "": a fresh owner, that waits for nobody's turn) of `client`, once
        its turn comes; None when `alive()` turned false while it waited; RequestError after `timeout_s`."""
        seat = Seat(owner or None, client, alive, next(self._came))
        deadline = time.monotonic() + self.timeout_s
        with self._state:
            self._waiting.append(seat)
            try:
                while not self._admits(seat):
                    if not seat.alive():
                        return None
                    self._ask_to_share()
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        own = (" (this session's previous answer was still running)"
                               if self._owner_runs(seat.owner) else "")  # fmt: skip
                        raise RequestError(f"the engine stayed busy for {self.timeout_s:.0f} s{own}; retry")
                    self._state.wait(min(remaining, self.POLL_S))
                self._running.append(seat)
                self._served[seat.client] = next(self._came)
                if len(self._served) > SERVED_REMEMBERED:  # forget clients with nothing here (newcomers again)
                    present = {s.client for s in (*self._running, *self._waiting)}
                    self._served = {c: n for c, n in self._served.items() if c in present}
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

    def _held(self, client: str) -> int:
        return sum(1 for seat in self._running if seat.client == client)

    def _next(self) -> Seat | None:
        """The waiting job whose turn it is: of those whose owner runs nothing, the one whose client holds the fewest
        places, then whose client was served least recently, then the first come. Call with the condition held."""
        ready = [seat for seat in self._waiting if not self._owner_runs(seat.owner)]
        return min(ready, key=lambda seat: (self._held(seat.client), self._served.get(seat.client, -1), seat.order),
                   default=None)  # fmt: skip

    def _admits(self, seat: Seat) -> bool:
        return len(self._running) < self.capacity and self._next() is seat

    def _ask_to_share(self) -> None:
        """With no place free and another client's job waiting: the client holding at least two places more than the
        waiting one's gives its newest up (one at a time). Call with the condition held."""
        waiting = self._next()
        if waiting is None or len(self._running) < self.capacity or any(s.shared.is_set() for s in self._running):
            return
        holders = [seat for seat in self._running if seat.client != waiting.client]
        if not holders:
            return
        most = max(holders, key=lambda seat: (self._held(seat.client), seat.order))
        if self._held(most.client) >= self._held(waiting.client) + 2:
            most.shared.set()
            self.shares_asked += 1

    def busy(self) -> bool:
        return bool(self._running)

    def running(self) -> int:
        """How many jobs hold a seat now (answers running, or being stopped)."""
        return len(self._running)

    def waiting(self) -> int:
        """How many jobs wait for a seat."""
        with self._state:
            return len(self._waiting)

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
        client: str = "",
        shared: Callable[[T], T] | None = None,
    ) -> None:
        self._open_stream = open_stream
        self._owner = owner  # the cache owner the job runs for (see EngineSlot)
        self._client = client  # the client it runs for: whose turn it takes (see EngineSlot)
        self._shared = shared  # a chunk made the last of its answer (one that gives its place up)
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
            seat = self._slot.acquire(self._owner, self._client, self._alive)
            if seat is None:
                log.info("an answer nobody reads any more left the wait for the engine")
                return
            try:
                if not self._alive():
                    log.info("an answer nobody reads any more was not started")
                    return
                stream = self._open_stream()
                try:
                    for chunk in stream:
                        if self._cancelled.is_set():
                            break
                        gone = ("its reader takes nothing" if self._orphaned()
                                else None if self._alive() else "nobody reads it any more")  # fmt: skip
                        if gone is not None:
                            log.info("an answer stopped after %d chunks: %s", self.chunks_delivered, gone)
                            break
                        give_up = seat.shared.is_set() and self._shared is not None
                        if give_up:  # the answer ends here: another client's turn (see EngineSlot)
                            chunk = self._shared(chunk)
                        with self._counts:
                            if self._pending == 0:
                                self._pending_since = time.monotonic()
                            self._pending += 1
                        self.chunks_delivered += 1
                        hand_over(CHUNK, chunk)
                        if give_up:
                            break
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
