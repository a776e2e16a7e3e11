"""The engine's contract cannot deadlock: per-request cancellation, busy and closed engines, use after close.

Every scenario that could hang runs in a thread joined with a timeout, so a regression fails instead of hanging."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from pairs import pair_files

from dflash_runtime import DFlashDraftModel, DFlashLlama, EngineBusyError, EngineClosedError, load_pair
from dflash_runtime.drafters.dflash import BlockDrafter
from dflash_runtime.errors import DecodeError
from dflash_runtime.native.batches import TokenBatch
from dflash_runtime.native.ext import dflash_api

LIMIT_S = 20.0


def within(seconds: float, action: Callable[[], Any]) -> Any:
    """Run `action` in a thread; fail the test if it does not return within `seconds`."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = action()
        except BaseException as error:  # handed to the test thread
            box["error"] = error

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"did not return within {seconds} s (a deadlock?)"
    if "error" in box:
        raise box["error"]
    return box.get("value")


@pytest.fixture
def engine():
    files = pair_files("hybrid", "dflash2")
    eng = load_pair(files.target, files.draft, n_ctx=1024, draft_capacity=7, busy_timeout_s=5.0)
    yield eng
    eng.close()


def test_close_with_a_suspended_stream_returns_and_the_stream_ends_cleanly(engine) -> None:
    stream = engine.stream("the quick brown fox", max_tokens=100, draft_length=7)
    first = next(stream)
    assert first.finish_reason is None
    within(LIMIT_S, engine.close)
    last = within(LIMIT_S, lambda: next(stream))
    assert last.finish_reason == "cancelled" and "closed" in last.finish_detail
    assert last.stats.n_generated == first.stats.n_generated
    with pytest.raises(StopIteration):
        next(stream)
    with pytest.raises(EngineClosedError):
        engine.generate("hello")


def test_a_second_request_on_the_thread_holding_a_suspended_stream_is_refused_at_once(engine) -> None:
    stream = engine.stream("the quick brown fox", max_tokens=100, draft_length=7)
    next(stream)
    # Same thread, so no watchdog thread: the engine's 5 s busy timeout bounds a regression instead of a hang.
    started = time.monotonic()
    with pytest.raises(EngineBusyError, match="suspended stream"):
        engine.generate("hello world", max_tokens=4)
    with pytest.raises(EngineBusyError, match="suspended stream"):
        next(iter(engine.stream("hello world", max_tokens=4)))
    with pytest.raises(EngineBusyError, match="suspended stream"):
        engine.reset()
    assert time.monotonic() - started < 4.0  # at once: no wait for the busy timeout
    stream.close()
    assert within(LIMIT_S, lambda: engine.generate("hello world", max_tokens=4)).finish_reason == "length"


def test_other_threads_wait_for_the_engine_with_a_timeout(engine) -> None:
    stream = engine.stream("the quick brown fox", max_tokens=100, draft_length=7)
    next(stream)
    waiter: dict[str, Any] = {}
    entered = threading.Event()

    def other_thread() -> None:
        entered.set()
        waiter["result"] = engine.generate("hello world", max_tokens=4)

    thread = threading.Thread(target=other_thread, daemon=True)
    thread.start()
    assert entered.wait(LIMIT_S)
    for _ in stream:  # finishing the stream lets the waiting thread in
        pass
    thread.join(LIMIT_S)
    assert not thread.is_alive() and waiter["result"].finish_reason == "length"
    # A waiter that outlasts the busy timeout gets EngineBusyError, not a hang.
    held = engine.stream("one two three", max_tokens=100, draft_length=7)
    next(held)
    files = pair_files("hybrid", "dflash2")
    with load_pair(files.target, files.draft, n_ctx=256, busy_timeout_s=0.2) as quick:
        stuck = quick.stream("one two", max_tokens=50)
        next(stuck)
        with pytest.raises(EngineBusyError, match="stayed busy"):
            within(LIMIT_S, lambda: quick.generate("hello", max_tokens=2))
        stuck.close()
    held.close()


def test_a_cancel_before_the_first_step_is_honoured_and_belongs_to_one_request(engine) -> None:
    stream = engine.stream("the quick brown fox", max_tokens=50)
    stream.cancel()
    events = list(stream)
    assert len(events) == 1 and events[0].finish_reason == "cancelled" and events[0].tokens == []
    pending = engine.stream("hello world", max_tokens=50)
    engine.cancel()  # cancels the streams that exist now, started or not
    assert [e.finish_reason for e in pending][-1] == "cancelled"
    later = engine.generate("hello world", max_tokens=12)  # created after the cancel: unaffected
    assert later.finish_reason == "length" and len(later.tokens) == 12


