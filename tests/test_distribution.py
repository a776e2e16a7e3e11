"""Above temperature 0 the guarantee is the distribution: speculative output must be distributed exactly as the target's
own sampling under the request's sampler (temperature, top-k, top-p, min-p), whatever the verification mode.

The reference is computed independently of the engine: the target's logits from llama-cpp-python's own `Llama`
(teacher-forced), and the sampler written out in numpy here. The tests have power: a deliberately broken verifier
(accepting every draft) fails them.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import pytest
from llama_cpp import Llama

from dflash_runtime import load_pair
from dflash_runtime.decoding.verify import DRAFT, TARGET, RejectionVerifier, Verifiers
from dflash_runtime.engine import Engine
from dflash_runtime.native.backends import load_backends
from dflash_runtime.testing.heads import SOFT_TOKENS
from dflash_runtime.testing.tiny_models import TinyPair, tiny_draft_model, tiny_pair

PROMPT = "hello world"
NGRAMS = ("ngram-mod", "ngram-map-k")
NGRAM_DRAFTS = (*NGRAMS, "ngram-cache")
DRAFT_SIMPLE = "draft-simple"
NGRAM_KEYS = {"ngram-mod": {"n_match": 1}, "ngram-map-k": {"size_n": 1}}  # one-token keys: 3-token answers draft
Z_LIMIT = 4.5  # one-sided normal quantile: a false alarm about once in 300,000 tests


@dataclass(frozen=True)
class NumpySampler:
    temperature: float
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0

    def kwargs(self) -> dict:
        return dict(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, min_p=self.min_p)

    def probabilities(self, logits: np.ndarray) -> dict[int, float]:
        """llama.cpp's sampler written out: top-k, top-p (at temperature 1), min-p, temperature, softmax."""
        ids = np.arange(len(logits))
        z = logits.astype(np.float64)
        if self.top_k > 0:
            keep = np.argsort(-z, kind="stable")[: self.top_k]
            ids, z = ids[keep], z[keep]
        if self.top_p < 1.0:
            order = np.argsort(-z, kind="stable")
            ids, z = ids[order], z[order]
            cumulative = np.cumsum(_softmax(z))
            n = int(np.argmax(cumulative >= self.top_p)) + 1 if cumulative[-1] >= self.top_p else len(z)
            ids, z = ids[:n], z[:n]
        if self.min_p > 0.0:
            keep = z >= z.max() + math.log(self.min_p)
            ids, z = ids[keep], z[keep]
        p = _softmax(z / self.temperature)
        return {int(i): float(q) for i, q in zip(ids, p, strict=True) if q > 1e-12}


def _softmax(z: np.ndarray) -> np.ndarray:
    e = np.exp(z - z.max())
    return e / e.sum()


def chi_square_z(observed: Counter, expected: dict, n: int) -> tuple[float, int]:
    """Pearson's statistic over cells with an expected count ≥ 5 (the rest pooled), as a Wilson–Hilferty z-score."""
    cells = [k for k, p in expected.items() if p * n >= 5]
    rest_expected = n - sum(expected[k] * n for k in cells)
    rest_observed = n - sum(observed[k] for k in cells)
    stat = sum((observed[k] - expected[k] * n) ** 2 / (expected[k] * n) for k in cells)
    dof = len(cells) - 1
    if rest_expected >= 1:
        stat += (rest_observed - rest_expected) ** 2 / rest_expected
        dof += 1
    elif rest_observed > 0:
        return math.inf, dof  # outcomes the target cannot produce
    dof = max(dof, 1)
    return ((stat / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof)), dof


class Reference:
    """The target's exact joint distribution of the first tokens after the prompt, from teacher-forced logits."""

    def __init__(self, pair: TinyPair, engine: Engine, text: str = PROMPT, method: str | None = None) -> None:
        load_backends()  # a build with loadable backends registers them once per process
        self.llm = Llama(model_path=str(pair.target), n_ctx=256, logits_all=True, verbose=False)
        self.text, self.method = text, method  # the requests' prompt and draft method (None: the default)
        self.prompt = engine.tokenize(text)

    def next_logits(self, prefix: Sequence[int]) -> np.ndarray:
        self.llm.reset()
        self.llm.eval(list(self.prompt) + list(prefix))
        return np.array(self.llm.scores[self.llm.n_tokens - 1], dtype=np.float64)

    def joint(self, sampler: NumpySampler, length: int) -> dict[tuple[int, ...], float]:
        out: dict[tuple[int, ...], float] = {(): 1.0}
        for _ in range(length):
            grown: dict[tuple[int, ...], float] = {}
            for prefix, p in out.items():
                for token, q in sampler.probabilities(self.next_logits(prefix)).items():
                    if p * q > 1e-9:
                        grown[(*prefix, token)] = p * q
            out = grown
        return out

    def close(self) -> None:
        self.llm.close()


