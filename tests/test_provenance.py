"""Every emitted token says where it came from: "draft" (an accepted draft token) or "target" (the target's own
sample: the correction or bonus token, or a plain step)."""

from __future__ import annotations

import pytest
from pairs import ALL_PAIRS, PAIR_IDS, PROMPTS

from dflash_runtime.results.events import TOKEN_SOURCES


def check_sources(tokens: list[int], sources: list[str], stats) -> None:
    assert len(sources) == len(tokens)
    assert set(sources) <= set(TOKEN_SOURCES)
    assert sources.count("draft") == stats.accepted
    if tokens:
        assert sources[0] == "target"  # the first token is the prefill's own sample


@pytest.mark.parametrize(("target", "draft"), ALL_PAIRS, ids=PAIR_IDS)
@pytest.mark.parametrize("head", ["shaped", "const"])
def test_sources_count_the_accepted_drafts(target: str, draft: str, head: str, engines: dict) -> None:
    eng = engines[(target, draft, head)]
    seen_draft = False
    for prompt in PROMPTS[:5]:
        for options in ({"draft_length": 7}, {"draft_length": "auto"},
                        {"draft_length": 3, "temperature": 0.8, "seed": 1},
                        {"draft_length": 3, "temperature": 0.8, "seed": 1, "verify": "match"}):
            result = eng.generate(prompt, max_tokens=30, **options)
            check_sources(result.tokens, result.token_sources, result.stats)
            seen_draft |= "draft" in result.token_sources
        plain = eng.generate(prompt, max_tokens=30, speculative=False)
        assert plain.token_sources == ["target"] * len(plain.tokens)
        check_sources(plain.tokens, plain.token_sources, plain.stats)
    assert seen_draft


def test_stream_events_carry_their_own_sources(engines: dict) -> None:
    eng = engines[("hybrid", "dflash2", "const")]
    tokens: list[int] = []
    sources: list[str] = []
    for event in eng.stream("hello world", max_tokens=40, draft_length=7):
        assert len(event.token_sources) == len(event.tokens)
        tokens += event.tokens
        sources += event.token_sources
        check_sources(tokens, sources, event.stats)  # consistent after every step, not only at the end
    # With a const head every draft is accepted: a step is 7 drafts then the bonus token from the target.
    assert sources[1:9] == ["draft"] * 7 + ["target"]


def test_a_stop_string_keeps_sources_aligned(engines: dict) -> None:
    eng = engines[("dense", "dflash2", "shaped")]
    base = eng.generate("hello world", max_tokens=30, speculative=False)
    stop = base.text[10:14]
    result = eng.generate("hello world", max_tokens=30, stop=[stop], draft_length=7)
    assert result.finish_reason == "stop"
    check_sources(result.tokens, result.token_sources, result.stats)


@pytest.mark.parametrize("head", ["shaped", "const"])
def test_delta_sources_mark_the_text_each_source_wrote(head: str, engines: dict) -> None:
    eng = engines[("dense", "dflash2", head)]
    text, draft_text = "", ""
    tokens: list[int] = []
    sources: list[str] = []
    for event in eng.stream("hello world", max_tokens=40, draft_length=7):
        assert sum(n for n, _ in event.delta_sources) == len(event.delta)
        offset = 0
        for n, source in event.delta_sources:
            if source == "draft":
                draft_text += event.delta[offset:offset + n]
            offset += n
        text += event.delta
        tokens += event.tokens
        sources += event.token_sources
    assert text == eng.detokenize(tokens)
    assert draft_text == "".join(eng.token_text(t) for t, s in zip(tokens, sources, strict=True) if s == "draft")
    assert draft_text  # both heads accept drafts
