"""EAGLE-3: a one-layer draft reading three target layers (llama.cpp's --spec-type draft-eagle3). At temperature 0
every answer is the target's own, alone, in a method list, with parallel sequences and across requests, on dense and
hybrid targets; the generated draft is laid out as the converter writes one; a draft that does not fit is refused.
(Above temperature 0: tests/test_distribution.py; against llama-server: tools/compare_llama_server.py.)"""

from __future__ import annotations

import gguf
import pytest
from pairs import PROMPTS, owners_in_turns_answer_alone

from dflash_runtime import PairMismatchError, load_pair
from dflash_runtime.files.gguf_meta import read_gguf
from dflash_runtime.testing.tiny_models import tiny_pair

METHOD = "eagle3"


@pytest.fixture(scope="module", params=["dense", "hybrid"])
def kind(request: pytest.FixtureRequest) -> str:
    return request.param


def test_the_draft_is_laid_out_as_the_converter_writes_one(kind) -> None:
    pair = tiny_pair(kind, METHOD, head="markov")
    info, target = read_gguf(pair.draft), read_gguf(pair.target)
    assert info.arch == "eagle3" and info.n_layer == 1
    assert len(info.key("target_layers")) == 3 and info.key("target_hidden_size") == target.n_embd
    assert info.key("norm_before_residual") is False and info.key("norm_before_fc") is False
    assert "token_embd.weight" not in info.tensor_shapes  # borrowed from the target through ctx_other
    assert info.tensor_shapes["fc.weight"] == (3 * target.n_embd, info.n_embd)
    assert info.tensor_shapes["blk.0.attn_q.weight"][0] == 2 * info.n_embd  # concat(embedding, g)
    assert "blk.0.attn_norm_2.weight" in info.tensor_shapes
    n_draft_vocab = info.tensor_shapes["d2t"][0]
    assert n_draft_vocab < target.n_vocab and info.tensor_shapes["output.weight"] == (info.n_embd, n_draft_vocab)
    assert info.tensor_types["d2t"] == gguf.GGMLQuantizationType.I64
    assert info.n_vocab == target.n_vocab  # the target's tokenizer


def test_every_answer_is_the_targets_own_drafts_right_and_wrong(kind) -> None:
    drafted = accepted = rejected = 0
    for head in ("markov", "random"):  # the draft guesses the target (markov) or chance (random)
        pair = tiny_pair(kind, METHOD, head=head)
        with load_pair(pair.target, pair.draft, n_ctx=512, draft_capacity=5) as engine:
            assert METHOD in engine.methods and "dflash" not in engine.methods and "draft-simple" not in engine.methods
            assert engine.default_method == METHOD
            info = engine.info()
            assert info["draft_kind"] == METHOD and info["target_layer_ids"] == [1, 2, 3]
            for prompt in PROMPTS[:3]:
                base = engine.generate(prompt, max_tokens=32, speculative=False)
                runs = [(METHOD, length) for length in (1, 5, "auto")] + [(f"ngram-mod,{METHOD}", 5)]
                for method, length in runs:
                    result = engine.generate(prompt, max_tokens=32, method=method, draft_length=length)
                    assert result.tokens == base.tokens, (head, prompt, method, length)
                    assert result.token_sources.count("draft") == result.stats.accepted
                    if method == METHOD:
                        drafted += result.stats.drafted
                        accepted += result.stats.accepted
                        rejected += result.stats.drafted - result.stats.accepted
    assert accepted > 0 and rejected > 0  # both paths of the verifier ran: the check can fail


def test_parallel_sequences_and_owners_answer_as_one_request_alone(kind) -> None:
    pair = tiny_pair(kind, METHOD, head="markov")
    with load_pair(pair.target, pair.draft, n_ctx=512, draft_capacity=4, parallel=3) as engine:
        owners_in_turns_answer_alone(engine, METHOD)


def test_a_long_lived_engine_answers_as_a_fresh_one(kind) -> None:
    pair = tiny_pair(kind, METHOD, head="markov")
    prompt = PROMPTS[3]
    with load_pair(pair.target, pair.draft, n_ctx=512, draft_capacity=4) as fresh:
        expected = fresh.generate(prompt, max_tokens=40, method=METHOD).tokens
    with load_pair(pair.target, pair.draft, n_ctx=512, draft_capacity=4) as engine:
        for i, other in enumerate(PROMPTS[:3]):  # history: other requests, a cut-short one, a shared prefix
            engine.generate(other, max_tokens=12 + 7 * i, method=METHOD if i != 1 else "ngram-mod")
            stream = engine.stream(prompt + other, max_tokens=30, method=METHOD)
            next(stream)
            stream.close()
        again = engine.generate(prompt, max_tokens=40, method=METHOD)  # under the policy the history taught
        assert again.tokens == expected
        # A fixed length drafts whatever timing taught "auto" (which may have chosen plain steps): the check can fail.
        fixed = engine.generate(prompt, max_tokens=40, method=METHOD, draft_length=4)
        assert fixed.tokens == expected and fixed.stats.accepted > 0
        assert engine.generate(prompt, max_tokens=40, speculative=False).tokens == expected


def test_long_answers_are_the_targets_own(kind) -> None:
    """Hundreds of tokens through the target's recurrent state (hybrid) and the draft's growing cache, with drafts
    that the target takes (markov) and drafts it refuses (random): still plain decoding's answer, token for token."""
    drafted = accepted = 0
    for head in ("markov", "random"):
        pair = tiny_pair(kind, METHOD, head=head)
        with load_pair(pair.target, pair.draft, n_ctx=1024, draft_capacity=5) as engine:
            for prompt in (PROMPTS[1], PROMPTS[6]):
                plain = engine.generate(prompt, max_tokens=320, speculative=False)
                assert len(plain.tokens) == 320  # no end of generation in these answers: all of them
                for length in (5, "auto"):
                    result = engine.generate(prompt, max_tokens=320, method=METHOD, draft_length=length)
                    assert result.tokens == plain.tokens, (head, prompt, length)
                    drafted += result.stats.drafted
                    accepted += result.stats.accepted
    assert 0 < accepted < drafted


def test_a_draft_of_another_target_is_refused() -> None:
    target = tiny_pair("dense", None, head="markov")
    wider = tiny_pair("dense", METHOD, head="markov", n_embd=256)
    with pytest.raises(PairMismatchError, match="hidden size 256"):
        load_pair(target.target, wider.draft, n_ctx=256)


def test_a_tap_at_n_layer_reads_the_targets_last_hidden_row() -> None:
    """Layer id n_layer is the target's last hidden row (its nextn embeddings, as llama.cpp reads it on qwen35)."""
    pair = tiny_pair("hybrid", METHOD, head="markov", target_layers=(1, 2, 4))
    with load_pair(pair.target, pair.draft, n_ctx=256, draft_capacity=4) as engine:
        assert engine.info()["target_layer_ids"] == [1, 2, 4]
        for prompt in PROMPTS[:2]:
            result = engine.generate(prompt, max_tokens=24, method=METHOD, draft_length=4)
            assert result.tokens == engine.generate(prompt, max_tokens=24, speculative=False).tokens
            assert result.stats.accepted > 0
