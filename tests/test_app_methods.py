"""The Space on a pair that runs both draft methods: a hybrid target with an MTP head (carrying the model's own
`general.sampling.*`) and a DFlash 2 draft, configured as a real pair (DFLASH_DEMO=off, local files, CPU). Through
the real server: /info lists the methods and where the sampling defaults came from, /chat runs each method (the same
text as plain decoding at temperature 0), draft_length is checked and the old draft_max still works; in the browser
the A/B offers every method and runs plain, DFlash 2, MTP and the n-gram methods picked side by side. And when the
DFlash draft is unusable (fails validation, or cannot be downloaded), the target drafts with its own MTP head, and the
Space says so."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gguf
import pytest
from app_fixtures import REPO_ROOT, FakeHub, RunningApp, running_app
from gguf.scripts.gguf_new_metadata import MetadataDetails, copy_with_new_metadata
from gradio_client import Client
from space_client import chat_args, host_reply
from test_app_browser import open_page, set_temperature, text_of, wait_for_page

from dflash_runtime import load_pair
from dflash_runtime.space.gpu.host import EngineHost
from dflash_runtime.space.gpu_job import ReplyChunk
from dflash_runtime.space.requests import Limits
from dflash_runtime.space.setup.downloads import PairDownload
from dflash_runtime.space.setup.presets import ModelSource, PairPreset, ResolvedPair
from dflash_runtime.testing.tiny_models import TinyPair, tiny_pair, write_broken_draft

ARTIFACTS = REPO_ROOT / "test-artifacts"
N_CTX = 1024
PRESET = "methods-pair"
NGRAMS = ["ngram-mod", "ngram-map-k", "ngram-simple", "ngram-map-k4v", "ngram-cache"]  # every pair runs them
# What a model card recommends (Qwen3's thinking-mode values), as general.sampling.* keys
SAMPLING = {"temp": 0.6, "top_k": 20, "top_p": 0.95, "min_p": 0.05}
SAMPLING_TYPES = {"temp": gguf.GGUFValueType.FLOAT32, "top_k": gguf.GGUFValueType.INT32,
                  "top_p": gguf.GGUFValueType.FLOAT32, "min_p": gguf.GGUFValueType.FLOAT32}  # fmt: skip
PROMPT = "Explain speculative decoding in three sentences."


def methods_pair() -> TinyPair:
    """A hybrid qwen35 target with one MTP layer and a DFlash 2 draft ("phrase" head: predictable stretches)."""
    return tiny_pair("hybrid", "dflash2", head="phrase", n_embd=512, dims="scaled", mtp_layers=1)


def with_sampling_keys(source: Path, dest: Path, sampling: dict[str, float]) -> Path:
    """A copy of a GGUF file with `general.sampling.<key>` set (as recent GGUFs carry them)."""
    reader = gguf.GGUFReader(source, "r")
    arch = reader.get_field(gguf.Keys.General.ARCHITECTURE).contents()
    writer = gguf.GGUFWriter(dest, arch=arch, endianess=reader.endianess)
    keys = {f"general.sampling.{k}": MetadataDetails(SAMPLING_TYPES[k], v) for k, v in sampling.items()}
    copy_with_new_metadata(reader, writer, keys, [])
    return dest


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningApp]:
    pair = methods_pair()
    target = with_sampling_keys(pair.target, tmp_path_factory.mktemp("sampling") / "target-sampling.gguf", SAMPLING)
    env = {"DFLASH_DEMO": "off", "DFLASH_TARGET_PATH": str(target), "DFLASH_DRAFT_PATH": str(pair.draft),
           "DFLASH_GPU_LAYERS": "0", "DFLASH_N_CTX": str(N_CTX), "DFLASH_PRESET_NAME": PRESET,
           "DFLASH_DRAFT_CAPACITY": "7"}  # fmt: skip
    with running_app(env, ARTIFACTS / "app_methods_server.log") as app:
        yield app


@pytest.fixture(scope="module")
def client(server: RunningApp) -> Client:
    return Client(server.url, verbose=False)


def generate(client: Client, **changes: Any) -> tuple[str, dict[str, Any]]:
    args = {**chat_args(PROMPT, preset=PRESET, max_tokens=64, temperature=0.0), **changes}
    return client.predict(**args, api_name="/generate")


def test_info_lists_the_methods_and_the_models_sampling_defaults(client: Client) -> None:
    info = client.predict(api_name="/info")
    assert info["methods"] == ["dflash", "mtp", *NGRAMS, "ngram-mod,dflash"]
    assert info["default_method"] == "dflash"
    assert info["draft_problem"] is None and info["offline_demo"] is False
    assert info["sampling_defaults_from"] == "the model's general.sampling"
    defaults = info["defaults"]
    assert {k: defaults[k] for k in ("temperature", "top_k", "top_p", "min_p")} == {
        "temperature": 0.6, "top_k": 20, "top_p": 0.95, "min_p": 0.05}  # fmt: skip
    assert defaults["method"] == "auto" and defaults["draft_length"] == "auto"
    limits = info["limits"]
    assert limits["draft_length"] == ["auto", [0, 7]]
    assert limits["method"] == ["auto", "dflash", "dflash-tree", "dspark", "mtp", "eagle3", "draft-simple", *NGRAMS,
                                "ngram-mod,dflash"]


def test_each_method_writes_the_plain_text_at_temperature_zero(client: Client) -> None:
    plain, plain_stats = generate(client, speculative=False)
    assert plain_stats["method"] is None and plain_stats["drafted"] == 0
    for method, length in (("mtp", "auto"), ("mtp", 3), ("dflash", "auto"), ("auto", 5)):
        text, stats = generate(client, method=method, draft_length=length)
        assert text == plain, f"{method} at draft length {length} changed the text"
        assert stats["method"] == ("dflash" if method == "auto" else method) and stats["draft_length"] == length
        assert stats["drafted"] > 0 and stats["notes"] == []


def test_unset_sampling_takes_the_models_defaults(client: Client) -> None:
    _, stats = generate(client, temperature=None, top_p=None, top_k=None, min_p=None)
    assert stats["verify_mode"] == "sample", "the model's temperature 0.6 samples"
    _, greedy = generate(client)
    assert greedy["verify_mode"] == "greedy"


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"draft_length": 8}, "draft_length must be 'auto' or an integer in 0..7 (0 = no draft), got 8"),
        ({"draft_length": "three"}, "draft_length must be 'auto' or an integer in 0..7 (0 = no draft), got 'three'"),
        ({"method": "eagle"},
         "method must be one of 'auto', 'dflash', 'dflash-tree', 'dspark', 'mtp', 'eagle3', 'draft-simple', "
         "'ngram-mod', 'ngram-map-k', 'ngram-simple', 'ngram-map-k4v', 'ngram-cache', 'ngram-mod,dflash', got 'eagle'"),
        ({"top_k": -1}, "top_k must be an integer in 0..1000 (0 = off), got -1"),
        ({"min_p": 1.5}, "min_p must be a number in [0.0, 0.99], got 1.5"),
    ],
)
def test_bad_method_and_draft_settings_are_refused_in_words(client: Client, changes: dict[str, Any],
                                                            message: str) -> None:  # fmt: skip
    with pytest.raises(Exception, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        generate(client, **changes)


def test_the_old_draft_max_still_works_and_says_it_is_deprecated(client: Client) -> None:
    plain, _ = generate(client, speculative=False)
    text, stats = generate(client, draft_max=0, method="mtp")  # 0 meant "adaptive"
    assert text == plain and stats["draft_length"] == "auto" and stats["method"] == "mtp"
    assert any("draft_max is deprecated" in note for note in stats["notes"])
    _, fixed = generate(client, draft_max=2)
    assert fixed["draft_length"] == 2


PICKED_JS = "Array.from(document.querySelectorAll('#ab-methods label')).filter(l => l.querySelector('input').checked)" \
    ".map(l => l.innerText.trim())"


def picked_for_ab(page: Any) -> list[str]:
    return page.evaluate(PICKED_JS)


@pytest.mark.browser
def test_the_page_offers_the_methods_and_the_ab_run_compares_them(server: RunningApp) -> None:
    with open_page(server.url) as page:
        wait_for_page(page)
        page.wait_for(f"{text_of('#sampling-source')}.includes(\"the model's general.sampling\")", 30,
                      "the sampling note")  # fmt: skip
        assert page.evaluate("document.querySelector(\"#temperature input[type='range']\").value") == "0.6"
        assert page.evaluate("!!document.querySelector('#method input')"), "the method choice"
        set_temperature(page, 0)
        # The A/B offers every method the pair runs and compares the registry's few unless the visitor picks: here
        # one of those is swapped for one it offers.
        offered = page.evaluate("Array.from(document.querySelectorAll('#ab-methods label')).map(l => l.innerText"
                                ".trim())")  # fmt: skip
        assert offered == ["DFlash 2", "MTP", *NGRAMS, "ngram-mod → DFlash 2"], offered
        assert picked_for_ab(page) == ["DFlash 2", "MTP", "ngram-mod", "ngram-map-k"]
        for label in ("ngram-map-k", "ngram-cache"):
            page.evaluate("Array.from(document.querySelectorAll('#ab-methods label')).find(l => l.innerText.trim() "
                          f"=== {label!r}).click()")  # fmt: skip
        page.wait_for(f"{PICKED_JS}.join() === 'DFlash 2,MTP,ngram-mod,ngram-cache'", 10, "the A/B's picks")
        page.type_into("#message-box textarea", PROMPT)
        page.click("#ab")
        result = page.wait_for(f"{text_of('#ab-result')}.includes('Texts identical') && {text_of('#ab-result')}",
                               240, "the A/B comparison")  # fmt: skip
        page.screenshot(ARTIFACTS / "app_methods_ab.png")
    rows = [line.split("\t")[0].strip() for line in result.splitlines() if line.count("\t") >= 4]
    assert rows == ["Method", "Plain", "DFlash 2", "MTP", "ngram-mod", "ngram-cache"], result
    assert "Texts identical: yes" in result and "DFlash 2: " in result and "MTP: " in result
    assert re.search(r"(DFlash 2|MTP): (no measurable speed-up|no speed-up|slower than plain here|[\d.]+× as fast)",
                     result), result  # fmt: skip


# -- MTP when the DFlash draft is unusable -----------------------------------------------------------------------


def run_job(host: EngineHost, files: ResolvedPair, **fields: Any) -> ReplyChunk:
    return host_reply(host, files, PROMPT, n_ctx=N_CTX, max_tokens=32, **fields)


def test_a_draft_that_fails_validation_leaves_the_target_drafting_with_its_mtp_head(tmp_path: Path) -> None:
    pair = methods_pair()
    broken = write_broken_draft("width", tmp_path / "draft-width.gguf", target=pair)
    host = EngineHost(load_pair)
    try:
        answer = run_job(host, ResolvedPair(pair.target, broken))
        assert answer.error is None, answer.error
        info = answer.engine_info
        assert info is not None and info["methods"] == ["mtp", *NGRAMS]
        assert info["draft_problem"].startswith("Draft unavailable: ")
        assert info["draft_problem"].endswith("; drafting with the target's MTP head")
        assert str(tmp_path) not in info["draft_problem"], "no server paths"
        assert answer.stats["method"] == "mtp" and answer.stats["drafted"] > 0
        plain = run_job(host, ResolvedPair(pair.target, broken), speculative=False)
        assert plain.delta == answer.delta
    finally:
        host.close()


def test_without_an_mtp_head_a_bad_draft_is_still_an_error(tmp_path: Path) -> None:
    pair = tiny_pair("hybrid", "dflash2", head="phrase", n_embd=512, dims="scaled")
    broken = write_broken_draft("width", tmp_path / "draft-width.gguf", target=pair)
    host = EngineHost(load_pair)
    try:
        answer = run_job(host, ResolvedPair(pair.target, broken))
        assert answer.error_type == "PairMismatchError"
    finally:
        host.close()


def test_a_draft_that_cannot_be_downloaded_leaves_the_target_alone(tmp_path: Path) -> None:
    hub = FakeHub().start()
    try:
        hub.add_file("org/target", "target.gguf", methods_pair().target.read_bytes())
        preset = PairPreset(name="p", label="p", target=ModelSource(repo="org/target", filename="target.gguf"),
                            draft=ModelSource(repo="org/target", filename="missing-draft.gguf"))  # fmt: skip
        files = PairDownload(preset, cache_dir=tmp_path, endpoint=hub.endpoint).wait(timeout=60)
    finally:
        hub.stop()
    assert files.draft_path is None and files.target_path.is_file()
    assert files.draft_problem is not None and "no such file in the repository" in files.draft_problem
    host = EngineHost(load_pair)
    try:
        answer = run_job(host, files)
        assert answer.engine_info is not None and answer.engine_info["methods"] == ["mtp", *NGRAMS]
        assert "Draft unavailable: Could not download the draft" in answer.engine_info["draft_problem"]
        assert answer.stats["method"] == "mtp"
    finally:
        host.close()


def test_info_box_lists_methods_and_warns_of_a_missing_draft() -> None:
    from dflash_runtime.space.page.views import info_markdown

    preset = PairPreset(name="p", label="p", target=ModelSource(repo="a/b", filename="t.gguf"),
                        draft=ModelSource(repo="a/c", filename="d.gguf"))  # fmt: skip
    text = info_markdown(preset, Limits(), {}, {"methods": ["mtp"], "draft_kind": None,
                                                "draft_problem": "Draft unavailable: gone; drafting with the "
                                                "target's MTP head"})  # fmt: skip
    assert "- Draft methods: MTP (the target's own multi-token-prediction head)" in text
    assert "⚠️ Draft unavailable: gone" in text
