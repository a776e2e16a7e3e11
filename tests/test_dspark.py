"""DSpark: a DFlash draft with a Markov head and, as a variant, a confidence head (llama.cpp's --spec-type
draft-dspark). The generated draft is laid out as llama.cpp's converter writes one; the registry gives it to DSpark
alone; at temperature 0 every answer is the target's own on dense and hybrid targets, with and without the confidence
head (whose cut makes drafts of every length), anchor-first and with a bonus anchor, on long answers and with parallel
sequences and owners; a file whose heads do not fit is refused. (Above temperature 0: tests/test_distribution.py;
long-lived engines: tests/test_exact_across_requests.py; against llama-server: the last test here.)"""

from __future__ import annotations

import itertools
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf.scripts.gguf_new_metadata import MetadataDetails, copy_with_new_metadata
from llama_server import BINARY, needs_llama_server
from pairs import PROMPTS, owners_in_turns_answer_alone
from space_client import host_reply

from dflash_runtime import PairMismatchError, RequestError, load_pair, methods
from dflash_runtime.files.gguf_meta import read_gguf
from dflash_runtime.space.gpu.host import EngineHost
from dflash_runtime.space.page.endpoints import ab_picked
from dflash_runtime.space.page.views import method_help
from dflash_runtime.space.setup.presets import ResolvedPair, pair_methods
from dflash_runtime.testing.tiny_models import TinyPair, tiny_pair

METHOD = "dspark"
BLOCK = 8  # the generated drafts' block_size: an anchor-first DSpark block drafts that many tokens
CONFIDENCE = {"confidence_head": True}


@pytest.fixture(scope="module", params=["dense", "hybrid"])
def kind(request: pytest.FixtureRequest) -> str:
    return request.param


def tensors(path: Path) -> dict[str, bytes]:
    return {t.name: bytes(np.asarray(t.data).tobytes()) for t in gguf.GGUFReader(path).tensors}


def test_the_draft_is_laid_out_as_the_converter_writes_one(kind: str) -> None:
    v1 = tensors(tiny_pair(kind, "dflash1", head="phrase").draft)
    markov_only = None
    for extra in ({}, CONFIDENCE):
        pair = tiny_pair(kind, METHOD, head="phrase", **extra)
        info = read_gguf(pair.draft)
        confident = bool(extra)
        assert info.arch == "dflash" and info.key("block_size") == BLOCK
        assert info.key("sample_from_anchor") is True and info.key("has_confidence_head") is confident
        shapes = info.tensor_shapes
        rank = shapes["markov_w1.weight"][0]
        assert shapes["markov_w1.weight"] == shapes["markov_w2.weight"] == (rank, info.n_vocab)
        assert ("conf_proj.weight" in shapes) is confident and ("conf_proj.bias" in shapes) is confident
        if confident:
            assert shapes["conf_proj.weight"] == (info.n_embd + rank, 1) and shapes["conf_proj.bias"] == (1,)
        assert not {"token_embd.weight", "output.weight", "selector_hidden.weight"} & set(shapes)
        assert info.key("selector_top_k") is None  # a DFlash v1 backbone
        # The backbone is the DFlash v1 draft of the same sizes, byte for byte; the variant only adds its head.
        data = tensors(pair.draft)
        assert {name: data[name] for name in v1} == v1
        if markov_only is None:
            markov_only = data
        else:
            assert {name: data[name] for name in markov_only} == markov_only
            assert set(data) - set(markov_only) == {"conf_proj.weight", "conf_proj.bias"}


def test_the_registry_gives_a_dspark_draft_to_dspark_alone(kind: str) -> None:
    pair = tiny_pair(kind, METHOD, head="phrase", **CONFIDENCE)
    target, draft = read_gguf(pair.target), read_gguf(pair.draft)
    assert methods.claimant(draft).name == METHOD
    listed = methods.from_headers(target, draft)
    assert listed[0] == METHOD and not {"dflash", "dflash-tree"} & set(listed)
    with load_pair(pair.target, pair.draft, n_ctx=256, draft_capacity=BLOCK) as engine:
        assert engine.methods == listed and engine.default_method == METHOD
        info = engine.info()
        assert info["draft_kind"] == METHOD and info["block_size"] == BLOCK and info["confidence_head"] is True
        assert info["draft_capacity"] == BLOCK  # anchor-first: a whole block of drafts
        with pytest.raises(RequestError, match="'dflash' is not available"):
            engine.generate("hello", max_tokens=2, method="dflash")
    with pytest.raises(PairMismatchError, match=rf"outside 1\.\.{BLOCK} \(block_size {BLOCK} for this draft\)"):
        load_pair(pair.target, pair.draft, n_ctx=256, draft_capacity=BLOCK + 1)


