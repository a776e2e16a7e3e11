"""Several requests at once on one engine (`parallel`): every stream of a concurrent schedule answers exactly as the
same request alone on a fresh engine, whatever shares its steps — dense and hybrid targets, DFlash 2, MTP and plain
requests mixed, random arrivals, cancels, lengths and owners; the steps really are shared; a deliberately broken
per-sequence rollback fails the comparison; the occupancy rules hold with several sequences."""

from __future__ import annotations

import random
import threading
from dataclasses import dataclass, field

import pytest

from dflash_runtime import DecodeError, EngineBusyError, load_pair
from dflash_runtime.cli.bench_concurrency import run_streams
from dflash_runtime.decoding.occupancy import RequestStream
from dflash_runtime.engine import Engine
from dflash_runtime.native.memory import SequenceMemory
from dflash_runtime.results.events import StreamEvent
from dflash_runtime.testing.tiny_models import TinyPair, tiny_pair

WORDS = ("the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "hello", "world", "one", "two", "three",
         "what", "is", "capital", "of", "france")
TIMEOUT_S = 120.0


@dataclass
class Job:
    prompt: list[int]
    options: dict
    arrive: int  # the tick it starts at
    cancel_after: int | None = None  # events read before it is cancelled (odd: cancel(), even: close())
    tokens: list[int] = field(default_factory=list)
    finish: str = ""
    stream: RequestStream | None = None
    read: int = 0


def _pair(target: str, draft: str) -> TinyPair:
    if draft == "mtp":
        return tiny_pair(target, None, head="random", mtp_layers=1)
    return tiny_pair(target, "dflash2", head="random")


def _text(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 12)))


def _jobs(rng: random.Random, engine: Engine, n: int) -> list[Job]:
    jobs: list[Job] = []
    history: list[list[int]] = []
    for i in range(n):
        if history and rng.random() < 0.4:  # a conversation going on: the same owner, its prompt growing
            base = rng.choice(history)
            prompt = base + engine.tokenize(" " + _text(rng), add_special=False)
        else:
            prompt = engine.tokenize(_text(rng))
        history.append(prompt)
        speculative = rng.random() < 0.75
        options = {
            "max_tokens": rng.randint(1, 40),
            "speculative": speculative,
            "draft_length": rng.choice(["auto", 1, 3, 7]),
            "cache_owner": rng.choice(["a", "b", "c", None]),
        }
        if speculative and "mtp" in engine.methods and "dflash" in engine.methods:
            options["method"] = rng.choice(["dflash", "mtp"])
        jobs.append(Job(prompt[:300], options, arrive=rng.randint(0, 3 * i + 1),
                        cancel_after=rng.choice([None, None, None, None, 0, 1, 3])))
    return jobs


def interleave(engine: Engine, jobs: list[Job], rng: random.Random) -> int:
    """Run the jobs from this thread, starting each at its tick and advancing a random running one per tick; returns
    the most streams that were running at once."""
    pending = sorted(jobs, key=lambda j: j.arrive)
    running: list[Job] = []
    tick = peak = 0
    while pending or running:
        while pending and pending[0].arrive <= tick and len(running) < engine.parallel:
            job = pending.pop(0)
            job.stream = engine.stream(job.prompt, **job.options)
            running.append(job)
        peak = max(peak, len(running))
        tick += 1
        if not running:
            continue
        job = rng.choice(running)
        assert job.stream is not None
        event = next(job.stream, None)
        if event is not None:
            job.tokens += event.tokens
            job.read += 1
            job.finish = event.finish_reason or ""
        if event is None or event.finish_reason is not None:
            running.remove(job)
            continue
        if job.cancel_after is not None and job.read > job.cancel_after:
            if job.cancel_after % 2:
                job.stream.cancel()
            else:
                job.stream.close()
                job.finish = "cancelled"
                running.remove(job)
    return peak


class Reference:
    """What a fresh engine answers alone: one sequence, its cache forgotten before every request."""

    def __init__(self, pair: TinyPair, n_ctx: int = 1024) -> None:
        self.engine = load_pair(pair.target, pair.draft, n_ctx=n_ctx, draft_capacity=7)

    def answer(self, job: Job) -> list[int]:
        self.engine.reset()
        return self.engine.generate(job.prompt, max_tokens=job.options["max_tokens"], speculative=False).tokens