def samples(engine: Engine, reference: Reference, sampler: NumpySampler, verify: str, n: int,
            length: int) -> Iterator[tuple[int, ...]]:
    for seed in range(n):
        result = engine.generate(reference.text, max_tokens=length, draft_length=3, verify=verify, seed=seed,
                                 method=reference.method, **sampler.kwargs())
        yield tuple(result.tokens)


def check_distribution(engine: Engine, reference: Reference, sampler: NumpySampler, verify: str, n: int,
                       length: int = 3) -> list[float]:
    """z-scores of the per-position marginals and of the joint, for `n` samples of `length` tokens."""
    expected = reference.joint(sampler, length)
    return z_scores(list(samples(engine, reference, sampler, verify, n, length)), expected, length)


def z_scores(drawn: list[tuple[int, ...]], expected: dict[tuple[int, ...], float], length: int) -> list[float]:
    """z-scores of the joint and of each position's marginal of `drawn` against `expected`."""
    n = len(drawn)
    zs = [chi_square_z(Counter(drawn), expected, n)[0]]
    for position in range(length):
        marginal: dict = {}
        for seq, p in expected.items():
            marginal[seq[position]] = marginal.get(seq[position], 0.0) + p
        zs.append(chi_square_z(Counter(s[position] for s in drawn), marginal, n)[0])
    return zs


# Every (target, draft, verify) combination, each with two of the sampler variants: all variants and both
# temperatures are covered, with thousands of samples in all.
VARIANTS = [NumpySampler(0.6), NumpySampler(1.0, top_k=3), NumpySampler(0.6, top_p=0.8), NumpySampler(1.0, min_p=0.25)]
COMBOS = [(t, d, v) for t in ("dense", "hybrid") for d in ("dflash2", "dflash1") for v in ("sample", "match")]
COMBOS += [("hybrid", "mtp", v) for v in ("sample", "match")]  # the target's own MTP head drafts
COMBOS += [(t, d, v) for t in ("dense", "hybrid") for d in NGRAMS for v in ("sample", "match")]  # no q: point masses
CASES = [(*combo, VARIANTS[(i + j) % len(VARIANTS)]) for i, combo in enumerate(COMBOS) for j in (0, 2)]
# A small model drafts, sampled with its q, verified by rejection sampling (the verifiers are every method's; the
# hybrid target and sample-and-match run its drafts at temperature 0 in tests/test_draft_simple.py).
CASES += [("dense", DRAFT_SIMPLE, "sample", VARIANTS[0])]
# Lookup decoding, whose dynamic cache each sample teaches: its drafts follow earlier samples, never the current one's
# draws, so they are point masses all the same.
CASES += [("hybrid", "ngram-cache", "sample", VARIANTS[3])]
# EAGLE-3 (its own head over a draft vocabulary: -inf logits outside it), sampled with its q and matched.
CASES += [("dense", "eagle3", "sample", VARIANTS[1]), ("hybrid", "eagle3", "match", VARIANTS[2])]
# DSpark matched (sampled with its q: test_dspark_samples_follow_the_target_distribution_where_q_is_far_from_p).
CASES += [("hybrid", "dspark", "match", VARIANTS[3])]


def ngram_prompt(engine: Engine) -> str:
    """A prompt whose tokens the markov head's answers reuse: n-gram drafts happen, some accepted, most not."""
    sampled = "".join(engine.generate(PROMPT, max_tokens=8, temperature=1.0, seed=s, speculative=False).text
                      for s in range(4))
    return PROMPT + engine.generate(PROMPT, max_tokens=12, speculative=False).text + sampled + " " + PROMPT


