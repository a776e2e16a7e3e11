"""ReplyJob: a blocking chunk stream handed to an async consumer, stopped when the consumer leaves or stops reading;
the engine slot's seats (as many jobs at once as the engine runs answers, one per cache owner); the HTTP gate's
rules for when a call is abandoned and how many may wait (callers.Callers, on a clock of its own)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from dflash_runtime.errors import RequestError
from dflash_runtime.space.web.callers import Call, Callers, GateSettings
from dflash_runtime.space.web.jobs import EngineSlot, ReplyJob
from dflash_runtime.space.web.probes import Message, PaddingBudget, TrafficFloor, queue_heartbeat

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


def run(coroutine: object) -> object:
    return asyncio.run(asyncio.wait_for(coroutine, TIMEOUT_S))  # type: ignore[arg-type]


def test_leaving_the_loop_closes_the_stream_and_frees_the_slot() -> None:
    stream, slot = Stream(), EngineSlot()
    job = ReplyJob(stream, slot)

    async def take_three() -> list[int]:
        taken = []
        async for chunk in job.chunks():
            taken.append(chunk)
            if len(taken) == 3:
                break
        return taken

    assert run(take_three()) == [1, 2, 3]
    assert job.cancelled and job.wait_done(TIMEOUT_S) and stream.closed.is_set()
    assert stream.produced < stream.count and not slot.busy()


def test_a_cancelled_consumer_stops_the_stream() -> None:
    gate = threading.Event()
    stream = Stream(gate=gate)
    job = ReplyJob(stream, EngineSlot())

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

    job = ReplyJob(stream, EngineSlot(), is_final=lambda chunk: chunk in (6, 12))

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
    job = ReplyJob(stream, EngineSlot(), orphan_timeout_s=0.2)

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
        run(consume(ReplyJob(failing, EngineSlot())))
    slot = EngineSlot(timeout_s=0.1)
    slot.acquire(client="another client")  # holds the engine: this job's client is not served for 0.1 s
    with pytest.raises(RequestError, match="the engine stayed busy"):
        run(consume(ReplyJob(Stream(), slot)))


def test_one_job_at_a_time_through_the_slot() -> None:
    slot, events = EngineSlot(), []
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

        one = asyncio.ensure_future(consume(ReplyJob(lambda: stream("first", True), slot)))
        await asyncio.to_thread(started.wait, TIMEOUT_S)
        two = asyncio.ensure_future(consume(ReplyJob(lambda: stream("second", False), slot)))
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


def test_a_call_is_abandoned_when_nobody_opens_its_result_in_time() -> None:
    clock = Clock()
    callers = Callers(GateSettings(reader_timeout_s=3.0), clock)
    call = callers.admit(1, 1, None)
    assert isinstance(call, Call)
    callers.queued(call, "e1")
    clock.now += 2.9
    assert callers.alive(call.id) and callers.start(call.id), "within the grace it runs"
    clock.now += 0.2
    assert not callers.alive(call.id)
    late = callers.admit(1, 1, None)
    assert isinstance(late, Call)
    callers.queued(late, "e2")
    clock.now += 3.1
    assert not callers.start(late.id), "abandoned while it waited: it never asks for a GPU"


def _read_call(clock: Clock) -> tuple[Callers, Any, Call]:
    """A session's reader, then a queued call of that session (grace 3 s)."""
    callers = Callers(GateSettings(reader_timeout_s=3.0), clock)
    reader = callers.opened("s")
    call = callers.admit(1, 1, "s")
    assert isinstance(call, Call)
    callers.queued(call, "e1")
    return callers, reader, call


def test_a_reader_that_leaves_after_the_call_abandons_it_at_once() -> None:
    clock = Clock()
    callers, reader, call = _read_call(clock)
    assert callers.start(call.id)
    clock.now += 60.0
    assert callers.alive(call.id), "read: it may run as long as it likes"
    callers.closed(reader)
    assert not callers.alive(call.id)
    # A later call of the session waits for its own reader for the grace, as a first one does.
    clock.now += 0.1
    later = callers.admit(1, 1, "s")
    assert isinstance(later, Call)
    callers.queued(later, "e2")
    assert callers.alive(later.id)
    clock.now += 3.1
    assert not callers.alive(later.id)


def test_a_stream_the_server_ends_is_no_hang_up() -> None:
    """Gradio ends a session's result stream once none of its events is pending. A call the page posted just before
    (its next message, sent as the last answer's final frame arrived) is neither dropped nor stopped: it waits for
    the page's next stream as a new call does; and once that stream comes it runs for as long as it is read."""
    clock = Clock()
    callers, reader, call = _read_call(clock)
    callers.closed(reader, hung_up=False)  # the server sent the stream's end
    assert callers.start(call.id), "a call posted before the server ended the stream is still queued"
    clock.now += 2.0
    assert callers.alive(call.id), "its client opens the next stream: the grace holds"
    callers.opened("s")
    clock.now += 60.0
    assert callers.alive(call.id)
    clock = Clock()
    callers, reader, call = _read_call(clock)
    callers.closed(reader, hung_up=False)
    clock.now += 3.1
    assert not callers.start(call.id), "no reader within the grace: abandoned, as any unread call"