def check_against_reference(jobs: list[Job], reference: Reference) -> int:
    compared = 0
    for job in jobs:
        expected = reference.answer(job)
        assert job.tokens == expected[:len(job.tokens)], (job.prompt, job.options)
        if job.finish != "cancelled":
            assert job.tokens == expected, (job.prompt, job.options, job.finish)
            compared += 1
    return compared


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize(("target", "draft"), [("dense", "dflash2"), ("hybrid", "dflash2"), ("hybrid", "mtp")])
def test_concurrent_schedules_answer_as_a_fresh_engine_alone(target: str, draft: str, seed: int) -> None:
    rng = random.Random(f"{target}-{draft}-{seed}")
    pair = _pair(target, draft)
    reference = Reference(pair)
    with load_pair(pair.target, pair.draft, n_ctx=1024, draft_capacity=7, parallel=4) as engine:
        before = engine.step_counters()
        jobs = _jobs(rng, engine, 16)
        peak = interleave(engine, jobs, rng)
        after = engine.step_counters()
    compared = check_against_reference(jobs, reference)
    reference.engine.close()
    assert compared >= 8 and peak >= 3
    # The steps were shared: more rows than decodes, and fewer decodes than requests' steps would take alone.
    assert after["rows"] - before["rows"] > after["decodes"] - before["decodes"]


def test_mixed_methods_share_one_decode() -> None:
    """A DFlash 2, an MTP and a plain request run in the same steps and each answers as it would alone."""
    pair = tiny_pair("hybrid", "dflash2", head="random", mtp_layers=1)
    reference = Reference(pair)
    rng = random.Random(5)
    with load_pair(pair.target, pair.draft, n_ctx=1024, draft_capacity=7, parallel=3) as engine:
        prompts = [engine.tokenize(_text(rng)) for _ in range(3)]
        jobs = [Job(prompts[0], {"max_tokens": 48, "method": "dflash", "draft_length": 7}, 0),
                Job(prompts[1], {"max_tokens": 48, "method": "mtp", "draft_length": 3}, 0),
                Job(prompts[2], {"max_tokens": 48, "speculative": False}, 0)]
        before = engine.step_counters()
        interleave(engine, jobs, rng)
        after = engine.step_counters()
    check_against_reference(jobs, reference)
    reference.engine.close()
    steps_alone = sum(len(j.tokens) for j in jobs)  # an upper bound: one decode per token and request
    assert after["decodes"] - before["decodes"] < steps_alone
    assert all(j.finish == "length" for j in jobs)


def test_threads_each_reading_its_own_stream_answer_as_alone() -> None:
    pair = tiny_pair("hybrid", "dflash2", head="random")
    reference = Reference(pair)
    rng = random.Random(11)
    with load_pair(pair.target, pair.draft, n_ctx=1024, draft_capacity=7, parallel=4) as engine:
        jobs = [Job(engine.tokenize(_text(rng)), {"max_tokens": 60, "cache_owner": f"v{i}"}, 0) for i in range(6)]
        errors: list[BaseException] = []

        def read(job: Job) -> None:
            try:
                result = engine.generate(job.prompt, **job.options)
                job.tokens, job.finish = result.tokens, result.finish_reason
            except BaseException as error:
                errors.append(error)

        threads = [threading.Thread(target=read, args=(job,)) for job in jobs]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(TIMEOUT_S)
        assert not any(t.is_alive() for t in threads) and not errors, errors
    assert check_against_reference(jobs, reference) == 6
    reference.engine.close()


def test_a_broken_per_sequence_rollback_fails_the_comparison(monkeypatch: pytest.MonkeyPatch) -> None:
    """The comparison has power: a rollback that cuts sequence 0 whatever sequence it was asked for fails it, by
    answers that differ from a fresh engine's or by libllama refusing the positions that follow."""
    original = SequenceMemory.remove_from

    def wrong_sequence(self: SequenceMemory, pos: int) -> bool:
        if self.name != "target" or pos == 0:
            return original(self, pos)
        seq, self.seq = self.seq, 0
        try:
            return original(self, pos)
        finally:
            self.seq = seq

    pair = tiny_pair("dense", "dflash2", head="random")
    reference = Reference(pair)
    rng = random.Random(3)
    monkeypatch.setattr(SequenceMemory, "remove_from", wrong_sequence)
    with pytest.raises((AssertionError, DecodeError)):
        with load_pair(pair.target, pair.draft, n_ctx=1024, draft_capacity=7, parallel=2) as engine:
            jobs = [Job(engine.tokenize(_text(rng)), {"max_tokens": 40, "draft_length": 7}, 0) for _ in range(4)]
            interleave(engine, jobs, rng)
        monkeypatch.undo()
        check_against_reference(jobs, reference)
    monkeypatch.undo()
    reference.engine.close()


