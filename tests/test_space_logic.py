"""The Space's logic without a server: run mode and the build check, request checks, fitting, GPU time, the views,
the session, and what may cross the ZeroGPU process line. Fitting runs against a real engine's tokenizer too."""

from __future__ import annotations

import os
import pickle
import random
import statistics
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import gradio as gr
import pytest
from app_fixtures import REPO_ROOT
from space_client import reference_engine, summary_contradiction

from dflash_runtime.errors import PromptTooLongError, RequestError
from dflash_runtime.results.stats import Stats
from dflash_runtime.space.gpu.fitting import fit_conversation, prompt_tokens
from dflash_runtime.space.gpu_job import GpuJob, ReplyChunk, resumed_stats
from dflash_runtime.space.page.endpoints import AB_MOST, ab_picked
from dflash_runtime.space.page.panel import speed_badge, stats_summary, too_wide
from dflash_runtime.space.page.panel import stats_details as panel
from dflash_runtime.space.page.session import ChatSession
from dflash_runtime.space.page.speedup import Estimate, LiveSpeedUp, Pending
from dflash_runtime.space.page.views import (
    ab_markdown,
    acceptance_rows,
    comparison_markdown,
    info_markdown,
    mode_banner,
    sharing_note,
    speed_up_rows,
    texts_side_by_side,
)
from dflash_runtime.space.requests import (
    ChatRequest,
    Limits,
    build_request,
    check_history,
    newest_turns,
    strip_thinking,
    thinking_prefix,
    turn_starts,
)
from dflash_runtime.space.scrub import scrub_paths
from dflash_runtime.space.setup.presets import AUTO_PARALLEL, ResolvedPair, parallel_from_env, preset_from_env
from dflash_runtime.space.setup.runmode import (
    FIX_COMMAND,
    RunMode,
    choose_run_mode,
    cuda_device_present,
    gpu_build_problems,
    settle_run_mode,
)
from dflash_runtime.space.setup.settings import PublicSettings
from dflash_runtime.space.web.gpu_time import GpuTimeEstimator, Votes

LIMITS = Limits(max_new_tokens=4096, max_input_chars=32000, max_history_messages=256, draft_capacity=7)
Message = dict[str, str]
# The deprecated draft_max (0 meant "auto") is still checked, and says it is deprecated.
OLD_DRAFT = "draft_max must be an integer in 0..7 (0 = adaptive; deprecated: use draft_length)"


def make_request(limits: Limits = LIMITS, **fields: Any) -> ChatRequest:
    values: dict[str, Any] = {"preset": "p", "presets": ["p"], "limits": limits, "message": "hi", "max_tokens": 64}
    values.update(fields)
    return build_request(**values)


# -- run mode --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("env", "overrides", "has_cuda", "tiny"),
    [
        ({}, [], False, True),
        ({}, [], True, False),
        ({"SPACES_ZERO_GPU": "true"}, [], False, False),
        ({}, ["DFLASH_TARGET_REPO"], False, False),
        ({"DFLASH_DEMO": "tiny"}, ["DFLASH_TARGET_REPO"], True, True),
        ({"DFLASH_DEMO": "off"}, [], False, False),
    ],
)
def test_run_mode_never_downloads_by_surprise(
    env: dict[str, str], overrides: list[str], has_cuda: bool, tiny: bool
) -> None:
    mode = choose_run_mode(env, overrides, has_cuda)
    assert mode.tiny is tiny and mode.reason
    assert ("random-weight" in mode_banner(mode)) is tiny


def test_unknown_demo_value_is_refused() -> None:
    with pytest.raises(ValueError, match="DFLASH_DEMO"):
        choose_run_mode({"DFLASH_DEMO": "maybe"}, [], False)


CPU_BUILD = {"cuda_build": False, "problems": []}
BLACKWELL_BUILD = {"cuda_build": True, "wheel_architectures": ["120a-real"], "compiled_architectures": ["sm_120a"]}
HOPPER_BUILD = {"cuda_build": True, "wheel_architectures": ["90-real"], "compiled_architectures": None}


@pytest.mark.parametrize(
    ("build", "zero_gpu", "devices", "problem"),
    [
        (CPU_BUILD, True, [], "CPU-only build"),
        (CPU_BUILD, False, [], "CPU-only build"),
        (BLACKWELL_BUILD, True, [], None),
        (HOPPER_BUILD, True, [], "CUDA code for 90-real only, which does not run on this GPU (compute 12.0)"),
        (HOPPER_BUILD, False, [[9, 0]], None),
        (HOPPER_BUILD, False, [[8, 6]], "does not run on this GPU (compute 8.6)"),
        ({"import_error": "OSError: libcuda.so.1: cannot open"}, True, [], "does not load: OSError"),
        ({**BLACKWELL_BUILD, "problems": ["CUDA runtime libraries not found: pip install x"]}, True, [], "not found"),
    ],
)
def test_the_build_check_names_what_keeps_the_gpu_unused(
    build: dict[str, Any], zero_gpu: bool, devices: list[list[int]], problem: str | None
) -> None:
    facts = {**build, "cuda_devices": [{"index": i, "compute_capability": cc} for i, cc in enumerate(devices)]}
    problems = gpu_build_problems(facts, zero_gpu)
    if problem is None:
        assert problems == []
    else:
        assert len(problems) == 1 and problem in problems[0]


def test_an_unusable_gpu_build_serves_the_offline_demo_with_the_fix() -> None:
    real = RunMode(False, "running on ZeroGPU")
    settled = settle_run_mode(real, CPU_BUILD, zero_gpu=True, has_cuda=False, n_gpu_layers=-1)
    assert settled.tiny and "cannot use the GPU on ZeroGPU" in settled.reason
    assert settled.fix and FIX_COMMAND in settled.fix and "requirements.txt" in settled.fix
    banner = mode_banner(settled)
    assert "CPU-only build" in banner and FIX_COMMAND in banner and "offline demo" in banner
    # A usable build, no GPU expected, or layers kept on the CPU on purpose: the configured pair stays.
    assert settle_run_mode(real, BLACKWELL_BUILD, zero_gpu=True, has_cuda=False, n_gpu_layers=-1) == real
    assert settle_run_mode(real, CPU_BUILD, zero_gpu=False, has_cuda=False, n_gpu_layers=-1) == real
    assert settle_run_mode(real, CPU_BUILD, zero_gpu=False, has_cuda=True, n_gpu_layers=0) == real
    demo = RunMode(True, "DFLASH_DEMO=tiny")
    assert settle_run_mode(demo, CPU_BUILD, zero_gpu=True, has_cuda=True, n_gpu_layers=-1) == demo


