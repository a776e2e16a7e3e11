"""The n-gram methods against llama.cpp itself, built from the same vendored sources with the wheel's CPU kernels
(CI builds them: tools/build_llama_server.py; give llama-server's path in DFLASH_LLAMA_SERVER, the lookup tools
beside it). Without it the tests are reported as not run (a skip that says so), never passed.

- `llama-server --spec-type T` on generated dense and hybrid targets at two draft lengths, temperature 0, through
  tools/compare_llama_server.py: ngram-simple, ngram-map-k4v (and ngram-mod, ngram-map-k), ngram-cache without
  files, with a static file made by llama-lookup-create, and with a dynamic file carried from one request to the
  next. Every row: the server's tokens, the engine's, and the engine's plain decoding's, the same; on the dense
  target also the drafted, accepted and verify-step counts. On the hybrid target the server counts otherwise by
  design (it replays a partly accepted draft in a step of its own: see the tool's doc), so the rows compare tokens.
  ngram-cache's draft lengths are 8 and 12: the server's lookup decoding drafts 8 whatever its draft length.
- `llama-lookup-create` and `llama-lookup-merge`: the engine's static file of a text is llama-lookup-create's,
  followers in the same order; a file llama-lookup-merge makes of two is the engine's merge of them."""

from __future__ import annotations

import re
import string
import subprocess
import sys
from pathlib import Path

from llama_server import BINARY, needs_llama_server

from dflash_runtime import load_pair
from dflash_runtime.drafters.lookup_cache import create_static, load, merge, save
from dflash_runtime.testing.heads import PHRASE
from dflash_runtime.testing.tiny_models import tiny_pair

TOOL = Path(__file__).resolve().parents[1] / "tools" / "compare_llama_server.py"
QUOTE = "".join(PHRASE)
# Prompts an answer copies (the phrase head continues the phrase), and one it does not.
PROMPTS = f"{QUOTE * 3}|Edit this text:{QUOTE * 2} Edited:|Hello world"
ENDINGS = string.ascii_letters + string.digits + string.punctuation  # 93 tokens after one 2-gram of the text below
pytestmark = needs_llama_server


def compare(*args: str) -> dict[str, tuple[int, int]]:
    """Run the comparison; every row must be identical. Returns each pair and draft length's server drafted and
    accepted counts (its acceptance table)."""
    run = subprocess.run([sys.executable, str(TOOL), "--server-bin", BINARY, "--heads", "phrase", "--prompts",
                          PROMPTS, "--max-tokens", "40", "--threads", "2", *args],
                         capture_output=True, text=True, timeout=600, check=False)  # fmt: skip
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
    rows = re.search(r"(\d+)/(\d+) rows identical", run.stdout)
    assert rows is not None and rows.group(1) == rows.group(2), run.stdout[-3000:]
    table = run.stdout.split("\n\n")[-2]
    return {f"{m.group(1)} {m.group(2)}": (int(m.group(3)), int(m.group(4)))
            for m in re.finditer(r"^(\S+) +(\d+) +(\d+) +(\d+) ", table, re.MULTILINE)}


def test_the_ngram_lookups_draft_as_llama_server_does() -> None:
    acceptance = compare("--drafts", "ngram-simple,ngram-map-k4v,ngram-mod,ngram-map-k", "--n-max", "3,7")
    assert len(acceptance) == 4 * 2 * 2  # methods × targets × draft lengths
    for group, (drafted, accepted) in acceptance.items():
        assert drafted > accepted > 0, group  # drafts made, some right and some wrong: the counts can differ
    k4v = compare("--drafts", "ngram-map-k4v", "--targets", "dense", "--n-max", "5", "--ngram-min-hits", "2")
    assert all(drafted > 0 for drafted, _ in k4v.values())


def test_lookup_decoding_drafts_as_llama_server_does_with_its_files() -> None:
    acceptance = compare("--drafts", "ngram-cache,ngram-cache-static,ngram-cache-dynamic", "--n-max", "8,12")
    assert len(acceptance) == 3 * 2 * 2
    for group, (drafted, accepted) in acceptance.items():
        assert drafted > accepted > 0, group


def lookup_tool(name: str) -> str:
    tool = Path(BINARY).with_name(name)
    assert tool.is_file(), f"{tool}: the lookup tools are built beside llama-server (tools/build_llama_server.py)"
    return str(tool)


def in_file_order(path: Path) -> dict[tuple[int, ...], list[tuple[int, int]]]:
    """Each n-gram's followers as the file lists them."""
    return {key: list(followers.counts.items()) for key, followers in load(path).items()}


def test_the_engines_lookup_files_are_llama_cpps(tmp_path: Path) -> None:
    """The same text's static file from the engine and from llama-lookup-create: the same n-grams, followers and
    counts, listed in the same order (one 2-gram has 93 followers: libstdc++'s table rehashed three times); and
    llama-lookup-merge's merge of two files is the engine's."""
    target = tiny_pair("dense", None, head="phrase").target
    texts = [" ".join(f"the draft{end} is a model" for end in ENDINGS),
             " ".join(f"the draft{end} world" for end in reversed(ENDINGS)) + QUOTE * 3]
    ours = [tmp_path / "ours-0.bin", tmp_path / "ours-1.bin"]
    with load_pair(target, None, n_ctx=1024) as engine:
        for text, path in zip(texts, ours, strict=True):
            save(create_static(engine.tokenize(text)), path)
    theirs = tmp_path / "theirs.bin"
    subprocess.run([lookup_tool("llama-lookup-create"), "-m", str(target), "-p", texts[0], "-lcs", str(theirs),
                    "-c", "1024", "-t", "2"], capture_output=True, timeout=300, check=True)  # fmt: skip
    assert in_file_order(theirs) == in_file_order(ours[0])
    assert max(len(f) for f in in_file_order(theirs).values()) > 59  # 13, 29, 59 buckets, then 127
    merged = tmp_path / "merged.bin"
    subprocess.run([lookup_tool("llama-lookup-merge"), str(ours[0]), str(ours[1]), str(merged)], capture_output=True,
                   timeout=300, check=True)  # fmt: skip
    mine = load(ours[0])
    merge(mine, load(ours[1]))
    assert in_file_order(merged) == {key: list(followers) for key, followers in mine.items()}
