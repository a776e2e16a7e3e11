"""The engine host: this process's engine (the GPU worker's on ZeroGPU), built on first use, one request at a time,
streaming replies as plain data that crosses the ZeroGPU process line."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from ..errors import RequestError
from .fitting import fit_conversation
from .presets import PairPreset, ResolvedPair
from .requests import ChatRequest, Message, thinking_prefix


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


class EngineHost:
    """Owns this process's engine: built on first use, rebuilt when the preset or files change, one request at a
    time. On ZeroGPU each GPU worker is a fresh fork, so a new worker starts without an engine and builds one."""

    def __init__(self, loader: Callable[..., Any], busy_timeout_s: float = 120.0) -> None:
        self._loader = loader
        self._busy_timeout_s = busy_timeout_s
        self._lock = threading.Lock()
        self._engine: Any = None
        self._key: tuple[Any, ...] | None = None

    def close(self) -> None:
        if self._engine is not None:
            self._engine.close()
            self._engine, self._key = None, None

    def _ensure(self, preset: PairPreset, files: ResolvedPair) -> Any:
        key = (preset, files)
        if self._engine is None or self._key != key:
            self.close()
            self._engine = self._loader(
                files.target_path,
                files.draft_path,
                n_ctx=preset.n_ctx,
                n_gpu_layers=preset.n_gpu_layers,
                draft_max=preset.draft_max,
            )
            self._key = key
        return self._engine

    def _acquire(self) -> None:
        if not self._lock.acquire(timeout=self._busy_timeout_s):
            raise RequestError(f"the engine stayed busy for {self._busy_timeout_s:.0f} s; try again")

    def stream_reply(self, request: ChatRequest, preset: PairPreset, files: ResolvedPair) -> Iterator[ReplyChunk]:
        """Fit the conversation in the context and stream the answer, with live stats after every step."""
        self._acquire()
        try:
            engine = self._ensure(preset, files)
            yield from self._stream(engine, request, request.speculative, "chat")
        finally:
            self._lock.release()

    def stream_comparison(self, request: ChatRequest, preset: PairPreset, files: ResolvedPair) -> Iterator[ReplyChunk]:
        """The same request with speculative decoding, then with plain decoding (for the A/B view)."""
        self._acquire()
        try:
            engine = self._ensure(preset, files)
            yield from self._stream(engine, request, True, "speculative")
            yield from self._stream(engine, request, False, "plain")
        finally:
            self._lock.release()

    def _stream(self, engine: Any, request: ChatRequest, speculative: bool, phase: str) -> Iterator[ReplyChunk]:
        thinking = request.enable_thinking

        def count(messages: list[Message]) -> int:
            return len(engine.tokenize(engine.render_chat(messages, enable_thinking=thinking)))

        fitted = fit_conversation(request, count, engine.n_ctx)
        prefix = thinking_prefix(engine.render_chat(fitted.messages, enable_thinking=thinking)) if thinking else ""
        info = engine.info()
        text = prefix
        events = engine.stream_chat(
            fitted.messages, enable_thinking=thinking, **request.generation_kwargs(speculative=speculative)
        )
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
                    engine_info=info,
                )
        finally:
            events.close()