# -- request checks ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("max_tokens", "abc", "max_tokens must be an integer in 1..4096, got 'abc'"),
        ("max_tokens", 1.5, "max_tokens must be an integer in 1..4096, got 1.5"),
        ("max_tokens", 64.0, "max_tokens must be an integer in 1..4096, got 64.0"),
        ("max_tokens", float("nan"), "max_tokens must be an integer in 1..4096, got nan"),
        ("max_tokens", True, "max_tokens must be an integer in 1..4096, got True"),
        ("draft_max", "auto", f"{OLD_DRAFT}, got 'auto'"),
        ("draft_max", float("inf"), f"{OLD_DRAFT}, got inf"),
        ("draft_length", 8, "draft_length must be 'auto' or an integer in 0..7 (0 = no draft), got 8"),
        ("draft_length", "3", "draft_length must be 'auto' or an integer in 0..7 (0 = no draft), got '3'"),
        ("draft_length", True, "draft_length must be 'auto' or an integer in 0..7 (0 = no draft), got True"),
        ("method", "eagle",
         "method must be one of 'auto', 'dflash', 'dflash-tree', 'dspark', 'mtp', 'eagle3', 'draft-simple', "
         "'ngram-mod', 'ngram-map-k', 'ngram-simple', 'ngram-map-k4v', 'ngram-cache', 'ngram-mod,dflash', got 'eagle'"),
        ("top_k", -1, "top_k must be an integer in 0..1000 (0 = off), got -1"),
        ("min_p", 1.0, "min_p must be a number in [0.0, 0.99], got 1.0"),
        ("temperature", float("nan"), "temperature must be a number in [0.0, 2.0], got nan"),
        ("temperature", "0.5", "temperature must be a number in [0.0, 2.0], got '0.5'"),
        ("top_p", float("inf"), "top_p must be a number in [0.01, 1.0], got inf"),
        ("speculative", "false", "speculative must be true or false (a boolean), got 'false'"),
        ("speculative", 0, "speculative must be true or false (a boolean), got 0"),
        ("enable_thinking", "no", "thinking must be true or false (a boolean), got 'no'"),
        ("message", "a\ud800b", "message contains an unpaired surrogate (U+D800) at character 1"),
        ("system_prompt", "\udfff", "system_prompt contains an unpaired surrogate (U+DFFF) at character 0"),
        ("history", [{"role": "user", "content": "ok\udc80"}], "history[0]['content'] contains an unpaired surrogate"),
        ("history", [{"role": "user", "content": 5}], "history[0]['content'] must be a string, got int"),
        ("message", 42, "message must be a string, got int"),
        ("preset", ["p"], "unknown preset ['p']"),
    ],
)
def test_every_field_is_checked_for_its_type_with_a_specific_message(field: str, value: Any, message: str) -> None:
    with pytest.raises(RequestError) as refused:
        make_request(**{field: value})
    assert message in str(refused.value)


def test_right_types_pass_and_keep_their_type() -> None:
    request = make_request(max_tokens=7, temperature=1, top_p=0.5, draft_length="auto", speculative=False,
                           enable_thinking=True, system_prompt=None)  # fmt: skip
    assert request.max_tokens == 7 and isinstance(request.temperature, float) and request.temperature == 1.0
    assert request.draft_length == "auto" and request.speculative is False and request.enable_thinking is True
    assert request.system_prompt == "" and make_request(draft_length=3).draft_length == 3 and not request.notes
    old = make_request(draft_max=0)  # the deprecated spelling: 0 meant "auto"
    assert old.draft_length == "auto" and "deprecated" in old.notes[0] and make_request(draft_max=3).draft_length == 3


def test_a_method_the_pair_does_not_run_is_refused_before_the_gpu() -> None:
    limits = Limits()
    ok = build_request(preset="p", presets=["p"], limits=limits, message="hi", method="mtp", methods=["dflash", "mtp"])
    assert ok.method == "mtp" and ok.generation_kwargs(True)["method"] == "mtp"
    auto = build_request(preset="p", presets=["p"], limits=limits, message="hi")
    assert auto.generation_kwargs(True)["method"] is None, "auto: the pair's default"
    with pytest.raises(RequestError, match="method 'mtp' is not available on this pair; it runs 'dflash'"):
        build_request(preset="p", presets=["p"], limits=limits, message="hi", method="mtp", methods=["dflash"])


def test_the_comparison_has_a_row_per_method_and_names_a_method_that_differs() -> None:
    plain = {**Stats(n_generated=9, decode_ms=300.0, speculative=False).to_dict(), "finish_reason": "length"}
    dflash = Stats(n_generated=9, decode_ms=100.0, draft_capacity=3, method="dflash")
    dflash.record_verify(3, 2, 3)
    mtp = Stats(n_generated=9, decode_ms=150.0, draft_capacity=3, method="mtp")
    mtp.record_verify(3, 1, 2)
    methods = {"DFlash 2": dflash.to_dict(), "MTP": mtp.to_dict()}
    summary = comparison_markdown(methods, plain, {"DFlash 2": True, "MTP": False})
    rows = [line.split(" | ")[0] for line in summary.splitlines() if line.startswith("| ") and "---" not in line]
    assert rows == ["| Method", "| Plain", "| DFlash 2", "| MTP"]
    assert "| 67% | 3.00 |" in summary and "| 33% | 2.00 |" in summary, "acceptance and mean accepted length"
    assert "**DFlash 2: 3.00× as fast as plain** (90.0 tok/s against plain's 30.0)" in summary
    assert "**MTP: 2.00× as fast as plain**" in summary and "÷" not in summary
    assert "MTP: **Texts identical: NO, and the difference was not explained**" in summary
    assert "DFlash 2:" not in summary.split("\n")[-1], "only the method that differs is named"
    fault = {"kind": "fault", "position": 3, "margin": 2.1, "bound": 1e-4, "text_a": " fox", "text_b": " dog"}
    explained = comparison_markdown(methods, plain, {"DFlash 2": True, "MTP": False}, divergences={"MTP": fault})
    assert "MTP: **Texts differ at token 3: fault (margin 2.1).**" in explained
    tie = {**fault, "kind": "near-tie", "margin": 3e-5}
    explained = comparison_markdown(methods, plain, {"DFlash 2": True, "MTP": False}, divergences={"MTP": tie})
    assert "**Texts differ at token 3: a near-tie (margin 3e-05, the kernels' rounding), not a fault.**" in explained
    assert summary.startswith("**A/B finished**")
    waiting = comparison_markdown({"DFlash 2": dflash.to_dict(), "MTP": None}, None, {})
    assert "| MTP | … | waiting | | |" in waiting and "as fast" not in waiting
    assert waiting.startswith("**A/B running: Plain** (1 of 3)")
    # Plain has finished, DFlash 2 too, MTP is still running: DFlash 2's sentence only, and no verdict yet.
    running = comparison_markdown({"DFlash 2": {**dflash.to_dict(), "finish_reason": "length"},
                                   "MTP": mtp.to_dict()}, plain, {"DFlash 2": True, "MTP": None})  # fmt: skip
    assert "DFlash 2: 3.00× as fast" in running and "MTP:" not in running and "identical" not in running
    assert running.startswith("**A/B running: MTP** (3 of 3, 9 tokens so far)")


def test_history_keeps_what_the_model_should_see() -> None:
    history = check_history(
        [
            {"role": "user", "content": "q1", "metadata": {"title": "ignored"}},
            {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nanswer one"},
            {"role": "user", "content": "q2"},
            {"role": "assistant", "content": "<think>\nstopped while thinking"},
        ]
    )
    assert history == [
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "answer one"},
        {"role": "user", "content": "q2"},
    ]
    assert strip_thinking("plain answer") == "plain answer"
    assert thinking_prefix("<|im_start|>assistant\n<think>\n") == "<think>\n"
    assert thinking_prefix("<|im_start|>assistant\n<think>\n\n</think>\n\n") == ""


def conversation(turns: int, user: str = "u", reply: str = "a") -> list[Message]:
    messages: list[Message] = []
    for turn in range(turns):
        messages += [{"role": "user", "content": f"{user}{turn}"}, {"role": "assistant", "content": f"{reply}{turn}"}]
    return messages


