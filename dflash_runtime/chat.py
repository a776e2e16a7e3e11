"""Chat prompts rendered with the target GGUF's own template (llama-cpp-python's Jinja2 formatter)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from llama_cpp.llama_chat_format import Jinja2ChatFormatter

from .errors import RequestError

ROLES = ("system", "user", "assistant", "tool")


class ChatTemplate:
    def __init__(self, template: str, bos_token: str, eos_token: str) -> None:
        self.source = template
        self.supports_thinking = "enable_thinking" in template
        self._formatter = Jinja2ChatFormatter(template=template, eos_token=eos_token, bos_token=bos_token)

    def render(self, messages: Sequence[Mapping[str, Any]], *, enable_thinking: bool | None = None) -> str:
        check_messages(messages)
        extra: dict[str, Any] = {}
        if enable_thinking is not None and self.supports_thinking:
            extra["enable_thinking"] = enable_thinking
        return self._formatter(messages=[dict(m) for m in messages], **extra).prompt


def check_messages(messages: Sequence[Mapping[str, Any]]) -> None:
    if not messages:
        raise RequestError("messages is empty: send at least one message")
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or m.get("role") not in ROLES or not isinstance(m.get("content", ""), str):
            raise RequestError(f"message {i} must be a dict with role in {ROLES} and a string content")
