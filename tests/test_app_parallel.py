"""Several visitors at once, through the real server: app.py in the offline demo at DFLASH_PARALLEL=2, driven by
gradio_client and raw HTTP. Two visitors' answers stream at the same time (each receives chunks before the other
ends), each with its own statistics and its own text; one conversation's calls take turns (they share its cached
prompt); a caller who hangs up stops its own answer within seconds while the other one streams on."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from app_fixtures import REPO_ROOT, RunningApp, running_app
from gradio_client import Client
from space_client import chat_args, expected_answer, info_when, prompt_length, raw_body, rebuilt, reference_engine

N_CTX = 1024
MAX_NEW_TOKENS = 3000
PARALLEL = 2
TIMEOUT_S = 180.0


@pytest.fixture(scope="module")
def server() -> Iterator[RunningApp]:
    env = {"DFLASH_DEMO": "tiny", "DFLASH_N_CTX": str(N_CTX), "DFLASH_MAX_NEW_TOKENS": str(MAX_NEW_TOKENS),
           "DFLASH_PARALLEL": str(PARALLEL)}  # fmt: skip
    with running_app(env, REPO_ROOT / "test-artifacts" / "app_parallel_server.log") as app:
        yield app


@pytest.fixture(scope="module")
def reference() -> Iterator[Any]:
    with reference_engine(N_CTX) as engine:
        yield engine


@dataclass
class TimedAnswer:
    """A /chat answer read in a thread of its own, with the time each item came (`started` once `first` came)."""

    items: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    first: int = 2
    started: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None
    thread: threading.Thread | None = None

    def read(self, client: Client, args: dict[str, Any]) -> TimedAnswer:
        def pump() -> None:
            try:
                job = client.submit(**args, api_name="/chat")
                for output in job:
                    self.items.append(tuple(output))  # type: ignore[arg-type]
                    self.times.append(time.monotonic())
                    if len(self.items) >= self.first:
                        self.started.set()
                job.result()  # the server's error, if any
            except BaseException as error:  # raised in the test's thread (see `end`)
                self.error = error
            finally:
                self.started.set()

        self.thread = threading.Thread(target=pump, daemon=True)
        self.thread.start()
        return self

    def wait_started(self) -> None:
        assert self.started.wait(TIMEOUT_S), f"fewer than {self.first} items within {TIMEOUT_S} s"
        assert self.error is None, self.error

    def end(self) -> tuple[str, dict[str, Any]]:
        """The whole answer (text and final statistics), once it has ended."""
        assert self.thread is not None
        self.thread.join(TIMEOUT_S)
        assert not self.thread.is_alive(), f"the answer did not end within {TIMEOUT_S} s"
        assert self.error is None, self.error
        return rebuilt(self.items)[-1]

    def during(self, other: TimedAnswer) -> int:
        """How many of this answer's items came while `other` streamed (after its first item, before its last)."""
        return sum(1 for t in self.times if other.times[0] < t < other.times[-1])


def new_client(server: RunningApp) -> Client:
    """A visitor of its own: gradio_client keeps one session per Client."""
    return Client(server.url, verbose=False)


def test_two_visitors_answers_stream_at_the_same_time_each_with_its_own_statistics(
    server: RunningApp, reference: Any
) -> None:
    info = new_client(server).predict(api_name="/info")
    assert info["parallel"] == PARALLEL and info["presets"]["tiny-random"]["parallel"] == PARALLEL
    first_args = chat_args("hello there, tell me a long story", max_tokens=700, draft_length="auto")
    second_args = chat_args("the quick brown fox", max_tokens=300, draft_length=3)
    first = TimedAnswer().read(new_client(server), first_args)
    first.wait_started()  # the first answer streams; the second visitor asks now
    second = TimedAnswer().read(new_client(server), second_args)
    second.wait_started()
    running = new_client(server).predict(api_name="/info")
    first_text, first_stats = first.end()
    second_text, second_stats = second.end()

    # Both streamed at once: each received items while the other was streaming, many of them (one at a time, the
    # second's first item would come after the first's last).
    assert second.times[0] < first.times[-1] and first.times[0] < second.times[-1]
    assert first.during(second) >= 10 and second.during(first) >= 10, (first.during(second), second.during(first))
    assert running["busy"] is True and running["running"] >= 1
    # Each visitor's statistics and text are its own, as if it had been alone.
    for args, text, stats in ((first_args, first_text, first_stats), (second_args, second_text, second_stats)):
        messages = [{"role": "user", "content": args["message"]}]
        assert stats["n_generated"] == args["max_tokens"] and stats["finish_reason"] == "length"
        assert stats["n_prompt"] == prompt_length(reference, messages) and stats["n_reused"] == 0
        assert stats["draft_length"] == args["draft_length"] and stats["decode_tok_s"] > 0
        assert sum(n for n, _ in stats["source_runs"]) == len(text)
        assert text == expected_answer(reference, messages, args["max_tokens"])
    assert first_stats["draft_lengths"] != second_stats["draft_lengths"]
    assert info_when(new_client(server), "idle")["running"] == 0
    assert "Traceback" not in server.log()


def test_one_visitors_calls_take_turns(server: RunningApp) -> None:
    """Two calls of one session (one cache owner, one parked prompt) do not run at once: the second's first item
    comes after the first's last, though the engine has a free sequence. (Each answer is read in a thread of its own,
    so the two readers may note the first's last item and the second's first in either order: at most the first's
    last two items may be noted after the second began, where answers running at once would interleave throughout.)"""
    client = new_client(server)
    first = TimedAnswer().read(client, chat_args("one two three", max_tokens=200))
    first.wait_started()
    second = TimedAnswer(first=1).read(client, chat_args("four five six", max_tokens=50))
    first.end()
    second.end()
    after = sum(1 for t in first.times if t > second.times[0])
    assert len(first.times) >= 10 and after <= 2, (len(first.times), after)


def test_a_caller_who_hangs_up_stops_its_answer_while_the_other_streams_on(server: RunningApp, reference: Any) -> None:
    """A raw HTTP call and a gradio_client call stream at once; the raw caller closes its result stream: its answer
    stops within two seconds (one answer runs again), and the other answer goes on to its end, unchanged."""
    monitor = new_client(server)
    other_args = chat_args("seven eight nine", max_tokens=900)
    other = TimedAnswer().read(new_client(server), other_args)
    other.wait_started()
    base = server.url.rstrip("/") + "/gradio_api/call/chat"
    body = raw_body(chat_args("hello there", max_tokens=MAX_NEW_TOKENS, draft_length="auto"))
    with httpx.Client(timeout=60) as http:
        event_id = http.post(base, content=body, headers={"Content-Type": "application/json"}).json()["event_id"]
        with http.stream("GET", f"{base}/{event_id}") as stream:
            lines = stream.iter_lines()
            while next(lines) != "event: generating":  # the raw call is answering, beside the other one
                pass
            hung_up = time.monotonic()
    deadline = hung_up + 30.0
    while (running := monitor.predict(api_name="/info")["running"]) > 1:  # polled to a deadline
        assert time.monotonic() < deadline, "the abandoned answer did not stop"
    stopped_s = time.monotonic() - hung_up
    assert running == 1 and other.thread is not None and other.thread.is_alive(), "the other answer still streams"
    text, stats = other.end()
    assert stopped_s < 2.0, f"the abandoned answer ran on for {stopped_s:.1f} s"
    assert stats["n_generated"] == 900 and text == expected_answer(
        reference, [{"role": "user", "content": other_args["message"]}], 900
    )
