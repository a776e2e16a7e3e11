"""What exactness across requests rests on: on the CPU, a target row's logits do not depend on the rows decoded with
it, nor on how its prefix was split into batches (one row, a few verify rows, prompt chunks). Upstream's llamafile
sgemm (two rows and up only) and the CPU FlashAttention kernel break this; the wheel recipe's CPU build patches sgemm
to take every row count, and numerics="exact" (the default) opens the target without FlashAttention and weight
repacking. `info()["batch_invariant"]` and `info()["numerics"]` say whether it holds (see docs/numerics.md)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest
from llama_cpp import llama_cpp as ll

from dflash_runtime import load_pair
from dflash_runtime.engine import Engine
from dflash_runtime.testing.tiny_models import tiny_pair


def _decode(engine: Engine, tokens: Sequence[int], pos0: int) -> np.ndarray:
    """Decode `tokens` at pos0.. on the target, every row with logits; returns them (rows × n_vocab)."""
    n_vocab = engine.info()["n_vocab"]
    batch = ll.llama_batch_init(len(tokens), 0, 1)
    try:
        for i, token in enumerate(tokens):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = token, pos0 + i, 1, 1
            batch.seq_id[i][0] = 0
        batch.n_tokens = len(tokens)
        assert ll.llama_decode(engine.target_ctx, batch) == 0
    finally:
        ll.llama_batch_free(batch)
    logits = ll.llama_get_logits(engine.target_ctx)
    return np.ctypeslib.as_array(logits, shape=(len(tokens), n_vocab)).copy()


def _rows(engine: Engine, prompt: list[int], splits: Sequence[int]) -> np.ndarray:
    """The logits of every prompt position when the prompt is decoded in batches of the given sizes."""
    ll.llama_memory_clear(ll.llama_get_memory(engine.target_ctx), True)
    out, pos = [], 0
    for size in splits:
        out.append(_decode(engine, prompt[pos:pos + size], pos))
        pos += size
    assert pos == len(prompt)
    return np.concatenate(out)


@pytest.mark.parametrize("target", ["dense", "hybrid"])
def test_a_rows_logits_do_not_depend_on_its_batch(target: str) -> None:
    pair = tiny_pair(target, "dflash2", head="phrase", n_embd=512, dims="scaled")
    with load_pair(pair.target, pair.draft, n_ctx=1024) as engine:
        assert engine.info()["batch_invariant"]
        assert engine.info()["numerics"]["holds"] == "exact" and engine.info()["numerics"]["asked"] == "exact"
        prompt = engine.tokenize("the draft proposes tokens and the target verifies them. " * 5)[:64]
        n = len(prompt)
        whole = _rows(engine, prompt, [n])
        for splits in ([n - 1, 1], [33, n - 33], [n - 8, 8], [n - 3, 1, 2], [1] * n, [2, 5, 7, n - 14]):
            assert np.array_equal(_rows(engine, prompt, splits), whole), splits
        engine.reset()


def test_fast_numerics_say_they_are_exact_up_to_near_ties() -> None:
    pair = tiny_pair("dense", "dflash2")
    with load_pair(pair.target, pair.draft, n_ctx=256, numerics="fast") as engine:
        numerics = engine.info()["numerics"]
        assert not engine.info()["batch_invariant"]
        assert numerics["asked"] == "fast" and numerics["holds"] == "exact up to near-ties"
        assert "FlashAttention and repacked weights" in numerics["why"]
    with pytest.raises(ValueError, match="numerics must be one of exact, fast"):
        load_pair(pair.target, pair.draft, n_ctx=256, numerics="fastest")
