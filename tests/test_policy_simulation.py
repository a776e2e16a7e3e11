"""The fair-share policy (dflash_runtime/space/web/policy.py), pure, driven through thousands of random schedules on
a clock of the test's own: clients arrive, post calls (some as a crowd, some as A/B runs of several answers), read
their streams, stall, hang up, take their answers' steps on 1–8 engine sequences, yield when asked, and leave. At
every step the test checks each guarantee docs/public-space.md states:

- places: the places counted are the live calls' (running + queued), seats held ≤ the sequences, every limit holds,
  and once every client has gone nothing is counted or seated (no place leaked);
- shares: no client holds two sequences more than a client waiting for one for longer than it takes to ask them
  back, one a step;
- a newcomer's first turn comes within ⌈C / S⌉ turns of `quantum_s` (C clients present, S sequences), plus steps;
- admission by max–min shares: a client is refused for a full server only when no client holding more has a call
  that has not run; a call whose place is taken never ran, and a call that ran is never cut (it yields and resumes);
- abandonment: a call whose reader hung up stops counting at once, one nobody reads (or whose reader stalled)
  within the reader timeout, and its seat goes at its job's next step.

Broken policies (first come first served; a quantum never enforced; abandonment seen only by running jobs, the leak a
crowd found) must fail it."""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import pytest

from dflash_runtime.space.setup.settings import PublicSettings
from dflash_runtime.space.web.policy import LIVE, Call, FairShare, Reader, State

SCHEDULES = 2000
SETTINGS = PublicSettings(client_jobs=8, session_jobs=3, total_jobs=24, client_events=4, reader_timeout_s=3.0,
                          quantum_s=2.0, busy_timeout_s=1e9)  # fmt: skip


class Broken(AssertionError):
    """A guarantee the policy broke."""


@dataclass(eq=False)
class Job:
    """An admitted call as the web process runs it: its handler, its engine steps."""

    call: Call
    steps: int  # engine steps its answer takes
    done: int = 0
    handler: bool = True  # Gradio runs its handler (False: dropped before its body ran, as a cancelled event)
    asked_at: float | None = None
    first_seat: float | None = None
    clients_at_ask: int = 0  # the most clients present while it waits
    newcomer: bool = False
    abandoned_at: float | None = None  # when the world made it unread (the policy must end it within the timeout)


@dataclass(eq=False)
class Client:
    key: str
    kind: str  # "honest": a few calls one after another; "crowd": as many as it may, again and again; "ab"
    session: str
    reader: Reader | None = None
    stalled_at: float | None = None
    left: bool = False
    jobs: list[Job] = field(default_factory=list)
    posts_left: int = 0
    refused: int = 0
    own_readers: list[Reader] = field(default_factory=list)  # session-less calls' streams


