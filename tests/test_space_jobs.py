"""ReplyJob: a blocking chunk stream handed to an async consumer, stopped when the consumer leaves or stops reading;
the engine slot (calls.Calls.seat: as many jobs at once as the engine runs answers, one per conversation); and the
policy's rules for when a call is abandoned, how many may wait and whose place is taken (policy.FairShare, on a
clock of the test's own: tests/test_policy_simulation.py drives it through thousands of schedules)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from dflash_runtime.errors import RequestError
from dflash_runtime.space.setup.settings import PublicSettings
from dflash_runtime.space.web.calls import WAITS_AT_ONCE, WAITS_PER_CLIENT, AdmissionError, Calls, ReplyJob
from dflash_runtime.space.web.policy import Call, FairShare, State
from dflash_runtime.space.web.probes import Message, TrafficFloor, queue_heartbeat

TIMEOUT_S = 30.0


class Stream:
    """A blocking stream of numbered chunks that records how far it got and whether it was closed."""

    def __init__(self, count: int = 10_000, gate: threading.Event | None = None) -> None:
        self.count = count
        self.gate = gate
        self.produced = 0
        self.closed = threading.Event()

    def __call__(self) -> Iterator[int]:
        try:
            for number in range(1, self.count + 1):
                if self.gate is not None and not self.gate.wait(TIMEOUT_S):
                    raise TimeoutError("the gate never opened")
                self.produced = number
                yield number
        finally:
            self.closed.set()


def engine_job(stream: Any, calls: Calls | None = None, client: str = "c", **options: Any) -> ReplyJob[Any]:
    """A ReplyJob for a call of `client` admitted as a route the HTTP gate does not see admits it (no session:
    nobody's reading is asked)."""
    calls = calls or Calls()
    return ReplyJob(stream, calls, calls.admitted(client, 1), **options)


def run(coroutine: object) -> object:
    return asyncio.run(asyncio.wait_for(coroutine, TIMEOUT_S))  # type: ignore[arg-type]


def test_leaving_the_loop_closes_the_stream_and_frees_the_slot() -> None:
    stream, calls = Stream(), Calls()
    job = engine_job(stream, calls)

    async def take_three() -> list[int]:
        taken = []
        async for chunk in job.chunks():
            taken.append(chunk)
            if len(taken) == 3:
                break
        return taken

    assert run(take_three()) == [1, 2, 3]
    assert job.cancelled and job.wait_done(TIMEOUT_S) and stream.closed.is_set()
    assert stream.produced < stream.count and calls.counts()["running"] == 0


def test_a_cancelled_consumer_stops_the_stream() -> None:
    gate = threading.Event()
    stream = Stream(gate=gate)
    job = engine_job(stream)

    async def consume_then_get_cancelled() -> None:
        waiting = asyncio.Event()

        async def consume() -> None:
            chunks = job.chunks()
            first = asyncio.ensure_future(chunks.__anext__())  # starts the job, then waits for its first chunk
            waiting.set()
            await first
            async for _chunk in chunks:
                pass

        task = asyncio.ensure_future(consume())
        await waiting.wait()  # the consumer has started the job and waits for its first chunk
        task.cancel()  # before the first chunk, as a Stop clicked while the model loads
        with pytest.raises(asyncio.CancelledError):
            await task

    run(consume_then_get_cancelled())
    gate.set()  # the first chunk arrives only now
    assert job.wait_done(TIMEOUT_S) and stream.closed.is_set() and stream.produced == 1


def test_latest_only_skips_replaced_chunks_but_never_a_final_one() -> None:
    first_taken = threading.Event()

    def stream() -> Iterator[int]:
        yield 1
        if not first_taken.wait(TIMEOUT_S):  # 2..12 come only once the reader holds chunk 1
            raise TimeoutError("the reader never took its first chunk")
        yield from range(2, 13)

    job = engine_job(stream, is_final=lambda chunk: chunk in (6, 12))

    async def slow_reader() -> list[int]:
        taken = []
        async for chunk in job.chunks(latest_only=True):
            if not taken:  # hold on until every other chunk is waiting
                first_taken.set()
                await asyncio.to_thread(job.wait_done, TIMEOUT_S)
            taken.append(chunk)
        return taken

    # The reader was busy while 2..12 queued up: of those only the final ones reach it, in order.
    assert run(slow_reader()) == [1, 6, 12]


def test_a_reader_that_stops_reading_is_treated_as_gone() -> None:
    stream = Stream(count=10**9)  # endless, for all the test cares
    job = engine_job(stream, orphan_timeout_s=0.2)

    async def read_one_then_stall() -> None:
        async for _chunk in job.chunks():
            await asyncio.to_thread(job.wait_done, TIMEOUT_S)  # stalls without leaving, until the job gives up
            break

    run(read_one_then_stall())
    assert stream.closed.is_set() and stream.produced < stream.count


def test_stream_errors_reach_the_consumer_and_a_busy_slot_is_refused_in_time() -> None:
    def failing() -> Iterator[int]:
        yield 1
        raise ValueError("the worker broke")

    async def consume(job: ReplyJob[int]) -> list[int]:
        return [chunk async for chunk in job.chunks()]

    with pytest.raises(ValueError, match="the worker broke"):
        run(consume(engine_job(failing)))
    calls = Calls(PublicSettings(busy_timeout_s=0.1, poll_s=0.05))
    assert calls.seat(calls.admitted("another client", 1), None, False)  # this job's client is not served for 0.1 s
    with pytest.raises(RequestError, match="the engine stayed busy"):
        run(consume(engine_job(Stream(), calls)))


def test_one_job_at_a_time_through_the_slot() -> None:
    calls, events = Calls(), []
    gate, started = threading.Event(), threading.Event()

    def stream(name: str, wait: bool) -> Iterator[int]:
        events.append(f"{name} starts")
        started.set()
        try:
            if wait and not gate.wait(TIMEOUT_S):
                raise TimeoutError("the gate never opened")
            yield 1
        finally:
            events.append(f"{name} closed")

    async def both() -> tuple[list[int], list[int]]:
        async def consume(job: ReplyJob[int]) -> list[int]:
            return [chunk async for chunk in job.chunks()]

        one = asyncio.ensure_future(consume(engine_job(lambda: stream("first", True), calls, "a")))
        await asyncio.to_thread(started.wait, TIMEOUT_S)
        two = asyncio.ensure_future(consume(engine_job(lambda: stream("second", False), calls, "b")))
        gate.set()
        return await one, await two

    assert run(both()) == ([1], [1])
    assert events == ["first starts", "first closed", "second starts", "second closed"]


class Clock:
    """A clock the test moves by hand: the rules below are about time, not about waiting."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def policy(**settings: Any) -> FairShare:
    return FairShare(PublicSettings(**{"reader_timeout_s": 3.0, **settings}))


def posted(share: FairShare, now: float, session: str | None, client: str = "me", weight: int = 1,
           event: str = "e1") -> Call:  # fmt: skip
    call = share.admit(now, client, session, weight)
    assert isinstance(call, Call), call
    share.queued(now, call, event)
    return call


def test_a_call_is_abandoned_when_nobody_opens_its_result_in_time() -> None:
    share = policy()
    call = posted(share, 1000.0, None)
    assert share.start(1002.9, call), "within the grace it runs"
    share.sweep(1003.1)
    assert call.state == State.ABANDONED and not call.live
    late = posted(share, 1003.1, None, event="e2")
    assert not share.start(1006.2, late), "abandoned while it waited: it never asks for a GPU"
    assert share.calls == [], "no place is kept for them"


def test_a_reader_that_leaves_after_the_call_abandons_it_at_once() -> None:
    share = policy()
    reader = share.opened(1000.0, "s")
    call = posted(share, 1000.0, "s")
    assert share.start(1000.0, call)
    share.sweep(1060.0)
    assert call.live, "read: it may run as long as it likes"
    share.closed(1060.0, reader, hung_up=True)
    assert call.state == State.ABANDONED
    later = posted(share, 1060.1, "s", event="e2")  # a later call of the session waits for its own reader's grace
    share.sweep(1063.0)
    assert later.live
    share.sweep(1063.2)
    assert not later.live


def test_a_stream_the_server_ends_is_no_hang_up() -> None:
    """Gradio ends a session's result stream once none of its events is pending. A call the page posted just before
    (its next message, sent as the last answer's final frame arrived) is neither dropped nor stopped: it waits for
    the page's next stream as a new call does; and once that stream comes it runs for as long as it is read."""
    share = policy()
    reader = share.opened(1000.0, "s")
    call = posted(share, 1000.0, "s")
    share.closed(1000.0, reader, hung_up=False)  # the server sent the stream's end
    assert share.start(1000.0, call), "a call posted before the server ended the stream is still queued"
    share.sweep(1002.0)
    assert call.live, "its client opens the next stream: the grace holds"
    share.opened(1002.0, "s")
    share.sweep(1062.0)
    assert call.live
    share = policy()
    reader = share.opened(1000.0, "s")
    call = posted(share, 1000.0, "s")
    share.closed(1000.0, reader, hung_up=False)
    assert not share.start(1003.1, call), "no reader within the grace: abandoned, as any unread call"


def test_a_reader_that_takes_no_write_counts_as_gone() -> None:
    share = policy()
    reader = share.opened(1000.0, "s")
    call = posted(share, 1000.0, "s")
    share.sending(1000.0, reader, True)
    share.sweep(1002.0)
    assert call.live
    share.sending(1002.0, reader, False)  # the write went through: a reader again
    share.sending(1002.0, reader, True)
    share.sweep(1005.5)
    assert not call.live


def test_limits_count_answers_per_client_per_session_and_in_all() -> None:
    share = policy(client_jobs=4, session_jobs=3, total_jobs=6)
    now = 1000.0
    share.opened(now, "s")
    assert isinstance(share.admit(now, "me", "s", 2), Call)  # an A/B run of two answers
    refused = share.admit(now, "me", "s", 2)
    assert isinstance(refused, str) and "this session has 2 answers queued or running" in refused
    ended = posted(share, now, "s")
    share.finish(now, ended)
    assert isinstance(share.admit(now, "me", "s", 1), Call), "an ended call frees its place"
    first = share.admit(now, "me", None, 1)  # session-less: counted as its client's
    assert isinstance(first, Call)
    over = share.admit(now, "me", "fresh-session", 1)
    assert isinstance(over, str) and "you have 4 answers queued or running (in all your sessions)" in over
    share.queued(now, first, None)  # Gradio refused it: its place is free again
    for session in ("t", "u", "w"):
        share.opened(now, session)
    assert isinstance(share.admit(now, "other", "t", 1), Call) and isinstance(share.admit(now, "more", "u", 1), Call)
    newest = share.admit(now + 1, "me", "w", 1)
    assert isinstance(newest, Call)
    # The total is full: a client with none gets in by taking the newest place of the client with the most.
    taker = share.admit(now + 2, "yet-another", None, 1)
    assert isinstance(taker, Call) and newest.state == State.TAKEN and taker.live
    even = policy(total_jobs=2)
    assert isinstance(even.admit(now, "one", None, 1), Call) and isinstance(even.admit(now, "two", None, 1), Call)
    full = even.admit(now, "three", None, 1)  # nobody holds more than the newcomer would: no place to take
    assert isinstance(full, str) and "its limit is 2" in full
    alone = policy(session_jobs=3)
    big = alone.admit(now, "me", "s", 5)  # an A/B run of four methods and plain decoding, alone in its session
    assert isinstance(big, Call) and isinstance(alone.admit(now, "me", "s", 5), str)


def test_a_place_is_taken_only_from_a_call_that_has_not_run() -> None:
    """One rule for an answer the crowd must give up: one that has run keeps its place (it yields its seat and
    resumes); one that has not is refused with the reason, and the service tells its caller so."""
    share = policy(total_jobs=2)
    now = 1000.0
    running, queued = posted(share, now, None, "crowd"), posted(share, now + 1, None, "crowd", event="e2")
    share.ask(now, running, None, can_yield=True)
    share.schedule(now)
    assert running.seated and running.started
    assert isinstance(share.admit(now + 2, "newcomer", None, 1), Call)
    assert queued.state == State.TAKEN and running.live, "the newest call that had not run went"
    assert isinstance(share.admit(now + 2, "another", None, 1), str), "a call that ran is never cut"
    calls = Calls(PublicSettings(total_jobs=2, poll_s=0.05))
    _, waiting = calls.admitted("crowd", 1), calls.admitted("crowd", 1)
    assert calls.start(waiting)
    calls.admitted("newcomer", 1)
    with pytest.raises(AdmissionError, match="took this one's place before it started"):
        calls.seat(waiting, None, False)


def test_a_queued_call_its_client_cancels_frees_its_place() -> None:
    share = policy(session_jobs=2)
    share.opened(1000.0, "s")
    ab = posted(share, 1000.0, "s", weight=2)
    assert isinstance(share.admit(1000.0, "me", "s", 1), str), "the session's places are taken"
    share.withdraw(1000.0, "e1")  # Stop while it waited: Gradio drops it from the queue, no handler runs
    assert not ab.live and isinstance(share.admit(1000.0, "me", "s", 2), Call)


def test_a_waiting_call_whose_reader_leaves_frees_its_place() -> None:
    share = policy(session_jobs=1)
    reader = share.opened(1000.0, "s")
    call = posted(share, 1000.0, "s")
    share.closed(1000.0, reader, hung_up=True)  # Gradio drops the session's waiting events
    assert isinstance(share.admit(1000.0, "me", "s", 1), Call) and not share.start(1000.0, call)


def test_a_call_whose_handler_never_ran_frees_its_place_when_gradio_completes_it_or_nobody_reads_it() -> None:
    """The place a crowd leaked: a call Gradio dropped before its handler's body ran is never ended by its handler.
    Gradio's word that its event completed frees it, and so does its readers' leaving, whatever its handler did."""
    share = policy()
    reader = share.opened(1000.0, "s")
    call = posted(share, 1000.0, "s")
    share.completed(1000.5, "e1")
    assert call.state == State.FINISHED and share.calls == []
    ghost = posted(share, 1001.0, "s", event="e2")
    share.closed(1002.0, reader, hung_up=True)
    assert ghost.state == State.ABANDONED and share.calls == []


def test_padding_is_bounded_per_client_and_in_total() -> None:
    """The reader probes' padding (FairShare.padding): one second's worth a bucket, refilled by the clock; one
    client's streams share its rate, every client's share the total."""
    share = policy(probe_client_bytes_s=1000, probe_total_bytes_s=2500)
    now = 1000.0
    assert [share.padding(now, "a", 600), share.padding(now, "a", 600), share.padding(now, "b", 600)] == [600, 400, 600]
    assert share.padding(now, "c", 5000) == 900, "what is left of the total"
    assert share.padding(now, "d", 5000) == 0, "the total is spent"
    assert share.padding(now + 0.5, "a", 5000) == 500 and share.padding(now + 0.5, "e", 5000) == 750
    sent = sum(share.padding(now + 10.5, client, 10_000) for client in "abcdefgh")
    assert sent == 2500, "after a pause: at most one second's worth in all"
    assert policy().padding(now, "z", 30) == 0, "too small a grant waits for the next tick"


def test_a_job_nobody_reads_stops_itself() -> None:
    stream, clock = Stream(), Clock()
    calls = Calls(PublicSettings(reader_timeout_s=3.0), clock=clock)
    reader = calls.apply(FairShare.opened, "s")
    call = calls.apply(FairShare.admit, "c", "s", 1)
    assert isinstance(call, Call)
    job = ReplyJob(stream, calls, call)

    async def read_until(count: int) -> list[int]:
        taken = []
        async for chunk in job.chunks():
            taken.append(chunk)
            if len(taken) == count:
                calls.apply(FairShare.closed, reader, True)  # it hung up: the job ends the stream at its next chunk
        return taken

    taken = run(read_until(3))
    assert taken[:3] == [1, 2, 3] and job.wait_done(TIMEOUT_S) and stream.closed.is_set()
    assert stream.produced < stream.count and call.state == State.ABANDONED


def seated(calls: Calls, client: str, owner: str | None = None) -> Call:
    call = calls.admitted(client, 1)
    assert calls.seat(call, owner, can_yield=False)
    return call


def test_the_slot_seats_up_to_its_capacity_and_one_job_per_conversation() -> None:
    """Two seats: two conversations run at once; a third job waits (and is refused once its wait is up), as does a
    second job of a conversation already running, with a message that says why; a freed seat goes at once."""
    calls = Calls(PublicSettings(busy_timeout_s=0.2, poll_s=0.05), capacity=2)
    first, second = seated(calls, "x", "a"), seated(calls, "y", "b")
    assert calls.counts()["running"] == 2 and calls.wait(True, 0.0)
    with pytest.raises(RequestError, match=r"the engine stayed busy for 0 s; retry"):
        seated(calls, "z", "c")  # a client served not at all for the busy timeout
    calls.apply(FairShare.release, second)
    with pytest.raises(RequestError, match="this session's previous answer was still running"):
        seated(calls, "w", "a")
    fresh = seated(calls, "v")  # no conversation: it waits for nobody's turn
    calls.apply(FairShare.release, first)
    again = seated(calls, "x", "a")
    assert calls.counts()["running"] == 2
    calls.apply(FairShare.release, fresh)
    calls.apply(FairShare.release, again)
    assert calls.counts()["running"] == 0 and calls.wait(False, 0.0)
    with pytest.raises(ValueError, match="capacity must be at least 1"):
        calls.resize(0)


def test_a_resized_slot_seats_what_the_loaded_engine_holds() -> None:
    """The slot starts at the most the queue lets through and is resized to the loaded engine's sequences: a job
    beyond them waits, and one waiting goes at once when the slot grows; a running job keeps its seat when it
    shrinks."""
    calls = Calls(PublicSettings(busy_timeout_s=TIMEOUT_S), capacity=1)
    first = seated(calls, "a")
    waiting, went = threading.Event(), threading.Event()

    def second() -> None:
        waiting.set()
        calls.apply(FairShare.release, seated(calls, "b"))
        went.set()

    thread = threading.Thread(target=second, daemon=True)
    thread.start()
    assert waiting.wait(TIMEOUT_S) and not went.wait(0.2)
    calls.resize(2)  # the waiting job goes now, beside the first
    assert went.wait(TIMEOUT_S)
    thread.join(TIMEOUT_S)
    calls.resize(1)
    assert calls.counts()["running"] == 1, "the running job keeps its seat"
    calls.apply(FairShare.release, first)


def test_a_waiting_job_of_a_running_conversation_lets_later_ones_pass() -> None:
    """Jobs take seats in turn, except that one held back by its own conversation's running job does not hold back
    a later conversation's."""
    calls = Calls(PublicSettings(busy_timeout_s=TIMEOUT_S, poll_s=0.05), capacity=2)
    running = seated(calls, "x", "a")
    started, went = threading.Event(), threading.Event()

    def second_of_a() -> None:
        started.set()
        call = seated(calls, "x", "a")  # waits for a's first job
        went.set()
        calls.apply(FairShare.release, call)

    thread = threading.Thread(target=second_of_a, daemon=True)
    thread.start()
    assert started.wait(TIMEOUT_S) and calls.wait(True, TIMEOUT_S)
    other = seated(calls, "y", "b")  # the free seat goes to b at once, though a's second job came first
    assert not went.is_set()
    calls.apply(FairShare.release, running)
    thread.join(TIMEOUT_S)
    assert went.is_set() and not thread.is_alive()
    calls.apply(FairShare.release, other)


def test_clients_take_turns_and_one_holding_most_shares_with_a_newcomer() -> None:
    """One sequence: a client with many waiting jobs does not go before another client's first. Two sequences: a
    client holding both is asked to yield one at once when another client's job waits, the yielded job coming back
    to the next free seat; and turn by turn, each answer yields after its quantum to the client holding one fewer."""
    clock = Clock()
    share = FairShare(PublicSettings(quantum_s=2.0), capacity=1)
    calls = [share.admit(clock.now, client, None, 1) for client in ("A", "A", "A", "B")]
    assert all(isinstance(call, Call) for call in calls)
    for call in calls:
        share.ask(clock.now, call, None, can_yield=True)  # type: ignore[arg-type]
    share.schedule(clock.now)
    first = calls[0]
    assert isinstance(first, Call) and first.seated
    share.release(clock.now + 1, first)
    share.schedule(clock.now + 1)
    assert [c.client for c in share.calls if c.seated] == ["B"], "B's first before A's others"
    two = FairShare(PublicSettings(), capacity=2)
    a1, a2, b1 = (two.admit(clock.now, client, None, 1) for client in ("A", "A", "B"))
    for call in (a1, a2):
        two.ask(clock.now, call, None, can_yield=True)  # type: ignore[arg-type]
    two.schedule(clock.now)
    two.ask(clock.now, b1, None, can_yield=True)  # type: ignore[arg-type]
    two.schedule(clock.now)
    asked = [c for c in (a1, a2) if isinstance(c, Call) and c.yield_asked]
    assert len(asked) == 1 and two.yields == 1, "A holds two more: one yields at once"
    two.yield_turn(clock.now + 0.1, asked[0])
    two.schedule(clock.now + 0.1)
    assert isinstance(b1, Call) and b1.seated and asked[0].state == State.YIELDED
    turns = FairShare(PublicSettings(quantum_s=2.0), capacity=1)
    a, b = turns.admit(clock.now, "A", None, 1), turns.admit(clock.now, "B", None, 1)
    assert isinstance(a, Call) and isinstance(b, Call)
    order = []
    for call in (a, b):
        turns.ask(clock.now, call, None, can_yield=True)
    turns.schedule(clock.now)
    for step in range(1, 60):  # steps of 0.1 s: each running answer yields after its 2 s turn
        now = clock.now + step * 0.1
        running = next(c for c in (a, b) if c.seated)
        if running.yield_asked:
            order.append(running.client)
            turns.yield_turn(now, running)
        turns.schedule(now)
    assert order == ["A", "B"] and turns.yields == 2, order


def test_a_waiting_job_looks_again_when_a_seat_holders_turn_ends() -> None:
    """While a call waits and no seat is free, the policy names the time the soonest turn reaches its quantum (the
    waiting job's next look, not a poll later); at that time the holder is asked to yield; with a free seat, or
    nobody waiting, there is no such time."""
    share = FairShare(PublicSettings(quantum_s=2.0), capacity=1)
    a, b = share.admit(0.0, "A", None, 1), share.admit(0.0, "B", None, 1)
    assert isinstance(a, Call) and isinstance(b, Call)
    assert share.turn_ends(0.0) is None
    share.ask(0.0, a, None, can_yield=True)
    share.schedule(0.0)
    assert a.seated and share.turn_ends(0.3) is None, "nobody waits"
    share.ask(0.3, b, None, can_yield=True)
    share.schedule(0.3)
    assert share.turn_ends(0.3) == 2.0 and not a.yield_asked
    share.schedule(1.999)
    assert not a.yield_asked
    share.schedule(2.0)
    assert a.yield_asked
    share.yield_turn(2.1, a)
    share.schedule(2.1)
    assert b.seated and share.turn_ends(2.1) == 4.1, "A waits again: B's turn ends a quantum after it began"
    share.release(2.5, b)
    assert share.turn_ends(2.5) is None, "a seat is free"


def test_a_client_waits_a_few_times_at_once_and_a_few_wait_in_all() -> None:
    """/wait holds a web server thread: a client's wait beyond WAITS_PER_CLIENT at once is refused at once, as is a
    wait beyond WAITS_AT_ONCE in all; a wait that has returned frees its place."""
    calls = Calls(capacity=1)
    clients = [f"client-{n // WAITS_PER_CLIENT}" for n in range(WAITS_AT_ONCE)]
    waiting = [threading.Thread(target=calls.wait, args=(True, TIMEOUT_S, client)) for client in clients]

    def refused(client: str) -> bool:
        try:
            calls.wait(True, 0.0, client)
        except RequestError:
            return True
        return False

    for thread in waiting:
        thread.start()
    deadline = time.monotonic() + TIMEOUT_S
    while calls.waits() < WAITS_AT_ONCE:  # until every wait has begun
        assert time.monotonic() < deadline
    assert refused("client-0"), "its waits at once already"
    assert refused("a newcomer"), "WAITS_AT_ONCE wait already"
    call = calls.admitted("client-0", 1)
    assert calls.seat(call)  # busy: every wait returns
    for thread in waiting:
        thread.join(TIMEOUT_S)
        assert not thread.is_alive()
    assert calls.wait(True, 0.0, "client-0") and calls.wait(True, 0.0, "a newcomer")


def test_stopping_a_job_that_waits_for_its_seat_frees_its_place_at_once() -> None:
    """Stop (ReplyJob.cancel) while a job waits for the engine: its wait ends and its place is free, with the seat's
    holder still running; its stream never opens."""
    asked = threading.Event()

    class Watched(FairShare):  # tells the test when a job has asked for a seat (under the lock, until it waits)
        def ask(self, now: float, call: Call, owner: str | None, can_yield: bool) -> None:
            super().ask(now, call, owner, can_yield)
            if call.client == "b":
                asked.set()

    calls = Calls(capacity=1)
    calls.policy = Watched(calls.settings, capacity=1)
    holder = calls.admitted("a", 1)
    assert calls.seat(holder)
    opened = threading.Event()

    def stream() -> Iterator[int]:
        opened.set()
        yield 1

    job = engine_job(stream, calls, client="b")

    async def stop_while_waiting() -> list[int]:
        async def consume() -> list[int]:
            return [chunk async for chunk in job.chunks()]

        consumer = asyncio.create_task(consume())
        assert await asyncio.to_thread(asked.wait, TIMEOUT_S), "the job never asked for a seat"
        assert calls.counts()["waiting"] == 1, "it waits: Stop comes while it does"
        job.cancel()
        return await consumer

    assert run(stop_while_waiting()) == []
    assert job.wait_done(TIMEOUT_S) and not opened.is_set()
    assert calls.counts() == {**calls.counts(), "running": 1, "waiting": 0, "places": 1}


def test_two_seats_stream_two_jobs_at_once() -> None:
    """With two seats, each of two jobs hands over a chunk while the other is still running: the first job goes on
    only once the second has sent its first chunk, and the second ends only after the first's second chunk."""
    calls = Calls(capacity=2)
    second_started, first_went_on = threading.Event(), threading.Event()

    def first() -> Iterator[str]:
        yield "first 1"
        if not second_started.wait(TIMEOUT_S):
            raise TimeoutError("the second job never ran beside the first")
        yield "first 2"
        first_went_on.set()

    def second() -> Iterator[str]:
        yield "second 1"
        second_started.set()
        if not first_went_on.wait(TIMEOUT_S):
            raise TimeoutError("the first job never went on beside the second")
        yield "second 2"

    async def both() -> tuple[list[str], list[str]]:
        async def consume(job: ReplyJob[str]) -> list[str]:
            return [chunk async for chunk in job.chunks()]

        return tuple(await asyncio.gather(consume(engine_job(first, calls, "x", owner="a")),  # type: ignore[return-value]
                                          consume(engine_job(second, calls, "y", owner="b"))))  # fmt: skip

    assert run(both()) == (["first 1", "first 2"], ["second 1", "second 2"])
    assert calls.counts()["running"] == 0


def test_the_traffic_floor_knows_when_the_server_ended_the_stream() -> None:
    """What tells the gate a stream's end from a hang-up: the floor has seen the app write the response's end."""
    written: list[Message] = []

    async def send(message: Message) -> None:
        written.append(message)

    async def stream() -> list[bool]:
        floor = TrafficFloor(send, 0, lambda: True, queue_heartbeat)
        seen = [floor.finished]
        await floor.send({"type": "http.response.start", "status": 200, "headers": []})
        await floor.send({"type": "http.response.body", "body": b"data: {}\n\n", "more_body": True})
        seen.append(floor.finished)
        await floor.send({"type": "http.response.body", "body": b"", "more_body": False})
        return [*seen, floor.finished]

    assert asyncio.run(stream()) == [False, False, True] and len(written) == 3


def test_the_gate_tells_a_stream_the_server_ended_from_a_hang_up_while_the_app_winds_down() -> None:
    """The server's hang-up news can come after the app wrote its stream's end but before the app returns: that is the
    server ending the stream, so a call of the session posted before waits for the page's next stream."""
    from dflash_runtime.space.web.gate import HttpGate

    now = [1000.0]

    class Watched(Calls):  # tells the app when the gate has taken the reader's end into account
        def apply(self, transition: Any, *args: Any, **kwargs: Any) -> Any:
            result = super().apply(transition, *args, **kwargs)
            if transition is FairShare.closed:
                told.set()
            return result

    calls = Watched(PublicSettings(reader_timeout_s=3.0), clock=lambda: now[0])
    call = calls.apply(FairShare.admit, "me", "s", 1)
    calls.apply(FairShare.queued, call, "e1")

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        await send({"type": "http.response.body", "body": b"data: {}\n\n", "more_body": False})
        ended.set()
        await asyncio.wait_for(told.wait(), TIMEOUT_S)  # the server winds down while the news comes

    async def receive() -> Message:
        await ended.wait()
        return {"type": "http.disconnect"}

    async def sent(_message: Message) -> None:
        return None

    async def read() -> None:
        scope = {"type": "http", "method": "GET", "path": "/gradio_api/queue/data", "query_string": b"session_hash=s",
                 "headers": []}  # fmt: skip
        await HttpGate(app, calls)(scope, receive, sent)

    told, ended = asyncio.Event(), asyncio.Event()
    run(read())
    now[0] += 2.0
    assert calls.start(call), "within the grace for the page's next stream: still queued"
    now[0] += 2.0
    assert not calls.alive(call), "no stream came within the grace: abandoned"
