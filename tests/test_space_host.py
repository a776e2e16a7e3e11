"""The engine host on the real tiny pair: errors end the stream as data, request errors keep the engine, engine
failures close it for the next request to reload, and a closed reply stops the engine between two steps; with
parallel sequences, two visitors' requests stream at once; an answer closed between two steps (of its prompt, or of
its answer) goes on exactly from what its chunks said."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import replace
from threading import Event, Thread
from typing import Any

import pytest
from space_client import demo_pair, expected_answer, reference_engine, whole_reply

from dflash_runtime import load_pair
from dflash_runtime.files.footprint import DEFAULT_RESERVE_BYTES, sequence_footprint
from dflash_runtime.files.gguf_meta import read_gguf
from dflash_runtime.native.backends import FreeMemory
from dflash_runtime.space.gpu.host import EngineHost
from dflash_runtime.space.gpu_job import AnswerSoFar, GpuJob, ReplyChunk, info_digest
from dflash_runtime.space.requests import DEFAULT_SYSTEM_PROMPT, Limits, build_request
from dflash_runtime.space.scrub import PRIVATE_ENGINE_KEYS
from dflash_runtime.space.setup.presets import ResolvedPair, configured_preset
from dflash_runtime.space.setup.settings import PublicSettings
from dflash_runtime.testing.tiny_models import pair_paths

N_CTX = 1024


class RecordingLoader:
    """load_pair, keeping the engines it opened (so a test can break one behind the host's back)."""

    def __init__(self) -> None:
        self.engines: list[Any] = []
        self.options: list[dict[str, Any]] = []  # what each load was asked for

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        engine = load_pair(*args, **kwargs)
        self.engines.append(engine)
        self.options.append(kwargs)
        return engine


@pytest.fixture
def host() -> Iterator[tuple[EngineHost, RecordingLoader]]:
    loader = RecordingLoader()
    host = EngineHost(loader)
    yield host, loader
    host.close()


def job(message: str, max_tokens: int = 16, **fields: Any) -> GpuJob:
    preset = configured_preset(True, {"DFLASH_N_CTX": str(N_CTX)}, pair_paths)
    pair = demo_pair()
    request = build_request(preset=preset.name, presets=[preset.name], limits=Limits(), message=message,
                            max_tokens=max_tokens, draft_length=7, **fields)  # fmt: skip
    return GpuJob(request, preset, ResolvedPair(pair.target, pair.draft))


def reply(engine_host: EngineHost, message: str, owner: str, **fields: Any) -> ReplyChunk:
    return whole_reply(engine_host.run(replace(job(message, **fields), cache_owner=owner)))


def test_request_errors_come_back_as_data_and_keep_the_engine(host: tuple[EngineHost, RecordingLoader]) -> None:
    engine_host, loader = host
    first = whole_reply(engine_host.run(job("hello world")))
    assert first.finish_reason == "length" and first.worker["loaded_now"] and first.worker["engine_loaded"]
    error = whole_reply(engine_host.run(job("0123456789 " * 200)))
    assert error.error_type == "PromptTooLongError" and "context cannot hold it" in (error.error or "")
    assert error.worker["engine_loaded"] is True and error.delta == ""
    again = whole_reply(engine_host.run(job("hello world")))
    assert again.delta == first.delta and again.worker["loads"] == 1 and len(loader.engines) == 1
    assert again.worker["previous_request"]["error_type"] == "PromptTooLongError"


def test_an_engine_failure_closes_the_engine_and_the_next_request_loads_it_again(
    host: tuple[EngineHost, RecordingLoader],
) -> None:
    engine_host, loader = host
    whole_reply(engine_host.run(job("hello world")))
    loader.engines[0].close()  # the engine breaks between two requests
    failed = whole_reply(engine_host.run(job("hello world")))
    assert failed.error_type == "EngineClosedError" and failed.worker["engine_loaded"] is False
    recovered = whole_reply(engine_host.run(job("hello world")))
    assert recovered.finish_reason == "length" and recovered.worker["loaded_now"] and recovered.worker["loads"] == 2
    with reference_engine(N_CTX) as reference:
        assert recovered.delta == expected_answer(reference, [{"role": "user", "content": "hello world"}], 16)


def test_closing_a_reply_stops_the_engine_and_is_recorded(host: tuple[EngineHost, RecordingLoader]) -> None:
    engine_host, _ = host
    stream = engine_host.run(job("hello there", max_tokens=400))
    for _ in range(3):
        next(stream)
    stream.close()
    after = whole_reply(engine_host.run(job("one two three")))
    stopped = after.worker["previous_request"]
    assert stopped["finish_reason"] == "closed by the caller" and 0 < stopped["n_generated"] < 400
    assert after.engine_info["target"] == demo_pair().target.name, "file names only, no server paths"


SECRET_SYSTEM = "Internal discount code: ZEBRA-4417. Never tell it."


def test_a_visitor_reuses_only_its_own_cached_prompt(host: tuple[EngineHost, RecordingLoader]) -> None:
    """Visitor V's private system prompt is cached; visitor A, guessing it, learns nothing from the reuse figures (the
    same for a right and a wrong guess, no more than the template's public start); V's own next turn reuses it."""
    engine_host, _ = host
    victim = reply(engine_host, "what is the code?", "victim", system_prompt=SECRET_SYSTEM)
    assert victim.stats["n_reused"] == 0
    guesses = {}
    for guess in ("ZEBRA-4417", "ZEBRA-1234", "LION-0000"):
        reply(engine_host, "what is the code?", "victim", system_prompt=SECRET_SYSTEM)  # V's cache is warm again
        system = SECRET_SYSTEM.replace("ZEBRA-4417", guess)
        # Each guess from a session of its own: what a session sent itself it may reuse.
        guesses[guess] = reply(engine_host, "what is the code?", f"attacker {guess}", system_prompt=system,
                               max_tokens=1).stats  # fmt: skip
    reused = {guess: stats["n_reused"] for guess, stats in guesses.items()}
    assert len(set(reused.values())) == 1, f"the reuse figure depends on the guess: {reused}"
    public = template_start()
    assert reused["ZEBRA-4417"] <= public
    history = [{"role": "user", "content": "what is the code?"}, {"role": "assistant", "content": "no"}]
    again = reply(engine_host, "and now?", "victim", system_prompt=SECRET_SYSTEM, history=history)
    assert again.stats["n_reused"] > public, "the engine parks each owner's cache: even after another visitor's"
    history += [{"role": "user", "content": "and now?"}, {"role": "assistant", "content": again.delta}]
    third = reply(engine_host, "one more?", "victim", system_prompt=SECRET_SYSTEM, history=history)
    assert third.stats["n_reused"] > public, "a visitor's own next turn reuses its cached prompt"


def template_start() -> int:
    """How many prompt tokens any conversation with a system message shares: the template's public start."""
    with reference_engine(N_CTX) as reference:
        a, b = (reference.chat_tokens([{"role": "system", "content": text}, {"role": "user", "content": "y"}],
                                      enable_thinking=False) for text in ("x", "z"))  # fmt: skip
    return next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)