class World:
    """One random schedule (see the module doc)."""

    def __init__(self, rng: random.Random, policy: FairShare) -> None:
        self.rng, self.policy, self.now = rng, policy, 1000.0
        self.step_s = rng.choice([0.05, 0.1, 0.25, 0.5])
        self.clients: list[Client] = []
        self.jobs: list[Job] = []
        self.streaks: dict[tuple[str, str], int] = {}

    # -- what the clients do ------------------------------------------------------------------------------------------

    def arrive(self) -> None:
        rng = self.rng
        kind = rng.choices(["honest", "crowd", "ab"], [4, 3, 1])[0]
        n = len(self.clients)
        client = Client(f"c{n}", kind, f"s{n}", posts_left={"honest": rng.randint(1, 3), "crowd": 30, "ab": 2}[kind])
        if rng.random() < 0.9:
            client.reader = self.policy.opened(self.now, client.session)
        self.clients.append(client)

    def post(self, client: Client) -> None:
        rng, policy = self.rng, self.policy
        weight = rng.randint(2, 4) if client.kind == "ab" else 1
        session = None if rng.random() < 0.1 else client.session  # session-less: its event id names its own session
        call = policy.admit(self.now, client.key, session, weight)
        if isinstance(call, str):
            client.refused += 1
            self.check_refusal(client, weight, call)
            return
        client.posts_left -= 1
        policy.queued(self.now, call, f"e{call.order}")
        job = Job(call, steps=rng.choice([1, 2, 5, 20, 60, 200]), handler=rng.random() > 0.05)
        if session is None:  # its own reader, on the call's own stream
            client.own_readers.append(policy.opened(self.now, call.session or ""))
        elif client.reader is None or client.stalled_at is not None:
            job.abandoned_at = self.now  # nobody reads it from the start
        client.jobs.append(job)
        self.jobs.append(job)
        if job.handler and policy.start(self.now, call):
            self.ask(job, owner=f"{client.session}" if session and rng.random() < 0.5 else None)

    def ask(self, job: Job, owner: str | None) -> None:
        present = {c.client for c in self.policy.calls if c.live and c.weight}
        mine = [c for c in self.policy.calls if c.client == job.call.client and c is not job.call and (c.asking or
                                                                                                       c.seated)]
        job.newcomer, job.asked_at, job.clients_at_ask = not mine, self.now, len(present)
        self.policy.ask(self.now, job.call, owner, can_yield=True)

    def act(self, client: Client) -> None:
        rng = self.rng
        if client.left:
            return
        busy = any(j.call.live for j in client.jobs)
        wants = client.posts_left > 0 and (client.kind == "crowd" or not busy)
        if wants and rng.random() < (0.3 if client.kind == "crowd" else 0.6):
            self.post(client)
        roll = rng.random()
        if roll < 0.004 and client.reader is not None and client.stalled_at is None:
            client.stalled_at = self.now  # stops reading: a write that never returns
            self.policy.sending(self.now, client.reader, True)
            self.unread(client)
        elif roll < 0.012 or (client.posts_left <= 0 and not busy):
            self.leave(client)

    def unread(self, client: Client) -> None:
        for job in client.jobs:
            if job.call.live and job.abandoned_at is None and job.call.session == client.session:
                job.abandoned_at = self.now

    def leave(self, client: Client) -> None:
        client.left = True
        if client.reader is not None:
            self.policy.closed(self.now, client.reader, hung_up=True)
        for reader in client.own_readers:
            self.policy.closed(self.now, reader, hung_up=True)
        for job in client.jobs:
            if job.call.live:
                job.abandoned_at = self.now if job.abandoned_at is None else job.abandoned_at
                if client.reader is not None and client.stalled_at is None and job.call.live:
                    raise Broken("a call whose reader hung up still counts")

    # -- the engine ----------------------------------------------------------------------------------------------------

    def step(self) -> None:
        """One engine step: every seated call's job advances, then stops, yields or ends as its call says."""
        policy = self.policy
        for job in [j for j in self.jobs if j.call.seated]:
            call = job.call
            if not call.live:  # abandoned (or taken): its job notices at this step and closes its stream
                policy.release(self.now, call)
                continue
            job.done += 1
            if job.done >= job.steps:
                policy.release(self.now, call)
                policy.finish(self.now, call)
            elif call.yield_asked:
                policy.yield_turn(self.now, call)

    def run(self, ticks: int) -> None:
        rng = self.rng
        for tick in range(ticks):
            self.now += self.step_s
            if tick < ticks * 0.7 and rng.random() < 0.15:
                self.arrive()
            for client in list(self.clients):
                self.act(client)
            self.step()
            for job in self.jobs:  # a ghost (never handled) gets Gradio's word that it completed, sometimes
                if not job.handler and job.call.live and rng.random() < 0.01:
                    self.policy.completed(self.now, job.call.event_id or "")
            self.policy.schedule(self.now)
            self.check()
        for client in self.clients:
            if not client.left:
                self.leave(client)
        for _ in range(int(SETTINGS.reader_timeout_s / self.step_s) + 3):
            self.now += self.step_s
            self.step()
            self.policy.schedule(self.now)
            self.check()
        self.check_all_gone()

    # -- the guarantees ------------------------------------------------------------------------------------------------

    def check(self) -> None:
        policy, now = self.policy, self.now
        live = [j.call for j in self.jobs if j.call.state in LIVE]
        counted = sum(c.weight for c in policy.calls if c.live)
        if counted != sum(c.weight for c in live):
            raise Broken(f"places counted {counted} != the live calls' {sum(c.weight for c in live)}")
        seats = policy.seats_used()
        if seats > policy.capacity or seats != sum(1 for j in self.jobs if j.call.seated):
            raise Broken(f"{seats} seats held of {policy.capacity}")
        if any((c.state is State.RUNNING) != c.seated for c in live):
            raise Broken("a live call runs without a seat, or holds one while it waits")
        self.check_limits(live)
        self.check_abandoned(now)
        self.check_shares()
        self.check_newcomers(now)

    def check_limits(self, live: list[Call]) -> None:
        per_client: dict[str, int] = {}
        for call in live:
            per_client[call.client] = per_client.get(call.client, 0) + call.weight
        if sum(per_client.values()) > SETTINGS.total_jobs or max(per_client.values(), default=0) > SETTINGS.client_jobs:
            raise Broken(f"limits passed: {per_client}")

    def check_abandoned(self, now: float) -> None:
        for job in self.jobs:
            call = job.call
            if job.abandoned_at is not None and call.live and now - job.abandoned_at > SETTINGS.reader_timeout_s + \
                    2 * self.step_s:  # fmt: skip
                raise Broken(f"a call nobody reads still counts {now - job.abandoned_at:.2f} s later")
            if call.state is State.TAKEN and job.done:
                raise Broken("a call that ran was cut")
        self.jobs = [j for j in self.jobs if j.call.live or j.call.seated or (j.newcomer and j.first_seat is None)]

    def check_shares(self) -> None:
        """No client holds two seats more than a client waiting for one, beyond a step per seat to ask back."""
        policy = self.policy
        held, _ = policy.loads(self.now)
        running = {c.owner for c in policy.calls if c.seated and c.owner}
        waiting = {c.client for c in policy.waiting() if c.owner is None or c.owner not in running}
        over = {(x, w) for w in waiting for x, h in held.items() if h >= held.get(w, 0) + 2}
        if policy.seats_used() < policy.capacity:
            over = set()
        self.streaks = {pair: self.streaks.get(pair, 0) + 1 for pair in over}
        if any(streak > policy.capacity + 1 for streak in self.streaks.values()):
            raise Broken(f"a client held two seats more than a waiting client's for long: {self.streaks}")

    def check_newcomers(self, now: float) -> None:
        """A client that comes (or comes back) gets its first turn within ⌈C / S⌉ turns, C the most clients with calls
        present while it waits."""
        present = len({c.client for c in self.policy.calls if c.live and c.weight})
        for job in self.jobs:
            if not job.newcomer or job.asked_at is None or job.first_seat is not None:
                continue
            if job.call.seated:
                job.first_seat = now
                continue
            job.clients_at_ask = max(job.clients_at_ask, present)
            turns = math.ceil(job.clients_at_ask / self.policy.capacity)
            bound = turns * (SETTINGS.quantum_s + 2 * self.step_s) + 2 * self.step_s
            if job.call.live and job.call.asking and now - job.asked_at > bound:
                raise Broken(f"a newcomer waited {now - job.asked_at:.1f} s for its first turn ({job.clients_at_ask} "
                             f"clients, {self.policy.capacity} sequences: bound {bound:.1f} s)")

    def check_refusal(self, client: Client, weight: int, reason: str) -> None:
        """Refused for a full server: no other client holding more than it would has a call that has not run."""
        if "the server has" not in reason:
            return
        mine = sum(c.weight for c in self.policy.calls if c.live and c.client == client.key) + weight
        held: dict[str, int] = {}
        for c in self.policy.calls:
            if c.live:
                held[c.client] = held.get(c.client, 0) + c.weight
        for c in self.policy.calls:
            if c.live and c.client != client.key and not c.started and c.weight and held[c.client] - c.weight >= mine:
                raise Broken(f"refused while {c.client} holds {held[c.client]} with a call that never ran")

    def check_all_gone(self) -> None:
        policy = self.policy
        if policy.calls or policy.seats_used() or sum(c.weight for c in policy.calls if c.live):
            raise Broken(f"after every client left: {len(policy.calls)} calls kept, {policy.seats_used()} seats")