MAX_TOKENS = 40


def cut_short(result, length: int) -> list[int]:
    """The lengths of the drafts of an answer that are shorter than the step asked for, where the room left in
    `MAX_TOKENS` did not cut them: each step emits its accepted drafts, then the target's own token."""
    sources = result.token_sources[1:]  # after the prefill's sample
    steps, emitted = [], 1
    while sources:
        n_drafted = next((i for i, s in enumerate(sources) if s == "target"), len(sources) - 1) + 1
        steps.append(emitted)
        emitted += n_drafted
        sources = sources[n_drafted:]
    assert len(steps) == len(result.stats.draft_lengths)
    return [n for n, before in zip(result.stats.draft_lengths, steps, strict=True)
            if n < min(length, MAX_TOKENS - before - 1)]


@pytest.mark.parametrize("confidence", [False, True], ids=["markov", "markov+confidence"])
def test_every_answer_is_the_targets_own(kind: str, confidence: bool) -> None:
    pair = tiny_pair(kind, METHOD, head="phrase", **(CONFIDENCE if confidence else {}))
    drafted = accepted = 0
    cuts: list[int] = []  # the lengths the confidence head cut drafts to
    with load_pair(pair.target, pair.draft, n_ctx=512, draft_capacity=BLOCK) as engine:
        for prompt in PROMPTS[:4]:
            plain = engine.generate(prompt, max_tokens=MAX_TOKENS, speculative=False).tokens
            for length, p_min in itertools.product((1, 3, BLOCK, "auto"), (0.0, 0.5)):
                result = engine.generate(prompt, max_tokens=MAX_TOKENS, method=METHOD, draft_length=length,
                                         p_min=p_min)
                assert result.tokens == plain, (prompt, length, p_min)
                assert result.token_sources.count("draft") == result.stats.accepted
                assert result.stats.method == METHOD
                drafted, accepted = drafted + result.stats.drafted, accepted + result.stats.accepted
                if length != "auto":
                    cut = cut_short(result, length)
                    assert not cut or (p_min and confidence), cut  # without a confidence head p_min cuts nothing
                    cuts += cut
        with_list = engine.generate(PROMPTS[0], max_tokens=MAX_TOKENS, method=f"ngram-mod,{METHOD}", draft_length=3)
        assert with_list.tokens == engine.generate(PROMPTS[0], max_tokens=MAX_TOKENS, speculative=False).tokens
    assert accepted > 0 and drafted > accepted  # drafts right and wrong: the check can fail
    if confidence:  # the confidence head ends drafts at positions of its own: before the first token and later
        assert 0 in cuts and len(set(cuts) - {0}) >= 2, sorted(cuts)


def test_a_bonus_anchor_draft_drafts_from_its_mask_rows(kind: str) -> None:
    """`sample_from_anchor` false (EAGLE-3-style exports): the block is [id_last, mask × n], as DFlash's."""
    pair = tiny_pair(kind, METHOD, head="phrase", sample_from_anchor=False)
    assert read_gguf(pair.draft).key("sample_from_anchor") is False
    with pytest.raises(PairMismatchError, match=rf"block_size {BLOCK} − 1 for this draft"):
        load_pair(pair.target, pair.draft, n_ctx=256, draft_capacity=BLOCK)
    with load_pair(pair.target, pair.draft, n_ctx=512, draft_capacity=BLOCK - 1) as engine:
        accepted = 0
        for prompt in PROMPTS[:3]:
            plain = engine.generate(prompt, max_tokens=40, speculative=False).tokens
            for length in (2, BLOCK - 1):
                result = engine.generate(prompt, max_tokens=40, method=METHOD, draft_length=length)
                assert result.tokens == plain, (prompt, length)
                accepted += result.stats.accepted
        assert accepted > 0


def test_long_answers_are_the_targets_own(kind: str) -> None:
    """Hundreds of tokens: many rollbacks of a hybrid target's recurrent state, drafts cut by room at the end."""
    for extra in ({}, CONFIDENCE):
        pair = tiny_pair(kind, METHOD, head="phrase", **extra)
        with load_pair(pair.target, pair.draft, n_ctx=1024, draft_capacity=BLOCK) as engine:
            for prompt, length in ((PROMPTS[1], BLOCK), (PROMPTS[7], "auto")):
                plain = engine.generate(prompt, max_tokens=320, speculative=False)
                result = engine.generate(prompt, max_tokens=320, method=METHOD, draft_length=length, p_min=0.5)
                assert len(plain.tokens) == 320 and result.tokens == plain.tokens, (extra, prompt, length)
                assert result.stats.accepted > 0 and result.stats.drafted > result.stats.accepted


