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
from typing import Any, Generic, Protocol, TypeVar

from ...errors import RequestError

log = logging.getLogger(__name__)

T = TypeVar("T")
SERVED_REMEMBERED = 1024  # clients whose last turn the slot remembers
CHUNK, ERROR, END = "chunk", "error", "end"


@dataclass(eq=False)
class Seat:
    """One job's place in the slot (compared by identity): the cache owner it runs for (None for nobody's), the client
    it runs for, whether anybody still waits for it, whether it can give its place up and come back (`can_yield`), and
    (`yield_asked`) whether it was asked to, at its next step."""

    owner: str | None = None
    client: str = ""
    alive: Callable[[], bool] = lambda: True
    order: int = 0  # when it came (a counter): a job that yielded keeps it
    can_yield: bool = False
    yield_asked: threading.Event = field(default_factory=threading.Event)
    turn_started: float = 0.0  # when it took its place this turn (time.monotonic)


class EngineSlot:
    """The web process's gate to the engine, a scheduler of clients: up to `capacity` GPU jobs at once (the engine's
    parallel sequences), never two of one cache owner at once (a conversation's turns and its A/B run share one parked
    cache, so they take turns). See docs/public-space.md, "The engine's scheduler".

    - A free place goes to the waiting job whose client holds the fewest places now, then whose client has used the
      least engine time (seat-seconds: its *virtual time*; a client that comes, or comes back, starts at the least of
      the clients present, so absence earns no credit), then whose client was served least recently, then the one
      that came first: one client's many calls never queue ahead of another's first.
    - Max–min shares, turn by turn: with no place free and a job waiting, a running job that can yield (`can_yield`:
      its answer resumes exactly, see ReplyJob) is asked to (`Seat.yield_asked`) when its client holds at least two
      places more than the waiting job's client, or one more, has held its place for `quantum_s` this turn and has
      used more engine time than the waiting client.
      It yields at its next step and waits again with its old place in the order; its client's used time decides
      when it comes back. One job is asked at a time.
    - The busy timeout counts the time a client is not served at all: a job waits at most `timeout_s` after the
      later of its coming and its client's last turn, and not at all while its client runs another job, so an answer
      never fails for waiting its turn while the engine serves clients in turn. A job whose caller left (`alive`)
      leaves the wait."""

    POLL_S = 0.5  # how often a waiting job asks whether anybody still waits for it (and whether a turn is over)
    QUANTUM_S = 2.0  # a turn: how long a job keeps its place before it yields to a client holding one fewer

    def __init__(self, timeout_s: float = 120.0, capacity: int = 1, quantum_s: float = QUANTUM_S,
                 clock: Callable[[], float] = time.monotonic) -> None:  # fmt: skip
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity}")
        self.timeout_s = timeout_s
        self.capacity = capacity
        self.quantum_s = quantum_s
        self._clock = clock
        self._state = threading.Condition()
        self._running: list[Seat] = []
        self._waiting: list[Seat] = []
        self._came = itertools.count()
        self._served: dict[str, int] = {}  # client -> when it last took a place (a counter)
        self._served_at: dict[str, float] = {}  # client -> when it last took or left a place (time.monotonic)
        self._used: dict[str, float] = {}  # client -> seat-seconds used (its virtual time), clients present only
        self.yields_asked = 0  # places given up for another client's turn (a count, nothing of whose)

    def acquire(self, owner: str | None = None, client: str = "", alive: Callable[[], bool] = lambda: True,
                can_yield: bool = False) -> Seat | None:  # fmt: skip
        """A seat for a job of `owner` (None or "": a fresh owner, that waits for nobody's turn) of `client`, once
        its turn comes; None when `alive()` turned false while it waited; RequestError when its client was not served
        for `timeout_s` (see the class doc)."""
        return self._take(Seat(owner or None, client, alive, next(self._came), can_yield))

    def yield_turn(self, seat: Seat) -> Seat | None:
        """Give `seat`'s place up (it was asked to, see the class doc) and wait for the job's next turn, in its old
        place in the order: the same seat again, or None when `alive()` turned false meanwhile."""
        with self._state:
            self._leave(seat)
            seat.yield_asked.clear()
        return self._take(seat)

    def _take(self, seat: Seat) -> Seat | None:
        came = self._clock()
        with self._state:
            self._present(seat.client)
            self._waiting.append(seat)
            try:
                while not self._admits(seat):
                    if not seat.alive():
                        return None
                    self._ask_to_yield()
                    now = self._clock()
                    remaining = self.timeout_s - (now - max(came, self._served_at.get(seat.client, came)))
                    if remaining <= 0 and not self._held(seat.client):
                        own = (" (this session's previous answer was still running)"
                               if self._owner_runs(seat.owner) else "")  # fmt: skip
                        raise RequestError(f"the engine stayed busy for {self.timeout_s:.0f} s{own}; retry")
                    self._state.wait(min(remaining, self.POLL_S) if remaining > 0 else self.POLL_S)
                seat.turn_started = self._clock()
                self._running.append(seat)
                self._served[seat.client] = next(self._came)
                self._served_at[seat.client] = seat.turn_started
                if len(self._served) > SERVED_REMEMBERED:  # forget clients with nothing here (newcomers again)
                    present = {s.client for s in (*self._running, *self._waiting)}
                    self._served = {c: n for c, n in self._served.items() if c in present}
                    self._served_at = {c: t for c, t in self._served_at.items() if c in present}
            finally:
                self._waiting.remove(seat)
                self._forget_absent()
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
            if seat is not None:
                self._leave(seat)
            self._forget_absent()
            self._state.notify_all()

    def _leave(self, seat: Seat) -> None:
        """`seat` leaves its place: its client's used time grows by the turn. Call with the condition held."""
        if seat in self._running:
            self._running.remove(seat)
            now = self._clock()
            self._used[seat.client] = self._used.get(seat.client, 0.0) + max(0.0, now - seat.turn_started)
            self._served_at[seat.client] = now
            self._state.notify_all()

    def _present(self, client: str) -> None:
        """A client that comes (or comes back) starts at the least used time of the clients present."""
        if client not in self._used:
            now = self._clock()
            self._used[client] = min((self.used(c, now) for c in self._used), default=0.0)

    def _forget_absent(self) -> None:
        present = {s.client for s in (*self._running, *self._waiting)}
        for client in [c for c in self._used if c not in present]:
            del self._used[client]

    def used(self, client: str, now: float) -> float:
        """A client's virtual time at `now`: the seat-seconds it used, its running turns included. Call with the
        condition held."""
        running = sum(max(0.0, now - s.turn_started) for s in self._running if s.client == client)
        return self._used.get(client, 0.0) + running

    def _owner_runs(self, owner: str | None) -> bool:
        return owner is not None and any(seat.owner == owner for seat in self._running)

    def _held(self, client: str) -> int:
        return sum(1 for seat in self._running if seat.client == client)

    def _next(self) -> Seat | None:
        """The waiting job whose turn it is (see the class doc). Call with the condition held."""
        ready, now = [seat for seat in self._waiting if not self._owner_runs(seat.owner)], self._clock()
        return min(ready, key=lambda seat: (self._held(seat.client), self.used(seat.client, now),
                                            self._served.get(seat.client, -1), seat.order), default=None)  # fmt: skip

    def _admits(self, seat: Seat) -> bool:
        return len(self._running) < self.capacity and self._next() is seat

    def _ask_to_yield(self) -> None:
        """With no place free and a job waiting: ask the running job that holds more than its share, or whose turn is
        over, to yield (one at a time; see the class doc). Call with the condition held."""
        waiting = self._next()
        if waiting is None or len(self._running) < self.capacity or any(s.yield_asked.is_set() for s in self._running):
            return
        now, wanted = self._clock(), self._held(waiting.client)
        owed = self.used(waiting.client, now)
        over = [seat for seat in self._running if seat.can_yield and seat.client != waiting.client and (
            self._held(seat.client) >= wanted + 2 or (
                self._held(seat.client) == wanted + 1 and now - seat.turn_started >= self.quantum_s
                and self.used(seat.client, now) > owed))]  # fmt: skip
        if not over:
            return
        most = max(over, key=lambda seat: (self._held(seat.client), self.used(seat.client, now),
                                           now - seat.turn_started))  # fmt: skip
        most.yield_asked.set()
        self.yields_asked += 1

    def busy(self) -> bool:
        return bool(self._running)

    def running(self) -> int:
        """How many jobs hold a seat now (answers running, or being stopped)."""
        return len(self._running)

    def waiting(self) -> int:
        """How many jobs wait for a seat (answers that yielded their turn included)."""
        with self._state:
            return len(self._waiting)

    def wait(self, busy: bool, timeout_s: float) -> bool:
        """Wait until the slot is busy (some job runs) or idle (none does); False when `timeout_s` passed first."""
        with self._state:
            return self._state.wait_for(lambda: bool(self._running) == busy, timeout_s)