def test_a_huge_history_is_cut_to_its_newest_whole_turns_before_any_tokenization() -> None:
    history = conversation(10_000)
    assert sum(len(m["content"]) for m in history) < 32000 * 4
    request = make_request(history=history)
    assert len(request.history) == 256 and request.history[0] == {"role": "user", "content": "u9872"}
    assert request.history[-1] == {"role": "assistant", "content": "a9999"}
    assert request.dropped_turns == 10_000 - 128
    # The character limit, too: what is kept, with the message and system prompt, stays within it.
    limits = Limits(max_input_chars=100, max_history_messages=10_000)
    short = make_request(limits, history=conversation(50), message="m" * 10, system_prompt="s" * 10)
    assert len(short.history) == 26 and short.input_chars == 20 + 13 * 6  # one more turn would make 104
    assert short.history[0] == {"role": "user", "content": "u37"} and short.dropped_turns == 37


def test_newest_turns_never_split_a_turn() -> None:
    history = [{"role": "assistant", "content": "welcome"}, *conversation(3)]
    assert turn_starts(history) == [0, 1, 3, 5, 7]
    kept, dropped = newest_turns(history, max_messages=3, max_chars=10_000)
    assert kept == history[5:] and dropped == 3
    assert newest_turns(history, max_messages=100, max_chars=0) == ([], 4)


# -- fitting -----------------------------------------------------------------------------------------------------


def brute_force_cut(request: ChatRequest, count: Any, n_ctx: int) -> int | None:
    """The reference: try every cut from the oldest on (what fitting did before, quadratic)."""
    system = [{"role": "system", "content": request.system_prompt}] if request.system_prompt.strip() else []
    history = list(request.history)
    for cut, start in enumerate(turn_starts(history)):
        if count(system + history[start:] + [{"role": "user", "content": request.message}]) + min(
            request.max_tokens, n_ctx // 2
        ) <= n_ctx:
            return cut
    return None


def test_fitting_finds_the_exact_cut_with_a_few_renders_on_a_real_tokenizer() -> None:
    rng = random.Random(7)
    words = ["the", "quick", "brown", "fox", "0123456789", "paris", "hello world", "<|im_end|>", "é", "a" * 40]
    with reference_engine(n_ctx=1024) as engine:
        calls = 0

        def encode(messages: list[Message]) -> list[int]:
            nonlocal calls
            calls += 1
            return prompt_tokens(engine, messages, enable_thinking=False)

        for trial in range(40):
            history = [
                {"role": role, "content": " ".join(rng.choice(words) for _ in range(rng.randint(1, 60)))}
                for _ in range(rng.randint(0, 60))
                for role in ("user", "assistant")
            ]
            request = make_request(history=history, message="what now?", max_tokens=rng.choice([16, 128, 400]),
                                   system_prompt=rng.choice(["", "be brief."]))  # fmt: skip
            calls = 0
            expected = brute_force_cut(request, lambda m: len(prompt_tokens(engine, m, False)), 1024)
            if expected is None:
                with pytest.raises(PromptTooLongError):
                    fit_conversation(request, encode, 1024)
                continue
            fitted = fit_conversation(request, encode, 1024)
            assert fitted.dropped_turns == request.dropped_turns + expected, f"trial {trial}"
            assert fitted.tokens == prompt_tokens(engine, fitted.messages, False), "the tokens the engine reads"
            assert calls == fitted.renders <= 2 + 2 * len(history).bit_length(), f"trial {trial}: {calls} renders"


def test_oldest_whole_turns_go_first_and_the_system_prompt_stays() -> None:
    history = []
    for turn in range(3):
        history += [{"role": "user", "content": f"u{turn}" + "x" * 98}, {"role": "assistant", "content": "y" * 100}]
    request = make_request(message="m" * 50, history=history, system_prompt="s" * 20, max_tokens=100)

    def count_chars(messages: list[Message]) -> list[int]:  # one token per character
        return [0] * sum(len(m["content"]) for m in messages)

    fitted = fit_conversation(request, count_chars, n_ctx=500)
    assert fitted.dropped_turns == 2 and "2 oldest turns" in (fitted.notice or "")
    assert [m["content"][:2] for m in fitted.messages] == ["ss", "u2", "yy", "mm"]
    assert fitted.prompt_tokens == 270
    assert fit_conversation(request, count_chars, n_ctx=2000).dropped_turns == 0
    assert fit_conversation(request, count_chars, n_ctx=2000).notice is None
    with pytest.raises(PromptTooLongError, match="cannot hold it"):
        fit_conversation(make_request(message="m" * 1000), count_chars, n_ctx=500)


def test_turns_dropped_by_the_request_limits_count_in_the_notice() -> None:
    request = make_request(Limits(max_history_messages=4), history=conversation(5))
    fitted = fit_conversation(request, lambda messages: [0] * len(messages), n_ctx=1000)
    assert request.dropped_turns == 3 and fitted.dropped_turns == 3 and "3 oldest turns" in (fitted.notice or "")


# -- GPU time ----------------------------------------------------------------------------------------------------


def speeds(decode_tok_s: float, n_generated: int = 100) -> dict[str, Any]:
    return {"n_generated": n_generated, "decode_tok_s": decode_tok_s, "speculative": True}


def test_gpu_time_starts_conservative_and_learns_the_worker_speeds() -> None:
    settings = PublicSettings(gpu_seconds_max=240, gpu_seconds_base=5, gpu_load_s=30, gpu_decode_tok_s=20,
                              gpu_prefill_tok_s=500, estimate_voters=1)  # one voter: the arithmetic alone
    estimator = GpuTimeEstimator(settings)
    request = make_request(max_tokens=512)
    first = estimator.estimate(request, (True,))
    assert first.includes_load and first.seconds == 5 + 30 + 32 + 1  # 512 tokens at 80 % of 20 tok/s; rounded up
    assert estimator.estimate(request, (True, False)).seconds == first.seconds + 32
    # A real pair's measurements: a default request (512 tokens) then asks for well under a minute.
    estimator.observe_load(18.0)
    estimator.engine_seen(loaded=True)
    estimator.observe({"n_generated": 512, "decode_tok_s": 60.0, "speculative": True, "n_prefilled": 300,
                       "prefill_ms": 150.0, "n_prompt": 300}, request, dropped_here=0, source="a")  # fmt: skip
    warm = estimator.estimate(request, (True,))
    assert not warm.includes_load and warm.seconds == 5 + 11 and warm.seconds * 1.5 <= 60  # 512 at 80 % of 60
    assert estimator.estimate(make_request(max_tokens=512, speculative=False), (False,)).seconds == first.seconds - 30
    # The figure is the median of the recent answers.
    estimator.observe(speeds(30.0), request, dropped_here=0, source="b")
    estimator.observe(speeds(100.0), request, dropped_here=0, source="c")
    assert estimator.describe()["decode_tok_s"]["speculative"] == 60.0
    # A lost worker brings the (measured) load time back.
    estimator.engine_seen(loaded=False)  # the worker is gone
    assert estimator.estimate(request, (True,)).includes_load
    assert estimator.describe()["load_s"] == 18.0
    estimator.engine_seen(loaded=True)
    assert not estimator.estimate(request, (True,)).includes_load
    estimator.engine_seen(loaded=False)  # the worker closed its engine after a failure: the next request loads it
    assert estimator.estimate(request, (True,)).includes_load
    assert estimator.estimate(make_request(max_tokens=4096), (True, False)).seconds <= 240


