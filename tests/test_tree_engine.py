"""The DFlash 2 tree method in the engine: lossless at temperature 0 on dense and hybrid targets (alone, after an
n-gram draft, with parallel sequences, across requests and other requests' steps, on long answers), the target's
distribution above it — drawn trees under recursive rejection, chosen ones under the walk — and broken verifiers
(passed in) that the distribution tests catch; on a hybrid target the paths get their state on the device.

The exactness tests use head="regime": the draft's likeliest token is often not the target's while another candidate
is, so accepted paths leave the spine (and the next step decodes the path before its own rows, drafting after it).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator

import pytest
from pairs import PROMPTS
from test_distribution import Z_LIMIT, NumpySampler, Reference, z_scores
from test_parallel import Reference as FreshEngine
from test_parallel import _jobs, check_against_reference, interleave
from test_tree import UnnormalisedResidual

from dflash_runtime import load_pair
from dflash_runtime.decoding.verify import MatchVerifier, RejectionVerifier, TreeRejection, Verifiers
from dflash_runtime.drafters.proposal import DRAFT, TARGET, Proposal
from dflash_runtime.drafters.tree import ROOT, DraftTree, TreeWalk, accepted_path
from dflash_runtime.engine import Engine
from dflash_runtime.errors import RequestError
from dflash_runtime.testing.tiny_models import TinyPair, tiny_pair

TREE = "dflash-tree"


@pytest.fixture(scope="module", params=["dense", "hybrid"])
def regime(request: pytest.FixtureRequest) -> Iterator[tuple[TinyPair, Engine]]:
    pair = tiny_pair(request.param, "dflash2", head="regime")
    with load_pair(pair.target, pair.draft, n_ctx=1024, draft_capacity=7, branches=3, parallel=2) as engine:
        yield pair, engine


def test_a_tree_answers_as_plain_decoding_alone_and_after_an_ngram_draft(regime) -> None:
    _, engine = regime
    assert TREE in engine.methods
    totals = {"tree_steps": 0, "tree_off_spine": 0, "tree_nodes": 0, "verify_steps": 0}
    for prompt in PROMPTS[:3]:
        plain = engine.generate(prompt, max_tokens=60, speculative=False).tokens
        for method, length, nodes in ((TREE, 7, 16), (TREE, 3, "auto"), (TREE, "auto", 12),
                                      (f"ngram-mod,{TREE}", 5, 16)):
            result = engine.generate(prompt, max_tokens=60, method=method, draft_length=length, tree_nodes=nodes)
            assert result.tokens == plain, (prompt, method, length, nodes)
            stats = result.stats
            assert result.token_sources.count(DRAFT) == stats.accepted
            for key in totals:
                totals[key] += getattr(stats, key)
    assert totals["tree_steps"] > 0 and totals["tree_off_spine"] > 0, totals
    assert totals["tree_nodes"] > totals["tree_steps"] * 7  # trees, not linear drafts


def test_long_tree_answers_are_plain_decodings_alone_and_beside_other_requests(regime) -> None:
    """Answers of 300 tokens to several prompts: alone, after other owners' requests, and stepped together with a
    request of another owner (every step's decode shared)."""
    _, engine = regime
    prompts = PROMPTS[1:4]
    plain = {p: engine.generate(p, max_tokens=300, speculative=False).tokens for p in prompts}
    for prompt in prompts:
        assert engine.generate(prompt, max_tokens=300, method=TREE, draft_length=7, tree_nodes=16).tokens == \
            plain[prompt]
        engine.generate(PROMPTS[5], max_tokens=40, method="dflash", cache_owner="other")
        engine.generate(PROMPTS[6], max_tokens=20, speculative=False, cache_owner="third")
    tree = engine.stream(prompts[0], max_tokens=300, method=TREE, draft_length=7, tree_nodes="auto",
                         cache_owner="tree")
    beside = engine.stream(prompts[1], max_tokens=300, method="dflash", draft_length=3, cache_owner="beside")
    got: dict[str, list[int]] = {"tree": [], "beside": []}
    running = {"tree": tree, "beside": beside}
    while running:
        for name, stream in list(running.items()):
            event = next(stream)
            got[name] += event.tokens
            if event.finish_reason is not None:
                del running[name]
    assert got["tree"] == plain[prompts[0]] and got["beside"] == plain[prompts[1]]


def test_a_tree_accepts_at_least_what_the_linear_draft_does_and_answers_long_as_plain(regime) -> None:
    _, engine = regime
    prompt = PROMPTS[1]
    plain = engine.generate(prompt, max_tokens=240, speculative=False).tokens
    linear = engine.generate(prompt, max_tokens=240, method="dflash", draft_length=7)
    tree = engine.generate(prompt, max_tokens=240, method=TREE, draft_length=7, tree_nodes=16)
    assert linear.tokens == tree.tokens == plain
    # the tree holds the linear draft: its steps emit at least as many tokens (a path off the spine costs no
    # decode of its own)
    assert tree.stats.n_generated / tree.stats.target_steps >= linear.stats.n_generated / linear.stats.target_steps
    assert tree.stats.tree_off_spine > 0 and tree.stats.plain_steps <= 1


WALKS: list[tuple[str, object, list[int]]] = []  # every verifier walk: (kind, what it verified, tokens it yielded)


def _recorded(walk: Iterator[tuple[int, str]], tokens: list[int]) -> Iterator[tuple[int, str]]:
    for token, source in walk:
        tokens.append(token)
        yield token, source


class LinearWalkRecorded(MatchVerifier):
    def walk(self, proposal: Proposal, first_row: int = 0) -> Iterator[tuple[int, str]]:
        WALKS.append(("linear", tuple(proposal.tokens), tokens := []))
        return _recorded(super().walk(proposal, first_row), tokens)


class TreeWalkRecorded(TreeWalk):
    def walk(self, tree: DraftTree, row_of: Callable[[int], int]) -> Iterator[tuple[int, str]]:
        WALKS.append(("tree", tree, tokens := []))
        return _recorded(super().walk(tree, row_of), tokens)


def _drafted(kind: str, what: object) -> object:
    """A walk's draft, comparable across engines: a linear draft's tokens, or a tree's nodes in order (token, parent,
    and the draft's log probability of its path, to the bit)."""
    return what if kind == "linear" else [(n.token, n.parent, n.logp) for n in what.nodes]  # type: ignore[attr-defined]


def _fork(kind: str, what: object, tokens: list[int]) -> int | None:
    """Where a tree walk's accepted path left the spine: its depth there (0: at the root); None: it did not."""
    if kind != "tree":
        return None
    accepted, spine = accepted_path(what, tokens), what.spine()  # type: ignore[arg-type, attr-defined]
    depth = 0
    while depth < min(len(accepted), len(spine)) and accepted[depth] == spine[depth]:
        depth += 1
    return depth if depth < len(accepted) else None


@pytest.mark.parametrize(("target", "head", "prompt", "below_root"), [
    ("dense", "regime", 0, False), ("hybrid", "regime", 2, False), ("dense", "words", 3, False),
    ("dense", "words", 4, True)], ids=["dense", "hybrid", "long-paths", "below-the-root"])
def test_the_step_after_a_path_off_the_spine_drafts_as_after_a_fresh_prefill(target: str, head: str, prompt: int,
                                                                               below_root: bool) -> None:
    """A tree's path accepted off its spine costs no decode of its own: its drafter takes the path's rows from the
    tree's decode, and the next step drafts at once. That draft must be the one a fresh prefill of the same tokens
    gives (the path's rows are the request's own, bit for bit): the next step's tree equals the first tree of a
    request whose prompt is everything before it. Paths of one token and of five (words), and a path that leaves
    the spine below the root (`below_root`)."""
    pair = tiny_pair(target, "dflash2", head=head)
    with load_pair(pair.target, pair.draft, n_ctx=1024, draft_capacity=7, branches=3,
                   verifiers=Verifiers(match=LinearWalkRecorded, tree=TreeWalkRecorded)) as engine:
        text = PROMPTS[prompt]
        plain = engine.generate(text, max_tokens=150, speculative=False).tokens
        WALKS.clear()
        decodes = engine.step_counters()["decodes"]
        result = engine.generate(text, max_tokens=150, method=TREE, draft_length=7, tree_nodes=16)
        assert result.tokens == plain
        stats, walks = result.stats, list(WALKS)
        # no decode of its own for any path off the spine: the prompt's one chunk, then the verify steps alone
        assert stats.tree_off_spine > 0 and stats.plain_steps <= 1, stats
        assert engine.step_counters()["decodes"] - decodes == 1 + stats.target_steps
        forks = [_fork(*walks[k - 1]) for k in range(1, len(walks))]
        after = [k for k in range(1, len(walks)) if forks[k - 1] is not None]
        for k in after[:8]:
            before = [token for _, _, tokens in walks[:k] for token in tokens]
            WALKS.clear()
            fresh = engine.generate(engine.tokenize(text) + before[:-1], max_tokens=12, method=TREE,
                                    draft_length=7, tree_nodes=16, cache_owner="fresh")
            assert WALKS[0][2] == [before[-1]] == fresh.tokens[:1]  # the prompt's own sample: the step's id_last
            kind, what, _ = walks[k]
            assert (WALKS[1][0], _drafted(*WALKS[1][:2])) == (kind, _drafted(kind, what)), k
        assert after
        assert any(forks[k - 1] for k in after[:8]) == below_root, forks


def test_parallel_tree_requests_across_a_long_lived_engine_answer_as_a_fresh_engine(regime) -> None:
    pair, engine = regime
    trees_in_turns_answer_as_a_fresh_engine(pair, engine, random.Random(3))


def trees_in_turns_answer_as_a_fresh_engine(pair: TinyPair, engine: Engine, rng: random.Random) -> None:
    """Ten random requests (trees of every size, linear drafts, plain ones) interleaved on `engine`: each answers as a
    fresh engine answers it alone."""
    jobs = _jobs(rng, engine, 10)
    for job in jobs:
        if job.options["speculative"]:
            job.options.update(method=rng.choice([TREE, TREE, "dflash"]), tree_nodes=rng.choice(["auto", 4, 16]))
    interleave(engine, jobs, rng)
    reference = FreshEngine(pair)
    try:
        assert check_against_reference(jobs, reference) > 0
    finally:
        reference.engine.close()


@pytest.mark.parametrize("seed", [3, 20])
def test_hybrid_trees_in_random_schedules_of_three_sequences_answer_as_a_fresh_engine(seed: int) -> None:
    """Prompt chunks, plain rows and other requests' trees beside a hybrid target's tree paths (a schedule where a
    path decoded beside a prompt chunk once gave a wrong answer)."""
    pair = tiny_pair("hybrid", "dflash2", head="regime")
    with load_pair(pair.target, pair.draft, n_ctx=1024, draft_capacity=7, branches=3, parallel=3) as engine:
        trees_in_turns_answer_as_a_fresh_engine(pair, engine, random.Random(seed))


def test_a_hybrid_trees_paths_get_their_state_on_the_device() -> None:
    """Every tree path of a hybrid target gets the request's recurrent state without a copy through host memory —
    at temperature 0 (answers exact), above it, with a linear step's rollback before the tree's (tree_nodes="auto"),
    and on a sequence that is not the last before the spare ones. Where libllama may have applied the request's
    rollback already (here: a divergence explained on another sequence between two steps), the state goes through
    host memory once, counted, and the answer stays exact."""
    pair = tiny_pair("hybrid", "dflash2", head="regime")
    with load_pair(pair.target, pair.draft, n_ctx=1024, draft_capacity=7, branches=3, parallel=2) as engine:
        prompt = PROMPTS[1]
        plain = engine.generate(prompt, max_tokens=120, speculative=False).tokens
        for nodes, temperature in ((16, 0.0), ("auto", 0.0), (16, 1.0)):
            result = engine.generate(prompt, max_tokens=120, method=TREE, draft_length=7, tree_nodes=nodes,
                                     temperature=temperature, seed=1)
            assert result.stats.tree_steps > 0 and result.stats.tree_host_bytes == 0, nodes
            assert temperature > 0 or result.tokens == plain
        counters = engine.step_counters()
        assert counters["forks"] > 0 and counters["fork_host_bytes"] == 0, counters
        tokens: list[int] = []
        for event in engine.stream(prompt, max_tokens=120, method=TREE, draft_length=7, tree_nodes=16):
            tokens += event.tokens
            if not event.stats.tree_host_bytes and event.finish_reason is None:
                engine.explain_divergence("hello world", [1, 2], [1, 3])  # decodes on the idle sequence
        assert tokens == plain and event.stats.tree_host_bytes > 0
        assert engine.step_counters()["fork_host_bytes"] == event.stats.tree_host_bytes


LINEAR_DRAFTS: list[tuple[int, int]] = []  # (drafted tokens, distributions recorded) of every linear verify


class LinearRecorded(RejectionVerifier):
    def walk(self, proposal: Proposal, first_row: int = 0) -> Iterator[tuple[int, str]]:
        LINEAR_DRAFTS.append((len(proposal.tokens), -1 if proposal.q is None else len(proposal.q)))
        yield from super().walk(proposal, first_row)


def test_a_tree_that_gets_no_path_is_a_linear_step() -> None:
    """Two tree requests stepped together on one spare sequence: the tree that gets no path is its spine, the linear
    draft's draw, verified by its rejection sampling with the draft's q and counted as a linear step."""
    pair = tiny_pair("dense", "dflash2", head="markov")
    with load_pair(pair.target, pair.draft, n_ctx=512, draft_capacity=7, branches=1, parallel=2,
                   verifiers=Verifiers(sample=LinearRecorded)) as engine:
        LINEAR_DRAFTS.clear()
        streams = [engine.stream(prompt, max_tokens=60, method=TREE, draft_length=5, tree_nodes=12, temperature=1.0,
                                 seed=seed, cache_owner=seed) for seed, prompt in enumerate(PROMPTS[1:3])]
        last = {}
        while streams:
            for stream in list(streams):
                event = next(stream)
                if event.finish_reason is not None:
                    last[id(stream)] = event.stats
                    streams.remove(stream)
        drafts = [(n, q) for n, q in LINEAR_DRAFTS if n]  # (the prompt's own first sample is a walk of no draft)
        linear = sum(s.verify_steps - s.tree_steps for s in last.values())
        assert sum(s.tree_steps for s in last.values()) > 0 and linear == len(drafts) > 0
        assert all(q == n for n, q in drafts)  # the spine's tokens, each with its q


def test_tree_nodes_is_checked_and_the_method_needs_spare_sequences() -> None:
    pair = tiny_pair("dense", "dflash2", head="regime")
    with load_pair(pair.target, pair.draft, n_ctx=256, draft_capacity=3) as engine:
        assert TREE not in engine.methods
        with pytest.raises(RequestError, match="not available"):
            engine.generate("hello", max_tokens=2, method=TREE)
        with pytest.raises(RequestError, match="tree_nodes"):
            engine.generate("hello", max_tokens=2, tree_nodes=0)
    with pytest.raises(ValueError, match="branches"):
        load_pair(pair.target, pair.draft, n_ctx=256, branches=-1)


# -- above temperature 0 ---------------------------------------------------------------------------------------------

ROOT_CHILDREN: list[int] = []  # the root's children of every tree RootCounted verified


class RootCounted(TreeRejection):
    """The engine's verifier, recording how many siblings each tree had at its root."""

    def walk(self, tree: DraftTree, row_of: Callable[[int], int]) -> Iterator[tuple[int, str]]:
        ROOT_CHILDREN.append(len(tree.children(ROOT)))
        yield from super().walk(tree, row_of)


class AnyChildWins:
    """Deliberately broken walk of a chosen tree: when the target's sample is the token of any child, the likeliest
    child is followed."""

    def __init__(self, sample: Callable[[int], int]) -> None:
        self._sample = sample

    def walk(self, tree: DraftTree, row_of: Callable[[int], int]) -> Iterator[tuple[int, str]]:
        node = ROOT
        while True:
            token = self._sample(row_of(node))
            kids = tree.children(node)
            if token not in kids:
                yield token, TARGET
                return
            node = next(iter(kids.values()))
            yield tree.nodes[node].token, DRAFT


@pytest.fixture(scope="module")
def opened() -> Iterator[Callable[..., tuple[Engine, Reference]]]:
    engines: dict = {}

    def get(target: str, head: str, verifiers: Verifiers | None = None) -> tuple[Engine, Reference]:
        key = (target, head, verifiers)
        if key not in engines:
            pair = tiny_pair(target, "dflash2", head=head)
            engine = load_pair(pair.target, pair.draft, n_ctx=256, draft_capacity=3, branches=3, verifiers=verifiers)
            engines[key] = (engine, Reference(pair, engine, method=TREE))
        return engines[key]

    yield get
    for engine, reference in engines.values():
        reference.close()
        engine.close()


def tree_z_scores(engine: Engine, reference: Reference, sampler: NumpySampler, verify: str, n: int) -> list[float]:
    """z-scores of three-token answers drawn with trees at every step (depth 3, tree_nodes fixed: no linear steps)."""
    drawn = [tuple(engine.generate(reference.text, max_tokens=3, draft_length=3, verify=verify, seed=seed,
                                   method=TREE, tree_nodes=9, **sampler.kwargs()).tokens) for seed in range(n)]
    return z_scores(drawn, reference.joint(sampler, 3), 3)


@pytest.mark.parametrize(("target", "verify", "sampler"), [("hybrid", "sample", NumpySampler(1.0)),
                                                            ("dense", "sample", NumpySampler(0.7, top_k=3)),
                                                            ("dense", "match", NumpySampler(1.0))])
def test_tree_samples_follow_the_target_distribution(opened, target: str, verify: str, sampler: NumpySampler) -> None:
    """Drawn trees (rejection sampling: q far from the target's p on the markov head, three drafted positions, up to
    four siblings at the root) and chosen ones (sample-and-match) alike."""
    engine, reference = opened(target, "markov", Verifiers(tree_sample=RootCounted))
    ROOT_CHILDREN.clear()
    zs = tree_z_scores(engine, reference, sampler, verify, n=600)
    assert max(zs) < Z_LIMIT, zs
    if verify == "sample":
        assert sum(n >= 3 for n in ROOT_CHILDREN) > len(ROOT_CHILDREN) // 2, ROOT_CHILDREN
    stats = engine.generate(reference.text, max_tokens=24, draft_length=3, verify=verify, seed=7, method=TREE,
                            tree_nodes=9, **sampler.kwargs()).stats
    assert stats.tree_steps > 0 and stats.tree_nodes > 3 * stats.tree_steps


class TreeRejectionRecorded(TreeRejection):
    def walk(self, tree: DraftTree, row_of: Callable[[int], int]) -> Iterator[tuple[int, str]]:
        WALKS.append(("tree", tree, tokens := []))
        return _recorded(super().walk(tree, row_of), tokens)


def test_steps_after_a_path_off_the_spine_sample_the_target_distribution(opened) -> None:
    """Trees of depth 1 (up to four siblings at the root, q far from p on the markov head): a sibling off the spine
    is often kept, and the next step drafts after it at once, its verify rows after the path's; answers of five
    tokens keep the target's law."""
    engine, reference = opened("hybrid", "markov", Verifiers(tree_sample=TreeRejectionRecorded))
    sampler, drawn, after = NumpySampler(1.0, top_k=3), [], 0
    for seed in range(600):
        WALKS.clear()
        drawn.append(tuple(engine.generate(reference.text, max_tokens=5, draft_length=1, seed=seed, method=TREE,
                                           tree_nodes=7, **sampler.kwargs()).tokens))
        after += sum(_fork(*WALKS[k - 1]) is not None for k in range(1, len(WALKS)))
    zs = z_scores(drawn, reference.joint(sampler, 5), 5)
    assert max(zs) < Z_LIMIT, zs
    assert after > 30, after  # trees drafted right after a path off the spine


@pytest.mark.parametrize(("verify", "broken"), [("sample", Verifiers(tree_sample=UnnormalisedResidual)),
                                                ("match", Verifiers(tree=AnyChildWins))],
                         ids=["unnormalised-residual", "any-child-wins"])
def test_a_broken_tree_verifier_fails_the_distribution_test(opened, verify: str, broken: Verifiers) -> None:
    """(Siblings drawn with replacement, and the unremoved q, are broken in the builder or too subtly on these
    pairs for 400 answers: tests/test_tree.py catches them on a table target.)"""
    engine, reference = opened("dense", "markov", broken)
    zs = tree_z_scores(engine, reference, NumpySampler(1.0), verify, n=400)
    assert max(zs) > Z_LIMIT, zs