def test_a_short_request_is_served_while_a_long_prompt_prefills() -> None:
    """A request that arrives while a 4,000-token prompt prefills gets its first token within two engine steps (a
    step prefills at most n_batch prompt tokens, the shortest prompts first), and both answer exactly."""
    pair = tiny_pair("dense", "dflash2", head="random")
    reference = Reference(pair, n_ctx=8192)
    with load_pair(pair.target, pair.draft, n_ctx=8192, n_batch=256, draft_capacity=7, parallel=2) as engine:
        long_prompt = (engine.tokenize(" ".join(WORDS)) * 240)[:4000]
        short_prompt = engine.tokenize("hello world")
        under_way = threading.Event()
        long_events: list[StreamEvent] = []

        def on_prefill(done: int, total: int) -> None:
            if done >= 512:
                under_way.set()

        def read_long() -> None:
            long_events.extend(engine.stream(long_prompt, max_tokens=4, on_prefill=on_prefill))

        thread = threading.Thread(target=read_long)
        thread.start()
        assert under_way.wait(TIMEOUT_S)
        short = engine.stream(short_prompt, max_tokens=3)
        decodes = engine.step_counters()["decodes"]
        first = next(short)
        steps_to_first = engine.step_counters()["decodes"] - decodes
        short_events = [first, *short]
        thread.join(TIMEOUT_S)
        assert not thread.is_alive()
        assert long_events[0].stats.n_prefilled == 4000
    assert first.tokens and steps_to_first <= 2, steps_to_first
    assert [t for e in short_events for t in e.tokens] == reference.engine.generate(
        short_prompt, max_tokens=3, speculative=False).tokens
    reference.engine.reset()
    assert [t for e in long_events for t in e.tokens] == reference.engine.generate(
        long_prompt, max_tokens=4, speculative=False).tokens
    reference.engine.close()


def test_beside_an_answer_being_written_the_steps_prompts_take_one_chunk_together() -> None:
    """Two long prompts prefill in chunks of 8 while a third request generates: a step that writes its token holds
    at most 8 prompt tokens in all, so its cost does not grow with the prompts waiting;
    every answer is exact."""
    pair = tiny_pair("hybrid", "dflash2", head="random")
    reference = Reference(pair, n_ctx=2048)
    with load_pair(pair.target, pair.draft, n_ctx=2048, draft_capacity=7, parallel=3) as engine:
        words = engine.tokenize(" ".join(WORDS))
        prompts = {"a": (words * 20)[:200], "b": (words * 30)[:320]}
        done = {"a": 0, "b": 0}

        def progress(name: str):
            return lambda n, _total: done.__setitem__(name, n)

        prompts["g"] = engine.tokenize("hello world")
        writing = engine.stream(prompts["g"], max_tokens=120, speculative=False)
        events = {"g": [next(writing)]}
        streams = {"g": writing}
        for name in ("a", "b"):
            streams[name] = engine.stream(prompts[name], max_tokens=2, prefill_events=True, prefill_chunk=8,
                                          on_prefill=progress(name), speculative=False)
            events[name] = []
        shared_steps = 0
        while streams:
            for name in list(streams):
                before, counters = dict(done), engine.step_counters()
                event = next(streams[name], None)
                after = engine.step_counters()
                if event is None or event.finish_reason is not None:
                    del streams[name]
                if event is not None:
                    events[name].append(event)
                prompt_rows = sum(done.values()) - sum(before.values())
                if after["decodes"] - counters["decodes"] == 1 and after["rows"] - counters["rows"] > prompt_rows > 0:
                    shared_steps += 1  # one step, holding a generating request's row beside prompt chunks
                    assert prompt_rows <= 8, (before, done)
        assert shared_steps >= 10, shared_steps
    for name, prompt in prompts.items():
        reference.engine.reset()
        expected = reference.engine.generate(prompt, max_tokens=len([t for e in events[name] for t in e.tokens]),
                                             speculative=False).tokens
        assert [t for e in events[name] for t in e.tokens] == expected, name
    reference.engine.close()