class Resumable(Protocol[T]):
    """How a job's answer comes back after it yielded its turn: it sees every chunk handed over, and `rest()` opens
    the stream of the rest of the answer (exactly what the answer would have gone on with), or None when it cannot."""

    def seen(self, chunk: T) -> None: ...

    def rest(self) -> Callable[[], Iterator[T]] | None: ...


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
        resumable: Resumable[T] | None = None,
    ) -> None:
        self._open_stream = open_stream
        self._owner = owner  # the cache owner the job runs for (see EngineSlot)
        self._client = client  # the client it runs for: whose turn it takes (see EngineSlot)
        self._resumable = resumable  # how its answer comes back after it yielded its turn (see EngineSlot)
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
            seat = self._slot.acquire(self._owner, self._client, self._alive, can_yield=self._resumable is not None)
            if seat is None:
                log.info("an answer nobody reads any more left the wait for the engine")
                return
            open_stream: Callable[[], Iterator[T]] | None = self._open_stream
            try:
                while open_stream is not None:
                    if not self._alive():
                        log.info("an answer nobody reads any more was not started")
                        return
                    open_stream = self._run(open_stream(), seat, hand_over)
                    if open_stream is not None:  # its turn is over: the rest comes at its next turn
                        came_back = self._slot.yield_turn(seat)
                        if came_back is None:
                            log.info("an answer nobody reads any more left the wait for its next turn")
                            return
            finally:
                self._slot.release(seat)
        except BaseException as error:  # the consumer raises it in the web request
            hand_over(ERROR, error)
        finally:
            self._done.set()
            hand_over(END, None)

    def _run(self, stream: Iterator[T], seat: Seat, hand_over: Callable[[str, Any], None]
             ) -> Callable[[], Iterator[T]] | None:  # fmt: skip
        """Hand `stream`'s chunks over until it ends, the job stops, or (asked to yield) a chunk that is not the
        answer's last: then the stream of the rest of the answer, opened at the job's next turn."""
        try:
            for chunk in stream:
                if self._cancelled.is_set():
                    return None
                gone = ("its reader takes nothing" if self._orphaned()
                        else None if self._alive() else "nobody reads it any more")  # fmt: skip
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
                if seat.yield_asked.is_set() and not self._is_final(chunk) and self._resumable is not None:
                    rest = self._resumable.rest()
                    if rest is not None:
                        return rest
                    seat.can_yield = False  # nothing left to resume: it runs to its end
                    seat.yield_asked.clear()
            return None
        finally:
            close = getattr(stream, "close", None)
            if close is not None:
                close()  # stops the engine; on ZeroGPU returns once the worker has stopped