def test_a_reader_that_takes_no_write_counts_as_gone() -> None:
    clock = Clock()
    callers, reader, call = _read_call(clock)
    callers.sending(reader, True)
    clock.now += 2.0
    assert callers.alive(call.id)
    callers.sending(reader, False)  # the write went through: a reader again
    callers.sending(reader, True)
    clock.now += 3.5
    assert not callers.alive(call.id)


def test_limits_count_answers_per_client_per_session_and_in_all() -> None:
    callers = Callers(GateSettings(client_jobs=4, session_jobs=3, total_jobs=6), Clock())
    assert isinstance(callers.admit(1, 2, "s", "me"), Call)  # an A/B run of two answers
    refused = callers.admit(1, 2, "s", "me")
    assert isinstance(refused, str) and "this session has 2 answers queued or running" in refused
    ended = callers.admit(1, 1, "s", "me")
    assert isinstance(ended, Call)
    callers.end(ended.id)
    assert isinstance(callers.admit(1, 1, "s", "me"), Call), "an ended call frees its place"
    first = callers.admit(1, 1, None, "me")  # session-less: counted as its client's
    assert isinstance(first, Call)
    over = callers.admit(1, 1, "fresh-session", "me")
    assert isinstance(over, str) and "you have 4 answers queued or running (in all your sessions)" in over
    callers.queued(first, None)  # Gradio refused it: its place is free again
    assert isinstance(callers.admit(1, 1, "t", "other"), Call) and isinstance(callers.admit(1, 1, "u", "more"), Call)
    newest = callers.admit(1, 1, "w", "me")
    assert isinstance(newest, Call)
    # The total is full: a client with none gets in by taking the newest place of the client with the most.
    taker = callers.admit(1, 1, "v", "yet-another")
    assert isinstance(taker, Call) and callers.taken(newest.id) and not callers.taken(taker.id)
    even = Callers(GateSettings(total_jobs=2), Clock())
    assert isinstance(even.admit(1, 1, "a", "one"), Call) and isinstance(even.admit(1, 1, "b", "two"), Call)
    full = even.admit(1, 1, "c", "three")  # nobody holds more than the newcomer would: no place to take
    assert isinstance(full, str) and "its limit is 2" in full
    alone = Callers(GateSettings(session_jobs=3), Clock())
    big = alone.admit(1, 5, "s")  # an A/B run of four methods and plain decoding, alone in its session
    assert isinstance(big, Call) and isinstance(alone.admit(1, 5, "s"), str)


def test_a_queued_call_its_client_cancels_frees_its_place() -> None:
    callers = Callers(GateSettings(session_jobs=2), Clock())
    ab = callers.admit(1, 2, "s")
    assert isinstance(ab, Call)
    callers.queued(ab, "e1")
    assert isinstance(callers.admit(1, 1, "s"), str), "the session's places are taken"
    callers.withdrawn("e1")  # Stop while it waited: Gradio drops it from the queue, no handler runs
    assert isinstance(callers.admit(1, 2, "s"), Call)


def test_a_waiting_call_whose_reader_leaves_frees_its_place() -> None:
    callers = Callers(GateSettings(session_jobs=1), Clock())
    reader = callers.opened("s")
    call = callers.admit(1, 1, "s")
    assert isinstance(call, Call)
    callers.queued(call, "e1")
    callers.closed(reader)  # Gradio drops the session's waiting events
    assert isinstance(callers.admit(1, 1, "s"), Call) and not callers.start(call.id)


def test_a_job_nobody_reads_stops_itself() -> None:
    stream, reading = Stream(), threading.Event()
    reading.set()
    job = ReplyJob(stream, EngineSlot(), alive=reading.is_set)

    async def read_until(count: int) -> list[int]:
        taken = []
        async for chunk in job.chunks():
            taken.append(chunk)
            if len(taken) == count:
                reading.clear()  # the reader is gone: the job ends the stream at its next chunk
        return taken

    taken = run(read_until(3))
    assert taken[:3] == [1, 2, 3] and job.wait_done(TIMEOUT_S) and stream.closed.is_set()
    assert stream.produced < stream.count


