"""Cache owners: a request reuses only what its own owner put in the cache, plus a public prefix; another owner's
state is parked and comes back for its owner's next request; answers stay exactly a fresh engine's."""

from __future__ import annotations

import random

import pytest

from dflash_runtime import RequestError, SessionPolicy, load_pair
from dflash_runtime.testing.tiny_models import tiny_pair

SYSTEM = "<|im_start|>system\nyou are a helpful assistant.<|im_end|>\n"
SECRET = "<|im_start|>user\nthe internal code is fox dog seven eight nine ten<|im_end|>\n<|im_start|>assistant\n"
GUESS_RIGHT = SECRET
GUESS_WRONG = "<|im_start|>user\nthe internal code is one two three four five<|im_end|>\n<|im_start|>assistant\n"


def _fresh_answer(pair, prompt: list[int], max_tokens: int) -> list[int]:
    with load_pair(pair.target, pair.draft, n_ctx=1024) as fresh:
        return fresh.generate(prompt, max_tokens=max_tokens, speculative=False).tokens


@pytest.mark.parametrize("target", ["dense", "hybrid"])
def test_another_owner_learns_nothing_from_the_cache(target: str) -> None:
    pair = tiny_pair(target, "dflash2")
    with load_pair(pair.target, pair.draft, n_ctx=1024) as engine:
        secret = engine.tokenize(SYSTEM + SECRET)
        victim = engine.generate(secret, max_tokens=12, cache_owner="visitor-v")
        right = engine.generate(engine.tokenize(SYSTEM + GUESS_RIGHT), max_tokens=1, cache_owner="visitor-a")
        wrong = engine.generate(engine.tokenize(SYSTEM + GUESS_WRONG), max_tokens=1, cache_owner="visitor-a")
        # The attacker's right guess reuses nothing of the victim's text; its wrong guess then reuses its own.
        assert right.stats.n_reused == 0
        assert right.stats.checkpoint_restored_at is None
        # The victim's own next turn still reuses its prefix.
        follow_up = secret + victim.tokens + engine.tokenize(" and then?", add_special=False)
        again = engine.generate(follow_up, max_tokens=12, cache_owner="visitor-v")
        assert again.stats.n_reused >= len(secret) - 1
        assert again.tokens == _fresh_answer(pair, follow_up, 12)
    assert wrong.stats.n_reused > 0  # the same owner's earlier prompt is its own to reuse


@pytest.mark.parametrize("target", ["dense", "hybrid"])
def test_a_public_prefix_is_shared_and_nothing_after_it(target: str) -> None:
    pair = tiny_pair(target, "dflash2")
    with load_pair(pair.target, pair.draft, n_ctx=1024) as engine:
        public = len(engine.tokenize(SYSTEM))
        first = engine.tokenize(SYSTEM + SECRET)
        engine.generate(first, max_tokens=8, cache_owner="a", public_prefix=public)
        other = engine.tokenize(SYSTEM + GUESS_RIGHT)
        shared = engine.generate(other, max_tokens=10, cache_owner="b", public_prefix=public)
        assert shared.stats.n_reused == public
        assert shared.tokens == _fresh_answer(pair, other, 10)
        # A prefix only one side declares public is not shared.
        third = engine.generate(other, max_tokens=10, cache_owner="c", public_prefix=0)
        assert third.stats.n_reused == 0
        assert third.tokens == shared.tokens


