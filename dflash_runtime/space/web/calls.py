"""The fair-share policy (policy.py) under one lock, and the GPU calls that wait in it for a seat on the engine
(`ReplyJob`, docs/public-space.md sections 4 to 6)."""

from __future__ import annotations

import asyncio
import contextvars
import logging
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any, Generic, Protocol, TypeVar

from ...errors import RequestError
from ..setup.settings import PublicSettings
from .policy import Call, FairShare, State

log = logging.getLogger(__name__)
T = TypeVar("T")
WAITS_AT_ONCE, WAITS_PER_CLIENT = 8, 2  # /wait calls holding a web server thread at once (of QUEUE_SIZE + 16)
ADMITTED = "dflash_call"  # the scope state's key of the call the HTTP gate admitted
# Transitions that change nobody's turn: no waiting job need look again (each looks every `poll_s` all the same).
QUIET = frozenset((FairShare.sending, FairShare.padding, FairShare.knows, FairShare.session_of_event,
                   FairShare.running_for, FairShare.opened, FairShare.cannot_yield))  # fmt: skip
TAKEN = ("the server's queue was full and a client with fewer answers took this one's place before it started (each "
         "client gets an equal share): retry once some of your answers have ended")


class AdmissionError(RequestError):
    """A call refused by the limits on answers (HTTP 429), or whose place a client with fewer answers took."""


class Calls:
    """The policy, thread-safe: every method is one of its transitions at the clock's time."""

    def __init__(self, settings: PublicSettings | None = None, capacity: int = 1,
                 clock: Callable[[], float] = time.monotonic) -> None:  # fmt: skip
        self.settings = settings or PublicSettings()
        self.policy = FairShare(self.settings, capacity)
        self._clock = clock
        self._changed = threading.Condition()
        self._waits: Counter[str] = Counter()  # the clients in `wait`, each holding a web server thread

    def apply(self, transition: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """One of the policy's methods (`FairShare.queued`, ...) under the lock."""
        with self._changed:
            result = transition(self.policy, self._clock(), *args, **kwargs)
            if transition not in QUIET:
                self._changed.notify_all()
            return result

    def admitted(self, client: str, weight: int) -> Call:
        """A session-less engine call of a route the HTTP gate does not see, or AdmissionError."""
        call = self.apply(FairShare.admit, client, None, weight)
        if isinstance(call, str):
            raise AdmissionError(call)
        return call

    def start(self, call: Call) -> bool:
        """The handler starts: False when the call is over (AdmissionError when its place was taken)."""
        if not (started := self.apply(FairShare.start, call)) and call.state == State.TAKEN:
            raise AdmissionError(TAKEN)
        return started

    def finish(self, call: Call | None) -> None:
        if call is not None:
            self.apply(FairShare.finish, call)

    def alive(self, call: Call) -> bool:
        """Whether the call still counts (a job asks at every chunk)."""
        with self._changed:
            self.policy.sweep(self._clock())
            return call.live

    def seat(self, call: Call, owner: str | None = None, can_yield: bool = False, *, again: bool = False) -> bool:
        """Wait for the call's turn (`again`: after giving its seat up when asked): True once it holds a seat, False
        when it ended meanwhile; AdmissionError when its place was taken, RequestError when its client was not
        served for the busy timeout."""
        with self._changed:
            if again:
                self.policy.yield_turn(self._clock(), call)
            else:
                self.policy.ask(self._clock(), call, owner, can_yield)
            while True:
                if self.policy.schedule(self._clock()):
                    self._changed.notify_all()
                if call.state is State.TAKEN:
                    raise AdmissionError(TAKEN)
                if call.seated or not call.live:
                    return call.seated
                if (refusal := self.policy.timed_out(self._clock(), call)) is not None:
                    self.policy.finish(self._clock(), call)
                    raise RequestError(refusal)
                now, poll_s = self._clock(), self.settings.poll_s
                turn_ends = self.policy.turn_ends(now)  # a seat holder's quantum ending: look then, not a poll later
                self._changed.wait(poll_s if turn_ends is None else min(poll_s, turn_ends - now))

    def resize(self, capacity: int) -> None:
        """Seat up to `capacity` jobs from now on; jobs running stay."""
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity}")
        with self._changed:
            self.policy.capacity = capacity
            self.policy.schedule(self._clock())
            self._changed.notify_all()

    def counts(self) -> dict[str, int]:
        """Seats in use, calls waiting for one, answers counted and turns yielded: nothing of whose."""
        with self._changed:
            self.policy.sweep(self._clock())
            return {"running": self.policy.seats_used(), "waiting": len(self.policy.waiting()),
                    "places": self.policy.places(), "turns_yielded": self.policy.yields}  # fmt: skip

    def waits(self) -> int:
        """The /wait calls waiting now."""
        with self._changed:
            return self._waits.total()

    def wait(self, busy: bool, timeout_s: float, client: str = "") -> bool:
        """Wait until some job holds a seat (`busy`) or none does; False when `timeout_s` passed first. Each wait
        holds one of the web server's threads: a client waits at most WAITS_PER_CLIENT times at once, and at most
        WAITS_AT_ONCE wait in all (RequestError beyond)."""
        with self._changed:
            if self._waits[client] >= WAITS_PER_CLIENT or self._waits.total() >= WAITS_AT_ONCE:
                raise RequestError(f"/wait: {WAITS_PER_CLIENT} waits per client at a time and {WAITS_AT_ONCE} in "
                                   "all; retry when yours have returned")  # fmt: skip
            self._waits[client] += 1
            try:
                return self._changed.wait_for(lambda: (self.policy.seats_used() > 0) == busy, timeout_s)
            finally:
                self._waits -= Counter((client,))  # a client waiting no more leaves the count