def test_an_answer_that_fills_the_context_is_the_targets_own(kind: str) -> None:
    """Whole blocks near the end of the context: the block shrinks to what the context holds."""
    pair = tiny_pair(kind, METHOD, head="phrase", **CONFIDENCE)
    with load_pair(pair.target, pair.draft, n_ctx=64, draft_capacity=BLOCK) as engine:
        prompt = engine.tokenize(PROMPTS[1])
        plain = engine.generate(prompt, max_tokens=500, speculative=False)
        for p_min in (0.0, 0.5):
            result = engine.generate(prompt, max_tokens=500, draft_length=BLOCK, p_min=p_min)
            assert result.finish_reason == plain.finish_reason == "length" and "context is full" in result.finish_detail
            assert result.tokens == plain.tokens and len(prompt) + len(result.tokens) == engine.n_ctx + 1


def test_parallel_sequences_and_owners_answer_as_one_request_alone(kind: str) -> None:
    pair = tiny_pair(kind, METHOD, head="phrase")
    with load_pair(pair.target, pair.draft, n_ctx=512, draft_capacity=5, parallel=3) as engine:
        owners_in_turns_answer_alone(engine, METHOD)


def test_the_space_lists_explains_and_runs_dspark_from_the_registry() -> None:
    """No Space file names DSpark: the files' headers list it, the method menu's help explains it, the GPU worker runs
    it, and the page's A/B compares it unless the visitor picks others (endpoints.ab_picked)."""
    pair = tiny_pair("hybrid", METHOD, head="phrase", **CONFIDENCE)
    listed = pair_methods(pair.target, pair.draft)
    assert listed[0] == METHOD and "dflash" not in listed
    shown = method_help(listed, METHOD, listed[0])
    assert "**auto**: the pair's default (DSpark)" in shown
    assert f"**DSpark**: {methods.registry()[METHOD].help}" in shown
    assert ab_picked(list(listed), None)[0] == METHOD
    host = EngineHost(load_pair)
    try:
        files = ResolvedPair(pair.target, pair.draft)
        drafted = host_reply(host, files, PROMPTS[1], n_ctx=1024, max_tokens=48, temperature=0.0, draft_length=7)
        plain = host_reply(host, files, PROMPTS[1], n_ctx=1024, max_tokens=48, temperature=0.0, speculative=False)
        assert drafted.error is None and drafted.delta == plain.delta
        assert drafted.stats["method"] == METHOD and drafted.stats["drafted"] > 0
        assert drafted.engine_info is not None and drafted.engine_info["methods"] == list(listed)
    finally:
        host.close()


def edited(source: Path, dest: Path, keys: dict[str, MetadataDetails], remove: tuple[str, ...] = ()) -> Path:
    reader = gguf.GGUFReader(source, "r")
    writer = gguf.GGUFWriter(dest, arch="dflash", endianess=reader.endianess)
    copy_with_new_metadata(reader, writer, keys, list(remove))
    return dest


def test_a_draft_whose_heads_do_not_fit_is_refused(tmp_path: Path) -> None:
    pair: TinyPair = tiny_pair("dense", METHOD, head="phrase")
    says_confident = edited(pair.draft, tmp_path / "says.gguf",
                            {"dflash.has_confidence_head": MetadataDetails(gguf.GGUFValueType.BOOL, True)})
    no_block = edited(pair.draft, tmp_path / "no-block.gguf", {}, ("dflash.block_size",))
    for path, match in ((says_confident, "says has_confidence_head=True, but its tensors lack conf_proj"),
                        (no_block, "has no dflash.block_size: its Markov head needs it")):
        with pytest.raises(PairMismatchError, match=match):
            load_pair(pair.target, path, n_ctx=256)


@needs_llama_server
def test_dspark_answers_and_counts_as_llama_server_does() -> None:
    """The same tokens, drafted and accepted counts and verify steps as `llama-server --spec-type draft-dspark`, on
    dense and hybrid targets, at two draft lengths (a whole block among them), with and without a confidence head
    (cutting drafts at p-min 0.5); every answer equal to plain decoding."""
    tool = Path(__file__).resolve().parents[1] / "tools" / "compare_llama_server.py"
    run = subprocess.run([sys.executable, str(tool), "--server-bin", BINARY,
                          "--drafts", "dspark,dspark-conf", "--heads", "phrase,random", "--n-max", f"3,{BLOCK}",
                          "--max-tokens", "48"], capture_output=True, text=True, timeout=600, check=False)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert "80/80 rows identical" in run.stdout, run.stdout[-4000:]  # targets × drafts × heads × lengths × prompts