def test_one_visitor_cannot_move_the_gpu_time_of_everybody_else() -> None:
    """Honest answers from a few sessions, then a hostile burst (slow decoding, dense tokens) from one session and
    a few more from others, fewer than the honest ones: the duration of an honest request stays within 25 % of what
    the honest answers alone gave."""
    estimator = GpuTimeEstimator(PublicSettings())
    estimator.engine_seen(loaded=True)
    honest = make_request(message="x" * 1000, max_tokens=512)
    for number, speed in enumerate([70.0, 75.0, 72.0, 68.0, 74.0]):
        stats = {**speeds(speed, 512), "n_prompt": 330, "n_prefilled": 330, "prefill_ms": 300.0}
        estimator.observe(stats, honest, dropped_here=0, source=f"honest-{number}")
    baseline = estimator.estimate(honest, (True,)).seconds
    hostile = make_request(message="字" * 1000, max_tokens=512, temperature=2.0)
    for _ in range(20):  # one session, as many times as it likes
        stats = {**speeds(14.9, 512), "n_prompt": 1960, "n_prefilled": 1960, "prefill_ms": 9000.0}
        estimator.observe(stats, hostile, dropped_here=0, source="hostile")
    for number in range(1):  # and another session
        stats = {**speeds(14.9, 512), "n_prompt": 1960, "n_prefilled": 1960, "prefill_ms": 9000.0}
        estimator.observe(stats, hostile, dropped_here=0, source=f"hostile-{number}")
    after = estimator.estimate(honest, (True,)).seconds
    assert abs(after - baseline) <= 0.25 * baseline, (baseline, after, estimator.describe())
    assert estimator.describe()["answers_counted"]["decode_speculative"] == 5 + 3 + 1, "3 per session at most"


def test_short_answers_teach_nothing_about_speed() -> None:
    estimator = GpuTimeEstimator(PublicSettings(estimate_voters=1))
    estimator.observe({"n_generated": 3, "decode_tok_s": 1.0, "speculative": True}, make_request(), dropped_here=0,
                      source="a")  # fmt: skip
    assert estimator.describe()["decode_tok_s"]["speculative"] == PublicSettings().gpu_decode_tok_s


def test_no_figure_moves_with_one_clients_calls() -> None:
    """Each figure /info shows (characters per token, speeds, answers counted) stays at its default until three
    distinct clients voted: one visitor's dense CJK message, however often sent, tells nothing of it."""
    estimator = GpuTimeEstimator(PublicSettings())
    before = estimator.describe()
    cjk = make_request(message="速度词语测试漢字鍵盤" * 60, max_tokens=512)
    stats = {**speeds(14.9, 512), "n_prompt": 1200, "n_prefilled": 1200, "prefill_ms": 900.0}
    for _ in range(5):
        estimator.observe(stats, cjk, dropped_here=0, source="one visitor")
    estimator.observe(stats, cjk, dropped_here=0, source="another")
    assert estimator.describe() == before, "two clients: nothing moved"
    estimator.observe(stats, cjk, dropped_here=0, source="a third")
    after = estimator.describe()
    assert after["chars_per_token"] < before["chars_per_token"] and after["answers_counted"]["chars_per_token"] == 5


# -- session, views, process line -----------------------------------------------------------------------------


class FakeJob:
    def __init__(self) -> None:
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


def test_clear_cancels_the_reply_and_no_late_update_brings_the_conversation_back() -> None:
    session = ChatSession()
    epoch, shown = session.start_turn("hello")
    assert shown == [{"role": "user", "content": "hello"}, {"role": "assistant", "content": ""}]
    job = FakeJob()
    session.attach(job)
    assert session.show_reply(epoch, "partial")[-1]["content"] == "partial"  # type: ignore[index]
    session.clear()
    assert job.cancelled and session.messages == []
    assert session.show_reply(epoch, "partial and more") is None and session.messages == []
    assert session.undo_turn(epoch) is None
    epoch2, _ = session.start_turn("again")
    assert session.undo_turn(epoch2) == [] and session.last_prompt() is None
    import copy

    assert copy.deepcopy(session).messages == [], "a new tab starts empty"


def test_statistics_panel_plot_rows_and_ab_summary() -> None:
    stats = Stats(n_prompt=10, n_reused=4, n_prefilled=6, n_generated=9, decode_ms=100.0, draft_capacity=3,
                  method="dflash")  # fmt: skip
    stats.record_verify(3, 2, 3)
    stats.record_verify(3, 0, 1)
    api = {**stats.to_dict(), "finish_reason": "length", "finish_detail": "max_tokens=9 reached",
           "gpu_seconds_requested": 46, "gpu_seconds_used": 12.34}  # fmt: skip
    text = panel(api)
    assert "90.0 tok/s" in text and "| 33% (2 of 6 drafted) |" in text
    assert "| 10 tokens = 4 reused + 6 read now |" in text and "length (max_tokens=9 reached)" in text
    assert "| 46 s / 12.3 s |" in text and "GPU time requested / used" in text
    assert "| 12.3 s |" in panel({**api, "gpu_seconds_requested": None})
    assert "| 2.00 = 1.00 accepted + 1 of the target's |" in text, "tokens per verify step, as the sum it is"
    summary = stats_summary(api)
    assert "**22 %** of these 9 tokens came from the draft, checked and kept by the main model; **90.0 tok/s**" \
        in summary  # fmt: skip
    assert "Finished: length (max_tokens=9 reached)." in summary
    assert acceptance_rows(stats.to_dict()) == [
        {"position": "1", "acceptance": 0.5},
        {"position": "2", "acceptance": 0.5},
        {"position": "3", "acceptance": 0.0},
    ]
    plain = {**Stats(n_generated=9, decode_ms=300.0, speculative=False).to_dict(), "finish_reason": "length"}
    summary = ab_markdown(stats.to_dict(), plain, identical=True)
    assert "3.00× as fast as plain" in summary and "Texts identical: yes" in summary
    assert "waiting" in ab_markdown(stats.to_dict(), None, None)
    # No gain is claimed where the draft did nothing, or where the difference is noise.
    rejected = {**stats.to_dict(), "accepted": 0, "decode_tok_s": 34.5}
    plain_30 = {**plain, "decode_tok_s": 30.0}
    assert "DFlash 2: no speed-up.** The target kept none" in ab_markdown(rejected, plain_30, identical=True)
    assert "1.15×" in ab_markdown(rejected, plain_30, True) and "noise" in ab_markdown(rejected, plain_30, True)
    close = {**stats.to_dict(), "decode_tok_s": 31.5}
    assert "no measurable speed-up** (1.05×" in ab_markdown(close, plain_30, identical=True)
    slow = {**stats.to_dict(), "decode_tok_s": 15.0}
    assert "**DFlash 2: slower than plain here, 0.50×**" in ab_markdown(slow, plain_30, identical=True)
    # Speed before the first decode step is not a number: the first token is the prefill's own sample.
    assert "… (DFlash 2 speculative: after a step)" in panel({**api, "decode_tok_s": None})
    assert "; speed after the first step," in stats_summary({**api, "decode_tok_s": None})


