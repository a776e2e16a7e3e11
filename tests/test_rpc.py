"""Pairs spread over an RPC server on 127.0.0.1 (the wheel's ggml-rpc-server, started as a user starts it): the demo
pairs with half the target's layers on the server (and, for the hybrid one, the whole draft) answer exactly as the
local engine for DFlash 2, MTP and plain requests, alone and at once; a server that is down at load, or killed in
the middle of an answer, ends every request with an error naming it within seconds, the process goes on, the engine
closes, and a new load works once the server is back."""

from __future__ import annotations

import importlib.util
import json
import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from space_client import whole_reply

from dflash_runtime import RemoteDeviceError, load_pair
from dflash_runtime.engine import Engine
from dflash_runtime.native.rpc import server_command
from dflash_runtime.pair import live_handles
from dflash_runtime.space.gpu.host import EngineHost
from dflash_runtime.space.gpu_job import GpuJob
from dflash_runtime.space.requests import Limits, build_request
from dflash_runtime.space.setup.presets import DEMO_PAIRS, ResolvedPair, configured_preset, parallel_from_env
from dflash_runtime.testing.rpc_server import LoopbackServer, free_port
from dflash_runtime.testing.tiny_models import pair_paths, tiny_pair

PROMPTS = ("the quick brown fox jumps over the lazy dog.", "one two three four five six")
MAX_TOKENS = 16
N_CTX = 512
# The demo targets have 8 trunk layers: 5 "GPU layers" put layers 4-7 and the output head on the server, 0-3 stay
# here; the hybrid one has its MTP block as layer 8, so 6 put it on the server too. The tiny pair has 4 layers.
HALF = 5
TINY_HALF = 3
FAULT_DEADLINE_S = 10.0
RECIPE = Path(__file__).resolve().parents[1] / "prebuilt_wheels" / "build_wheel.py"


def _pair(name: str) -> Any:
    """A demo pair (DEMO_PAIRS), or "tiny": the small dense pair (4 layers) for the fault tests."""
    return tiny_pair("dense", "dflash2") if name == "tiny" else tiny_pair(**DEMO_PAIRS[name][0])


def _open(name: str, parallel: int = 2, **remote: Any) -> Engine:
    pair = _pair(name)
    return load_pair(pair.target, pair.draft, n_ctx=N_CTX, draft_capacity=7, parallel=parallel, **remote)


@pytest.fixture(scope="module")
def server() -> Iterator[LoopbackServer]:
    with LoopbackServer(threads=1) as running:
        yield running


def _requests(engine: Engine) -> list[dict[str, Any]]:
    """Every method the pair runs, and plain decoding, at temperature 0."""
    runs: list[dict[str, Any]] = [{"speculative": False}]
    runs += [{"method": m, "draft_length": "auto"} for m in ("dflash", "mtp") if m in engine.methods]
    return runs


def _alone(engine: Engine, runs: list[dict[str, Any]]) -> list[list[int]]:
    return [engine.generate(p, max_tokens=MAX_TOKENS, **r).tokens for r in runs for p in PROMPTS]


def _at_once(engine: Engine, runs: list[dict[str, Any]]) -> list[list[int]]:
    """The same requests, `parallel` at a time, their steps interleaved from this thread."""
    jobs = [(p, r) for r in runs for p in PROMPTS]
    out: list[list[int]] = []
    for i in range(0, len(jobs), engine.parallel):
        streams = [engine.stream(p, max_tokens=MAX_TOKENS, **r) for p, r in jobs[i:i + engine.parallel]]
        tokens: list[list[int]] = [[] for _ in streams]
        live = set(range(len(streams)))
        while live:
            for k in sorted(live):
                event = next(streams[k])
                tokens[k] += event.tokens
                if event.finish_reason is not None:
                    live.discard(k)
        out += tokens
    return out


@pytest.mark.parametrize(("name", "gpu_layers", "remote_layers", "draft_gpu_layers", "draft_where"),
                         [("dense", HALF, "4-7", 0, "CPU"), ("methods", HALF + 1, "4-8", -1, "RPC")])