def test_chunks_carry_what_each_step_added(host: tuple[EngineHost, RecordingLoader]) -> None:
    """The reply's chunks: text and runs as deltas, draft lengths as added, the engine's description only when the
    web process does not hold it already, the worker's report on the first and last chunk only."""
    engine_host, _ = host
    chunks = list(engine_host.run(job("hello there", max_tokens=64)))
    assert len(chunks) > 3
    assert chunks[0].engine_info and all(c.engine_info is None for c in chunks[1:])
    assert not set(PRIVATE_ENGINE_KEYS) & set(chunks[0].engine_info), "nothing of the cache's state, no counts"
    assert [bool(c.worker) for c in chunks] == [True] + [False] * (len(chunks) - 2) + [True]
    assert all(sum(n for n, _ in c.source_runs) == len(c.delta) for c in chunks)
    assert "draft_lengths" not in chunks[-1].stats
    with reference_engine(N_CTX) as reference:
        result = reference.chat([{"role": "user", "content": "hello there"}], enable_thinking=False, max_tokens=64,
                                temperature=0.0, draft_length=7)  # fmt: skip
    assert [n for c in chunks for n in c.draft_lengths] == result.stats.draft_lengths and result.stats.draft_lengths
    assert "".join(c.delta for c in chunks) == result.text
    known = replace(job("hello there"), engine_info_seen=info_digest(chunks[0].engine_info))
    assert all(c.engine_info is None for c in engine_host.run(known)), "nothing is sent twice"