def snapshots(steps: str, plain_ms: tuple[float, ...], verify_ms: tuple[float, ...] = (20.0,),
              accepted_per_verify: int = 3) -> list[dict[str, object]]:  # fmt: skip
    """An answer's statistics after each of its steps ("v": a verify step, "p": a plain one, "m": both between two
    snapshots), plain and verify steps taking the `plain_ms` and `verify_ms` times in turn."""
    out, plain, verify, accepted, elapsed, n = [], 0, 0, 0, 0.0, 1
    for kind in steps:
        if kind in "pm":
            plain, n, elapsed = plain + 1, n + 1, elapsed + plain_ms[plain % len(plain_ms)]
        if kind in "vm":
            verify, accepted = verify + 1, accepted + accepted_per_verify
            n, elapsed = n + accepted_per_verify + 1, elapsed + verify_ms[(verify - 1) % len(verify_ms)]
        out.append({"plain_steps": plain, "verify_steps": verify, "decode_ms": elapsed, "n_generated": n,
                    "accepted": accepted, "drafted": verify * 4, "decode_tok_s": (n - 1) / (elapsed / 1000),
                    "draft_length": "auto", "speculative": True, "method": "dflash"})  # fmt: skip
    return out


def test_the_live_speed_up_rests_on_timed_plain_steps_and_says_its_uncertainty() -> None:
    """Plain steps of 9 and 11 ms in turn (10 ms: 100 tok/s plain), one after every two verify steps that write 4
    tokens in 20 ms: the estimate is the answer's speed over 100 tok/s, shown from the first snapshot with 32 tokens, a
    timed plain step and 8 verify steps timed alone; with 8 timed plain steps or more its margin is twice the standard
    error of the difference between their mean and that of a plain answer as long (one step a token), from their own
    spread, and of the offset plain steps taken alone among verify steps share (6 %, for the share of them that came
    alone); an interval that mixes a verify step with a plain one is not timed."""
    steps = "vvp" * 12 + "m" * 5
    live = LiveSpeedUp()
    shown = []
    for stats in snapshots(steps, (9.0, 11.0)):
        live.add(stats)
        shown.append(live.current(stats))
    first = next(i for i, e in enumerate(shown) if isinstance(e, Estimate))
    tokens = [int(s["n_generated"]) for s in snapshots(steps, (9.0, 11.0))]  # type: ignore[call-overload]
    # The first snapshot has no earlier one to time its step against.
    ready = next(
        i for i, n in enumerate(tokens) if n >= 32 and "p" in steps[1 : i + 1] and steps[1 : i + 1].count("v") >= 8
    )
    assert first == ready, "shown from 32 tokens on, once a plain step and 8 verify steps are timed"
    assert isinstance(shown[0], Pending) and "one-token step" in shown[0].reason
    assert isinstance(shown[first], Estimate) and shown[first].plain_steps < 8, "before 8 plain steps are timed"
    final, stats = shown[-1], snapshots(steps, (9.0, 11.0))[-1]
    assert isinstance(final, Estimate) and final.plain_steps == 12, "the 5 mixed intervals are not timed"
    assert final.plain_speed == pytest.approx(100.0)
    assert final.ratio == pytest.approx(stats["decode_tok_s"] * 10.0 / 1000.0)  # type: ignore[operator]
    # The sample standard deviation of 9, 11, 9, ... ms (12 steps), relative to 10 ms, and the plain answer's steps.
    spread = (12 / 11) ** 0.5 / 10.0
    n = int(stats["n_generated"])  # type: ignore[call-overload]
    # Each plain step came alone, right after a verify step: their common offset from a plain answer's steps (6 %)
    # does not average away.
    assert final.margin == pytest.approx(final.ratio * 2 * (spread**2 * (1 / 12 + 1 / n) + 0.06**2) ** 0.5)
    summary, details = stats_summary(stats, final), panel(stats, final)
    # The 5 mixed intervals' plain steps count in the table's 17, not in the 12 timed: the details say both; the
    # summary says the estimate and its range in words (narrow enough here to be the figure).
    assert stats["plain_steps"] == 17 and "| **Plain steps**" in details and "| 17 |" in details
    assert not too_wide(final) and final.ratio - final.margin > 1.05
    digits = 2 if final.margin < 0.1 else 1  # the figures the uncertainty leaves meaningful
    low, high = f"{final.ratio - final.margin:.{digits}f}", f"{final.ratio + final.margin:.{digits}f}"
    assert f"**about {final.ratio:.{digits}f}× as fast** as the main model alone (estimate: {low}–{high}×)" in summary
    assert "±" not in summary and "plain step" not in summary, "no term a newcomer cannot read"
    assert (f"≈ {final.ratio:.2f}× ({low}–{high}×, about 95 %): {final.speed:.1f} against 100.0 tok/s, timed over 12 "
            "of its 17 plain steps") in details  # fmt: skip
    every = panel({**stats, "plain_steps": 12}, final)
    assert "timed over its 12 plain steps" in every, "all of them timed: said as one count"
    assert "same engine, same load" in details, "what it compares, also when answers share the engine"
    # The same twelve plain steps in one run after the verify steps: only the first came alone.
    run = LiveSpeedUp()
    for stats in snapshots("v" * 24 + "p" * 12, (9.0, 11.0)):
        run.add(stats)
    together = run.current(stats)
    assert isinstance(together, Estimate) and together.plain_steps == 12
    n = int(stats["n_generated"])  # type: ignore[call-overload]
    sampled = spread**2 * (1 / 12 + 1 / n)
    assert together.margin == pytest.approx(together.ratio * 2 * (sampled + (0.06 / 12) ** 2) ** 0.5)
    # A fixed draft length drafts at every step: no plain step, no estimate, and it says why.
    fixed = LiveSpeedUp()
    for stats in snapshots("v" * 20, (10.0,)):
        fixed.add({**stats, "draft_length": 3})
    pending = fixed.current({**stats, "draft_length": 3})
    assert isinstance(pending, Pending) and "fixed draft length" in pending.reason
    assert "not estimated (a fixed draft length takes no one-token step" in stats_summary(stats, pending)


def plain_at(steps: tuple[int, ...], verify: int) -> str:
    """Steps for `snapshots`: plain ones at these step numbers, `verify` verify steps around them."""
    return "".join("p" if step in steps else "v" for step in range(verify + len(steps)))


def jittered(levels: list[float]) -> tuple[float, ...]:
    """Verify step times 10 % under and over their level in turn."""
    return tuple(level * (0.9 if k % 2 else 1.1) for k, level in enumerate(levels))


def verify_spread(verify_ms: tuple[float, ...]) -> float:
    """The spread the estimate borrows, by its rule: each verify step's time against the median (one row count here),
    from the median absolute deviation."""
    deviations = [ms / statistics.median(verify_ms) - 1 for ms in verify_ms]
    centre = statistics.median(deviations)
    return 1.4826 * statistics.median(abs(d - centre) for d in deviations)


