"""The public Space's one fair-share policy, pure: plain data in and out, the clock passed in (`now`), no locks,
threads, I/O or Gradio, so that tests/test_policy_simulation.py can prove it (docs/public-space.md)."""

from __future__ import annotations

import itertools
from collections import Counter, OrderedDict
from dataclasses import dataclass

from ..setup.settings import PublicSettings

REMEMBERED = 4096  # sessions and event ids kept after their calls: far more than the queue holds
MIN_PADDING = 64  # bytes: a smaller grant waits for the stream's next tick
FREE_FLOOR_S = 10.0  # the seconds of floor any answer's stream gets: a reader that stops early is seen as soon as ever


class State:
    """A call's states (docs/public-space.md, "A call's life"); each transition is one method of FairShare."""

    WAITING, RUNNING, YIELDED = "waiting", "running", "yielded"
    FINISHED, ABANDONED, TAKEN = "finished", "abandoned", "taken"


LIVE = frozenset((State.WAITING, State.RUNNING, State.YIELDED))  # a place is counted


@dataclass(eq=False)
class Call:
    """An engine call (`weight`: the answers it runs) or a waiting event of another queued function (0)."""

    order: int
    client: str  # its client's key (clients.py), never the session, which a client mints freely
    session: str | None  # None: session-less until Gradio names its event
    weight: int
    posted: float
    sessionless: bool = False
    owner: str | None = None  # its conversation's cache owner: one answer per conversation runs at a time
    event_id: str | None = None
    state: str = State.WAITING
    handled: bool = False  # its handler started (a withdrawn call leaves Gradio's queue only before)
    asking: bool = False  # its job waits for a seat
    can_yield: bool = False  # its answer can go on exactly after a yield
    started: bool = False  # it has run on the engine: its place is never taken
    seated: bool = False  # its job holds a seat, until its stream is closed (whatever the state)
    since: float = 0.0  # when its job last asked for a seat (waiting) or took one (seated)
    yield_asked: bool = False  # asked to give its seat up at its next step

    @property
    def live(self) -> bool:
        return self.state in LIVE


@dataclass(eq=False)
class Reader:
    session: str
    sending_since: float | None = None  # a write to it that has not returned yet