def simulate(make: Callable[[int], FairShare], schedules: int, seed: int = 0) -> tuple[int, str]:
    """How many schedules ran before one broke a guarantee, and what it broke ("" when none did)."""
    rng = random.Random(seed)
    for number in range(schedules):
        capacity = rng.choice([1, 1, 2, 3, 4, 8])
        world = World(random.Random(rng.random()), make(capacity))
        try:
            world.run(ticks=rng.choice([60, 120, 200]))
        except Broken as broken:
            return number, f"schedule {number} (capacity {capacity}): {broken}"
    return schedules, ""


def test_the_policy_keeps_every_guarantee_through_thousands_of_random_schedules() -> None:
    started = time.process_time()  # this process's CPU time: the machine may be shared
    ran, broken = simulate(lambda capacity: FairShare(SETTINGS, capacity), SCHEDULES)
    seconds = time.process_time() - started
    assert not broken, broken
    assert ran == SCHEDULES and seconds < 30.0, f"{SCHEDULES} schedules took {seconds:.1f} s of CPU"


class FirstComeFirstServed(FairShare):
    def next_call(self, now: float) -> Call | None:
        running = {c.owner for c in self.calls if c.seated and c.owner}
        return min((c for c in self.waiting() if c.owner is None or c.owner not in running), key=lambda c: c.order,
                   default=None)  # fmt: skip


class SeenOnlyByJobs(FairShare):
    """Abandonment seen only when a running job asks (the crowd's place leak: calls whose handler never ran)."""

    def sweep(self, now: float) -> None:
        for call in self.calls:
            if call.live and (call.asking or call.seated) and self.abandoned(now, call):
                call.state = State.ABANDONED
        self._tidy()


@pytest.mark.parametrize("make", [
    lambda capacity: FirstComeFirstServed(SETTINGS, capacity),
    lambda capacity: FairShare(replace(SETTINGS, quantum_s=math.inf), capacity),
    lambda capacity: SeenOnlyByJobs(SETTINGS, capacity),
], ids=["first-come-first-served", "no-quantum", "leak"])  # fmt: skip
def test_a_broken_policy_fails_the_simulation(make: Callable[[int], FairShare]) -> None:
    _, broken = simulate(make, SCHEDULES)
    assert broken, "the simulation did not tell the broken policy from the policy"