def test_the_live_speed_up_shows_on_one_plain_step_with_the_spread_of_the_verify_steps() -> None:
    """Verify steps of 20 ms, 10 % under or over in turn, and one plain step of 10 ms after them: the estimate shows
    from 32 tokens on, on that one plain step (100 tok/s). Its margin is twice the standard error of a mean of one step
    against a plain answer's n, with the spread of the verify steps around their median, and the offset a plain step
    taken alone among verify steps may have from a plain answer's (6 %): wide, as a figure on one step must be."""
    verify_ms = jittered([20.0] * 24)
    live = LiveSpeedUp()
    for stats in snapshots(plain_at((6,), len(verify_ms)), (10.0,), verify_ms):
        live.add(stats)
        estimate = live.current(stats)
        if int(stats["n_generated"]) < 32:  # type: ignore[call-overload]
            assert isinstance(estimate, Pending), (stats, estimate)
    assert isinstance(estimate, Estimate) and estimate.plain_steps == 1
    assert estimate.plain_speed == pytest.approx(100.0)
    n = int(stats["n_generated"])  # type: ignore[call-overload]
    sampled = verify_spread(verify_ms[1:]) ** 2 * (1 + 1 / n)  # the first step has no snapshot before it to time it
    assert estimate.margin == pytest.approx(estimate.ratio * 2 * (sampled + 0.06**2) ** 0.5)


def test_a_stalled_plain_step_does_not_count_as_the_answers_plain_cost() -> None:
    """Verify steps of 20 ms (10 % under or over in turn), plain steps of 10 ms, one of which stalled (30 ms). Of two
    timed plain steps the faster counts, raised by what the faster of two falls short of their centre (0.56 spreads);
    of three, the median: the stall moves neither. The margin says the two or three disagree (their own spread)."""
    verify_ms = jittered([20.0] * 60)
    spread = verify_spread(verify_ms[1:])
    for steps, expected in (((10.0, 30.0), 10.0 * (1 + 0.5642 * spread)),
                            ((10.0, 30.0, 10.0), 10.0)):  # fmt: skip
        live = LiveSpeedUp()
        for stats in snapshots(plain_at((6, 30, 50)[: len(steps)], len(verify_ms)), steps, verify_ms):
            live.add(stats)
        estimate = live.current(stats)
        assert isinstance(estimate, Estimate) and estimate.plain_steps == len(steps)
        assert 1000.0 / estimate.plain_speed == pytest.approx(expected)
        own = statistics.stdev(steps) / statistics.mean(steps)
        n = int(stats["n_generated"])  # type: ignore[call-overload]
        sampled = own**2 * (1 / len(steps) + 1 / n)
        assert estimate.margin == pytest.approx(estimate.ratio * 2 * (sampled + 0.06**2) ** 0.5)


def speculative_stats(n: int, accepted: int, finished: bool) -> dict[str, Any]:
    stats = {**Stats(n_generated=n, accepted=accepted, drafted=accepted + 20, decode_ms=1000.0, method="dflash",
                     draft_length="auto").to_dict()}  # fmt: skip
    return {**stats, "finish_reason": "stopped", "finish_detail": "by you"} if finished else stats


@pytest.mark.parametrize("done", [False, True])
def test_the_summary_says_in_words_where_its_estimate_is_too_wide_and_never_contradicts_itself(done: bool) -> None:
    """Every share the draft may have written, against every speed-up estimate, narrow or wide, below, about and
    above 1×: no summary contradicts itself (tests/space_client.py: a figure only with a range narrow enough to be
    it; most of the answer from the draft beside about 1× only with why); a range that holds 1 and is too wide says
    "too early to tell" (the answer ended: "too uncertain to tell"), never a figure; no "±", no "plain steps". The
    case seen after a Stop: 75 of 113 tokens from the draft, 1.0× ± 1.0."""
    verdict = "too uncertain to tell" if done else "too early to tell"
    for accepted in (0, 10, 57, 75, 110):
        for ratio in (0.6, 0.97, 1.0, 1.02, 1.3, 2.0):
            for relative in (0.02, 0.1, 0.2, 0.3, 1.0):
                estimate = Estimate(ratio, ratio * relative, 50.0, 50.0 / ratio, 3)
                summary = stats_summary(speculative_stats(113, accepted, done), estimate)
                assert summary_contradiction(summary) is None, (summary_contradiction(summary), summary)
                assert "±" not in summary and "plain step" not in summary, summary
                if too_wide(estimate) and ratio * (1 - relative) <= 1.05 and ratio * (1 + relative) >= 0.95:
                    assert f"**{verdict}**" in summary and "× as fast**" not in summary, summary
    seen = stats_summary(speculative_stats(113, 75, True), Estimate(1.0, 1.0, 40.0, 40.0, 2))
    assert "**66 %** of these 113 tokens came from the draft" in seen and "**too uncertain to tell**" in seen
    assert summary_contradiction("**66 %** of these 113 tokens came from the draft; **about 1.0× as fast** as the "
                                 "main model alone (estimate: 0.1–1.9×)") is not None, "the check finds the old case"
    badge = speed_badge(speculative_stats(113, 75, True), Estimate(1.0, 1.0, 40.0, 40.0, 2))
    assert badge == "DFlash 2 · 113 tok/s · 66 % from the draft · speed-up uncertain", badge
    assert "≈ 1.30× as fast (1.26–1.34×)" in speed_badge(speculative_stats(113, 75, True),
                                                          Estimate(1.3, 0.04, 40.0, 30.0, 9))  # fmt: skip
    slower = Estimate(0.6, 0.3, 40.0, 66.0, 3)  # too wide for a figure, slower over its whole range
    assert "**slower**" in stats_summary(speculative_stats(113, 20, True), slower)
    assert speed_badge(speculative_stats(113, 20, True), slower).endswith("· slower (0.3–0.9×)")
    plain = {**Stats(n_generated=9, decode_ms=100.0, speculative=False).to_dict(), "finish_reason": "length"}
    assert speed_badge(plain) == "plain decoding · 90 tok/s"


def test_one_definition_of_the_mean_accepted_length() -> None:
    """Tokens per verify step, the target's own one included; 1.0 where nothing was verified (every token the
    target's own, one a step): the engine's statistics, the Space's resumed ones and the A/B table agree, so a method
    that drafted nothing reads 1.00 everywhere, never 0.00 in one place and 1.00 in another."""
    nothing = Stats(n_generated=9, decode_ms=100.0, method="ngram-mod")
    assert nothing.mean_accepted_length == 1.0 and nothing.to_dict()["mean_accepted_length"] == 1.0
    assert resumed_stats(nothing.to_dict(), nothing.to_dict())["mean_accepted_length"] == 1.0
    drafted = Stats(n_generated=9, decode_ms=100.0, method="dflash")
    drafted.record_verify(3, 2, 3)
    assert drafted.mean_accepted_length == 3.0
    assert resumed_stats(drafted.to_dict(), nothing.to_dict())["mean_accepted_length"] == 3.0
    plain = {**Stats(n_generated=9, decode_ms=300.0, speculative=False).to_dict(), "finish_reason": "length"}
    table = comparison_markdown({"ngram-mod": {**nothing.to_dict(), "finish_reason": "length"}}, plain,
                                {"ngram-mod": True})  # fmt: skip
    assert "| Plain | 9 | 30.0 | – | 1.00 |" in table and "| ngram-mod | 9 | 90.0 | – | 1.00 |" in table
    assert "0.00" not in table