class FairShare:
    """The calls, their sessions' readers, the clients' engine time and the padding buckets."""

    def __init__(self, settings: PublicSettings, capacity: int = 1) -> None:
        self.settings = settings
        self.capacity = capacity  # the engine's sequences: seats
        self.calls: list[Call] = []  # live calls, and ended ones still seated
        self.yields = 0  # turns given up for another client's (a count, nothing of whose)
        self._orders = itertools.count()
        self._readers: dict[str, list[Reader]] = {}
        self._left: dict[str, tuple[float, bool]] = {}  # session -> when its last reader left, whether it hung up
        self._sessions: OrderedDict[str, None] = OrderedDict()  # sessions that joined: who may read a queue stream
        self._events: OrderedDict[str, str] = OrderedDict()  # event id -> session
        self._used: dict[str, float] = {}  # client -> seat-seconds (its virtual time), clients present only
        self._served: dict[str, tuple[int, float]] = {}  # client -> (turn counter, when it last took or left a seat)
        self._buckets: dict[str, tuple[float, float]] = {}  # padding: client ("" for all) -> (bytes left, when)

    # -- admission ---------------------------------------------------------------------------------------------------

    def admit(self, now: float, client: str, session: str | None, weight: int) -> Call | str:
        """An engine call of `weight` answers, or why it is refused (docs/public-space.md, section 3)."""
        self.sweep(now)
        s = self.settings
        if (queued := self._make_room(client, weight)) and queued + weight > s.total_jobs:
            return (f"the server has {queued} answers queued or running, its limit is {s.total_jobs}, and no "
                    "client holds more than you would: retry in a minute")  # fmt: skip
        if (used := self.places(client=client)) and used + weight > s.client_jobs:
            return (f"you have {used} answers queued or running (in all your sessions) and this call would add "
                    f"{weight}; the limit is {s.client_jobs} (an A/B run counts as the answers it runs): wait for "
                    "them, or stop them")  # fmt: skip
        if session is not None and (used := self.places(session=session)) and used + weight > s.session_jobs:
            return (f"this session has {used} answers queued or running and this call would add {weight}; the limit "
                    f"is {s.session_jobs} (an A/B run counts as the answers it runs): wait for them, or stop them")
        return self._add(Call(next(self._orders), client, session, weight, now, sessionless=session is None))

    def admit_event(self, now: float, client: str, session: str) -> Call | str:
        """A waiting event of the page's other queued functions (its load, its timer), or why it is refused."""
        self.sweep(now)
        used = sum(1 for c in self.calls if c.live and not c.weight and c.client == client)
        if used >= self.settings.client_events:
            return (f"you have {used} events of this page waiting in the queue (in all your sessions); the limit is "
                    f"{self.settings.client_events}: wait for them")  # fmt: skip
        return self._add(Call(next(self._orders), client, session, 0, now))

    def _add(self, call: Call) -> Call:
        self.calls.append(call)
        if call.session is not None:
            _remember(self._sessions, call.session, None)
        return call

    def places(self, client: str | None = None, session: str | None = None) -> int:
        """The answers counted (live calls'), of a client, of a session, or in all."""
        return sum(c.weight for c in self.calls if c.live and (client is None or c.client == client)
                   and (session is None or c.session == session))  # fmt: skip

    def _make_room(self, client: str, weight: int) -> int:
        """Max–min shares: while `weight` more answers would pass the limit, take places of calls that have not run
        from the clients holding the most; the answers counted then."""
        mine = self.places(client=client) + weight
        while (total := self.places()) and total + weight > self.settings.total_jobs:
            held: Counter[str] = Counter()  # one pass: a flood of calls makes no admission slow
            for c in self.calls:
                if c.live and c.client != client:
                    held[c.client] += c.weight
            takeable = [c for c in self.calls if c.live and c.weight and not c.started and c.client in held
                        and held[c.client] - c.weight >= mine]  # fmt: skip
            if not takeable:
                break
            self._end(State.TAKEN, max(takeable, key=lambda c: (held[c.client], c.posted, c.order)))
        return total

    # -- what Gradio and the handlers say ----------------------------------------------------------------------------

    def queued(self, now: float, call: Call, event_id: str | None) -> None:
        """Gradio answered the call's POST with its event id, or (None) refused it."""
        if event_id is None:
            self._end(State.FINISHED, call)
            return
        call.event_id = event_id
        if call.session is None:
            call.session = event_id
            _remember(self._sessions, event_id, None)
        _remember(self._events, event_id, call.session)

    def withdraw(self, now: float, event_id: object) -> None:
        """Its client cancelled an event: one whose handler has not started leaves Gradio's queue now."""
        self._end(State.FINISHED, *[c for c in self.calls if c.event_id == event_id and not c.handled])

    def completed(self, now: float, event_id: str) -> None:
        """Gradio says an event completed: its handler is over, or never ran."""
        self._end(State.FINISHED, *[c for c in self.calls if c.event_id == event_id])

    def start(self, now: float, call: Call) -> bool:
        """The call's handler starts: False when the call is over already."""
        self.sweep(now)
        call.handled = True
        return call.live

    def finish(self, now: float, call: Call) -> None:
        self._end(State.FINISHED, call)

    def _end(self, state: str, *calls: Call) -> None:
        for call in calls:
            if call.live:
                call.state, call.asking = state, False
        self._tidy()

    # -- readers ------------------------------------------------------------------------------------------------------

    def knows(self, now: float, session: str) -> bool:
        return session in self._sessions

    def session_of_event(self, now: float, event_id: str) -> str | None:
        return self._events.get(event_id)

    def opened(self, now: float, session: str) -> Reader:
        reader = Reader(session)
        self._readers.setdefault(session, []).append(reader)
        return reader

    def closed(self, now: float, reader: Reader, hung_up: bool = True) -> None:
        """A reader's stream ended: its client hung up, or (`hung_up` False) the server ended it."""
        readers = self._readers.get(reader.session, [])
        if reader in readers:
            readers.remove(reader)
            if not readers:
                del self._readers[reader.session]
                self._left[reader.session] = (now, hung_up)
        self.sweep(now)

    def sending(self, now: float, reader: Reader, busy: bool) -> None:
        reader.sending_since = now if busy else None

    def running_for(self, now: float, session: str) -> bool:
        """Whether an engine call of `session` is being answered: its stream gets padding."""
        return any(c.live and c.weight and c.handled and c.session == session for c in self.calls)

    def abandoned(self, now: float, call: Call) -> bool:
        """Nobody reads it: no reader takes its writes (a write that has not returned for the reader timeout tells
        one gone) and its last one hung up after it came, or none was there for the reader timeout."""
        limit = self.settings.reader_timeout_s
        if call.session is None or any(r.sending_since is None or now - r.sending_since <= limit
                                       for r in self._readers.get(call.session, ())):  # fmt: skip
            return False
        at, hung_up = self._left.get(call.session, (0.0, False))
        return (hung_up and at >= call.posted) or now - max(call.posted, at) > limit

    def sweep(self, now: float) -> None:
        """Every live call nobody reads is abandoned: its place is free at once, its seat at its job's next step."""
        self._end(State.ABANDONED, *[c for c in self.calls if c.live and self.abandoned(now, c)])

    def _tidy(self) -> None:
        self.calls = [c for c in self.calls if c.live or c.seated]
        sessions, present = {c.session for c in self.calls}, {c.client for c in self.calls}
        self._left = {s: left for s, left in self._left.items() if s in sessions}
        self._used = {k: v for k, v in self._used.items() if k in present}
        self._served = {k: v for k, v in self._served.items() if k in present}

    # -- the engine's seats -------------------------------------------------------------------------------------------

    def ask(self, now: float, call: Call, owner: str | None, can_yield: bool) -> None:
        """The call's job asks for a seat; a client that comes (back) starts at the least engine time present."""
        call.asking, call.since, call.owner, call.can_yield = True, now, owner or None, can_yield
        if call.client not in self._used:
            self._used[call.client] = min(self.loads(now)[1].values(), default=0.0)
            self._served[call.client] = (next(self._orders), now)

    def loads(self, now: float) -> tuple[dict[str, int], dict[str, float]]:
        """Each present client's seats held, and its virtual time (seat-seconds, running turns included)."""
        held = Counter(c.client for c in self.calls if c.seated)
        used = dict(self._used)
        for c in self.calls:
            if c.seated:
                used[c.client] = used.get(c.client, 0.0) + now - c.since
        return held, used

    def seats_used(self) -> int:
        return sum(c.seated for c in self.calls)

    def waiting(self) -> list[Call]:
        return [c for c in self.calls if c.asking and not c.seated and c.live]

    def next_call(self, now: float) -> Call | None:
        """Whose turn it is (docs/public-space.md, section 6); never a second answer of a conversation that runs."""
        held, used = self.loads(now)
        running = {c.owner for c in self.calls if c.seated and c.owner}
        ready = [c for c in self.waiting() if c.owner not in running]
        return min(ready, key=lambda c: (held.get(c.client, 0), used.get(c.client, 0.0),
                                         self._served.get(c.client, (-1, 0.0))[0], c.order), default=None)  # fmt: skip

    def schedule(self, now: float) -> bool:
        """Seat whoever's turn it is while seats are free, then ask one call over its share to yield; any change?"""
        self.sweep(now)
        changed = False
        while (call := self.next_call(now)) is not None and self.seats_used() < self.capacity:
            call.state, call.seated, call.started, call.asking, call.since = State.RUNNING, True, True, False, now
            self._served[call.client], changed = (next(self._orders), now), True
        return self._ask_to_yield(now, call) or changed

    def _ask_to_yield(self, now: float, waiting: Call | None) -> bool:
        """With no seat free (a call `waiting`), ask the call of a client holding two seats more than the waiting
        call's, or one more after a turn (`quantum_s`) and more engine time, to yield (one at a time)."""
        if waiting is None or any(c.yield_asked for c in self.calls):
            return False
        held, used = self.loads(now)
        wanted, owed = held.get(waiting.client, 0), used.get(waiting.client, 0.0)
        over = [c for c in self.calls if c.seated and c.live and c.can_yield and c.client != waiting.client and (
            held[c.client] >= wanted + 2 or (held[c.client] == wanted + 1 and used[c.client] > owed
                                             and now - c.since >= self.settings.quantum_s))]  # fmt: skip
        if over:
            max(over, key=lambda c: (held[c.client], used[c.client], now - c.since)).yield_asked = True
            self.yields += 1
        return bool(over)

    def turn_ends(self, now: float) -> float | None:
        """While a call waits and no seat is free: the soonest time a seated call's turn reaches `quantum_s`, when
        `schedule` may ask it to yield with nothing else happening (so a waiting job looks then, not a poll later)."""
        if not self.waiting() or self.seats_used() < self.capacity:
            return None
        ends = [c.since + self.settings.quantum_s for c in self.calls if c.seated]
        return min((end for end in ends if end > now), default=None)

    def yield_turn(self, now: float, call: Call) -> None:
        """The call's job closed its stream for another client's turn: it waits again, in its old place."""
        self._unseat(now, call)
        if call.live:
            call.state, call.asking, call.since = State.YIELDED, True, now

    def release(self, now: float, call: Call) -> None:
        """The call's job closed its stream for good: its seat is free, and a running call is over."""
        self._unseat(now, call)
        self._end(State.FINISHED, call)

    def _unseat(self, now: float, call: Call) -> None:
        if call.seated:
            call.seated, call.yield_asked = False, False
            self._used[call.client] = self._used.get(call.client, 0.0) + max(0.0, now - call.since)
            self._served[call.client] = (self._served.get(call.client, (-1, now))[0], now)

    def cannot_yield(self, now: float, call: Call) -> None:
        """Nothing of the call's answer is left to resume: it runs to its end."""
        call.can_yield = call.yield_asked = False

    def timed_out(self, now: float, call: Call) -> str | None:
        """Why a waiting call gives up (its client not served at all for the busy timeout), or None."""
        served = max(call.since, self._served.get(call.client, (0, call.since))[1])
        if not call.asking or call.client in self.loads(now)[0] or now - served <= self.settings.busy_timeout_s:
            return None
        own = " (this session's previous answer was still running)" if call.owner and any(
            c.seated and c.owner == call.owner for c in self.calls) else ""  # fmt: skip
        return f"the engine stayed busy for {self.settings.busy_timeout_s:.0f} s{own}; retry"

    # -- padding -------------------------------------------------------------------------------------------------------

    def padding(self, now: float, client: str, wanted: int) -> int:
        """Bytes of padding a stream of `client` may send now: buckets of one second's worth, per client and in all."""
        s = self.settings
        total, own = self._level(now, "", s.probe_total_bytes_s), self._level(now, client, s.probe_client_bytes_s)
        granted = int(min(wanted, total, own))
        granted = granted if granted >= MIN_PADDING else 0
        self._buckets[""], self._buckets[client] = (total - granted, now), (own - granted, now)
        if len(self._buckets) > REMEMBERED:  # forget the full buckets
            self._buckets = {k: b for k, b in self._buckets.items()
                             if not k or self._level(now, k, s.probe_client_bytes_s) < s.probe_client_bytes_s}
        return granted

    def _level(self, now: float, key: str, rate: float) -> float:
        level, at = self._buckets.get(key, (rate, now))
        return min(rate, level + rate * (now - at))


def padding_room(settings: PublicSettings, items: int, idle: int, padded: int) -> int:
    """The padding one stream may still send, so that its bytes follow its answer's length, not its time."""
    return int(max(0.0, max(settings.probe_per_item * items, settings.probe_bytes_s * FREE_FLOOR_S) + idle - padded))


def _remember(kept: OrderedDict[str, object], key: str, value: object) -> None:
    kept[key] = value
    kept.move_to_end(key)
    while len(kept) > REMEMBERED:
        kept.popitem(last=False)
