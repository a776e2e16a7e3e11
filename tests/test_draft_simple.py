"""draft-simple: a small autoregressive model of the target's vocabulary drafts (llama.cpp's --spec-type
draft-simple). At temperature 0 every answer is the target's own, alone, chained and with parallel sequences, on
dense and hybrid targets; the file is refused clearly where it cannot draft. (Above temperature 0:
tests/test_distribution.py; against llama-server: tools/compare_llama_server.py --draft draft-simple.)"""

from __future__ import annotations

import re

import pytest
from pairs import PROMPTS

from dflash_runtime import PairMismatchError, load_pair
from dflash_runtime.footprint import sequence_footprint
from dflash_runtime.gguf_meta import read_gguf
from dflash_runtime.testing.tiny_models import tiny_draft_model, tiny_pair

KV_LINE = re.compile(r"llama_kv_cache: size = +([\d.]+) MiB")  # as tests/test_footprint.py reads libllama's log

METHOD = "draft-simple"


@pytest.fixture(scope="module", params=["dense", "hybrid"])
def pair(request: pytest.FixtureRequest):
    target = tiny_pair(request.param, None, head="phrase")
    return target, tiny_draft_model(target)


def test_a_small_model_drafts_and_every_answer_is_the_targets_own(pair) -> None:
    target, draft = pair
    with load_pair(target.target, draft, n_ctx=512, draft_capacity=5) as engine:
        assert METHOD in engine.methods and "dflash" not in engine.methods
        assert engine.default_method == METHOD  # a model of its own: a default, as DFlash and MTP are
        info = engine.info()
        assert info["draft_kind"] == METHOD and info["draft_capacity"] == 5 and info["block_size"] is None
        drafted = accepted = 0
        for prompt in PROMPTS[:4]:
            base = engine.generate(prompt, max_tokens=40, speculative=False)
            runs = [(METHOD, length) for length in (1, 5, "auto")]
            runs += [(f"ngram-mod,{METHOD}", 5), (f"{METHOD},ngram-map-k", "auto")]  # chained, either side
            for method, length in runs:
                result = engine.generate(prompt, max_tokens=40, method=method, draft_length=length)
                assert result.tokens == base.tokens, (prompt, length, method)
                assert result.token_sources.count("draft") == result.stats.accepted
                if method == METHOD:
                    assert set(result.stats.drafted_by) <= {METHOD}
                    drafted += result.stats.drafted
                    accepted += result.stats.accepted
        assert accepted > 0 and drafted > accepted  # it drafts, some right and some wrong: the check can fail


def test_parallel_sequences_and_owners_answer_as_one_request_alone(pair) -> None:
    target, draft = pair
    with load_pair(target.target, draft, n_ctx=512, draft_capacity=4, parallel=3) as engine:
        prompts = PROMPTS[:5]
        alone = {p: engine.generate(p, max_tokens=32, speculative=False).tokens for p in prompts}
        # Three at once; the second round's owners take the first round's sequences (parked and restored states).
        for round_, (batch, owners) in enumerate(((prompts[:3], (0, 1, 2)), (prompts[2:], (3, 0, 1)))):
            streams = [engine.stream(p, max_tokens=32, method=METHOD, cache_owner=f"owner-{o}")
                       for p, o in zip(batch, owners, strict=True)]
            tokens: dict[int, list[int]] = {i: [] for i in range(len(streams))}
            running = set(tokens)
            while running:
                for i in sorted(running):
                    event = next(streams[i])
                    tokens[i] += event.tokens
                    if event.finish_reason is not None:
                        running.discard(i)
            for i, prompt in enumerate(batch):
                assert tokens[i] == alone[prompt], (round_, prompt)
        info = engine.info()
        assert len(info["n_cached_by_sequence"]) == 3 and info["n_cached"] == sum(info["n_cached_by_sequence"])


def test_the_target_itself_drafts_every_token_right() -> None:
    target = tiny_pair("dense", None, head="phrase")
    with load_pair(target.target, target.target, n_ctx=256, draft_capacity=4) as engine:
        result = engine.generate(PROMPTS[1], max_tokens=24, method=METHOD, draft_length=4)
        assert result.tokens == engine.generate(PROMPTS[1], max_tokens=24, speculative=False).tokens
        assert result.stats.drafted > 0 and result.stats.accepted == result.stats.drafted


def test_a_recurrent_model_is_refused_as_a_draft() -> None:
    hybrid = tiny_pair("hybrid", None, head="phrase")
    dense = tiny_pair("dense", None, head="phrase")
    with pytest.raises(PairMismatchError, match=r"recurrent .* attention only"):
        load_pair(dense.target, hybrid.target, n_ctx=256)


def test_its_memory_per_sequence_is_what_libllama_allocates(capfd: pytest.CaptureFixture[str]) -> None:
    """footprint.py's draft_kv for a draft-simple model: the draft context's KV cache as libllama logs it, for one
    sequence and for each more."""
    dense = tiny_pair("dense", None, head="phrase")
    draft = tiny_draft_model(dense)
    one = sequence_footprint(read_gguf(dense.target), read_gguf(draft), n_ctx=1024)
    assert one["device"] == sequence_footprint(read_gguf(dense.target), n_ctx=1024)["device"] + one["draft_kv"]
    logged = []
    for parallel in (1, 2):
        capfd.readouterr()
        with load_pair(dense.target, draft, n_ctx=1024, parallel=parallel, verbose=True):
            pass
        kv = [float(m.group(1)) for m in KV_LINE.finditer(capfd.readouterr().err)]
        assert len(kv) == 2, kv  # the target's, then the draft's
        logged.append(kv[1])
    assert one["draft_kv"] / 2**20 > 0.1
    assert logged == pytest.approx([one["draft_kv"] / 2**20, 2 * one["draft_kv"] / 2**20], abs=0.012)