def test_a_long_prefill_can_be_cancelled_between_chunks() -> None:
    files = pair_files("hybrid", "dflash2")
    with load_pair(files.target, files.draft, n_ctx=4096, n_batch=8, draft_capacity=7) as eng:
        prompt = [5 + i % 300 for i in range(3000)]
        progress: list[tuple[int, int]] = []
        box: dict[str, Any] = {}

        def on_prefill(done: int, total: int) -> None:
            progress.append((done, total))
            if len(progress) == 3:
                box["stream"].cancel()  # a cancel from another thread lands the same way: between two chunks

        box["stream"] = stream = eng.stream(prompt, max_tokens=4, on_prefill=on_prefill)
        events = within(LIMIT_S, lambda: list(stream))
        assert events[-1].finish_reason == "cancelled" and not any(e.tokens for e in events)
        chunk = eng.n_batch  # 9: the verify batch of 8 rows must fit one ubatch
        assert progress == [(chunk, 3000), (2 * chunk, 3000), (3 * chunk, 3000)]  # stopped before the next chunk
        assert eng.info()["n_cached"] == 3 * chunk
        # The partial prefill is a valid cache: the next request reuses it and answers exactly.
        done = eng.generate(prompt[:1000], max_tokens=8)
        assert done.stats.n_reused == 3 * chunk
    with load_pair(files.target, files.draft, n_ctx=4096, n_batch=8) as fresh:
        assert fresh.generate(prompt[:1000], max_tokens=8).tokens == done.tokens


def test_every_public_method_after_close_raises(engine) -> None:
    engine.close()
    engine.close()  # idempotent
    calls: list[Callable[[], Any]] = [
        lambda: engine.generate("hi"),
        lambda: engine.stream("hi"),
        lambda: engine.chat([{"role": "user", "content": "hi"}]),
        lambda: engine.stream_chat([{"role": "user", "content": "hi"}]),
        lambda: engine.render_chat([{"role": "user", "content": "hi"}]),
        lambda: engine.chat_tokens([{"role": "user", "content": "hi"}]),
        lambda: engine.tokenize("hi"),
        lambda: engine.detokenize([5, 6]),
        lambda: engine.token_text(5),
        engine.info,
        engine.reset,
        engine.cancel,
    ]
    for call in calls:
        with pytest.raises(EngineClosedError):
            call()


def test_llama_compat_methods_after_close_raise() -> None:
    files = pair_files("dense", "dflash2")
    llm = DFlashLlama(model_path=str(files.target), draft_model=DFlashDraftModel(files.draft), n_ctx=256)
    llm.close()
    calls: list[Callable[[], Any]] = [
        llm.token_eos,
        llm.token_bos,
        llm.token_nl,
        llm.n_ctx,
        llm.n_vocab,
        llm.n_embd,
        llm.reset,
        lambda: llm.tokenize(b"hi"),
        lambda: llm.detokenize([5, 6]),
        lambda: llm.create_completion("hi", max_tokens=2),
        lambda: llm.create_chat_completion([{"role": "user", "content": "hi"}], max_tokens=2),
        lambda: llm("hi", max_tokens=2),
    ]
    for call in calls:
        with pytest.raises(EngineClosedError):
            call()


def test_a_stream_left_unread_at_its_last_event_does_not_hold_the_engine(engine) -> None:
    stream = engine.stream("hello world", max_tokens=3)
    for event in stream:
        if event.finish_reason:
            break  # the caller stops at the last event without reading past it
    assert within(LIMIT_S, lambda: engine.generate("hello world", max_tokens=3)).finish_reason == "length"


def test_the_draft_length_is_clamped_to_the_room_left_before_drafting(engine) -> None:
    """A round never drafts (nor plans to draft) past max_tokens: the controller learns the cost of what ran."""
    for max_tokens in (2, 3, 5, 9):
        for policy in (7, "auto"):
            events = list(engine.stream("the quick brown fox", max_tokens=max_tokens, draft_length=policy))
            stats = events[-1].stats
            steps = len(stats.draft_lengths)
            planned = stats.controller.get("recent_lengths", stats.draft_lengths)[-steps:] if steps else []
            generated = len(events[0].tokens)  # the prefill's first token
            for step, event in enumerate(events[1:]):
                room = max_tokens - generated - 1
                assert stats.draft_lengths[step] <= max(room, 0) and planned[step] <= max(room, 0), (
                    max_tokens, policy, planned, stats.draft_lengths)
                generated += len(event.tokens)
            assert generated == max_tokens


def test_a_failed_draft_decode_is_raised_as_itself() -> None:
    """The block's cleanup runs in a finally: its own failure must not hide the decode error that came first."""
    files = pair_files("dense", "dflash2")
    with load_pair(files.target, files.draft, n_ctx=64, draft_capacity=7) as eng:
        spec, pair = eng.spec, eng.pair
        drafter = BlockDrafter(dflash_api(), eng.draft_ctx, spec, pair.n_embd_draft, pair.n_vocab)
        eng.generate("hello world", max_tokens=1)
        try:
            with pytest.raises(DecodeError, match="draft block"):
                drafter.draft(10**7, 3, 7)  # a token id outside the vocabulary: libllama refuses the batch
        finally:
            drafter.free()
        assert eng.generate("hello world", max_tokens=4).finish_reason == "length"  # the engine is unharmed
    batch = TokenBatch(4)
    with pytest.raises(ValueError):
        batch.fill([], 0, outputs="all")
    batch.free()
