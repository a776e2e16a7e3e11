"""The engine host: the engine of the process where generation runs (the GPU worker on ZeroGPU), built on first use,
one request at a time, streaming replies as plain data that crosses the ZeroGPU process line.

On ZeroGPU the worker is a fork of the web process, and `spaces` throws a worker away after *any* exception raised
in the GPU function (with it the loaded model). So `EngineHost.run` never raises the runtime's own errors: it ends the
stream with a chunk that carries the error, and the web process raises it there. A request error (bad input the web
process could not see, such as a prompt too long in tokens) leaves the engine as it is; an engine failure (a failed
decode) closes the engine, which the next request rebuilds in the same worker. Anything else (a bug, a CUDA fault)
does raise: then a fresh worker is the right cure. Every chunk says whether the engine is loaded, so the web process
knows when the next request must plan a load.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from ..errors import DecodeError, DFlashError, EngineClosedError, RequestError
from .fitting import FittedConversation, count_prompt_tokens, fit_conversation
from .presets import PairPreset, ResolvedPair
from .requests import ChatRequest, thinking_prefix

PHASES = {"chat": None, "speculative": True, "plain": False}  # None: the request's own `speculative`
# Errors after which the engine's state is not to be trusted: it is closed, and the next request loads it again.
# Any other runtime error (a bad request, a prompt too long, a busy engine) leaves it as it is.
ENGINE_FAILURES = (DecodeError, EngineClosedError)


@dataclass(frozen=True)
class GpuJob:
    """Everything the GPU function needs (plain data: it is pickled into the ZeroGPU worker)."""

    request: ChatRequest
    preset: PairPreset
    files: ResolvedPair
    phases: tuple[str, ...] = ("chat",)  # ("speculative", "plain") for an A/B comparison
    gpu_seconds: int = 60  # the duration asked of ZeroGPU, decided in the web process

    def __post_init__(self) -> None:
        unknown = [phase for phase in self.phases if phase not in PHASES]
        if unknown or not self.phases:
            raise ValueError(f"phases must be some of {list(PHASES)}, got {self.phases}")

    def speculative_phases(self) -> tuple[bool, ...]:
        return tuple(self.request.speculative if PHASES[p] is None else bool(PHASES[p]) for p in self.phases)


@dataclass
class ReplyChunk:
    """What a streaming reply sends after each engine step (plain data: it crosses the ZeroGPU process line)."""

    text: str
    stats: dict[str, Any]
    finish_reason: str | None = None
    finish_detail: str = ""
    notice: str | None = None
    phase: str = "chat"  # "chat", or "speculative" / "plain" during an A/B comparison
    engine_info: dict[str, Any] = field(default_factory=dict)
    worker: dict[str, Any] = field(default_factory=dict)  # pid, loads, load_s, loaded_now, engine_loaded, used_s, ...
    dropped_turns: int = 0
    error_type: str | None = None  # set on a final chunk that reports an error instead of raising it
    error: str | None = None
    # Who wrote the text this chunk adds: runs of (n_chars, "draft" | "target") covering exactly the new text (the
    # text is cumulative, the runs are not: a view appends them, nothing is repeated per token).
    source_runs: list[tuple[int, str]] = field(default_factory=list)


def _public_info(info: dict[str, Any]) -> dict[str, Any]:
    """The engine's description without the server's file-system paths (file names only)."""
    return {k: Path(v).name if k in ("target", "draft") and isinstance(v, str) else v for k, v in info.items()}


class EngineHost:
    """Owns this process's engine: built on first use, rebuilt when the preset or files change, one request at a
    time, with counters that tell a warm worker from a new one (`loads`, `requests`, the process id)."""

    def __init__(self, loader: Callable[..., Any], busy_timeout_s: float = 120.0) -> None:
        self._loader = loader
        self._busy_timeout_s = busy_timeout_s
        self._lock = threading.Lock()
        self._engine: Any = None
        self._key: tuple[Any, ...] | None = None
        self.loads = 0
        self.requests = 0
        self.last_load_s: float | None = None
        self.previous_request: dict[str, Any] = {}

    def close(self) -> None:
        with self._lock:
            self._close()

    def _close(self) -> None:
        if self._engine is not None:
            self._engine.close()
            self._engine, self._key = None, None

    def _ensure(self, preset: PairPreset, files: ResolvedPair) -> tuple[Any, bool]:
        """The engine for this preset and files, and whether it was loaded now. Call with the lock held."""
        key = (preset, files)
        if self._engine is not None and self._key == key:
            return self._engine, False
        self._close()
        started = time.monotonic()
        self._engine = self._loader(
            files.target_path,
            files.draft_path,
            n_ctx=preset.n_ctx,
            n_gpu_layers=preset.n_gpu_layers,
            draft_capacity=preset.draft_capacity,
        )
        self._key = key
        self.loads += 1
        self.last_load_s = round(time.monotonic() - started, 3)
        return self._engine, True

    def run(self, job: GpuJob) -> Iterator[ReplyChunk]:
        """Stream the job's phases; every runtime error ends the stream as an error chunk (see the module doc)."""
        started = time.monotonic()
        report: dict[str, Any] = {"pid": os.getpid(), "previous_request": dict(self.previous_request)}
        outcome: dict[str, Any] = {"finish_reason": "closed before the first token", "n_generated": 0}
        if not self._lock.acquire(timeout=self._busy_timeout_s):
            yield self._error_chunk(RequestError(f"the engine stayed busy for {self._busy_timeout_s:.0f} s; retry"))
            return
        try:
            self.requests += 1
            engine, loaded_now = self._ensure(job.preset, job.files)
            report.update(loaded_now=loaded_now, load_s=self.last_load_s if loaded_now else None)
            thinking = job.request.enable_thinking
            fitted = fit_conversation(job.request, partial(count_prompt_tokens, engine, enable_thinking=thinking),
                                      engine.n_ctx)  # fmt: skip
            info = _public_info(engine.info())
            for phase in job.phases:
                speculative = job.request.speculative if PHASES[phase] is None else bool(PHASES[phase])
                for chunk in self._stream(engine, job.request, fitted, speculative, phase):
                    outcome = {"finish_reason": chunk.finish_reason or "closed by the caller",
                               "n_generated": chunk.stats["n_generated"], "phase": phase}  # fmt: skip
                    chunk.engine_info = info
                    chunk.worker = self._report(report, started)
                    yield chunk
        except DFlashError as error:
            if isinstance(error, ENGINE_FAILURES):
                self._close()
            outcome = {"finish_reason": "error", "error_type": type(error).__name__, "n_generated": 0}
            chunk = self._error_chunk(error)
            chunk.worker = self._report(report, started)
            yield chunk
        finally:
            self.previous_request = outcome
            self._lock.release()

    def _report(self, report: dict[str, Any], started: float) -> dict[str, Any]:
        used_s = round(time.monotonic() - started, 3)
        loaded = self._engine is not None
        return {**report, "loads": self.loads, "requests": self.requests, "engine_loaded": loaded, "used_s": used_s}

    @staticmethod
    def _error_chunk(error: DFlashError) -> ReplyChunk:
        return ReplyChunk(text="", stats={}, finish_reason="error", error_type=type(error).__name__, error=str(error))

    @staticmethod
    def _stream(
        engine: Any, request: ChatRequest, fitted: FittedConversation, speculative: bool, phase: str
    ) -> Iterator[ReplyChunk]:
        thinking = request.enable_thinking
        prefix = thinking_prefix(engine.render_chat(fitted.messages, enable_thinking=thinking)) if thinking else ""
        text = prefix
        events = engine.stream_chat(
            fitted.messages, enable_thinking=thinking, **request.generation_kwargs(speculative=speculative)
        )
        runs: list[tuple[int, str]] = [(len(prefix), "target")] if prefix else []
        try:
            for event in events:
                text += event.delta
                yield ReplyChunk(
                    text=text,
                    stats=event.stats.to_dict(),
                    finish_reason=event.finish_reason,
                    finish_detail=event.finish_detail,
                    notice=fitted.notice,
                    phase=phase,
                    dropped_turns=fitted.dropped_turns,
                    source_runs=[*runs, *event.delta_sources],
                )
                runs = []
        finally:
            events.close()  # a closed reply stops the engine between two steps