def test_the_default_system_prompt_is_public_and_reused_across_visitors(
    host: tuple[EngineHost, RecordingLoader],
) -> None:
    """The page's system prompt up to where a visitor's own text begins is public: another visitor reuses exactly
    that much (with an engine that parks owners' caches), never more, whatever the visitor before sent."""
    engine_host, _ = host
    with reference_engine(N_CTX) as reference:
        a, b = (reference.chat_tokens([{"role": "system", "content": DEFAULT_SYSTEM_PROMPT},
                                       {"role": "user", "content": text}], enable_thinking=False)
                for text in ("a", "b"))  # fmt: skip
    public = next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
    reply(engine_host, "my private question", "first", system_prompt=DEFAULT_SYSTEM_PROMPT)
    second = reply(engine_host, "my private question too", "second", system_prompt=DEFAULT_SYSTEM_PROMPT)
    # Whether the visitor before used the page's system prompt or one of its own makes no difference either.
    reply(engine_host, "my private question", "third", system_prompt=DEFAULT_SYSTEM_PROMPT[:-1] + "!")
    fourth = reply(engine_host, "another question", "fourth", system_prompt=DEFAULT_SYSTEM_PROMPT)
    assert second.stats["n_reused"] == fourth.stats["n_reused"] == public > template_start()


def test_the_methods_demo_pair_drafts_with_both_methods(host: tuple[EngineHost, RecordingLoader]) -> None:
    """DFLASH_DEMO_PAIR=methods: the offline demo's hybrid target carries an MTP head beside its DFlash 2 draft."""
    engine_host, _ = host
    preset = configured_preset(True, {"DFLASH_N_CTX": str(N_CTX), "DFLASH_DEMO_PAIR": "methods"}, pair_paths)
    assert "MTP head" in preset.label
    pair = ResolvedPair(preset.target.local_path, preset.draft.local_path)
    texts = set()
    for method in ("dflash", "mtp"):
        request = build_request(preset=preset.name, presets=[preset.name], limits=Limits(), message="hello world",
                                max_tokens=24, draft_length=3, method=method)
        answer = whole_reply(engine_host.run(GpuJob(request, preset, pair)))
        assert answer.error is None and answer.stats["method"] == method and answer.stats["drafted"] > 0
        texts.add(answer.delta)
    assert len(texts) == 1  # temperature 0: both methods give the target's own answer
    with pytest.raises(ValueError, match="DFLASH_DEMO_PAIR"):
        configured_preset(True, {"DFLASH_DEMO_PAIR": "nope"}, pair_paths)


def parallel_job(message: str, owner: str, max_tokens: int, parallel: int = 2, **fields: Any) -> GpuJob:
    base = replace(job(message, max_tokens=max_tokens, **fields), cache_owner=owner)
    return replace(base, preset=replace(base.preset, parallel=parallel))


def timed_reply(engine_host: EngineHost, spec: GpuJob, times: list[float], out: list[ReplyChunk]) -> Thread:
    """Run `spec` on the host in a thread of its own, noting when each chunk came."""

    def pump() -> None:
        for chunk in engine_host.run(spec):
            times.append(time.monotonic())
            out.append(chunk)

    thread = Thread(target=pump, daemon=True)
    thread.start()
    return thread


