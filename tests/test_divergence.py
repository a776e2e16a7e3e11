"""A temperature-0 difference from plain decoding explained by the target's own logits at the first differing token:
a verifier that accepts a wrong token is a fault every time; on a configuration whose kernels are not batch-invariant
(numerics="fast", the stand-in for a GPU), the differences that appear are near-ties."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from dflash_runtime import load_pair
from dflash_runtime.decoding.divergence import FAULT, IDENTICAL, NEAR_TIE, Divergence, first_difference
from dflash_runtime.decoding.verify import MatchVerifier, Verifiers
from dflash_runtime.drafters.proposal import DRAFT, TARGET, Proposal
from dflash_runtime.engine import Engine
from dflash_runtime.native.sampling import Sampler
from dflash_runtime.testing.tiny_models import tiny_pair

PROMPTS = [f"{a} {b}" for a in ("the quick brown fox", "hello world", "what is the capital of", "once upon a time",
                                "one two three") for b in ("jumps", "and the dog", "said the model", "over it")]


class BrokenMatch:
    """A `Verifiers.match` factory: a fresh AcceptsOneWrongToken per request."""

    def __call__(self, sampler: Sampler, target_ctx: object) -> AcceptsOneWrongWalk:
        return AcceptsOneWrongWalk(sampler, target_ctx)


class AcceptsOneWrongWalk(MatchVerifier):
    """MatchVerifier's walk, except that the first draft token the target rejects is kept (once per verifier)."""

    def __init__(self, sampler: Sampler, target_ctx: object) -> None:
        super().__init__(sampler, target_ctx)
        self.broke = False

    def walk(self, proposal: Proposal, first_row: int = 0) -> Iterator[tuple[int, str]]:
        drafts = proposal.tokens
        for i in range(len(drafts) + 1):
            token = self._sampler.sample(self._ctx, first_row + i)
            if i < len(drafts) and token == drafts[i]:
                yield token, DRAFT
                continue
            if i < len(drafts) and not self.broke:
                self.broke = True
                yield drafts[i], DRAFT  # a token the target did not choose, kept as if it had
                return
            yield token, TARGET
            return


@pytest.fixture(scope="module")
def broken() -> Iterator[Engine]:
    pair = tiny_pair("dense", "dflash2", head="phrase")
    with load_pair(pair.target, pair.draft, n_ctx=512, verifiers=Verifiers(match=BrokenMatch())) as engine:
        yield engine


def test_a_verifier_that_keeps_a_wrong_token_is_a_fault_every_time(broken: Engine) -> None:
    verdicts = []
    for prompt in PROMPTS:
        tokens = broken.tokenize(prompt)
        plain = broken.generate(tokens, max_tokens=24, speculative=False).tokens
        wrong = broken.generate(tokens, max_tokens=24, draft_length=3).tokens
        assert wrong != plain, f"{prompt!r}: the broken verifier kept no wrong token"
        why = broken.explain_divergence(tokens, plain, wrong)
        assert why.position == first_difference(plain, wrong)
        assert why.token_a == plain[why.position] and why.token_b == wrong[why.position]
        verdicts.append(why)
    assert [v.kind for v in verdicts] == [FAULT] * len(PROMPTS) == [FAULT] * 20, [v.summary() for v in verdicts]
    for why in verdicts:
        assert why.plain is not None and why.verify is not None
        # The target's argmax is plain's token under both scorings, and the kept token trails it beyond the bound.
        assert why.plain.top == why.token_a == why.verify.top
        assert why.margin > why.bound > 0
        assert why.spread == 0.0 or not why.batch_invariant, "a batch-invariant build scores both rows alike"
        assert why.summary() == f"differs at token {why.position}: fault (margin {why.margin:.3g})"
        assert Divergence.from_dict(why.to_dict()) == why


def test_identical_answers_and_bad_arguments(broken: Engine) -> None:
    tokens = broken.tokenize(PROMPTS[0])
    plain = broken.generate(tokens, max_tokens=8, speculative=False).tokens
    assert broken.explain_divergence(tokens, plain, plain).kind == IDENTICAL
    assert broken.explain_divergence(tokens, plain, list(plain)).summary() == "identical"
    with pytest.raises(ValueError, match="verify_rows"):
        broken.explain_divergence(tokens, plain, plain[:-1], verify_rows=0)
    # An answer that ended early differs where it ended: its candidate is the end-of-generation token.
    short = broken.explain_divergence(tokens, plain, plain[:-1])
    assert short.position == len(plain) - 1 and short.token_b == broken.pair.vocabulary.eos
    assert short.kind in (FAULT, NEAR_TIE)


WORDS = ("the quick brown fox", "hello world", "what is the capital of", "once upon a time", "one two three",
         "jumps over", "and the dog", "said the model", "over it", "tell me a story")


def test_on_kernels_that_are_not_batch_invariant_the_differences_are_near_ties() -> None:
    """numerics="fast" stands in for a GPU: with two threads and 512+ cached cells, FlashAttention splits a single
    row's cells across the threads (partial sums), a verify batch's rows are summed whole. Long prompts whose answers
    differ there are searched (two, where this build's kernels break a near-tie); every difference is a near-tie."""
    pair = tiny_pair("dense", "dflash2", head="phrase")
    found = []
    with load_pair(pair.target, pair.draft, n_ctx=1024, numerics="fast", n_threads=2) as engine:
        assert not engine.info()["batch_invariant"]
        base = engine.tokenize(" ".join(WORDS) * 6)[:300]
        for tail in (" the quick brown fox and the dog", " hello world and the dog"):
            prompt = base + engine.tokenize(tail, add_special=False)
            plain = engine.generate(prompt, max_tokens=64, speculative=False).tokens
            speculative = engine.generate(prompt, max_tokens=64, draft_length=7).tokens
            if plain != speculative:
                found.append(engine.explain_divergence(prompt, plain, speculative))
    assert found, "no difference appeared on the stand-in kernels"
    for why in found:
        assert why.kind == NEAR_TIE, why.to_dict()
        assert 0 <= why.margin <= why.bound and why.spread > 0 and not why.batch_invariant
        assert why.summary() == (f"differs at token {why.position}: a near-tie (margin {why.margin:.2g}, the kernels' "
                                 "rounding), not a fault")