class Resumable(Protocol[T]):
    """How an answer comes back after it yielded its turn: `rest()`, the stream of what it would have gone on with,
    from the chunks it has `seen` (None when it cannot)."""

    def seen(self, chunk: T) -> None: ...

    def rest(self) -> Callable[[], Iterator[T]] | None: ...


class ReplyJob(Generic[T]):
    """Runs `open_stream()` (a blocking iterator of chunks) in a thread while its call holds a seat, until its close
    returns, and yields its chunks to one async consumer."""

    def __init__(self, open_stream: Callable[[], Iterator[T]], calls: Calls, call: Call, *,
                 is_final: Callable[[T], bool] = lambda _chunk: False,
                 fold: Callable[[T, T], T] = lambda _older, newer: newer, orphan_timeout_s: float = 120.0,
                 owner: str | None = None, resumable: Resumable[T] | None = None) -> None:  # fmt: skip
        self._open_stream, self._calls, self._call = open_stream, calls, call
        self._owner, self._resumable = owner, resumable  # its conversation's cache owner; how it resumes
        self._is_final, self._fold, self._orphan_timeout_s = is_final, fold, orphan_timeout_s
        self.cancelled = False  # the consumer left (or cancelled): the stream stops at its next chunk
        self._done = threading.Event()
        self._handing = threading.Lock()
        self._handed: list[tuple[bool, Any]] = []  # handed over, not taken yet: (a chunk?, the chunk or the end)
        self._since = 0.0  # since when the consumer is behind (the list not empty)

    def cancel(self) -> None:
        """Stop at the next chunk, or leave the wait for a seat at once: the call is over and its place free
        (thread-safe; the consumer also calls it when it leaves)."""
        self.cancelled = True
        self._calls.finish(self._call)

    def wait_done(self, timeout_s: float) -> bool:
        return self._done.wait(timeout_s)  # the stream closed and the seat freed

    async def chunks(self, latest_only: bool = False) -> AsyncIterator[T]:
        """The chunks as they come; with `latest_only`, one a newer chunk replaced while the consumer was busy is folded
        into it (never a final one). Leaving the loop, by any path, cancels the job."""
        loop, handed = asyncio.get_running_loop(), asyncio.Event()

        def hand_over(chunk: bool, value: Any) -> None:  # value: the chunk, or the end (an error, or None)
            with self._handing:  # with `latest_only`, a chunk a newer one follows is folded into it
                kept = self._handed
                self._since = self._since if kept else time.monotonic()  # the consumer is behind from now on
                if latest_only and chunk and kept and kept[-1][0] and not self._is_final(kept[-1][1]):
                    value = self._fold(kept.pop()[1], value)
                kept.append((chunk, value))
            try:
                loop.call_soon_threadsafe(handed.set)
            except RuntimeError:  # the event loop is closed: nobody will read
                self.cancel()

        # The copied context carries Gradio's request into the thread (ZeroGPU reads the visitor's token from it).
        context = contextvars.copy_context()
        threading.Thread(target=context.run, args=(self._pump, hand_over), name="dflash-reply", daemon=True).start()
        try:
            while True:
                await handed.wait()
                handed.clear()
                with self._handing:  # the consumer made progress: an orphan is one that makes none for orphan_timeout_s
                    taken, self._handed, self._since = self._handed, [], time.monotonic()
                for chunk, value in taken:
                    if chunk:
                        yield value
                    elif value is not None:
                        raise value
                    else:
                        return
        finally:
            self.cancel()

    def _pump(self, hand_over: Callable[[bool, Any], None]) -> None:
        calls, call = self._calls, self._call
        try:
            open_stream = self._open_stream if calls.seat(call, self._owner, self._resumable is not None) else None
            try:
                while open_stream is not None and calls.alive(call):
                    rest = self._run(open_stream(), hand_over)  # the answer's rest, opened at the job's next turn
                    open_stream = rest if rest is not None and calls.seat(call, again=True) else None
            finally:
                calls.apply(FairShare.release, call)
        except BaseException as error:  # the consumer raises it in the web request
            hand_over(False, error)
        finally:
            self._done.set()
            hand_over(False, None)

    def _run(self, stream: Iterator[T], hand_over: Callable[[bool, Any], None]) -> Callable[[], Iterator[T]] | None:
        """Hand `stream`'s chunks over until it ends, the job stops, or it yields when asked (then the stream of the
        answer's rest, opened at the job's next turn)."""
        try:
            for chunk in stream:
                with self._handing:  # an orphan: a chunk has waited that long for a consumer that took nothing
                    orphaned = self._handed and time.monotonic() - self._since > self._orphan_timeout_s
                if self.cancelled or orphaned or not self._calls.alive(self._call):
                    log.info("an answer stopped before its end (stopped, or nobody reads it)")
                    return None
                if self._resumable is not None:
                    self._resumable.seen(chunk)
                hand_over(True, chunk)
                if self._call.yield_asked and not self._is_final(chunk) and self._resumable is not None:
                    if (rest := self._resumable.rest()) is not None:
                        return rest
                    self._calls.apply(FairShare.cannot_yield, self._call)  # nothing left to resume: it runs to its end
            return None
        finally:
            if (close := getattr(stream, "close", None)) is not None:
                close()  # stops the engine; on ZeroGPU returns once the worker has stopped
