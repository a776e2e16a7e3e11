"""The fair-share policy (policy.py) under one lock, for the web process's threads and its event loop alike: every
method is one of the policy's transitions at the clock's time, and `seat` is the engine slot: a job waits here for
its turn (see docs/public-space.md)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from ...errors import RequestError
from ..setup.settings import PublicSettings
from .policy import Call, FairShare, State

ADMITTED = "dflash_call"  # the scope state's key of the call the HTTP gate admitted


class AdmissionError(RequestError):
    """A call refused by the limits on answers (HTTP 429), or whose place a client with fewer answers took."""


# Transitions after which no waiting job need look at its turn again (it looks every `poll_s` all the same).
QUIET = frozenset((FairShare.sending, FairShare.padding, FairShare.knows, FairShare.session_of_event,
                   FairShare.running_for, FairShare.opened, FairShare.cannot_yield))  # fmt: skip
TAKEN = ("the server's queue was full and a client with fewer answers took this one's place before it started (each "
         "client gets an equal share): retry once some of your answers have ended")


class Calls:
    """The policy, thread-safe (see the module doc)."""

    def __init__(self, settings: PublicSettings | None = None, capacity: int = 1,
                 clock: Callable[[], float] = time.monotonic) -> None:  # fmt: skip
        self.settings = settings or PublicSettings()
        self.policy = FairShare(self.settings, capacity)
        self._clock = clock
        self._changed = threading.Condition()

    def apply(self, transition: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """One of the policy's methods (`FairShare.queued`, ...) at the clock's time, under the lock; every waiting
        job looks at its turn again, but after one that changes nobody's turn (a write, a question: QUIET)."""
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
        if self.apply(FairShare.start, call):
            return True
        if call.state == State.TAKEN:
            raise AdmissionError(TAKEN)
        return False

    def finish(self, call: Call | None) -> None:
        if call is not None:
            self.apply(FairShare.finish, call)

    def alive(self, call: Call) -> bool:
        """Whether the call still counts: read, neither finished nor taken (asked by its job at every chunk; a waiting
        call it finds abandoned leaves its wait at its next look, within `poll_s`)."""
        with self._changed:
            self.policy.sweep(self._clock())
            return call.live

    # -- the engine slot --------------------------------------------------------------------------------------------

    def seat(self, call: Call, owner: str | None, can_yield: bool) -> bool:
        """Wait for the call's turn on the engine: True once it holds a seat, False when it ended meanwhile
        (AdmissionError when its place was taken), RequestError when its client was not served for the busy
        timeout."""
        with self._changed:
            self.policy.ask(self._clock(), call, owner, can_yield)
            return self._wait_turn(call)

    def yield_turn(self, call: Call) -> bool:
        """Give the seat up (its job was asked to, and closed its stream) and wait for the next turn, as `seat`."""
        with self._changed:
            self.policy.yield_turn(self._clock(), call)
            return self._wait_turn(call)

    def _wait_turn(self, call: Call) -> bool:
        while True:
            if self.policy.schedule(self._clock()):
                self._changed.notify_all()
            if call.seated:
                return True
            if call.state is State.TAKEN:
                raise AdmissionError(TAKEN)
            if not call.live:
                return False
            if (refusal := self.policy.timed_out(self._clock(), call)) is not None:
                self.policy.finish(self._clock(), call)
                raise RequestError(refusal)
            now, poll_s = self._clock(), self.settings.poll_s
            turn_ends = self.policy.turn_ends(now)  # a seat holder's quantum ending: look then, not a poll later
            self._changed.wait(poll_s if turn_ends is None else min(poll_s, turn_ends - now))

    def resize(self, capacity: int) -> None:
        """Seat up to `capacity` jobs from now on (the loaded engine's sequences); jobs running stay."""
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity}")
        with self._changed:
            self.policy.capacity = capacity
            self.policy.schedule(self._clock())
            self._changed.notify_all()

    def counts(self) -> dict[str, int]:
        """Seats in use, calls waiting for one, answers counted against the limits (queued or running) and turns
        yielded: counts, nothing of whose."""
        with self._changed:
            policy = self.policy
            policy.sweep(self._clock())
            return {"running": policy.seats_used(), "waiting": len(policy.waiting()), "places": policy.places(),
                    "turns_yielded": policy.yields}  # fmt: skip

    def wait(self, busy: bool, timeout_s: float) -> bool:
        """Wait until some job holds a seat (`busy`) or none does; False when `timeout_s` passed first."""
        with self._changed:
            return self._changed.wait_for(lambda: (self.policy.seats_used() > 0) == busy, timeout_s)