def test_owners_keep_their_own_sequences_without_parking() -> None:
    """Two visitors alternating on two sequences each reuse their whole previous prompt, and nothing is parked."""
    pair = tiny_pair("hybrid", "dflash2", head="random")
    with load_pair(pair.target, pair.draft, n_ctx=1024, parallel=2) as engine:
        prompts = {owner: engine.tokenize(f"{owner} says hello to the quick brown fox") for owner in ("a", "b")}
        for turn in range(3):
            for owner in ("a", "b"):
                result = engine.generate(prompts[owner], max_tokens=6, cache_owner=owner)
                if turn:
                    assert result.stats.n_reused >= len(prompts[owner]) - 8, (owner, turn, result.stats.n_reused)
                prompts[owner] = prompts[owner] + result.tokens + engine.tokenize(" and", add_special=False)
        assert engine.info()["sessions"]["parked"] == 0
        assert engine.info()["parallel"] == 2 and engine.info()["running"] == 0


def test_requests_that_run_together_take_consecutive_sequences() -> None:
    """libllama decodes per-sequence KV streams in ubatches of consecutive sequence ids, one pass of the model per
    run of them: requests that run together get a block of neighbouring sequences, round after round, where taking
    the least recently used one alone would scatter them ({0, 5, 6, 7} after a round on {1, 2, 3, 4})."""
    pair = tiny_pair("hybrid", "dflash2", head="random")
    with load_pair(pair.target, pair.draft, n_ctx=256, parallel=8) as engine:
        prompts = [engine.tokenize(f"round robin {word}") for word in ("one", "two", "three", "four")]
        engine.generate(prompts[0], max_tokens=2)  # one sequence used before the rounds
        blocks = []
        for _ in range(4):
            engine.reset()
            run_streams(engine, prompts, [{"max_tokens": 12, "draft_length": 3}] * 4, TIMEOUT_S)
            used = [seq for seq, n in enumerate(engine.info()["n_cached_by_sequence"]) if n]
            assert len(used) == 4 and used == list(range(used[0], used[0] + 4)), used
            blocks.append(used[0])
        assert len(set(blocks)) > 1, "the rounds move over the sequences (least recently used first)"


@pytest.mark.parametrize("target", ["dense", "hybrid"])
def test_requests_of_different_lengths_share_one_width_and_answer_as_alone(target: str) -> None:
    """A plain request (1 row a step) beside draft lengths 1 and 7 (2 and 8 rows): each takes the widest request's
    rows, the rest filler (libllama runs one ubatch of 8 rows a sequence, not three), the filler goes with the
    rejected drafts, and every answer is the same request's alone on a fresh engine."""
    pair = tiny_pair(target, "dflash2", head="random")
    options = [{"max_tokens": 40, "speculative": False}, {"max_tokens": 40, "draft_length": 1},
               {"max_tokens": 40, "draft_length": 7}]  # fmt: skip
    with load_pair(pair.target, pair.draft, n_ctx=512, draft_capacity=7, parallel=3) as engine:
        prompts = [engine.tokenize(text) for text in ("the quick brown fox", "hello world", "what is the capital")]
        runs, counted = run_streams(engine, prompts, options, TIMEOUT_S)
        assert counted["pad_rows"] >= 10 * 13, counted  # 7 + 6 filler rows a step while all three run
    with load_pair(pair.target, pair.draft, n_ctx=512, draft_capacity=7) as alone:
        for prompt, option, run in zip(prompts, options, runs, strict=True):
            alone.reset()
            assert run.ids == alone.generate(prompt, **option).tokens, option


def test_a_third_request_waits_for_a_sequence_and_the_same_thread_is_told_at_once() -> None:
    pair = tiny_pair("dense", "dflash2", head="random")
    with load_pair(pair.target, pair.draft, n_ctx=512, parallel=2, busy_timeout_s=0.5) as engine:
        a, b = engine.stream("hello world", max_tokens=8), engine.stream("one two three", max_tokens=8)
        next(a), next(b)  # both hold a sequence, suspended
        with pytest.raises(EngineBusyError, match="suspended"):
            next(engine.stream("the fox", max_tokens=2))
        outcome: list[object] = []
        thread = threading.Thread(target=lambda: outcome.append(_try(lambda: list(engine.stream("a", max_tokens=2)))))
        thread.start()
        thread.join(TIMEOUT_S)
        assert isinstance(outcome[0], EngineBusyError)  # another thread waited its busy timeout, then was told
        a.close()
        assert list(engine.stream("the fox", max_tokens=2))[-1].finish_reason == "length"  # a's sequence is free
        b.close()


def _try(fn: object) -> object:
    try:
        return fn()  # type: ignore[operator]
    except Exception as error:
        return error


