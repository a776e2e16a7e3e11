"""Threads: one-row decodes and batches (verifies, draft blocks, prompts) each on their own count, as llama.cpp takes
them (`n_threads`, `n_threads_batch`); and a row's numbers the same whatever the counts, so that exactness holds
when a plain step and a verify run on different ones."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest
from llama_cpp import llama_cpp as ll

from dflash_runtime import load_pair
from dflash_runtime.engine import Engine
from dflash_runtime.pair import available_cores
from dflash_runtime.testing.tiny_models import tiny_pair

PROMPT = "the draft proposes tokens and the target verifies them. " * 5


def logits_by_splits(engine: Engine, prompt: Sequence[int], splits: Sequence[int]) -> np.ndarray:
    """Every prompt row's logits when the prompt is decoded in batches of the given sizes (a fresh cache)."""
    ctx, n_vocab = engine.target_ctx, engine.info()["n_vocab"]
    ll.llama_memory_clear(ll.llama_get_memory(ctx), True)
    out, pos = [], 0
    for size in splits:
        batch = ll.llama_batch_init(size, 0, 1)
        try:
            for i in range(size):
                batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = prompt[pos + i], pos + i, 1, 1
                batch.seq_id[i][0] = 0
            batch.n_tokens = size
            assert ll.llama_decode(ctx, batch) == 0
        finally:
            ll.llama_batch_free(batch)
        out.append(np.ctypeslib.as_array(ll.llama_get_logits(ctx), shape=(size, n_vocab)).copy())
        pos += size
    return np.concatenate(out)


def test_batches_take_the_decodes_threads_unless_told() -> None:
    pair = tiny_pair("dense", "dflash2")
    half = max(1, available_cores() // 2)
    with load_pair(pair.target, pair.draft, n_ctx=256) as engine:
        assert engine.info()["threads"] == {"decode": half, "batch": half}
    with load_pair(pair.target, pair.draft, n_ctx=256, n_threads=2) as engine:
        assert engine.info()["threads"] == {"decode": 2, "batch": 2}
    with load_pair(pair.target, pair.draft, n_ctx=256, n_threads=3, n_threads_batch=5) as engine:
        assert engine.info()["threads"] == {"decode": 3, "batch": 5}
        assert ll.llama_n_threads(engine.target_ctx) == 3 and ll.llama_n_threads_batch(engine.target_ctx) == 5
        assert ll.llama_n_threads_batch(engine.draft_ctx) == 5
    for bad in (-1, 1.5, True):  # (0 or None: the default, as in llama-cpp-python)
        with pytest.raises(ValueError, match="n_threads_batch must be an integer"):
            load_pair(pair.target, pair.draft, n_ctx=256, n_threads_batch=bad)


@pytest.mark.parametrize("target", ["dense", "hybrid"])
def test_a_rows_logits_do_not_depend_on_the_thread_counts(target: str) -> None:
    """One thread for one-row decodes and two for batches, against one for both: every split of a prompt gives the
    logits of the whole prompt decoded on one thread, bit for bit."""
    pair = tiny_pair(target, "dflash2", head="phrase", n_embd=512, dims="scaled")
    with load_pair(pair.target, pair.draft, n_ctx=1024, n_threads=1, n_threads_batch=1) as engine:
        prompt = engine.tokenize(PROMPT)[:64]
        whole = logits_by_splits(engine, prompt, [len(prompt)])
    with load_pair(pair.target, pair.draft, n_ctx=1024, n_threads=1, n_threads_batch=2) as engine:
        assert engine.info()["batch_invariant"]
        n = len(prompt)
        for splits in ([n], [n - 1, 1], [n - 8, 8], [1] * n, [2, 5, 7, n - 14]):
            assert np.array_equal(logits_by_splits(engine, prompt, splits), whole), splits


@pytest.mark.parametrize("target", ["dense", "hybrid"])
def test_answers_do_not_depend_on_the_thread_counts(target: str) -> None:
    """Speculative answers with batches on two threads equal plain decoding on one, token for token, over an answer
    long enough for near-ties to show."""
    pair = tiny_pair(target, "dflash2", head="phrase", n_embd=512, dims="scaled")
    with load_pair(pair.target, pair.draft, n_ctx=1024, n_threads=1, n_threads_batch=1) as engine:
        prompt = engine.tokenize(PROMPT)[:40]
        plain = engine.generate(prompt, max_tokens=384, speculative=False).tokens
    with load_pair(pair.target, pair.draft, n_ctx=1024, n_threads=1, n_threads_batch=2) as engine:
        result = engine.generate(prompt, max_tokens=384, draft_length="auto")
        assert result.stats.drafted > 0
        assert result.tokens == plain