@pytest.fixture(scope="module")
def markov() -> Iterator[dict]:
    opened: dict = {}

    def get(target: str, draft: str, verifiers: Verifiers | None = None) -> tuple[Engine, Reference]:
        key = (target, draft, verifiers)
        if key not in opened:
            if draft in NGRAM_DRAFTS:
                pair = tiny_pair(target, None, head="markov")
                engine = load_pair(pair.target, None, n_ctx=256, draft_capacity=3, verifiers=verifiers,
                                   method_options=NGRAM_KEYS)
                opened[key] = (engine, Reference(pair, engine, ngram_prompt(engine), draft))
                return opened[key]
            if draft == DRAFT_SIMPLE:
                pair = tiny_pair(target, None, head="markov")
                engine = load_pair(pair.target, tiny_draft_model(pair), n_ctx=256, draft_capacity=3,
                                   verifiers=verifiers)
                opened[key] = (engine, Reference(pair, engine, PROMPT, DRAFT_SIMPLE))
                return opened[key]
            pair = (tiny_pair(target, None, head="markov", mtp_layers=1) if draft == "mtp"
                    else tiny_pair(target, draft, head="markov"))
            engine = load_pair(pair.target, pair.draft, n_ctx=256, draft_capacity=3, verifiers=verifiers)
            opened[key] = (engine, Reference(pair, engine))
        return opened[key]

    yield get  # type: ignore[misc]
    for engine, reference in opened.values():
        reference.close()
        engine.close()


@pytest.mark.parametrize(("target", "draft", "verify", "sampler"), CASES,
                         ids=[f"{t}-{d}-{v}-{c}" for t, d, v, c in CASES])
def test_speculative_samples_follow_the_target_distribution(target, draft, verify, sampler, markov) -> None:
    engine, reference = markov(target, draft)
    zs = check_distribution(engine, reference, sampler, verify, n=1200)
    assert max(zs) < Z_LIMIT, zs
    stats = engine.generate(reference.text, max_tokens=24, draft_length=3, verify=verify, seed=7,
                            method=reference.method, **sampler.kwargs()).stats
    assert stats.verify_mode == verify and stats.drafted > 0


def test_plain_sampling_follows_the_reference(markov) -> None:
    """The reference itself is right: target-only sampling (llama.cpp's own sampler) passes the same test."""
    engine, reference = markov("hybrid", "dflash2")
    sampler = NumpySampler(1.0, top_p=0.9)
    expected = reference.joint(sampler, 3)
    n = 1200
    drawn = Counter(tuple(engine.generate(PROMPT, max_tokens=3, speculative=False, seed=s, **sampler.kwargs()).tokens)
                    for s in range(n))
    assert chi_square_z(drawn, expected, n)[0] < Z_LIMIT


class AcceptEverything:
    """A broken verifier: keeps every draft token, then samples the bonus from the target."""

    mode = "sample"

    def __init__(self, *args: object) -> None:
        self._inner = RejectionVerifier(*args)  # type: ignore[arg-type]

    def walk(self, proposal, first_row: int = 0):
        for token in proposal.tokens:
            yield token, DRAFT
        for token, _ in self._inner.walk(type(proposal)(), first_row + len(proposal.tokens)):
            yield token, TARGET


@pytest.mark.parametrize(("target", "draft"), [("dense", "dflash2"), ("dense", "dflash1"), ("hybrid", "mtp"),
                                               ("dense", "ngram-mod"), ("hybrid", "ngram-map-k"),
                                               ("hybrid", "ngram-cache"), ("hybrid", "eagle3")])
def test_a_broken_verifier_fails_the_distribution_test(target, draft, markov) -> None:
    engine, reference = markov(target, draft, verifiers=Verifiers(sample=AcceptEverything))
    zs = check_distribution(engine, reference, NumpySampler(1.0), "sample", n=1200)
    assert max(zs) > Z_LIMIT, zs


# DSpark on head="markov": its Markov head bets against the target's odds (testing/heads.py, dspark_markov), so each
# drafted token is drawn from a q far from p; answers of five tokens, so that the first step drafts three positions
# (draft_length 3) and every drafted position is verified.
DSPARK_LENGTH = 5


@pytest.mark.parametrize(("target", "sampler"), [("dense", VARIANTS[0]), ("hybrid", NumpySampler(1.0))])
def test_dspark_samples_follow_the_target_distribution_where_q_is_far_from_p(target, sampler, markov) -> None:
    engine, reference = markov(target, "dspark")
    zs = check_distribution(engine, reference, sampler, "sample", n=1200, length=DSPARK_LENGTH)
    assert max(zs) < Z_LIMIT, zs
    stats = engine.generate(reference.text, max_tokens=48, draft_length=3, seed=7, **sampler.kwargs()).stats
    assert stats.drafted > 24 and stats.acceptance_rate < 0.5, stats  # q far from p: most drafts are rejected


class ShiftedQ:
    """A broken q: each draft token is checked against the distribution its neighbour was drawn from (an off-by-one
    between a block's rows and the tokens read from them)."""

    mode = "sample"

    def __init__(self, *args: object) -> None:
        self._inner = RejectionVerifier(*args)  # type: ignore[arg-type]

    def walk(self, proposal, first_row: int = 0):
        q = proposal.q
        if q is not None and len(q) > 1:
            proposal = type(proposal)(proposal.tokens, [*q[1:], q[0]])
        return self._inner.walk(proposal, first_row)


