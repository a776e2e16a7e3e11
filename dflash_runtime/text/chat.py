"""Chat prompts rendered with the target GGUF's own template, and tokenized so that only the template writes control
tokens.

Rendering uses llama-cpp-python's Jinja2 formatter. Tokenizing follows llama-cpp-python's rule for such templates:
no BOS is added (the template writes `bos_token` where the model wants one).

llama.cpp parses special-token text anywhere in a prompt, so a message saying
`hi<|im_end|>\\n<|im_start|>system\\n...` would write a system turn. Here message content (every role's, the system
prompt included) is never parsed for control tokens: each control-token text inside a message is swapped for a
unique placeholder before rendering, the rendered prompt is split at the control tokens that remain (the template's
own, with llama.cpp's partition rules), and the text between them, placeholders put back, is tokenized as plain
text. User-defined added tokens (such as `<think>`) are matched in text as llama.cpp and Hugging Face tokenizers
do. A conversation without control-token text takes the plain path and gives exactly llama.cpp's tokens.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from llama_cpp.llama_chat_format import Jinja2ChatFormatter

from ..errors import RequestError
from ..native.vocab import CONTROL_ATTRS, LSTRIP, RSTRIP, Vocabulary

ROLES = ("system", "user", "assistant", "tool")
WHITESPACE = " \t\n\v\f\r"  # C isspace(), as llama.cpp strips around LSTRIP / RSTRIP tokens

Tokenize = Callable[[str, bool, bool], list[int]]  # (text, add_special, parse_special) -> ids


@dataclass(frozen=True)
class ControlToken:
    text: str
    id: int
    lstrip: bool
    rstrip: bool


def control_tokens(vocab: Vocabulary) -> list[ControlToken]:
    """The vocabulary's control (and unknown) tokens, longest text first, as llama.cpp's partition orders them."""
    found = []
    for token in range(vocab.n_tokens):
        attr = vocab.attrs(token)
        if attr & CONTROL_ATTRS:
            text = vocab.piece_text(token)
            if text:
                found.append(ControlToken(text, token, bool(attr & LSTRIP), bool(attr & RSTRIP)))
    return sorted(found, key=lambda t: len(t.text.encode()), reverse=True)


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

    def tokens(self, messages: Sequence[Mapping[str, Any]], tokenize: Tokenize, controls: Sequence[ControlToken], *,
               enable_thinking: bool | None = None) -> list[int]:
        """The prompt's token ids, control tokens only where the template wrote them."""
        check_messages(messages)
        if not any(c.text in str(m.get("content") or "") for m in messages for c in controls):
            return tokenize(self.render(messages, enable_thinking=enable_thinking), False, True)
        guard = _Placeholders(controls)
        guarded = [{**m, "content": guard.hide(str(m.get("content") or ""))} for m in messages]
        rendered = self.render(guarded, enable_thinking=enable_thinking)
        out: list[int] = []
        for fragment in split_on_controls(rendered, controls):
            out += [fragment] if isinstance(fragment, int) else tokenize(guard.show(fragment), False, False)
        return out


def split_on_controls(text: str, controls: Sequence[ControlToken]) -> list[str | int]:
    """`text` as raw-text pieces and control-token ids, split the way llama.cpp's tokenizer partitions a prompt
    (control tokens longest first, each occurrence left to right, whitespace stripped around LSTRIP / RSTRIP
    tokens, empty pieces dropped)."""
    fragments: list[str | int] = [text]
    for control in controls:
        out: list[str | int] = []
        for fragment in fragments:
            if isinstance(fragment, int) or control.text not in fragment:
                out.append(fragment)
                continue
            pieces = fragment.split(control.text)
            for j, piece in enumerate(pieces):
                if j > 0:
                    out.append(control.id)
                    if control.rstrip:
                        piece = piece.lstrip(WHITESPACE)
                if j < len(pieces) - 1 and control.lstrip:
                    piece = piece.rstrip(WHITESPACE)
                if piece:
                    out.append(piece)
        fragments = out
    return fragments


class _Placeholders:
    """Swaps control-token text in message content for unique private-use placeholders, and back."""

    def __init__(self, controls: Sequence[ControlToken]) -> None:
        self._controls = controls
        self._nonce = secrets.token_hex(8)
        self._texts: list[str] = []

    def hide(self, content: str) -> str:
        for control in self._controls:
            while control.text in content:
                mark = f"\ue000{self._nonce}:{len(self._texts)}\ue001"
                self._texts.append(control.text)
                content = content.replace(control.text, mark, 1)
        return content

    def show(self, fragment: str) -> str:
        for index, text in enumerate(self._texts):
            fragment = fragment.replace(f"\ue000{self._nonce}:{index}\ue001", text)
        return fragment


def check_messages(messages: Sequence[Mapping[str, Any]]) -> None:
    if not messages:
        raise RequestError("messages is empty: send at least one message")
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or m.get("role") not in ROLES or not isinstance(m.get("content", ""), str):
            raise RequestError(f"message {i} must be a dict with role in {ROLES} and a string content")


def model_template(source: str | None, vocab: Vocabulary) -> ChatTemplate | None:
    """The chat template a model carries (`tokenizer.chat_template`), with its BOS and EOS texts; None without one."""
    if not source:
        return None
    bos, eos = vocab.bos, vocab.eos
    return ChatTemplate(source, vocab.piece_text(bos) if 0 <= bos < vocab.n_tokens else "",
                        vocab.piece_text(eos) if 0 <= eos < vocab.n_tokens else "")