def test_parking_is_bounded() -> None:
    pair = tiny_pair("hybrid", "dflash2")
    with load_pair(pair.target, pair.draft, n_ctx=1024, sessions=SessionPolicy(max_parked=0)) as engine:
        prompt = engine.tokenize(SYSTEM + SECRET)
        engine.generate(prompt, max_tokens=4, cache_owner="a")
        engine.generate(engine.tokenize("one two three"), max_tokens=4, cache_owner="b")
        back = engine.generate(prompt, max_tokens=4, cache_owner="a")
        assert back.stats.n_reused == 0  # nothing was kept aside for "a"
        assert engine.info()["sessions"]["parked"] == 0
    with load_pair(pair.target, pair.draft, n_ctx=1024, sessions=SessionPolicy(max_parked=2)) as engine:
        for owner in "abcde":
            engine.generate(engine.tokenize(f"{SYSTEM}{owner} one two three"), max_tokens=4, cache_owner=owner)
        assert engine.info()["sessions"]["parked"] == 2
        assert engine.info()["sessions"]["parked_bytes"] > 0
        oldest = engine.generate(engine.tokenize(f"{SYSTEM}a one two three"), max_tokens=4, cache_owner="a")
        newest = engine.generate(engine.tokenize(f"{SYSTEM}d one two three"), max_tokens=4, cache_owner="d")
        assert oldest.stats.n_reused == 0 and newest.stats.n_reused > 0


def test_recent_states_are_not_evicted_by_a_burst_of_new_owners() -> None:
    """With protect_s, owners that come later do not push out the states parked recently: theirs are not kept."""
    pair = tiny_pair("hybrid", "dflash2")
    policy = SessionPolicy(max_parked=2, park_on_switch=False, protect_s=3600)
    with load_pair(pair.target, pair.draft, n_ctx=1024, sessions=policy) as engine:
        prompts = {owner: engine.tokenize(f"{SYSTEM}{owner} one two three") for owner in "abcdef"}
        for owner in "abcdef":  # a and b are parked first; c..f come after, within protect_s
            engine.generate(prompts[owner], max_tokens=4, cache_owner=owner)
            engine.park()
        assert engine.info()["sessions"]["parked"] == 2
        assert engine.generate(prompts["f"], max_tokens=4, cache_owner="x").stats.n_reused == 0
        kept = [engine.generate(prompts[o], max_tokens=4, cache_owner=o).stats.n_reused > 0 for o in "abcde"]
        assert kept == [True, True, False, False, False]


@pytest.mark.parametrize("target", ["dense", "hybrid"])
def test_interleaved_owners_answer_as_a_fresh_engine(target: str) -> None:
    rng = random.Random(f"owners-{target}")
    pair = tiny_pair(target, "dflash2", head="shaped")
    words = ("fox", "dog", "one", "two", "three", "hello", "world", "what", "is", "the")
    with load_pair(pair.target, pair.draft, n_ctx=1024) as engine, \
            load_pair(pair.target, pair.draft, n_ctx=1024) as reference:
        chats: dict[str, list[int]] = {}
        reused_own = 0
        for _ in range(16):
            owner = rng.choice("abc")
            text = " ".join(rng.choice(words) for _ in range(rng.randint(2, 6)))
            prompt = chats.get(owner, engine.tokenize(SYSTEM)) + engine.tokenize(f" {text}", add_special=False)
            options = {"max_tokens": rng.randint(1, 12), "draft_length": rng.choice(["auto", 1, 3, 7])}
            result = engine.generate(prompt, cache_owner=owner, **options)
            reference.reset()
            assert result.tokens == reference.generate(prompt, max_tokens=options["max_tokens"],
                                                       speculative=False).tokens
            if owner in chats:
                reused_own += result.stats.n_reused >= len(chats[owner]) - 1
            else:
                assert result.stats.n_reused == 0
            chats[owner] = prompt + result.tokens
        assert reused_own >= 4


def test_owner_and_public_prefix_are_checked() -> None:
    pair = tiny_pair("dense", "dflash2")
    with load_pair(pair.target, pair.draft, n_ctx=256) as engine:
        with pytest.raises(RequestError, match="cache_owner"):
            engine.generate("hello", max_tokens=1, cache_owner=["not", "hashable"])
        with pytest.raises(RequestError, match="public_prefix"):
            engine.generate("hello", max_tokens=1, public_prefix=-1)
        assert engine.generate("hello", max_tokens=2, cache_owner="x", public_prefix=10**6).finish_reason