def test_half_the_target_on_a_server_answers_as_the_local_engine(server: LoopbackServer, name: str, gpu_layers: int,
                                                                 remote_layers: str, draft_gpu_layers: int,
                                                                 draft_where: str) -> None:  # fmt: skip
    with _open(name) as local:
        runs = _requests(local)
        expected = _alone(local, runs)
    with _open(name, rpc=[server.endpoint], rpc_cpu=True, n_gpu_layers=gpu_layers,
               draft_gpu_layers=draft_gpu_layers) as remote:  # fmt: skip
        info = remote.info()
        placement = info["placement"]
        assert [(r["device"][:3], r["layers"]) for r in placement["target"]] == [
            ("CPU", "0-3"), ("RPC", remote_layers), ("RPC", "output")]
        assert {r["device"][:3] for r in placement["draft"] if r["layers"] != "output"} == {draft_where}
        assert [d["where"] for d in placement["devices"]] == ["local", server.endpoint]
        assert info["batch_invariant"] is True and len(runs) == (3 if name == "methods" else 2)
        if name == "methods":
            assert placement["mtp_head"].startswith("RPC")  # the nextn layer follows the trunk's last layers
        before = placement["rpc"][server.endpoint]["round_trips"]
        assert _alone(remote, runs) == expected
        assert _at_once(remote, runs) == expected
        assert remote.info()["placement"]["rpc"][server.endpoint]["round_trips"] > before


def test_a_server_that_is_down_at_load_is_named_within_seconds() -> None:
    endpoint = f"127.0.0.1:{free_port()}"  # nothing listens there
    handles = live_handles()
    started = time.monotonic()
    with pytest.raises(RemoteDeviceError, match=f"RPC server at {endpoint} is not reachable"):
        _open("tiny", rpc=[endpoint], n_gpu_layers=TINY_HALF)
    assert time.monotonic() - started < FAULT_DEADLINE_S and live_handles() == handles


def test_a_server_killed_mid_answer_fails_every_request_and_a_new_load_works_after_its_restart(tmp_path) -> None:
    with _open("tiny", parallel=1) as local:
        expected = local.generate(PROMPTS[0], max_tokens=MAX_TOKENS, speculative=False).tokens
    handles = live_handles()
    server = LoopbackServer(threads=1, log=tmp_path / "server.log").start()
    try:
        engine = _open("tiny", rpc=[server.endpoint], rpc_cpu=True, n_gpu_layers=TINY_HALF)
        streams = [engine.stream(p, max_tokens=400, speculative=i == 0) for i, p in enumerate(PROMPTS)]
        for stream in streams:
            assert next(stream).finish_reason is None  # both mid-answer
        server.kill()
        killed = time.monotonic()
        for stream in streams:  # every sequence's request ends with the same error, naming the server
            with pytest.raises(RemoteDeviceError, match=f"RPC server at {server.endpoint} went away"):
                for _ in stream:
                    pass
        assert time.monotonic() - killed < FAULT_DEADLINE_S
        engine.close()
        assert live_handles() == handles
        with pytest.raises(RemoteDeviceError, match=f"{server.endpoint} is not reachable"):
            _open("tiny", rpc=[server.endpoint], n_gpu_layers=TINY_HALF)
        server.start()  # the same port again
        with _open("tiny", parallel=1, rpc=[server.endpoint], rpc_cpu=True, n_gpu_layers=TINY_HALF) as again:
            assert again.generate(PROMPTS[0], max_tokens=MAX_TOKENS, speculative=False).tokens == expected
    finally:
        server.kill()
    assert live_handles() == handles