def test_the_slot_seats_up_to_its_capacity_and_one_job_per_owner() -> None:
    """Two seats: two owners run at once; a third job waits (and is refused once its wait is up), as does a second
    job of an owner already running, with a message that says why; a freed seat goes to the next job at once."""
    slot = EngineSlot(timeout_s=0.2, capacity=2)
    first, second = slot.acquire("a", "x"), slot.acquire("b", "y")
    assert slot.running() == 2 and slot.busy()
    with pytest.raises(RequestError, match=r"the engine stayed busy for 0 s; retry"):
        slot.acquire("c", "z")  # a client served not at all for the busy timeout
    slot.release(second)
    with pytest.raises(RequestError, match="this session's previous answer was still running"):
        slot.acquire("a", "w")
    fresh = slot.acquire(None, "v")  # nobody's (a session-less call): a fresh owner, it waits for nobody's turn
    slot.release(first)
    again = slot.acquire("a", "x")
    assert slot.running() == 2
    slot.release(fresh)
    slot.release(again)
    assert not slot.busy() and slot.wait(False, 0.0)
    with pytest.raises(ValueError, match="capacity must be at least 1"):
        EngineSlot(capacity=0)


def test_a_resized_slot_seats_what_the_loaded_engine_holds() -> None:
    """The slot starts at the most the queue lets through and is resized to the loaded engine's sequences: a job
    beyond them waits, and one waiting goes at once when the slot grows; a running job keeps its seat when it
    shrinks."""
    slot = EngineSlot(timeout_s=TIMEOUT_S, capacity=1)
    first = slot.acquire("a")
    waiting, seated = threading.Event(), threading.Event()

    def second() -> None:
        waiting.set()
        slot.release(slot.acquire("b"))
        seated.set()

    thread = threading.Thread(target=second, daemon=True)
    thread.start()
    assert waiting.wait(TIMEOUT_S) and not seated.is_set()
    slot.resize(2)  # the waiting job goes now, beside the first
    assert seated.wait(TIMEOUT_S)
    thread.join(TIMEOUT_S)
    slot.resize(1)
    assert slot.running() == 1, "the running job keeps its seat"
    slot.timeout_s = 0.0
    with pytest.raises(RequestError, match="the engine stayed busy"):
        slot.acquire("c", "another client")  # (a client that holds a seat waits its turn however long)
    slot.release(first)
    slot.release(slot.acquire("c", "another client"))
    with pytest.raises(ValueError, match="capacity must be at least 1"):
        slot.resize(0)


def test_a_waiting_job_of_a_running_owner_lets_later_owners_pass() -> None:
    """Jobs take seats in the order they came, except that one held back by its own owner's running job does not
    hold back a later owner's."""
    slot = EngineSlot(timeout_s=TIMEOUT_S, capacity=2)
    running = slot.acquire("a")
    waiting_started, seated = threading.Event(), threading.Event()

    def second_of_a() -> None:
        waiting_started.set()
        seat = slot.acquire("a")  # waits for a's first job
        seated.set()
        slot.release(seat)

    thread = threading.Thread(target=second_of_a, daemon=True)
    thread.start()
    assert waiting_started.wait(TIMEOUT_S)
    other = slot.acquire("b")  # the free seat goes to b at once, though a's second job came first
    assert not seated.is_set()
    slot.release(running)
    thread.join(TIMEOUT_S)
    assert seated.is_set() and not thread.is_alive()
    slot.release(other)


def test_two_seats_stream_two_jobs_at_once() -> None:
    """With two seats, each of two jobs hands over a chunk while the other is still running: the first job goes on
    only once the second has sent its first chunk, and the second ends only after the first's second chunk."""
    slot = EngineSlot(capacity=2)
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

        return tuple(await asyncio.gather(consume(ReplyJob(first, slot, owner="a")),  # type: ignore[return-value]
                                          consume(ReplyJob(second, slot, owner="b"))))  # fmt: skip

    assert run(both()) == (["first 1", "first 2"], ["second 1", "second 2"])
    assert not slot.busy()


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


def test_padding_is_bounded_per_client_and_in_total() -> None:
    """The reader probes' padding (probes.PaddingBudget): one second's worth a bucket, refilled by the clock; one
    client's streams share its rate, every client's share the total."""
    clock = Clock()
    budget = PaddingBudget(client_bytes_s=1000, total_bytes_s=2500, clock=clock)
    assert [budget.take("a", 600), budget.take("a", 600), budget.take("b", 600)] == [600, 400, 600]
    assert budget.take("c", 5000) == 900, "what is left of the total"
    assert budget.take("d", 5000) == 0, "the total is spent"
    clock.now += 0.5
    assert budget.take("a", 5000) == 500 and budget.take("e", 5000) == 750
    clock.now += 10.0
    sent = sum(budget.take(client, 10_000) for client in "abcdefgh")
    assert sent == 2500, "after a pause: at most one second's worth in all"
    assert PaddingBudget(1000, 2500, clock=clock).take("z", 30) == 0, "too small a grant waits for the next tick"