def test_retry_edit_and_undo_take_back_turns_and_start_from_the_turns_before() -> None:
    """The chat's retry, edit and undo as the session holds them: a turn taken back leaves no run, highlight or badge
    behind; a new turn after the first `keep` messages follows exactly those."""
    session = ChatSession()
    for message in ("one", "two", "three"):
        epoch, _ = session.start_turn(message)
        session.show_reply(epoch, f"answer to {message}", [(3, "draft"), (7 + len(message), "target")], done=True)
        session.end_reply(epoch, f"badge {message}")
    assert session.user_turn(-1) == ("three", 4) and session.user_turn(1) == ("two", 2)
    assert session.user_turn(3) is None and session.user_turn(-4) is None
    _, keep = session.user_turn(1)  # an edit of "two": the turns before it stay
    epoch, shown = session.start_turn("two, edited", keep=keep)
    assert [m["content"] for m in session.messages] == ["one", "answer to one", "two, edited", ""]
    assert set(session.sources) == {1, 3} and set(session.badges) == {1}, "nothing of the turns taken back"
    assert "badge one" in shown[1]["content"] and shown[3] == {"role": "assistant", "content": ""}
    session.show_reply(epoch, "new answer", [(10, "target")], done=True)
    message, keep = session.user_turn(-1)  # a retry: the same message after the same turns
    session.start_turn(message, keep=keep)
    assert [m["content"] for m in session.messages] == ["one", "answer to one", "two, edited", ""]
    assert session.take_back(0) == [] and session.messages == [] and not session.badges  # an undo of the first turn


def test_the_ab_chart_and_the_texts_side_by_side() -> None:
    plain = {**Stats(n_generated=9, decode_ms=300.0, speculative=False).to_dict(), "finish_reason": "length"}
    fast = {**Stats(n_generated=9, decode_ms=100.0, method="dflash").to_dict(), "finish_reason": "length"}
    running = Stats(n_generated=4, decode_ms=100.0, method="mtp").to_dict()
    assert speed_up_rows({"DFlash 2": fast, "MTP": running}, plain) == [
        {"method": "Plain", "speed-up": 1.0}, {"method": "DFlash 2", "speed-up": 3.0}]  # fmt: skip
    assert speed_up_rows({"DFlash 2": fast}, None) == [] and speed_up_rows({"MTP": running}, plain) == []
    html = texts_side_by_side({"Plain": "a <b> text", "DFlash 2": "a <b> text", "MTP": "a <b> test"})
    assert html.count('class="ab-text"') == 3 and 'class="ab-body">a &lt;b&gt; text</div>' in html, "escaped"
    assert "DFlash 2</b> · the same text" in html and "MTP</b> · differs from character 9" in html
    assert "a &lt;b&gt; te<mark>st</mark>" in html and texts_side_by_side({}) == ""


def test_the_ab_compares_the_registrys_few_unless_the_visitor_picks_up_to_four() -> None:
    runs = ["dflash", "mtp", "ngram-mod", "ngram-map-k", "ngram-simple", "ngram-map-k4v", "ngram-cache",
            "ngram-mod,dflash"]  # fmt: skip
    assert ab_picked(runs, None) == ["dflash", "mtp", "ngram-mod", "ngram-map-k"]  # the first AB_MOST compared
    assert ab_picked(runs[2:], []) == ["ngram-mod", "ngram-map-k", "ngram-mod,dflash"]
    assert ab_picked(runs, ["ngram-cache", "dflash", "ngram-cache"]) == ["dflash", "ngram-cache"], "the menu's order"
    with pytest.raises(RequestError, match="at most 4 methods"):
        ab_picked(runs, runs[:AB_MOST + 1])
    with pytest.raises(RequestError, match="cannot compare eagle3: the pair runs dflash, mtp"):
        ab_picked(runs, ["eagle3"])
    with pytest.raises(RequestError, match="must be a list of method names"):
        ab_picked(runs, [3])  # type: ignore[list-item]


def test_the_panel_counts_add_up_as_shown() -> None:
    """Tokens = the draft's accepted ones + the target's own (one after the prompt, one per verify step, one per
    plain step); tokens per verify step = accepted per step + the target's one; prompt = reused + read now."""
    stats = Stats(n_prompt=45, n_reused=33, n_prefilled=12, n_generated=12, decode_ms=200.0, draft_capacity=3,
                  method="dflash", draft_length="auto", draft_ms=15.0, verify_ms=130.0, plain_ms=60.0)  # fmt: skip
    stats.record_verify(3, 3, 4)
    stats.record_verify(3, 0, 1)
    stats.plain_steps = 6
    text = panel({**stats.to_dict(), "decode_tok_s": 55.0})
    assert "| 12 = 3 from the draft + 9 from the target (1 right after the prompt, 2 after verify steps, 6 from " \
           "plain steps) |" in text  # fmt: skip
    assert "| 2.50 = 1.50 accepted + 1 of the target's |" in text
    assert "| 45 tokens = 33 reused + 12 read now |" in text and "the shared system prompt" in text
    assert "| draft 15.0 ms · verify steps 70.0 ms · plain steps 60.0 ms |" in text
    assert "| 2 |" in text and "| 6 |" in text and "steps of the target that checked a draft" in text
    assert "across your requests in this conversation" in text, "the adaptive length's memory is said"
    plain = {**Stats(n_generated=5, decode_ms=50.0, verify_ms=40.0, plain_ms=40.0, speculative=False,
                     plain_steps=4).to_dict(), "decode_tok_s": 80.0}  # fmt: skip
    assert "vs plain" not in panel(plain) and "Acceptance" not in panel(plain)
    assert "Plain decoding, without a draft: **5 tokens**, one step of the main model each; **80.0 tok/s**." \
        in stats_summary(plain)  # fmt: skip


def test_server_paths_are_cut_to_file_names() -> None:
    assert scrub_paths("could not load /home/me/.cache/x/t.gguf: bad") == "could not load t.gguf: bad"
    assert scrub_paths("'/srv/models/d.gguf' has no chat template") == "'d.gguf' has no chat template"
    kept = "50 tok/s, 1/2, https://huggingface.co/org/repo/resolve/main/f.gguf"
    assert scrub_paths(kept) == kept


def test_info_box_names_the_pair_and_the_build() -> None:
    preset = preset_from_env({})
    text = info_markdown(preset, LIMITS, {"llama.cpp build": "llama-cpp-python 0.3.36 (/opt/x/lib)"},
                         {"target_arch": "qwen35"})  # fmt: skip
    assert "utautako/Qwen3.8-27B-NVFP4-MTP-Q8attn-GGUF" in text and "incoai/Qwen3.8-27B-DFlash2-GGUF" in text
    assert "target NVFP4, draft Q4_K_M" in text and "16384 tokens" in text and "0.3.36" in text
    assert "/opt/x" not in text


@pytest.mark.parametrize(
    ("value", "zero_gpu", "parallel", "fit"),
    [(None, False, AUTO_PARALLEL, True), ("auto", False, AUTO_PARALLEL, True), (" AUTO ", False, AUTO_PARALLEL, True),
     ("1", False, 1, False), ("3", False, 3, False), (None, True, 1, False), ("auto", True, 1, False),
     ("1", True, 1, False)],
)  # fmt: skip
def test_dflash_parallel_is_read_with_auto_one_on_zero_gpu(value: str | None, zero_gpu: bool, parallel: int,
                                                           fit: bool) -> None:
    """`auto` off ZeroGPU is a most (the engine opens as many as fit in memory); a number is what it says."""
    env = {} if value is None else {"DFLASH_PARALLEL": value}
    assert parallel_from_env(env, zero_gpu) == (parallel, fit)
    assert AUTO_PARALLEL > 1, "off ZeroGPU a few answers share the engine by default"