def test_the_space_reports_a_lost_server_without_its_address_and_loads_again_once_it_is_back() -> None:
    server = LoopbackServer(threads=1).start()
    env = {"DFLASH_N_CTX": str(N_CTX), "DFLASH_RPC": server.endpoint, "DFLASH_GPU_LAYERS": str(TINY_HALF)}
    parallel, parallel_fit = parallel_from_env({"DFLASH_PARALLEL": "auto"}, zero_gpu=False)  # as the service does
    preset = replace(configured_preset(True, env, pair_paths), parallel=parallel, parallel_fit=parallel_fit)
    pair = _pair("tiny")  # the demo's preset and settings, the small pair's files (the host opens the job's files)
    request = build_request(preset=preset.name, presets=[preset.name], limits=Limits(), message="hello world",
                            max_tokens=MAX_TOKENS, draft_length=7)
    job = GpuJob(request, preset, ResolvedPair(pair.target, pair.draft))
    host = EngineHost(load_pair)
    try:
        first = whole_reply(host.run(job))
        assert first.finish_reason == "length", first.error
        placement = first.engine_info["placement"]
        assert [d["where"] for d in placement["devices"]] == ["local", "remote"] and "rpc" not in placement
        assert server.endpoint not in json.dumps(first.engine_info)
        assert host.parallel_plan is not None and "1 remote device" in host.parallel_plan.where  # auto counts it
        server.kill()
        for reason in ("went away", "is not reachable"):  # mid-use, then at the reload the failure asked for
            failed = whole_reply(host.run(job))
            assert failed.error_type == "RemoteDeviceError" and reason in (failed.error or "")
            assert server.endpoint not in (failed.error or "") and "<DFLASH_RPC>" in (failed.error or "")
        server.start()
        again = whole_reply(host.run(job))
        assert again.delta == first.delta and again.worker["loaded_now"]
    finally:
        host.close()
        server.kill()


def test_the_server_command_is_the_wheels_binary_with_its_rpc_backend() -> None:
    argv, env = server_command("127.0.0.1", 50052, threads=2)
    assert argv[0].endswith("llama_cpp/lib/ggml-rpc-server") and argv[1:] == ["--host", "127.0.0.1", "--port",
                                                                             "50052", "--threads", "2"]
    assert env["GGML_BACKEND_PATH"].endswith("llama_cpp/lib/rpc/libggml-rpc.so")


def test_bad_endpoints_and_splits_are_refused_before_anything_loads(server: LoopbackServer) -> None:
    for bad in (["nohost"], ["127.0.0.1:0"], "127.0.0.1:50052"):
        with pytest.raises(ValueError, match="host:port"):
            _open("tiny", rpc=bad, n_gpu_layers=TINY_HALF)
    with pytest.raises(ValueError, match="one weight"):
        _open("tiny", rpc=[server.endpoint], n_gpu_layers=TINY_HALF, tensor_split=[1.0, 2.0])


def test_the_recipe_moves_the_rpc_module_aside_and_builds_the_server_once(tmp_path) -> None:
    spec = importlib.util.spec_from_file_location("build_wheel_rpc", RECIPE)
    recipe = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = recipe  # its dataclasses look their module up
    spec.loader.exec_module(recipe)
    assert "-DGGML_RPC=ON" in recipe.BuildConfig("cpu", [], "", []).cmake_args()
    lines = "    llama_cpp_python_install_target(ggml-musa)\n" + recipe.RPC_CMAKE_ANCHOR + "    # rest\n"
    (tmp_path / "CMakeLists.txt").write_text(lines)
    for _ in range(2):  # a resumed build patches the same tree again
        recipe.patch_rpc_server(tmp_path)
        patched = (tmp_path / "CMakeLists.txt").read_text()
        assert patched == lines.replace(recipe.RPC_CMAKE_ANCHOR, recipe.RPC_CMAKE_HOOK)
    assert "lib/rpc" in patched and "add_subdirectory(vendor/llama.cpp/tools/rpc)" in patched
    (tmp_path / "CMakeLists.txt").write_text("project(other)\n")
    with pytest.raises(recipe.RecipeError, match="the patch cannot apply"):
        recipe.patch_rpc_server(tmp_path)
