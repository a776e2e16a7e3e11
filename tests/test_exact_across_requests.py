"""A long-lived engine answers every temperature-0 request exactly as a fresh engine would, after any history of
requests, cancellations and rollbacks; and it reuses what it can (context checkpoints on hybrid targets)."""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest
from pairs import ALL_PAIRS, PAIR_IDS

from dflash_runtime import load_pair
from dflash_runtime.cache.checkpoints import CheckpointPolicy
from dflash_runtime.engine import Engine
from dflash_runtime.testing.tiny_models import TinyPair, tiny_pair

WORDS = ("the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "hello", "world", "one", "two", "three",
         "what", "is", "capital", "of", "france")

# Shapes other than the default tiny pair: fewer/more layers, another width, heads with random or partial acceptance.
SHAPES = {
    "random-e64-l5": dict(head="random", n_embd=64, n_layer=5),
    "shaped-e96-l3": dict(head="shaped", n_embd=96, n_layer=3, n_head=3, n_head_kv=1),
}


def _pair(target: str, draft: str, shape: str) -> TinyPair:
    if draft == "mtp":  # the target alone, drafting with its own MTP head
        return tiny_pair(target, None, mtp_layers=1, **SHAPES[shape])
    return tiny_pair(target, draft, **SHAPES[shape])


class Reference:
    """What a fresh engine answers: a second engine whose cache is forgotten before every request."""

    def __init__(self, pair: TinyPair, draft_capacity: int) -> None:
        self.engine = load_pair(pair.target, pair.draft, n_ctx=1024, draft_capacity=draft_capacity)

    def answer(self, prompt: list[int], max_tokens: int) -> list[int]:
        self.engine.reset()
        return self.engine.generate(prompt, max_tokens=max_tokens, speculative=False).tokens


def _random_text(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 9)))


def _requests(rng: random.Random, engine: Engine) -> Iterator[tuple[list[int], dict, int | None]]:
    """(prompt tokens, options, cancel after this many events or None), building on earlier prompts and answers."""
    history: list[list[int]] = [engine.tokenize(_random_text(rng))]
    while True:
        kind = rng.choice(["new", "continue", "continue", "share", "repeat", "diverge"])
        base = rng.choice(history)
        if kind == "new":
            prompt = engine.tokenize(_random_text(rng))
        elif kind == "continue":
            prompt = base + engine.tokenize(" " + _random_text(rng), add_special=False)
        elif kind == "share":
            prompt = base[: rng.randint(1, len(base))] + engine.tokenize(" " + _random_text(rng), add_special=False)
        elif kind == "repeat":
            prompt = list(base)
        else:  # a prompt that leaves the cached sequence k tokens before its end
            cut = max(1, len(base) - rng.randint(1, 9))
            prompt = [*base[:cut], rng.choice(engine.tokenize(" " + rng.choice(WORDS), add_special=False))]
        options = {
            "max_tokens": rng.randint(1, 24),
            "speculative": rng.random() < 0.8,
            "draft_length": rng.choice(["auto", 1, 2, 3, 5, 7]),
        }
        cancel_after = rng.choice([None, None, None, None, None, 0, 1, 2, 4])
        yield prompt[:700], options, cancel_after
        history.append(prompt[:700])


def _run(engine: Engine, prompt: list[int], options: dict, cancel_after: int | None) -> tuple[list[int], str]:
    tokens: list[int] = []
    finish = ""
    with engine.stream(prompt, **options) as events:
        for index, event in enumerate(events):
            tokens += event.tokens
            finish = event.finish_reason or finish
            if cancel_after is not None and index == cancel_after:
                if index % 2:
                    events.cancel()
                else:
                    finish = "cancelled"
                    break  # closing the stream between steps (the with block) is the other way to stop
    return tokens, finish


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize(("target", "draft"), [*ALL_PAIRS, ("hybrid", "mtp"), ("hybrid", "dspark")],
                         ids=[*PAIR_IDS, "hybrid-mtp", "hybrid-dspark"])
def test_random_request_sequences_match_a_fresh_engine(target: str, draft: str, shape: str, seed: int) -> None:
    rng = random.Random(f"{target}-{draft}-{shape}-{seed}")
    pair = _pair(target, draft, shape)
    reference = Reference(pair, draft_capacity=7)
    compared = reused = 0
    with load_pair(pair.target, pair.draft, n_ctx=1024, draft_capacity=7) as engine:
        requests = _requests(rng, engine)
        for _ in range(24):
            prompt, options, cancel_after = next(requests)
            tokens, finish = _run(engine, prompt, options, cancel_after)
            expected = reference.answer(prompt, options["max_tokens"])
            # A cancelled request's tokens are a prefix of the answer; a finished one's are the answer.
            assert tokens == expected[: len(tokens)], (prompt, options, cancel_after)
            if finish != "cancelled":
                assert tokens == expected, (prompt, options)
                compared += 1
            reused += engine.info()["n_cached"] > 0
    reference.engine.close()
    assert compared >= 8 and reused