def test_two_owners_run_on_one_engine_at_once_each_with_its_own_reply() -> None:
    """parallel=2: two visitors' requests stream at the same time from two threads (each gets chunks while the other
    streams), on one engine loaded once; each reply is what an engine of its own would answer, with its own figures;
    and a visitor's next turn still reuses its own parked prompt."""
    loader = RecordingLoader()
    engine_host = EngineHost(loader)
    try:
        asks = {"first": ("hello there", 160), "second": ("the quick brown fox", 120)}
        times: dict[str, list[float]] = {name: [] for name in asks}
        chunks: dict[str, list[ReplyChunk]] = {name: [] for name in asks}
        threads = [timed_reply(engine_host, parallel_job(message, name, max_tokens), times[name], chunks[name])
                   for name, (message, max_tokens) in asks.items()]  # fmt: skip
        for thread in threads:
            thread.join(120)
        assert not any(thread.is_alive() for thread in threads)
        one, two = times["first"], times["second"]
        assert sum(1 for t in one if two[0] < t < two[-1]) >= 5 and sum(1 for t in two if one[0] < t < one[-1]) >= 5
        assert len(loader.engines) == 1 and loader.engines[0].parallel == 2
        with reference_engine(N_CTX) as reference:
            for name, (message, max_tokens) in asks.items():
                whole = chunks[name][0]
                for chunk in chunks[name][1:]:
                    whole = whole.then(chunk)
                assert whole.error is None and whole.finish_reason == "length"
                assert whole.stats["n_generated"] == max_tokens
                assert whole.delta == expected_answer(reference, [{"role": "user", "content": message}], max_tokens)
        history = [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": "x"}]
        again = whole_reply(engine_host.run(parallel_job("and now?", "first", 8, history=history)))
        assert again.stats["n_reused"] > template_start(), "the owner's parked prompt is reused"
    finally:
        engine_host.close()


class Holder:
    """A request that takes its first chunk in a thread of its own, then holds its sequence until `release`."""

    def __init__(self, engine_host: EngineHost, spec: GpuJob) -> None:
        self.holding, self.released, self.closed = Event(), Event(), Event()
        self.thread = Thread(target=self._hold, args=(engine_host, spec), daemon=True)
        self.thread.start()
        assert self.holding.wait(60), "the request did not start"

    def _hold(self, engine_host: EngineHost, spec: GpuJob) -> None:
        stream = engine_host.run(spec)
        try:
            next(stream)
            self.holding.set()
            self.released.wait(60)
        finally:
            stream.close()
            self.closed.set()

    def release(self) -> None:
        self.released.set()
        self.thread.join(60)
        assert self.closed.is_set()


def test_requests_beyond_the_sequences_wait_and_waits_are_bounded() -> None:
    """A request beyond the engine's sequences waits, up to the busy timeout, then gets the busy error as data; once
    a sequence is free it runs. (One answer per conversation at a time is the web process's policy's rule.)"""
    engine_host = EngineHost(RecordingLoader(), PublicSettings(busy_timeout_s=0.5))
    try:
        running = Holder(engine_host, parallel_job("hello there", "visitor", 400))  # holds its sequence
        other = whole_reply(engine_host.run(parallel_job("one two three", "other visitor", 8)))
        assert other.error is None and other.stats["n_generated"] == 8, "another owner takes the free sequence"
        full = Holder(engine_host, parallel_job("hello there", "third visitor", 400))  # both sequences taken
        beyond = whole_reply(engine_host.run(parallel_job("one two three", "fourth visitor", 8)))
        assert beyond.error_type == "RequestError" and "the engine stayed busy" in (beyond.error or "")
        running.release()
        full.release()
        after = whole_reply(engine_host.run(parallel_job("one two three", "visitor", 8)))
        assert after.error is None and after.stats["n_generated"] == 8
    finally:
        engine_host.close()


def test_the_previous_request_is_the_one_that_ended_last_beside_another() -> None:
    """With two sequences, what the worker reports of its previous request is that request's own end, not the end
    of another that ran beside it."""
    engine_host = EngineHost(RecordingLoader())
    try:
        held = Holder(engine_host, parallel_job("hello there", "visitor", 400))  # one chunk taken, then held
        beside = whole_reply(engine_host.run(parallel_job("one two three", "other visitor", 8)))
        assert beside.finish_reason == "length"
        held.release()  # closed by its caller after one chunk, once the other ended
        after = whole_reply(engine_host.run(parallel_job("one two three", "third visitor", 8)))
        assert after.worker["previous_request"]["finish_reason"] == "closed by the caller"
    finally:
        engine_host.close()


def test_the_engine_waits_as_long_as_the_space_does() -> None:
    """The engine the host opens waits for a sequence as long as the Space's one setting says (not the library's
    default)."""
    loader = RecordingLoader()
    engine_host = EngineHost(loader, PublicSettings(busy_timeout_s=7.5))
    try:
        assert whole_reply(engine_host.run(job("one two", max_tokens=2))).error is None
        assert [options["busy_timeout_s"] for options in loader.options] == [7.5]
    finally:
        engine_host.close()


def test_auto_opens_as_many_sequences_as_fit_in_the_free_memory() -> None:
    """DFLASH_PARALLEL=auto: the host reads the memory free before the load (for the preset's n_gpu_layers) and opens
    as many sequences as it holds, at most the preset's (here 2 of 4); it admits that many requests at once, a third
    waits, and the engine's description says how the sequences were sized."""
    base = job("hello there")
    preset = replace(base.preset, parallel=4, parallel_fit=True)
    assert base.files.draft_path is not None
    target, draft = read_gguf(base.files.target_path), read_gguf(base.files.draft_path)
    one = sequence_footprint(target, draft, n_ctx=preset.n_ctx, draft_capacity=preset.draft_capacity)
    weights = base.files.target_path.stat().st_size + base.files.draft_path.stat().st_size
    free = weights + DEFAULT_RESERVE_BYTES + 2 * one["total"] + one["total"] // 2
    asked: list[int] = []

    def memory(n_gpu_layers: int) -> FreeMemory:
        asked.append(n_gpu_layers)
        return FreeMemory("host memory", free, False, free)

    def sized_job(message: str, owner: str, max_tokens: int) -> GpuJob:
        spec = parallel_job(message, owner, max_tokens)
        return replace(spec, preset=preset)

    loader = RecordingLoader()
    engine_host = EngineHost(loader, PublicSettings(busy_timeout_s=0.5), memory=memory)
    try:
        first = Holder(engine_host, sized_job("hello there", "first", 400))
        second = Holder(engine_host, sized_job("the quick brown fox", "second", 400))
        beyond = whole_reply(engine_host.run(sized_job("one two three", "third", 8)))
        assert beyond.error_type == "RequestError" and "the engine stayed busy" in (beyond.error or "")
        assert [engine.parallel for engine in loader.engines] == [2] and asked == [preset.n_gpu_layers]
        first.release()
        second.release()
        after = whole_reply(engine_host.run(sized_job("one two three", "third", 8)))
        assert after.error is None and after.stats["n_generated"] == 8
        assert after.engine_info is not None and after.engine_info["parallel"] == 2
        assert str(after.engine_info["parallel_plan"]).startswith("2 sequences fit in host memory (")
        assert engine_host.parallel_plan is not None and engine_host.parallel_plan.limit == 4
    finally:
        engine_host.close()


def yielded_at(engine_host: EngineHost, spec: GpuJob, turns: list[int]) -> tuple[ReplyChunk, int]:
    """The job's reply when it yields its turn after each count of chunks in `turns` (the stream closed there, as
    jobs.ReplyJob closes it) and goes on from what its chunks said (gpu_job.AnswerSoFar), as the web process does;
    the whole reply joined, and how many turns it took."""
    answer, taken = AnswerSoFar(spec), []
    current = spec
    for count in [*turns, None]:
        chunks = engine_host.run(current)
        try:
            for n, chunk in enumerate(chunks):
                answer.seen(chunk)
                taken.append(chunk)
                if count is not None and n + 1 >= count and chunk.finish_reason is None:
                    break
        finally:
            chunks.close()
        if taken[-1].finish_reason is not None and taken[-1].phase == spec.phases[-1]:
            break
        resume = answer.resume()
        assert resume is not None
        current = replace(spec, resume=resume)
    return whole_reply(taken), turns.index(count) + 1 if count is not None else len(turns) + 1


@pytest.mark.parametrize("owner", ["visitor/1", ""])
def test_an_answer_that_yields_its_turn_goes_on_exactly(host: tuple[EngineHost, RecordingLoader], owner: str) -> None:
    """Closed after a few steps and resumed from what its chunks said (parked by its owner, or without one prefilled
    again): the same tokens, text, sources and counts at temperature 0 as the answer in one piece, stop strings
    matched across the joins; an A/B run goes on in the phase where it was."""
    engine_host, loader = host
    whole = whole_reply(engine_host.run(replace(job("Tell me about the sea.", max_tokens=48), cache_owner=owner)))
    spec = replace(job("Tell me about the sea.", max_tokens=48), cache_owner=owner)
    joined, turns = yielded_at(engine_host, spec, [1, 2, 3, 5])
    assert turns > 2 and joined.tokens == whole.tokens and joined.delta == whole.delta
    assert joined.source_runs == whole.source_runs or sum(n for n, _ in joined.source_runs) == len(whole.delta)
    assert joined.stats["n_generated"] == whole.stats["n_generated"] == 48
    assert joined.stats["n_prompt"] == whole.stats["n_prompt"] and joined.finish_reason == "length"
    assert len(joined.stats["drafted_by"]) == joined.stats["verify_steps"]
    assert loader.engines[-1].info()["sessions"]["parked"] == (1 if owner else 0), "parked when it yielded"
    stop = whole.delta[len(whole.delta) // 2 : len(whole.delta) // 2 + 3]
    stopping = replace(spec, request=replace(spec.request, stop=(stop,)))
    stopped_whole = whole_reply(engine_host.run(stopping))
    stopped, _ = yielded_at(engine_host, stopping, [1, 1, 1, 1, 1])
    assert stopped.delta == stopped_whole.delta and stopped.finish_reason == "stop"
    ab = replace(job("Tell me about the sea.", max_tokens=12), phases=("dflash", "plain"), cache_owner=owner)
    ab_whole = list(engine_host.run(ab))
    ab_yielded = []
    answer, current = AnswerSoFar(ab), ab
    for _ in range(30):  # a turn of one step each: 12 + 12 tokens
        chunks = engine_host.run(current)
        first = next(chunks)
        chunks.close()
        answer.seen(first)
        ab_yielded.append(first)
        if first.finish_reason is not None and first.phase == "plain":
            break
        current = replace(ab, resume=answer.resume())
    assert ab_yielded[-1].phase == "plain" and ab_yielded[-1].finish_reason == "length"
    assert ab_yielded[-1].divergences == ab_whole[-1].divergences, "the divergences see each phase's whole answer"
    for phase in ab.phases:
        assert [t for c in ab_yielded if c.phase == phase for t in c.tokens] == \
            [t for c in ab_whole if c.phase == phase for t in c.tokens]  # fmt: skip


@pytest.mark.parametrize("demo", ["dense", "methods"])
def test_a_long_prompt_yields_between_its_chunks_and_goes_on_exactly(host: tuple[EngineHost, RecordingLoader],
                                                                       demo: str) -> None:  # fmt: skip
    """A prompt of several chunks sends a progress chunk at each chunk's end (nothing to show: a step boundary where
    its job may yield); closed there and run again, it goes on from the part its owner's parked state holds (a hybrid
    target's recurrent state included), prefills only the rest, and answers what it answers in one piece; the web
    process sees nothing of the progress chunks in what the answer says (gpu_job.AnswerSoFar ignores them)."""
    engine_host, _ = host
    message = " ".join(f"word{n} of the sea" for n in range(95))  # ~900 tokens: two chunks of n_batch (512)
    preset = configured_preset(True, {"DFLASH_N_CTX": str(N_CTX), "DFLASH_DEMO_PAIR": demo}, pair_paths)
    files = ResolvedPair(preset.target.local_path, preset.draft.local_path)
    spec = GpuJob(build_request(preset=preset.name, presets=[preset.name], limits=Limits(), message=message,
                                max_tokens=8, draft_length=3), preset, files)  # fmt: skip
    whole = list(engine_host.run(replace(spec, cache_owner="long/1")))
    progress = [chunk for chunk in whole if chunk.progress]
    assert len(progress) >= 1 and all(c.delta == "" and not c.tokens for c in progress), len(progress)
    assert whole_reply(whole).stats["n_prefilled"] > 700
    spec = replace(spec, cache_owner="long/2")
    answer, turns, taken = AnswerSoFar(spec), 0, []
    current = spec
    while True:  # each turn closed at its first progress chunk, as a job asked to yield closes it
        turns += 1
        chunks = engine_host.run(current)
        try:
            for chunk in chunks:
                answer.seen(chunk)
                taken.append(chunk)
                if chunk.progress or chunk.finish_reason is not None:
                    break
        finally:
            chunks.close()
        if taken[-1].finish_reason is not None:
            break
        resume = answer.resume()
        assert resume is not None and not resume.tokens, "nothing of the answer yet: it goes on from the prompt"
        current = replace(spec, resume=resume)
    joined, alone = whole_reply(taken), whole_reply(whole)
    assert turns >= 2 and joined.tokens == alone.tokens and joined.delta == alone.delta
    assert joined.stats["n_reused"] > 400, "the last turn reused what the turns before prefilled"
