"""The Space with spare target sequences (DFLASH_BRANCHES): its files list the draft tree among the methods before
any model opens, the GPU worker opens the pair with them, an answer drafted with trees is plain decoding's text at
temperature 0, and the statistics' details show the trees."""

from __future__ import annotations

from typing import Any

from space_client import host_reply

from dflash_runtime import load_pair
from dflash_runtime.space.gpu.host import EngineHost
from dflash_runtime.space.gpu_job import ReplyChunk
from dflash_runtime.space.page.panel import stats_details
from dflash_runtime.space.setup.presets import ResolvedPair, pair_methods, preset_from_env
from dflash_runtime.testing.tiny_models import tiny_pair

TREE = "dflash-tree"
PROMPT = "the quick brown fox jumps over the lazy dog."


def answer(host: EngineHost, files: ResolvedPair, branches: int, **fields: Any) -> ReplyChunk:
    return host_reply(host, files, PROMPT, n_ctx=1024, max_tokens=48, branches=branches, temperature=0.0, **fields)


def test_the_files_list_the_tree_only_with_spare_sequences_and_a_dflash2_draft() -> None:
    dflash2, dflash1 = tiny_pair("dense", "dflash2"), tiny_pair("dense", "dflash1")
    assert TREE in pair_methods(dflash2.target, dflash2.draft, branches=2)
    assert TREE not in pair_methods(dflash2.target, dflash2.draft)
    assert TREE not in pair_methods(dflash1.target, dflash1.draft, branches=2)  # v1 has no candidate lattice
    assert preset_from_env({"DFLASH_BRANCHES": "3"}).branches == 3 and preset_from_env({}).branches == 0


def test_an_answer_drafted_with_trees_is_the_plain_text_and_its_details_show_the_trees() -> None:
    pair = tiny_pair("dense", "dflash2", head="random")  # drafts the target refuses: the tree is tried
    files = ResolvedPair(pair.target, pair.draft)
    host = EngineHost(load_pair)
    try:
        tree = answer(host, files, branches=2, method=TREE)
        assert tree.error is None, tree.error
        assert tree.engine_info is not None and TREE in tree.engine_info["methods"]
        plain = answer(host, files, branches=2, speculative=False)
        assert tree.delta == plain.delta
        stats = tree.stats
        assert stats["method"] == TREE and stats["tree_steps"] > 0 and stats["tree_nodes"] > stats["tree_steps"]
        assert "Draft trees" in stats_details(stats) and "Draft trees" not in stats_details(plain.stats)
    finally:
        host.close()
