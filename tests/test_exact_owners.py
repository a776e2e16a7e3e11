"""Exact after any history of cache owners: parkings, public prefixes, owner switches, rollbacks and checkpoints,
with answers long enough (hundreds of tokens) that near-tied logits are met; and a new owner's own figures do not
depend on what earlier owners left in the caches."""

from __future__ import annotations

import random

import pytest

from dflash_runtime import SessionPolicy, load_pair
from dflash_runtime.engine import Engine
from dflash_runtime.testing.tiny_models import TinyPair, tiny_pair

SYSTEM = "You are a helpful assistant."
GREEDY = {"temperature": 0.0, "top_k": 40, "top_p": 1.0, "min_p": 0.0}


def _fresh_plain(pair: TinyPair, prompt: list[int], max_tokens: int, n_ctx: int) -> list[int]:
    with load_pair(pair.target, pair.draft, n_ctx=n_ctx) as engine:
        return engine.generate(prompt, max_tokens=max_tokens, speculative=False, **GREEDY).tokens


def _chat(engine: Engine, text: str) -> list[int]:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": text}]
    return engine.chat_tokens(messages, enable_thinking=False)


def _public(engine: Engine) -> int:
    """The public prefix as the Space declares it: what two chats that differ only in the visitor's text share."""
    a, b = _chat(engine, "a"), _chat(engine, "b")
    return next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)


@pytest.mark.slow
def test_a_plain_answer_after_a_public_prefix_and_a_speculative_answer_is_a_fresh_engines() -> None:
    """The offline demo's pair: a one-token request for the public prefix, then a speculative and a plain answer of
    1,024 tokens to the same chat prompt. The plain one used to differ from a fresh engine's from token 672 on."""
    pair = tiny_pair(target="dense", draft="dflash2", head="phrase", n_embd=512, dims="scaled")
    with load_pair(pair.target, pair.draft, n_ctx=4096) as engine:
        assert engine.info()["batch_invariant"], "the CPU build must take one path for any row count"
        prompt = _chat(engine, "hello, tell me a story")
        public = _public(engine)
        engine.generate(prompt[:public], max_tokens=1, speculative=False, cache_owner="public", public_prefix=public)
        speculative = engine.generate(prompt, max_tokens=1024, cache_owner="x", public_prefix=public, **GREEDY)
        plain = engine.generate(prompt, max_tokens=1024, speculative=False, cache_owner="x", public_prefix=public,
                                **GREEDY)
        assert plain.stats.n_reused == len(prompt) - 1
    expected = _fresh_plain(pair, prompt, 1024, 4096)
    assert speculative.tokens == expected
    assert plain.tokens == expected


WORDS = ("the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "hello", "world", "tell", "me", "a",
         "story", "about", "paris", "and", "france")


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize(("target", "draft", "head"), [("dense", "dflash2", "phrase"), ("hybrid", "dflash2", "random"),
                                                       ("hybrid", None, "phrase")])
def test_random_owner_sequences_with_long_answers_match_a_fresh_engine(target: str, draft: str | None, head: str,
                                                                       seed: int) -> None:
    rng = random.Random(f"owners-{target}-{draft}-{head}-{seed}")
    # Small pairs, to run many owner histories; the power against summation-order changes (which flip near-ties in
    # wider models) comes from test_batch_invariance.py and the demo-pair test above.
    pair = tiny_pair(target, draft, head=head, **({"mtp_layers": 1} if draft is None else {}))
    n_ctx = 1024
    policy = SessionPolicy(max_parked=rng.choice([1, 2, 8]), park_on_switch=bool(seed % 2))
    reference = load_pair(pair.target, pair.draft, n_ctx=n_ctx)
    conversations: dict[str, list[int]] = {}
    compared = 0
    with reference, load_pair(pair.target, pair.draft, n_ctx=n_ctx, sessions=policy) as engine:
        public = _public(engine)
        for _ in range(10):
            owner = rng.choice(["a", "b", "c", None])
            history = conversations.get(str(owner))
            if history and rng.random() < 0.6:  # the owner's next turn builds on its last prompt and answer
                words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 8)))
                prompt = history + engine.tokenize(" " + words, add_special=False)
            else:
                prompt = _chat(engine, " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 12))))
            prompt = prompt[: n_ctx // 2]
            max_tokens = rng.choice([1, 40, 200, 400])
            options = {"speculative": rng.random() < 0.7, "draft_length": rng.choice(["auto", 1, 3, 7]),
                       "cache_owner": owner, "public_prefix": rng.choice([0, public, public])}
            tokens: list[int] = []
            cancel_after = rng.choice([None, None, None, 3])
            with engine.stream(prompt, max_tokens=max_tokens, **GREEDY, **options) as events:
                for index, event in enumerate(events):
                    tokens += event.tokens
                    if index == cancel_after:
                        break
            if rng.random() < 0.5:
                engine.park()
            reference.reset()
            expected = reference.generate(prompt, max_tokens=max_tokens, speculative=False, **GREEDY).tokens
            assert tokens == expected[: len(tokens)], (owner, len(prompt), options)
            if cancel_after is None:
                assert tokens == expected, (owner, len(prompt), options)
                compared += 1
            conversations[str(owner)] = prompt + tokens
    assert compared >= 4


@pytest.mark.parametrize("target", ["dense", "hybrid"])
def test_a_new_owner_finds_the_same_caches_after_short_and_long_chats_of_others(target: str) -> None:
    """What a new visitor's request reuses, restores and prefills depends on its own prompt and the public prefix
    only: not on how much another visitor said before it, nor on whether that visitor used the public prefix."""
    pair = tiny_pair(target, "dflash2", head="random")
    figures = []
    for victim_turns, victim_public in [(1, True), (4, True), (4, False)]:
        with load_pair(pair.target, pair.draft, n_ctx=2048, sessions=SessionPolicy(park_on_switch=False)) as engine:
            public = _public(engine)
            engine.generate(_chat(engine, "x")[:public], max_tokens=1, speculative=False, cache_owner="nobody",
                            public_prefix=public)  # the public prefix is kept before any visitor comes
            prompt = _chat(engine, "the quick brown fox")
            if not victim_public:
                prompt = engine.tokenize("no system prompt here: the quick brown fox")
            for turn in range(victim_turns):
                answer = engine.generate(prompt, max_tokens=60, cache_owner="victim",
                                         public_prefix=public if victim_public else 0)
                prompt = prompt + answer.tokens + engine.tokenize(f" and turn {turn}", add_special=False)
                engine.park()
            mine = engine.generate(_chat(engine, "hello world"), max_tokens=8, cache_owner="newcomer",
                                   public_prefix=public)
            s = mine.stats
            figures.append((s.n_reused, s.n_prefilled, s.checkpoint_restored_at, s.checkpoints_saved))
            assert engine.info()["sessions"]["parked"] == 1  # the victim's own state is kept for its next turn
    assert figures[0] == figures[1] == figures[2], figures
    assert figures[0][0] == public
