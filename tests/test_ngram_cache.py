"""ngram-cache, llama.cpp's lookup decoding (drafters/ngram_cache.py, drafters/lookup_cache.py): its tables in
libstdc++'s order, its files, what its dynamic cache learns and for whom, and its bad options. (Lossless answers:
tests/test_ngram.py; against llama-server and llama.cpp's lookup tools: tests/test_llama_server_ngrams.py.)"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from dflash_runtime import SessionPolicy, load_pair
from dflash_runtime.drafters.lookup_cache import Followers, create_static, load, merge, save, std_order, update
from dflash_runtime.drafters.ngram_cache import KEPT_OWNERS, MAX_LEARNED, DynamicCaches
from dflash_runtime.testing.heads import PHRASE
from dflash_runtime.testing.tiny_models import tiny_pair

METHOD = "ngram-cache"
TEACHER = "Hello world"  # its answer is the phrase over and over: what the dynamic cache learns
LEARNER = "Once upon a time the"  # nothing of the phrase in it: only a dynamic cache that learnt it drafts at once
REQUEST = {"method": METHOD, "draft_length": 8, "max_tokens": 48}


@pytest.fixture(scope="module")
def target() -> Path:
    return tiny_pair("dense", None, head="phrase").target


def opened(target: Path, **options: Any) -> Any:
    """An engine of the target alone, drafting up to 8 (ngram-cache's draft); `options`: ngram-cache's, or others."""
    method = {k: options.pop(k) for k in ("lookup_cache_static", "lookup_cache_dynamic") if k in options}
    return load_pair(target, None, n_ctx=512, draft_capacity=8, method_options={METHOD: method}, **options)


def counts(result: Any) -> tuple[int, int, int]:
    return result.stats.drafted, result.stats.accepted, result.stats.verify_steps


def test_followers_come_in_the_order_libstdcpp_iterates_them() -> None:
    """Known answers of g++ 12's std::unordered_map<int, int> (keys inserted in order; `|`: into a copy)."""
    assert std_order([5, 18, 31, 2, 15]) == [15, 2, 31, 18, 5]  # 13 buckets: 5, 18, 31 share one
    assert std_order(range(20)) == [*range(19, 12, -1), *range(13)]  # the 14th key rehashes to 29 buckets
    assert std_order([7 * i for i in range(35)]) == [238, 231, 224, 217, 210, 203, *range(84, -1, -7),
                                                     *range(91, 197, 7)]  # 59 buckets from the 30th
    assert std_order([3, 16, 29, 42, 55, 1]) == [1, 55, 42, 29, 16, 3]  # a copy goes on as the original would
    followers = Followers()
    for token in (5, 18, 31, 18, 2, 15, 5):
        followers.add(token)
    assert list(followers) == [(15, 1), (2, 1), (31, 1), (18, 2), (5, 2)]


def test_a_table_goes_through_its_file_in_its_order(tmp_path: Path) -> None:
    """The file lists each n-gram's followers in the table's order, and reading it takes them in that order (so, as
    in llama.cpp, a table read back iterates as a table filled in that order: the file is what both read)."""
    tokens = [t for i in range(40) for t in (1, 2, 100 + 37 * i)] + [1, 2, 100, 5, 6, 7, 8]
    table: dict = {}
    update(table, tokens, len(tokens))
    path = tmp_path / "table.bin"
    save(table, path)
    loaded = load(path)
    assert {k: list(v.counts.items()) for k, v in loaded.items()} == {k: list(v) for k, v in table.items()}
    assert len(table[(1, 2, -1, -1)]) == 40  # past two of libstdc++'s rehashes
    assert path.stat().st_size == sum(4 * (5 + 2 * len(v)) for v in table.values())
    static = create_static(tokens)
    assert set(static) == {k for k in table if k[1] != -1 and k[2] == -1}  # its 2-grams, as llama-lookup-create's
    merge(loaded, static)
    assert loaded[(1, 2, -1, -1)].counts == {t: 2 * c for t, c in table[(1, 2, -1, -1)].counts.items()}


def test_a_file_that_is_not_a_lookup_cache_is_refused_clearly(tmp_path: Path, target: Path) -> None:
    good = tmp_path / "good.bin"
    save(create_static([1, 2, 3, 1, 2, 4]), good)
    cut = tmp_path / "cut.bin"
    cut.write_bytes(good.read_bytes()[:-4])
    odd = tmp_path / "odd.bin"
    odd.write_bytes(good.read_bytes() + b"\x01")
    for path, message in ((cut, "the file ends first"), (odd, "not a whole number of int32s"),
                          (tmp_path / "missing.bin", "No such file")):
        with pytest.raises(ValueError, match=rf"ngram-cache cannot read its lookup_cache_static .*{message}"):
            load_pair(target, None, n_ctx=256, method_options={METHOD: {"lookup_cache_static": str(path)}})
    with pytest.raises(ValueError, match=r"no folder .* to write it in"):
        load_pair(target, None, n_ctx=256,
                  method_options={METHOD: {"lookup_cache_dynamic": str(tmp_path / "nowhere" / "d.bin")}})
    with pytest.raises(ValueError, match="lookup_cache_static is a file path or None"):
        load_pair(target, None, n_ctx=256, method_options={METHOD: {"lookup_cache_static": 3}})
    with load_pair(target, None, n_ctx=256, method_options={METHOD: {"lookup_cache_static": str(good)}}) as engine:
        assert METHOD in engine.methods


def test_a_static_file_drafts_what_it_saw(tmp_path: Path, target: Path) -> None:
    """The engine's own static file of the phrase's text: the learner's answer is drafted from it at once."""
    static = tmp_path / "static.bin"
    with opened(target) as engine:
        save(create_static(engine.tokenize("".join(PHRASE) * 4)), static)
        plain = engine.generate(LEARNER, max_tokens=48, speculative=False)
        alone = engine.generate(LEARNER, **REQUEST)
    with opened(target, lookup_cache_static=str(static)) as engine:
        helped = engine.generate(LEARNER, **REQUEST)
    assert alone.tokens == helped.tokens == plain.tokens
    assert alone.stats.drafted == 0 and helped.stats.accepted > 0


def test_the_dynamic_cache_learns_from_one_request_for_the_next_as_its_file_does(tmp_path: Path,
                                                                                 target: Path) -> None:  # fmt: skip
    """The second request drafts from what the first taught it: in memory, and from the file the engine writes when
    it closes (the default owner's), read by a fresh engine — the same drafts, and the same file in the end."""
    first_file, both_file = tmp_path / "first.bin", tmp_path / "both.bin"
    with opened(target) as fresh:
        plain = fresh.generate(LEARNER, max_tokens=48, speculative=False)
        untaught = fresh.generate(LEARNER, **REQUEST)
    with opened(target, lookup_cache_dynamic=str(first_file)) as one:
        one.generate(TEACHER, **REQUEST)
    with opened(target, lookup_cache_dynamic=str(both_file)) as eng:
        eng.generate(TEACHER, **REQUEST)
        in_memory = eng.generate(LEARNER, **REQUEST)
        assert not both_file.exists()  # not before the engine closes
    taught_once = load(first_file)
    assert len(load(both_file)) > len(taught_once) > 0  # each request's n-grams
    with opened(target, lookup_cache_dynamic=str(first_file)) as eng:
        from_file = eng.generate(LEARNER, **REQUEST)
    assert in_memory.tokens == from_file.tokens == untaught.tokens == plain.tokens
    assert untaught.stats.drafted == 0 and in_memory.stats.accepted > 0
    assert counts(in_memory) == counts(from_file)
    assert {k: v.counts for k, v in load(first_file).items()} == {k: v.counts for k, v in load(both_file).items()}


def test_what_one_owner_teaches_drafts_for_that_owner_only(tmp_path: Path, target: Path) -> None:
    """A's dynamic cache serves A's next request whatever ran between (B on A's sequence, or on a sequence of its
    own), as long as the engine keeps A's conversation (parked at the switch, or by the Space's explicit park; not
    at all: gone with it); B, and C starting from a public prefix whose caches A's request kept, draft as on a fresh
    engine; nothing of an owner's is written to the file."""
    dynamic = tmp_path / "dynamic.bin"
    with opened(target) as fresh:
        public = fresh.tokenize(TEACHER)
        declared = {"cache_owner": "c", "public_prefix": len(public)}
        after_public = public + fresh.tokenize(" " + LEARNER, add_special=False)
        untaught = counts(fresh.generate(LEARNER, **REQUEST, cache_owner="b"))
        untaught_c = counts(fresh.generate(after_public, **REQUEST, **declared))
        fresh.generate(TEACHER, **REQUEST, cache_owner="a")
        taught = counts(fresh.generate(LEARNER, **REQUEST, cache_owner="a"))
    assert untaught != taught
    unparked = SessionPolicy(park_on_switch=False)
    for parallel, sessions, park in ((1, None, False), (1, unparked, True), (2, None, False), (1, unparked, False)):
        case = (parallel, sessions, park)
        with opened(target, lookup_cache_dynamic=str(dynamic), parallel=parallel, sessions=sessions) as eng:
            eng.generate(TEACHER, **REQUEST, cache_owner="a")
            if park:
                eng.park("a")
            assert counts(eng.generate(LEARNER, **REQUEST, cache_owner="b")) == untaught, case
            kept = sessions is None or park
            assert counts(eng.generate(LEARNER, **REQUEST, cache_owner="a")) == (taught if kept else untaught), case
            eng.generate(public + public[1:], **REQUEST, cache_owner="a", public_prefix=len(public))
            assert counts(eng.generate(after_public, **REQUEST, **declared)) == untaught_c, case
        assert not dynamic.exists(), "only the default owner's cache is written back"


def test_owners_caches_are_bounded() -> None:
    """Past KEPT_OWNERS other owners the least recently used owner's cache goes, and an owner's cache past
    MAX_LEARNED n-grams starts over (the default owner's, the file's, is bounded by neither)."""
    caches = DynamicCaches({}, None)

    def teach(owner: object, tokens: list[int]) -> None:
        _, learning = caches.start(owner, lambda _: True)
        update(learning.table, tokens, len(tokens))
        learning.done = True

    def cache_of(owner: object) -> dict:
        dynamic, learning = caches.start(owner, lambda _: True)
        learning.done = True
        return dict(dynamic)

    teach("first", [1, 2, 3])
    for owner in range(KEPT_OWNERS):
        teach(owner, [1, 2])
    assert cache_of(KEPT_OWNERS - 1) and not cache_of("first")
    big = list(range(MAX_LEARNED // 4 + 4))  # n-grams of 1 to 4 tokens: MAX_LEARNED + 6
    teach("big", big)
    teach(None, big)
    assert not cache_of("big") and len(cache_of(None)) == MAX_LEARNED + 6