def test_a_dspark_draft_checked_against_a_broken_q_fails_the_distribution_test(markov) -> None:
    engine, reference = markov("dense", "dspark", verifiers=Verifiers(sample=ShiftedQ))
    zs = check_distribution(engine, reference, VARIANTS[0], "sample", n=1200, length=DSPARK_LENGTH)
    assert max(zs) > Z_LIMIT, zs


@pytest.mark.parametrize("target", ["dense", "hybrid"])
@pytest.mark.parametrize("temperature", [0.6, 1.0])
def test_rejection_sampling_keeps_more_drafts_than_sample_and_match(target: str, temperature: float) -> None:
    """On a pair whose draft distribution is close to the target's (head="soft"), rejection sampling keeps nearly
    every draft, sample-and-match about p_max per position."""
    pair = tiny_pair(target, "dflash2", head="soft")
    rates: dict[str, list[float]] = {}
    with load_pair(pair.target, pair.draft, n_ctx=1024, draft_capacity=7) as engine:
        soft = {engine.tokenize(text, add_special=False)[0] for text in SOFT_TOKENS}
        for verify, seed in itertools.product(("sample", "match"), range(6)):
            result = engine.generate(PROMPT, max_tokens=120, draft_length=7, verify=verify, seed=seed,
                                     temperature=temperature, top_k=0)
            assert set(result.tokens) <= soft
            rates.setdefault(verify, []).append(result.stats.acceptance_rate)
            assert result.token_sources.count(DRAFT) == result.stats.accepted
    sample, match = float(np.mean(rates["sample"])), float(np.mean(rates["match"]))
    assert sample > 0.8, rates
    assert sample > match + 0.2, rates


def samples_beside_neighbours(engine: Engine, reference: Reference, sampler: NumpySampler, verify: str, n: int,
                              length: int) -> Iterator[tuple[int, ...]]:
    """The same samples, three at a time on an engine of several sequences, beside a neighbour that decodes a long
    greedy answer to another prompt: every step of a sample shares its target decode with other requests' rows."""
    seeds = iter(range(n))
    neighbour = engine.stream("the quick brown fox", max_tokens=10**6, speculative=True)
    try:
        while True:
            batch = [s for _, s in zip(range(engine.parallel - 1), seeds, strict=False)]
            if not batch:
                return
            streams = [engine.stream(reference.text, max_tokens=length, draft_length=3, verify=verify, seed=seed,
                                     method=reference.method, **sampler.kwargs()) for seed in batch]
            drawn: list[list[int]] = [[] for _ in streams]
            running = list(range(len(streams)))
            while running:
                for i in list(running):
                    event = next(streams[i])
                    drawn[i] += event.tokens
                    if event.finish_reason is not None:
                        running.remove(i)
                if next(neighbour).finish_reason is not None:  # the context is full: start it again
                    neighbour = engine.stream("the quick brown fox", max_tokens=10**6)
            yield from (tuple(d) for d in drawn)
    finally:
        neighbour.close()


@pytest.mark.parametrize(("target", "draft", "verify", "sampler"), [
    ("dense", "dflash2", "sample", VARIANTS[0]), ("hybrid", "dflash2", "sample", VARIANTS[1]),
    ("hybrid", "mtp", "sample", VARIANTS[2]), ("hybrid", "dflash2", "match", VARIANTS[3]),
    ("dense", "ngram-mod", "sample", VARIANTS[1]),
], ids=lambda v: str(v))
def test_samples_beside_busy_neighbours_follow_the_target_distribution(target, draft, verify, sampler) -> None:
    if draft in NGRAMS:
        pair = tiny_pair(target, None, head="markov")
    else:
        pair = tiny_pair(target, None, head="markov", mtp_layers=1) if draft == "mtp" else tiny_pair(
            target, draft, head="markov")
    options = {"method_options": NGRAM_KEYS} if draft in NGRAMS else {}
    with load_pair(pair.target, pair.draft, n_ctx=256, draft_capacity=3, parallel=4, **options) as engine:
        reference = Reference(pair, engine, ngram_prompt(engine) if draft in NGRAMS else PROMPT,
                              draft if draft in NGRAMS else None)
        length, n = 3, 1200
        expected = reference.joint(sampler, length)
        drawn = list(samples_beside_neighbours(engine, reference, sampler, verify, n, length))
        reference.close()
    assert len(drawn) == n
    zs = z_scores(drawn, expected, length)
    assert max(zs) < Z_LIMIT, zs