@pytest.mark.parametrize(
    ("value", "zero_gpu", "message"),
    [("0", False, "DFLASH_PARALLEL must be an integer >= 1 or 'auto', got 0"),
     ("-2", False, "DFLASH_PARALLEL must be an integer >= 1 or 'auto', got -2"),
     ("two", False, "DFLASH_PARALLEL must be an integer >= 1 or 'auto', got 'two'"),
     ("1.5", False, "DFLASH_PARALLEL must be an integer >= 1 or 'auto', got '1.5'"),
     ("2", True, "DFLASH_PARALLEL=2 cannot take effect on ZeroGPU: `spaces` runs each concurrent GPU call in a "
                 "worker process of its own")],
)  # fmt: skip
def test_a_bad_dflash_parallel_is_a_clear_error(value: str, zero_gpu: bool, message: str) -> None:
    with pytest.raises(ValueError) as refused:
        parallel_from_env({"DFLASH_PARALLEL": value}, zero_gpu)
    assert str(refused.value).startswith(message), refused.value


def test_the_page_says_how_many_answers_share_the_engine() -> None:
    assert "4 answers can run at once on this engine" in sharing_note(4)
    assert "One answer runs at a time on this engine" in sharing_note(1)
    assert "Up to 4 answers can run at once on this engine (as many as fit in memory" in sharing_note(4, True)
    preset = preset_from_env({})
    assert preset.parallel == 1 and preset.describe()["parallel"] == 1 and not preset.parallel_fit
    assert "Answers at once: 3 (DFLASH_PARALLEL)" in info_markdown(replace(preset, parallel=3), LIMITS, {}, None)
    auto = replace(preset, parallel=4, parallel_fit=True)
    assert "Answers at once: up to 4, as many as fit in memory when the engine loads" in info_markdown(
        auto, LIMITS, {}, None)
    sized = {"parallel": 2, "parallel_plan": "2 sequences fit in CUDA0 (...)"}
    assert "Answers at once: 2 (DFLASH_PARALLEL=auto: 2 sequences fit in CUDA0 (...))" in info_markdown(
        auto, LIMITS, {}, sized)


def test_everything_crossing_the_zero_gpu_process_line_pickles() -> None:
    request = make_request(history=[{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}])
    files = ResolvedPair(Path("/models/t.gguf"), Path("/models/d.gguf"))
    job = GpuJob(request, preset_from_env({}), files, ("speculative", "plain"), 42)
    chunk = ReplyChunk(delta="hi", stats=Stats().to_dict(), finish_reason="stop", notice="n", engine_info={"a": 1},
                       worker={"pid": 1}, error_type="RequestError", error="bad")  # fmt: skip
    for value in (request, job, chunk):
        assert pickle.loads(pickle.dumps(value)) == value
    assert job.speculative_phases() == (True, False)
    with pytest.raises(ValueError, match="phases"):
        GpuJob(request, preset_from_env({}), files, ("sideways",))
    error = pickle.loads(pickle.dumps(gr.Error("the message is empty", title="RequestError")))
    assert error.message == "the message is empty"


IMPORT_CHECK = """
import inspect, sys
sys.modules["spaces"] = None  # as if the package were not installed: the identity decorator stands in
import app
from dflash_runtime.space.gpu import zerogpu
maps = open("/proc/self/maps").read()
assert "libllama" not in maps and "libcuda" not in maps and "llama_cpp" not in sys.modules, "native code loaded"
assert inspect.isgeneratorfunction(zerogpu.run_on_gpu)
assert app.SERVICE.config.download.status().state == "idle", "importing must not start a download"
print(app.SERVICE.config.mode.tiny, app.SERVICE.config.preset.name)
"""


@pytest.mark.parametrize("demo", ["tiny", "off", None])
def test_importing_the_app_loads_no_native_code_and_needs_no_spaces(demo: str | None) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DFLASH_", "SPACES_"))}
    if demo is not None:
        env["DFLASH_DEMO"] = demo
    result = subprocess.run(
        [sys.executable, "-c", IMPORT_CHECK], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=180
    )
    assert result.returncode == 0, result.stderr[-3000:]
    # Unset, the app serves the real pair only where a GPU is: a bare `python app.py` on a laptop is the demo.
    tiny = demo == "tiny" or (demo is None and not cuda_device_present())
    expected = "True tiny-random" if tiny else "False qwen3.8-27b-dflash2"
    assert result.stdout.strip().splitlines()[-1] == expected


PAGE_LOAD_CHECK = """
import sys
sys.modules["spaces"] = None
import app
from dflash_runtime.space.page.endpoints import PageHandlers
handlers = PageHandlers(app.SERVICE)
print(repr(handlers.page_load()[-1]))  # the A/B's picker: the methods are those the page was built with
app.SERVICE.engine_info = {**app.SERVICE.engine_info, "methods": ["dflash2"]}  # a loaded engine runs fewer
print(repr(handlers.page_load()[-1]))
"""


def test_the_page_load_leaves_the_ab_picks_alone_unless_the_methods_changed() -> None:
    """A page's load event may come after its visitor changed the A/B's picks: it sends the picker only when the
    methods to pick from are not those the page was built with."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DFLASH_", "SPACES_"))}
    env["DFLASH_DEMO"] = "tiny"
    result = subprocess.run([sys.executable, "-c", PAGE_LOAD_CHECK], cwd=REPO_ROOT, env=env, capture_output=True,
                            text=True, timeout=180)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    unchanged, changed = result.stdout.strip().splitlines()[-2:]
    assert unchanged == repr(gr.skip()), unchanged
    assert changed.startswith("{'choices': [(") and "'dflash2')]" in changed, "the picker of the methods now run"


def test_the_api_parameters_are_declared_once() -> None:
    """/chat's and /generate's signatures and documented parameters follow API_PARAMETERS; an endpoint that differs
    is refused when the API is made."""
    from types import SimpleNamespace

    from dflash_runtime.space.page.endpoints import API_PARAMETERS, api_problems, documented_parameters, make_api

    service = SimpleNamespace(config=SimpleNamespace(preset=SimpleNamespace(name="p")), defaults={"max_tokens": 8})
    chat, generate, _, wait = make_api(service)
    assert documented_parameters(chat) == documented_parameters(generate) == API_PARAMETERS
    assert documented_parameters(wait) == ("until", "timeout_s")

    def shuffled(history: list[Any] | None = None, message: str = "", request: Any = None) -> None:
        """Two parameters, in another order than declared.

        Parameters:
            message: the message
            history: earlier turns
        """

    assert api_problems(shuffled, ("message", "history")) == [
        "shuffled's signature takes ('history', 'message'), not ('message', 'history')"]


def test_a_figure_does_not_follow_who_voted_last() -> None:
    """Four clients' votes: the figure is one of them, the lower middle one, whatever order they came in; a client
    voting again as it did moves nothing."""
    votes = Votes(1.0, PublicSettings())
    for source, value in zip("abcd", (2.0, 3.0, 4.0, 5.0), strict=True):
        votes.add(source, value, 50 * 4096)  # work enough for the pace to let it move anywhere
    assert votes.value == 3.0
    votes.add("a", 2.0, 50 * 4096)
    assert votes.value == 3.0