def test_parallel_is_checked() -> None:
    pair = tiny_pair("dense", "dflash2", head="random")
    for bad in (0, -1, True, 2.0, 1000):
        with pytest.raises(ValueError, match="parallel"):
            load_pair(pair.target, pair.draft, n_ctx=256, parallel=bad)



@pytest.mark.parametrize("target", ["dense", "hybrid"])
def test_a_newcomers_figures_say_nothing_of_other_visitors_chats(target: str) -> None:
    """A newcomer's request after other visitors' short or long chats (running beside it or finished) gets the same
    reuse, the same prefill and the same answer: the sequence it gets is emptied the same way whatever it held."""
    pair = tiny_pair(target, "dflash2", head="random")
    seen = []
    for turns in (1, 4):
        with load_pair(pair.target, pair.draft, n_ctx=2048, parallel=2) as engine:
            system = engine.tokenize("you are a helpful fox.")
            for owner in ("x", "y", "z"):  # more owners than sequences: the newcomer gets a used one
                prompt = list(system)
                for _ in range(turns):
                    prompt += engine.tokenize(" tell me about the lazy dog and the quick brown fox", add_special=False)
                    answer = engine.generate(prompt, max_tokens=24, cache_owner=owner, public_prefix=len(system))
                    prompt += answer.tokens
            newcomer = system + engine.tokenize(" hello there", add_special=False)
            result = engine.generate(newcomer, max_tokens=12, cache_owner="new", public_prefix=len(system))
            seen.append((result.stats.n_reused, result.stats.n_prefilled, result.tokens,
                         result.stats.checkpoint_restored_at))
    assert seen[0] == seen[1], seen


@pytest.mark.parametrize("target", ["dense", "hybrid"])
def test_long_concurrent_answers_on_a_flat_model_answer_as_alone(target: str) -> None:
    """Near-ties show up after hundreds of tokens on flat distributions: four 800-token answers sharing their steps
    (speculative beside plain, their rows evened out with filler rows, on the offline demo's pair, where a
    history-dependent near-tie once flipped token 672) each equal the same request alone on a fresh engine."""
    pair = tiny_pair(target, "dflash2", head="phrase", n_embd=512, dims="scaled")
    reference = Reference(pair, n_ctx=2048)
    rng = random.Random(f"long-{target}")
    with load_pair(pair.target, pair.draft, n_ctx=2048, draft_capacity=7, parallel=4) as engine:
        jobs = [Job(engine.tokenize(_text(rng)), {"max_tokens": 800, "speculative": i % 2 == 0,
                                                  "cache_owner": f"v{i}"}, arrive=3 * i) for i in range(4)]
        peak = interleave(engine, jobs, rng)
        padded = engine.step_counters()["pad_rows"]
    assert check_against_reference(jobs, reference) == 4 and peak == 4
    assert all(len(j.tokens) == 800 for j in jobs)
    assert padded > 800, "the plain answers' single rows were evened out to the drafts' (filler rows)"
    reference.engine.close()


@pytest.mark.parametrize("draft", ["dflash2", "dspark"])
def test_a_sequence_at_its_contexts_end_drafts_beside_a_neighbour_asking_a_longer_block(draft: str) -> None:
    """A block drafter decodes every drafting sequence's block at one width, the longest ask's: a sequence whose
    context ends sooner gets a block cut at its last cell, not one past it (its draft context has no cell there). The
    sequence that fills its context drafts one token a step; its neighbour asks three, all along."""
    pair = tiny_pair("dense", draft, head="phrase")
    with load_pair(pair.target, pair.draft, n_ctx=64, draft_capacity=3, parallel=2) as engine:
        prompt = engine.tokenize("the quick brown fox")
        alone = engine.generate(prompt, max_tokens=10**6, draft_length=1)
        assert alone.finish_reason == "length" and len(prompt) + len(alone.tokens) == engine.n_ctx + 1
        filling = engine.stream(prompt, max_tokens=10**6, draft_length=1)
        neighbour = engine.stream(engine.tokenize("hello world"), max_tokens=8, draft_length=3)
        tokens, finish, asked_beside = [], None, 0
        try:
            while finish is None:
                event = next(filling)
                tokens += event.tokens
                finish = event.finish_reason
                if next(neighbour).finish_reason is not None:  # a new neighbour, so one always drafts beside
                    neighbour.close()
                    neighbour = engine.stream(engine.tokenize("hello world"), max_tokens=8, draft_length=3)
                    asked_beside += 1
        finally:
            filling.close()
            neighbour.close()
        assert tokens == alone.tokens and finish == "length"
        assert asked_beside > 2, "the neighbour drafted beside it to the end"
