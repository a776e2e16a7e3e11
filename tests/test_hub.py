"""Presets from environment variables and Hub downloads, against a local fake of the Hub's file endpoints."""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import huggingface_hub.constants
import pytest
from app_fixtures import FakeHub, FakeHubRequest, launch_app, stop_app
from gradio_client import Client
from gradio_client.exceptions import AppError
from space_client import chat_args, raw_body, raw_call

from dflash_runtime import load_pair
from dflash_runtime.errors import DownloadError, ModelFileError
from dflash_runtime.space.setup.downloads import PairDownload, fetch_model_file
from dflash_runtime.space.setup.presets import (
    DEFAULT_DRAFT,
    DEFAULT_PRESET_NAME,
    DEFAULT_TARGET,
    ModelSource,
    PairPreset,
    overrides_in_env,
    preset_from_env,
)
from dflash_runtime.testing.tiny_models import tiny_pair

TARGET_REPO, TARGET_FILE = "test-org/target-GGUF", "target-Q8_0.gguf"
DRAFT_REPO, DRAFT_FILE = "test-org/draft-GGUF", "draft-Q4_K_M.gguf"


def _payload(seed: str, size: int) -> bytes:
    """Deterministic, non-repeating bytes so a misplaced resume shows up as a content mismatch."""
    blocks = (hashlib.sha256(f"{seed}{i}".encode()).digest() for i in range(size // 32 + 1))
    return b"".join(blocks)[:size]


@pytest.fixture
def hub(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeHub]:
    # Small chunks so that a few MB stream as many chunks: progress and resume points become observable.
    monkeypatch.setattr(huggingface_hub.constants, "DOWNLOAD_CHUNK_SIZE", 64 * 1024)
    fake = FakeHub().start()
    fake.add_file(TARGET_REPO, TARGET_FILE, _payload("target", 3 * 1024 * 1024 + 17))
    fake.add_file(DRAFT_REPO, DRAFT_FILE, _payload("draft", 1024 * 1024 + 5))
    yield fake
    fake.stop()


def _preset(**changes: object) -> PairPreset:
    fields: dict[str, object] = {
        "name": "test",
        "label": "test pair",
        "target": ModelSource(repo=TARGET_REPO, filename=TARGET_FILE),
        "draft": ModelSource(repo=DRAFT_REPO, filename=DRAFT_FILE),
    }
    fields.update(changes)
    return PairPreset(**fields)  # type: ignore[arg-type]


def test_default_preset_is_the_published_pair() -> None:
    preset = preset_from_env({})
    assert preset.name == DEFAULT_PRESET_NAME
    assert preset.target == DEFAULT_TARGET and preset.draft == DEFAULT_DRAFT
    assert preset.target.repo == "utautako/Qwen3.8-27B-NVFP4-MTP-Q8attn-GGUF"
    assert preset.draft.filename == "Qwen3.8-27B-DFlash2-Q4_K_M.gguf"
    assert preset.quantisation == "target NVFP4, draft Q4_K_M"
    assert overrides_in_env({}) == []


def test_every_part_of_the_preset_follows_the_environment(tmp_path: Path) -> None:
    local_draft = tmp_path / "draft.gguf"
    env = {
        "DFLASH_PRESET_NAME": "mine",
        "DFLASH_TARGET_REPO": "me/t",
        "DFLASH_TARGET_FILE": "t-Q5_K_S.gguf",
        "DFLASH_TARGET_REVISION": "abc123",
        "DFLASH_DRAFT_PATH": str(local_draft),
        "DFLASH_N_CTX": "2048",
        "DFLASH_GPU_LAYERS": "12",
        "DFLASH_DRAFT_CAPACITY": "15",
    }
    preset = preset_from_env(env)
    assert preset.name == "mine"
    assert preset.target == ModelSource(repo="me/t", filename="t-Q5_K_S.gguf", revision="abc123")
    assert preset.draft.local_path == local_draft
    assert (preset.n_ctx, preset.n_gpu_layers, preset.draft_capacity) == (2048, 12, 15)
    assert preset.target.describe() == "me/t/t-Q5_K_S.gguf@abc123"
    assert preset.describe()["draft"] == "local file draft.gguf", "visitors see no server paths"
    assert sorted(overrides_in_env(env)) == sorted(
        ["DFLASH_TARGET_REPO", "DFLASH_TARGET_FILE", "DFLASH_TARGET_REVISION", "DFLASH_DRAFT_PATH"]
    )


@pytest.mark.parametrize(
    ("name", "value"),
    [("DFLASH_N_CTX", "lots"), ("DFLASH_N_CTX", "16"), ("DFLASH_GPU_LAYERS", "-2"), ("DFLASH_DRAFT_CAPACITY", "0"),
     ("DFLASH_DRAFT_MAX", "0")],
)
def test_bad_numbers_in_the_environment_name_the_variable(name: str, value: str) -> None:
    with pytest.raises(ValueError, match=name):
        preset_from_env({name: value})


def test_the_old_draft_capacity_variable_is_read_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("WARNING", logger="dflash_runtime.space.setup.presets"):
        assert preset_from_env({"DFLASH_DRAFT_MAX": "5"}).draft_capacity == 5
    assert "DFLASH_DRAFT_MAX is deprecated: set DFLASH_DRAFT_CAPACITY" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="dflash_runtime.space.setup.presets"):
        assert preset_from_env({"DFLASH_DRAFT_CAPACITY": "3", "DFLASH_DRAFT_MAX": "5"}).draft_capacity == 3
    assert "deprecated" not in caplog.text, "the new name wins, and the old one is then ignored"


def test_local_path_is_used_as_is_and_checked(tmp_path: Path) -> None:
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    assert fetch_model_file(ModelSource(local_path=model), "target") == model
    with pytest.raises(ModelFileError, match="DFLASH_DRAFT_PATH"):
        fetch_model_file(ModelSource(local_path=tmp_path / "missing.gguf"), "draft")


def test_download_reports_progress_and_is_cached(hub: FakeHub, tmp_path: Path) -> None:
    seen: list[tuple[int, int | None]] = []
    source = ModelSource(repo=TARGET_REPO, filename=TARGET_FILE)
    path = fetch_model_file(
        source,
        "target",
        cache_dir=tmp_path,
        endpoint=hub.endpoint,
        token="hf_test",
        on_progress=lambda d, t: seen.append((d, t)),
    )
    expected = hub.files[(TARGET_REPO, TARGET_FILE)]
    assert path.read_bytes() == expected
    assert seen[0] == (0, len(expected)), "the size must be known as soon as the transfer starts"
    assert len(seen) > 10, "progress should be reported while the file streams"
    assert seen[-1] == (len(expected), len(expected))
    assert all(r.authorization == "Bearer hf_test" for r in hub.requests)

    again = fetch_model_file(source, "target", cache_dir=tmp_path, endpoint=hub.endpoint)
    assert again == path
    assert hub.get_count(TARGET_FILE) == 1, "a cached file must not be fetched twice"


def test_a_dropped_connection_resumes_where_it_stopped(hub: FakeHub, tmp_path: Path) -> None:
    hub.planned_gets = ["truncate"]
    source = ModelSource(repo=DRAFT_REPO, filename=DRAFT_FILE)
    path = fetch_model_file(source, "draft", cache_dir=tmp_path, endpoint=hub.endpoint)
    assert path.read_bytes() == hub.files[(DRAFT_REPO, DRAFT_FILE)]
    ranges = [r.range for r in hub.requests if r.method == "GET"]
    assert len(ranges) == 2 and ranges[0] is None and ranges[1] is not None and ranges[1].startswith("bytes=")


def test_a_failed_partial_download_recovers_on_retry(hub: FakeHub, tmp_path: Path) -> None:
    # The draft arrives; the target's first GET breaks halfway and its resumed GET fails outright.
    hub.planned_gets = ["truncate", "error"]
    download = PairDownload(_preset(), cache_dir=tmp_path, endpoint=hub.endpoint)
    with pytest.raises(DownloadError, match="Could not download the target") as failure:
        download.wait(timeout=60)
    assert "retry" in str(failure.value) and "HfHubHTTPError" in str(failure.value)
    status = download.status()
    assert status.state == "failed" and status.error and status.summary().startswith("Download failed")
    assert [r.range is not None for r in hub.requests if r.method == "GET"] == [False, True]
    assert not list(tmp_path.rglob("*.incomplete")), "a failed transfer must not leave a partial file behind"

    download.start()
    resolved = download.wait(timeout=60)
    assert resolved.target_path.read_bytes() == hub.files[(TARGET_REPO, TARGET_FILE)]
    assert resolved.draft_path.read_bytes() == hub.files[(DRAFT_REPO, DRAFT_FILE)]
    final = download.status()
    assert final.state == "done" and all(item.fraction == 1.0 for item in final.files)


@pytest.mark.parametrize(
    ("source", "hint"),
    [
        (ModelSource(repo="nobody/none", filename=TARGET_FILE), "DFLASH_TARGET_REPO"),
        (ModelSource(repo=TARGET_REPO, filename="other.gguf"), "DFLASH_TARGET_FILE"),
    ],
)
def test_missing_repo_or_file_is_a_clear_error(hub: FakeHub, tmp_path: Path, source: ModelSource, hint: str) -> None:
    with pytest.raises(DownloadError, match=hint):
        fetch_model_file(source, "target", cache_dir=tmp_path, endpoint=hub.endpoint)


def test_download_status_reads_from_env(hub: FakeHub, tmp_path: Path) -> None:
    env = {"HF_ENDPOINT": hub.endpoint, "DFLASH_CACHE_DIR": str(tmp_path), "HF_TOKEN": "hf_env"}
    download = PairDownload.from_env(_preset(), env)
    assert download.status().state == "idle"
    resolved = download.wait(timeout=60)
    assert resolved.target_path.is_relative_to(tmp_path)
    assert {r.authorization for r in hub.requests} == {"Bearer hf_env"}
    summary = download.status().summary()
    assert "target target-Q8_0.gguf: 100%" in summary and "draft draft-Q4_K_M.gguf: 100%" in summary
    assert os.environ.get("HF_TOKEN") != "hf_env"


def gated_hub_pair(tmp_path: Path) -> tuple[Any, FakeHub, dict[str, str]]:
    """A tiny pair on a fake Hub whose downloads wait for its gate, and the Space's settings that name it."""
    tiny = tiny_pair(target="dense", draft="dflash2", head="shaped")
    fake = FakeHub(gate=threading.Event()).start()
    fake.add_file("test-org/tiny-target-GGUF", "tiny-target-F32.gguf", tiny.target.read_bytes())
    fake.add_file("test-org/tiny-draft-GGUF", "tiny-draft-F32.gguf", tiny.draft.read_bytes())
    env = {
        "HF_ENDPOINT": fake.endpoint,
        "DFLASH_CACHE_DIR": str(tmp_path / "hub-cache"),
        "DFLASH_TARGET_REPO": "test-org/tiny-target-GGUF",
        "DFLASH_TARGET_FILE": "tiny-target-F32.gguf",
        "DFLASH_DRAFT_REPO": "test-org/tiny-draft-GGUF",
        "DFLASH_DRAFT_FILE": "tiny-draft-F32.gguf",
        "DFLASH_PRESET_NAME": "fake-hub-pair",
        "DFLASH_N_CTX": "1024",
    }
    return tiny, fake, env


def test_the_app_downloads_the_pair_in_the_web_process(tmp_path: Path) -> None:
    """Model variables set → the app runs the configured pair: it fetches both files from the (fake) Hub while the
    page is already up, reports progress on /info, then answers with them like an engine on the same bytes."""
    tiny, fake, env = gated_hub_pair(tmp_path)  # downloads wait until the test has seen the page up
    env["HF_TOKEN"] = "hf_space_secret"
    app = launch_app(env, tmp_path / "server.log")
    try:
        client = Client(app.url, verbose=False)
        first = client.predict(api_name="/info")
        assert first["offline_demo"] is False and "model variables set" in first["mode_reason"]
        assert first["download"]["state"] == "running", "the page must be up before the download ends"
        fake.gate.set()
        text, stats = client.predict("hello world", [], "", "fake-hub-pair", 24, 0.0, 1.0, 7, True, False,
                                     api_name="/generate")  # fmt: skip
        done = client.predict(api_name="/info")
    finally:
        stop_app(app.process)
        fake.stop()
    assert done["download"]["state"] == "done"
    assert "tiny-target-F32.gguf: 100%" in done["download"]["summary"]
    assert done["presets"]["fake-hub-pair"]["quantisation"] == "target F32, draft F32"
    file_requests = [r for r in fake.requests if "/resolve/" in r.path]
    assert {r.authorization for r in file_requests} == {"Bearer hf_space_secret"}
    assert fake.get_count("tiny-target-F32.gguf") == 1 and fake.get_count("tiny-draft-F32.gguf") == 1
    with load_pair(tiny.target, tiny.draft, n_ctx=1024, draft_length=7) as engine:
        messages = [{"role": "user", "content": "hello world"}]
        assert text == engine.chat(messages, enable_thinking=False, max_tokens=24, temperature=0.0).text
    assert stats["n_generated"] == 24 and stats["preset"] == "fake-hub-pair"


def test_an_api_call_waits_for_the_download_no_longer_than_the_busy_timeout(tmp_path: Path) -> None:
    """While the pair still downloads, an API call waits for it at most DFLASH_BUSY_TIMEOUT_S, then is told to retry
    (with the download's progress); once the files are there, calls are answered."""
    _, fake, env = gated_hub_pair(tmp_path)  # the download waits until the test lets it go
    env["DFLASH_BUSY_TIMEOUT_S"] = "2"
    app = launch_app(env, tmp_path / "server.log")
    try:
        client = Client(app.url, verbose=False)
        started = time.monotonic()
        with pytest.raises(AppError, match="still downloading") as refused:
            client.predict("hello world", api_name="/generate", max_tokens=4)
        waited = time.monotonic() - started
        fake.gate.set()
        text, stats = client.predict("hello world", api_name="/generate", max_tokens=4)
    finally:
        stop_app(app.process)
        fake.stop()
    assert 2.0 <= waited < 30.0, waited
    assert "retry in a few minutes" in str(refused.value)
    assert stats["n_generated"] == 4 and text


class OutageHub(FakeHub):
    """A Hub that answers every request with HTTP 500 (an outage)."""

    def _serve(self, handler: BaseHTTPRequestHandler, send_body: bool) -> None:
        self.requests.append(FakeHubRequest(handler.command, handler.path, None, handler.headers.get("Authorization")))
        self._reply_error(handler, 500, None)


def test_a_hub_outage_reads_as_one_through_the_api(tmp_path: Path) -> None:
    """The Hub answers 500 to everything: the download fails, and /info, gradio_client and a raw HTTP call all say
    it is an outage (not a missing file), without the token."""
    hub = OutageHub().start()
    env = {
        "HF_ENDPOINT": hub.endpoint,
        "HF_TOKEN": "hf_outage_secret",
        "DFLASH_CACHE_DIR": str(tmp_path / "hub-cache"),
        "DFLASH_TARGET_REPO": TARGET_REPO,
        "DFLASH_TARGET_FILE": TARGET_FILE,
        "DFLASH_DRAFT_REPO": DRAFT_REPO,
        "DFLASH_DRAFT_FILE": DRAFT_FILE,
        "DFLASH_PRESET_NAME": "outage-pair",
    }
    app = launch_app(env, tmp_path / "server.log")
    try:
        client = Client(app.url, verbose=False)
        with pytest.raises(AppError) as through_client:  # waits for the download, which retries, then fails
            client.predict("hello", preset="outage-pair", max_tokens=8, api_name="/generate")
        info = client.predict(api_name="/info")
        raw = raw_call(app.url, "generate", raw_body(chat_args("hello", preset="outage-pair", max_tokens=8)))
    finally:
        stop_app(app.process)
        hub.stop()
    expected = "the Hub answered HTTP 500 (a Hub outage, not a problem with the configuration); retry later"
    for message in (str(through_client.value), info["download"]["summary"], raw.message):
        assert expected in message and "no such file" not in message, message
    assert raw.event == "error" and info["download"]["state"] == "failed"
    file_requests = [r for r in hub.requests if "/resolve/" in r.path]
    assert file_requests and all(r.authorization == "Bearer hf_outage_secret" for r in file_requests)
    for text in (str(through_client.value), json.dumps(info), raw.message, app.log()):
        assert "hf_outage_secret" not in text
