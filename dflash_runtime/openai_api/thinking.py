"""A thinking model's text apart: what it writes inside `<think>…</think>` goes to `reasoning_content` (the field the
ecosystem reads: llama-server, vLLM, DeepSeek's API), the rest to `content`.

The thinking block is the one the answer opens with, or the one the template opened at the end of the prompt
(Qwen3 and its kind, with thinking on). Streamed text is split as it comes: a tag cut between two deltas is held
back until the next one tells what it is, so the two fields join to what a whole answer splits into.
"""

from __future__ import annotations

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
PENDING, REASONING, CONTENT = "pending", "reasoning", "content"


def opens_thinking(prompt: str) -> bool:
    """Whether a rendered prompt ends inside a thinking block the template opened."""
    return prompt.rstrip().endswith(THINK_OPEN)


def _partial_tail(text: str, tag: str) -> int:
    """How many characters at the end of `text` may begin `tag` (held back until more text comes)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ThinkingSplitter:
    """Feed the answer's deltas; each call says what they added to (reasoning, content)."""

    def __init__(self, opened: bool = False) -> None:
        self.state = REASONING if opened else PENDING
        self.held = ""
        self.after_close = False  # the content's leading whitespace after the closing tag is dropped
        self.thought = False  # the reasoning's leading whitespace is dropped too, until it has begun

    def feed(self, delta: str) -> tuple[str, str]:
        text = self.held + delta
        self.held = ""
        reasoning, content = "", ""
        if self.state == PENDING:
            start = text.lstrip()
            if start.startswith(THINK_OPEN):
                self.state, text = REASONING, start[len(THINK_OPEN):]
            elif THINK_OPEN.startswith(start):  # whitespace, or a tag not whole yet
                self.held = text
                return "", ""
            else:
                self.state = CONTENT
        if self.state == REASONING:
            if not self.thought:
                text = text.lstrip()
                self.thought = bool(text) and not THINK_CLOSE.startswith(text)
            if THINK_CLOSE in text:
                reasoning, text = text.split(THINK_CLOSE, 1)
                self.state, self.after_close = CONTENT, True
            else:
                keep = _partial_tail(text, THINK_CLOSE)
                self.held = text[len(text) - keep:] if keep else ""
                return text[: len(text) - keep], ""
        if self.after_close:
            text = text.lstrip()
            self.after_close = not text
        content = text
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What is still held back, once the answer has ended."""
        held, self.held = self.held, ""
        if self.state == REASONING:
            return held, ""
        return "", "" if self.after_close else held


def split(text: str, opened: bool = False) -> tuple[str, str]:
    """A whole answer's (reasoning, content)."""
    splitter = ThinkingSplitter(opened)
    reasoning, content = splitter.feed(text)
    more_reasoning, more_content = splitter.finish()
    return reasoning + more_reasoning, content + more_content
