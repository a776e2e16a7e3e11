"""Shared fixtures: generated tiny pairs (real GGUF files, cached) and engines opened on them."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from pairs import ALL_PAIRS, PAIR_IDS, pair_files

from dflash_runtime import load_pair
from dflash_runtime.pair import live_handles
from dflash_runtime.testing.tiny_models import TinyPair


@pytest.fixture(scope="session", params=ALL_PAIRS, ids=PAIR_IDS)
def shaped_pair(request: pytest.FixtureRequest) -> TinyPair:
    """Every target × draft combination, with heads that accept some drafts and reject others."""
    return pair_files(*request.param)


@pytest.fixture(scope="module")
def engines() -> Iterator[dict]:
    """Engines opened on demand and shared within a module: engines[(target, draft, head)]."""
    cache: dict = {}

    class Engines(dict):
        def __missing__(self, key: tuple[str, str, str]):  # type: ignore[override]
            p = pair_files(*key)
            eng = load_pair(p.target, p.draft, n_ctx=1024, draft_capacity=7)
            self[key] = eng
            return eng

    cache = Engines()
    yield cache
    for eng in cache.values():
        eng.close()


@pytest.fixture
def no_leaks() -> Iterator[None]:
    before = live_handles()
    yield
    assert live_handles() == before, "native handles leaked"
