"""The engine host on the real tiny pair: errors end the stream as data, request errors keep the engine, engine
failures close it for the next request to reload, and a closed reply stops the engine between two steps."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from space_client import demo_pair, expected_answer, reference_engine

from dflash_runtime import load_pair
from dflash_runtime.space.host import EngineHost, GpuJob, ReplyChunk
from dflash_runtime.space.presets import ResolvedPair, configured_preset
from dflash_runtime.space.requests import Limits, build_request

N_CTX = 1024


class RecordingLoader:
    """load_pair, keeping the engines it opened (so a test can break one behind the host's back)."""

    def __init__(self) -> None:
        self.engines: list[Any] = []

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        engine = load_pair(*args, **kwargs)
        self.engines.append(engine)
        return engine


@pytest.fixture
def host() -> Iterator[tuple[EngineHost, RecordingLoader]]:
    loader = RecordingLoader()
    host = EngineHost(loader)
    yield host, loader
    host.close()


def job(message: str, max_tokens: int = 16, **fields: Any) -> GpuJob:
    preset = configured_preset(True, {"DFLASH_N_CTX": str(N_CTX)})
    pair = demo_pair()
    request = build_request(preset=preset.name, presets=[preset.name], limits=Limits(), message=message,
                            max_tokens=max_tokens, draft_max=7, **fields)  # fmt: skip
    return GpuJob(request, preset, ResolvedPair(pair.target, pair.draft))


def final(chunks: Iterator[ReplyChunk]) -> ReplyChunk:
    return list(chunks)[-1]


def test_request_errors_come_back_as_data_and_keep_the_engine(host: tuple[EngineHost, RecordingLoader]) -> None:
    engine_host, loader = host
    first = final(engine_host.run(job("hello world")))
    assert first.finish_reason == "length" and first.worker["loaded_now"] and first.worker["engine_loaded"]
    error = final(engine_host.run(job("0123456789 " * 200)))
    assert error.error_type == "PromptTooLongError" and "context cannot hold it" in (error.error or "")
    assert error.worker["engine_loaded"] is True and error.text == ""
    again = final(engine_host.run(job("hello world")))
    assert again.text == first.text and again.worker["loads"] == 1 and len(loader.engines) == 1
    assert again.worker["previous_request"]["error_type"] == "PromptTooLongError"


def test_an_engine_failure_closes_the_engine_and_the_next_request_loads_it_again(
    host: tuple[EngineHost, RecordingLoader],
) -> None:
    engine_host, loader = host
    final(engine_host.run(job("hello world")))
    loader.engines[0].close()  # the engine breaks between two requests
    failed = final(engine_host.run(job("hello world")))
    assert failed.error_type == "EngineClosedError" and failed.worker["engine_loaded"] is False
    recovered = final(engine_host.run(job("hello world")))
    assert recovered.finish_reason == "length" and recovered.worker["loaded_now"] and recovered.worker["loads"] == 2
    with reference_engine(N_CTX) as reference:
        assert recovered.text == expected_answer(reference, [{"role": "user", "content": "hello world"}], 16)


def test_closing_a_reply_stops_the_engine_and_is_recorded(host: tuple[EngineHost, RecordingLoader]) -> None:
    engine_host, _ = host
    stream = engine_host.run(job("hello there", max_tokens=400))
    for _ in range(3):
        next(stream)
    stream.close()
    after = final(engine_host.run(job("one two three")))
    stopped = after.worker["previous_request"]
    assert stopped["finish_reason"] == "closed by the caller" and 0 < stopped["n_generated"] < 400
    assert after.engine_info["target"] == demo_pair().target.name, "file names only, no server paths"
