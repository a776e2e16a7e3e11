"""A tree path's sequence gets its request's state on the device (cache/spares.py), checked against libllama itself on
a generated hybrid target: after a rollback through the snapshots, libllama's bare sequence copy starts from the
rejected tokens' state; the fork, which gives the copy the same pending rollback first, starts from the exact state
(bit for bit the logits of a fresh decode) without a byte through host memory; where the rollback may have been
applied already, the fork's copy through host memory is exact too, and counted."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
from llama_cpp import llama_cpp as ll

from dflash_runtime import load_pair
from dflash_runtime.cache.pair_cache import PairCache
from dflash_runtime.cache.spares import SpareSequences
from dflash_runtime.engine import Engine
from dflash_runtime.native.batches import TokenBatch
from dflash_runtime.native.memory import SequenceMemory
from dflash_runtime.testing.tiny_models import tiny_pair

DRAFTED = [5, 9, 13, 17, 21]  # a verify batch's drafts
KEPT = 3  # of which the target keeps 3: a rollback of 2 pending until the sequence's next decode
NEXT = 7  # the token decoded after the kept ones


@pytest.fixture(scope="module")
def hybrid() -> Iterator[Engine]:
    pair = tiny_pair("hybrid", "dflash2", head="markov")
    with load_pair(pair.target, pair.draft, n_ctx=256, draft_capacity=7, branches=2) as engine:
        yield engine  # its own caches stay empty: the test drives the target context directly


class Target:
    """Sequence 0 of the engine's target context as a request's cache, and the spare sequences beside it."""

    def __init__(self, engine: Engine) -> None:
        pair = engine.pair
        self.ctx, self.n_vocab = pair.target_ctx, pair.n_vocab
        self.cache = PairCache(pair.target_ctx, [], recurrent=True, n_rs_seq=pair.n_rs_seq, checkpoints=None)
        self.spares = SpareSequences(pair.target_ctx, pair.branch_seqs, recurrent=True, n_rs_seq=pair.n_rs_seq)
        self.batch = TokenBatch(64)
        self.prompt = engine.tokenize("the quick brown fox jumps over the lazy dog.")

    def decode(self, rows: list[tuple[int, list[int], int]], outputs: str = "none") -> list[np.ndarray]:
        """One decode of (sequence, tokens, first position) rows; each sequence's last row's logits."""
        self.batch.clear()
        last = [self.batch.add(tokens, pos0, seq, outputs=outputs) + len(tokens) - 1 for seq, tokens, pos0 in rows]
        self.batch.decode(self.ctx, "test")
        if outputs == "none":
            return []
        return [np.ctypeslib.as_array(ll.llama_get_logits_ith(self.ctx, row), shape=(self.n_vocab,)).copy()
                for row in last]

    def verified(self) -> None:
        """The prompt, then a verify batch whose last drafts the target rejected: a rollback pending."""
        self.cache.clear()
        self.spares.prime()
        self.decode([(0, self.prompt, 0)])
        self.cache.decoded(self.prompt)
        self.decode([(0, DRAFTED, len(self.prompt))])
        self.cache.decoded(DRAFTED)
        self.cache.roll_back(len(self.prompt) + KEPT)
        assert self.cache.pending_rollback == len(DRAFTED) - KEPT

    def next_rows(self) -> list[np.ndarray]:
        """NEXT decoded after the kept tokens in the request's sequence and in every spare one, in one decode."""
        pos = len(self.prompt) + KEPT
        return self.decode([(seq, [NEXT], pos) for seq in (0, *self.spares.seqs)], outputs="all")

    def fresh(self) -> np.ndarray:
        self.cache.clear()
        return self.decode([(0, [*self.prompt, *DRAFTED[:KEPT], NEXT], 0)], outputs="last")[0]

    def free(self) -> None:
        self.batch.free()
        self.spares.free()


def test_a_bare_copy_starts_from_the_rejected_tokens_state_and_the_fork_from_the_exact_one(hybrid: Engine) -> None:
    target = Target(hybrid)
    try:
        expected = target.fresh()
        target.verified()
        for seq in target.spares.seqs:
            SequenceMemory(target.ctx, "spare", seq).copy_from(0)
        own, *copies = target.next_rows()
        assert np.array_equal(own, expected)
        assert all(not np.allclose(c, expected, atol=1e-3) for c in copies)  # the state after all 5 drafts

        target.verified()
        assert target.spares.fork(target.cache, target.spares.seqs) == 0
        own, *forks = target.next_rows()
        assert np.array_equal(own, expected) and all(np.array_equal(f, expected) for f in forks)
    finally:
        target.free()


def test_where_the_rollback_may_have_been_applied_the_fork_copies_through_host_memory(hybrid: Engine) -> None:
    target = Target(hybrid)
    try:
        expected = target.fresh()
        target.verified()
        spare = target.spares.seqs[-1]  # a decode of another sequence, which may apply sequence 0's rollback
        target.decode([(spare, [NEXT], hybrid.pair.n_rs_seq + 2)])
        target.cache.beside_decode()
        assert target.cache.pending_rollback is None
        moved = target.spares.fork(target.cache, target.spares.seqs)
        assert moved > 0
        own, *forks = target.next_rows()
        assert np.array_equal(own, expected) and all(np.array_equal(f, expected) for f in forks)
    finally:
        target.free()