@pytest.mark.parametrize("target", ["dense", "hybrid"])
def test_multi_turn_chat_prefills_only_what_follows_the_previous_prompt(target: str) -> None:
    pair = tiny_pair(target, "dflash2", head="random")
    messages = [{"role": "system", "content": "You are a helpful assistant."}]
    previous_prompt = 0
    with load_pair(pair.target, pair.draft, n_ctx=2048, draft_capacity=7) as engine:
        for turn in range(4):
            messages.append({"role": "user", "content": f"question {turn}: tell me about the fox and the dog"})
            answer = engine.chat(messages, max_tokens=30)
            stats = answer.stats
            assert stats.n_prompt == len(engine.chat_tokens(messages))
            if turn:
                # The previous prompt (all but the token a checkpoint leaves to decode) comes from the cache.
                assert stats.n_reused >= previous_prompt - 1, (turn, stats.n_reused, previous_prompt)
                assert stats.n_prefilled <= stats.n_prompt - previous_prompt + 1
            previous_prompt = stats.n_prompt
            messages.append({"role": "assistant", "content": answer.text})
        again = engine.chat(messages[:-1], max_tokens=30)  # the last request once more
        assert again.stats.n_prefilled <= 2
        assert again.tokens == answer.tokens
        if target == "hybrid":
            assert again.stats.checkpoint_restored_at is not None
            assert engine.info()["checkpoints"]["count"] >= 1
        else:
            assert engine.info()["checkpoints"] is None


def test_checkpoints_are_bounded_in_count_and_bytes() -> None:
    pair = tiny_pair("hybrid", "dflash2", head="random")
    probe = load_pair(pair.target, pair.draft, n_ctx=2048)
    probe.generate("hello world", max_tokens=2)
    one = probe.info()["checkpoints"]["bytes"]
    probe.close()
    assert one > 0
    policy = CheckpointPolicy(max_count=3, max_bytes=int(2.5 * one), interval=16)
    with load_pair(pair.target, pair.draft, n_ctx=2048, checkpoints=policy) as engine:
        prompt = engine.tokenize("one two three four five")
        for _ in range(6):
            result = engine.generate(prompt, max_tokens=40)
            prompt = prompt + result.tokens
            state = engine.info()["checkpoints"]
            assert state["count"] <= 2 and state["bytes"] <= policy.max_bytes  # 2.5 copies' worth of bytes
            assert result.stats.checkpoints_saved >= 1 and result.stats.checkpoint_bytes >= one
    off = CheckpointPolicy(max_count=0)
    with load_pair(pair.target, pair.draft, n_ctx=2048, checkpoints=off) as engine:
        first = engine.generate("one two three four five", max_tokens=8)
        again = engine.generate("one two three four five", max_tokens=8)
        assert engine.info()["checkpoints"]["count"] == 0
        assert again.stats.n_reused == 0 and again.tokens == first.tokens  # no checkpoint: a full prefill, same text


def test_a_rollback_deeper_than_the_snapshots_keeps_the_draft_cache() -> None:
    """The draft cache is attention only: a target restore to a checkpoint cuts it there, it never clears it."""
    pair = tiny_pair("hybrid", "dflash2", head="shaped")
    with load_pair(pair.target, pair.draft, n_ctx=1024, draft_capacity=7) as engine:
        prompt = engine.tokenize("the quick brown fox jumps over the lazy dog")
        first = engine.generate(prompt, max_tokens=30, draft_length=7)
        edited = prompt + first.tokens[:10] + engine.tokenize(" fox", add_special=False)
        warm = engine.generate(edited, max_tokens=20, draft_length=7)
        assert warm.stats.checkpoint_restored_at == len(prompt) - 1
    with load_pair(pair.target, pair.draft, n_ctx=1024, draft_capacity=7) as fresh:
        cold = fresh.generate(edited, max_tokens=20, draft_length=7)
    assert warm.tokens == cold.tokens
    # The same drafts were proposed from the same draft cache contents: same sources, same acceptance.
    assert warm.token_sources == cold.token_sources
