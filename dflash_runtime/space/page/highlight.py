"""The chat's draft highlight: a reply as the Markdown the chat renders, with the words the draft wrote (and the target
accepted) marked, the legend that says so, and the page's CSS for both.

A token's edges fall inside words ("d|og"), so marking the draft's characters one by one breaks words visually. A
whole word is marked instead: one whose characters the draft wrote more than half of. The text stays the Markdown it
is (the chat renders it as with the highlight off: headings, lists, emphasis, links, code); the only markup added is
a `span` around a marked word's letters, placed where Markdown reads it as inline HTML and nothing else:
- never inside code (a fenced or indented block, a backtick span), a `$$` formula or an HTML tag of the text itself,
  where it would show as text or break what it sits in; those words stay unmarked;
- around a word's letters only: the characters Markdown reads as syntax at a word's edges (`**`, `_`, brackets,
  quotes) stay outside the span, and a word with syntax inside it (`snake_case`, `a|b`, `[x](y)`) stays unmarked;
- never around a line's block marker (`1.`, `-`, `>`, `#`).
Model output is untrusted; with the highlight on, as off, the chat renders it with its own sanitiser (Gradio's
Chatbot, `sanitize_html`). A thinking block keeps the chat's own `<think>` tags around it, so it still folds.

The Markdown of a growing reply only grows: a word is written out once it is whole (whitespace after it, or the
reply has ended), so what was sent before stays a prefix and Gradio streams only the new part.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from ..provenance import DRAFT, Run
from ..requests import THINK_CLOSE, THINK_OPEN

DRAFT_CLASS = "dflash-draft"
BADGE_CLASS = "dflash-badge"
CSS = f"""
.{DRAFT_CLASS} {{ background: rgba(250, 190, 40, 0.35); border-radius: 3px; box-decoration-break: clone; }}
.{BADGE_CLASS} {{ display: inline-block; font-size: var(--text-sm); color: var(--body-text-color-subdued);
                 border: 1px solid var(--border-color-primary); border-radius: 999px; padding: 0 8px; }}
#draft-legend {{ font-size: var(--text-sm); }}
"""
LEGEND = (
    f'<span class="{DRAFT_CLASS}">highlighted</span>: words the draft wrote (most of their characters) and the '
    "target accepted; the rest: the target's own tokens (the token after each accepted draft, corrections, plain "
    "steps). Code and formulas are not marked."
)
_ESCAPES = {"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;", "$": "&#36;", "\n": "<br>"}
_TABLE = str.maketrans(_ESCAPES)

_TOKENS = re.compile(r"\s+|\S+")
# A word's edges that Markdown may read as syntax: they stay outside the mark.
_EDGE = "*_~[](){}\"'"
# What a marked word's letters may hold: nothing Markdown or HTML reads inside a word.
_PLAIN = re.compile(r"(?:[^\W_]|[.,;:!?%@/+=&'’\-])+")
_HAS_LETTER = re.compile(r"[^\W_]")
_BLOCK_MARKER = re.compile(r"\d{1,9}[.)]|[-*+>]|#{1,6}")
_FENCE = re.compile(r"(`{3,}|~{3,})")
_LEAD = re.compile(r"\s*")


def escape(text: str) -> str:
    """Text as HTML that shows it verbatim: markup characters escaped, `$` too (the chat would read `$$...$$` as
    LaTeX), line breaks as `<br>`."""
    return text.translate(_TABLE)


def draft_flags(runs: Sequence[Run], into: bytearray | None = None) -> bytearray:
    """One byte per character the runs cover: 1 where the draft wrote it (appended to `into`)."""
    flags = into if into is not None else bytearray()
    for n, source in runs:
        flags.extend((b"\x01" if source == DRAFT else b"\x00") * n)
    return flags


@dataclass
class _Marker:
    """Writes one block of a reply's text as Markdown with its draft words marked, word by word, keeping what it has
    read of the Markdown so far (a fence, a formula, a code span, a tag still open), so that it can go on where it
    stopped. `pos`: the text's index it has written up to."""

    pos: int
    fence: str | None = None  # the open fence's marker
    formula: bool = False  # inside $$ ... $$
    code: int = 0  # the open backtick span's length
    tag: bool = False  # inside an HTML tag of the text
    line_start: bool = True  # no word yet on this line but block markers
    code_line: bool = False  # an indented code line
    blank_before: bool = True

    def feed(self, text: str, flags: bytearray, end: int, final: bool) -> str:
        """The Markdown of text[pos:end], up to its last whole word (all of it when `final`)."""
        out: list[str] = []
        tokens = list(_TOKENS.finditer(text, self.pos, end))
        if not final and tokens and not tokens[-1].group().isspace():
            tokens.pop()  # the last word may still grow
        if not final and tokens and tokens[-1].group().isspace():
            tokens.pop()  # and whitespace may still become a blank line
        for token in tokens:
            piece = token.group()
            if piece.isspace():
                self._space(piece)
                out.append(piece)
            else:
                out.append(self._word(piece, flags, token.start()))
            self.pos = token.end()
        return "".join(out)

    def _space(self, space: str) -> None:
        if "\n" not in space:
            return
        self.blank_before = space.count("\n") > 1 or (self.line_start and not self.code_line)
        self.line_start, self.tag = True, False
        indent = space.rsplit("\n", 1)[1].replace("\t", "    ")
        self.code_line = len(indent) >= 4 and (self.blank_before or self.code_line) and self.fence is None

    def _word(self, word: str, flags: bytearray, start: int) -> str:
        first, self.line_start = self.line_start, False
        fence = _FENCE.match(word)
        if first and fence and (self.fence is None or word.startswith(self.fence)):
            self.fence = fence.group(1) if self.fence is None else None
            return word
        if self.fence is not None or self.code_line:
            return word
        if first and _BLOCK_MARKER.fullmatch(word):
            self.line_start = True  # "> - 1." may follow one another
            return word
        if self.formula or self.code or self.tag or "`" in word or "$" in word or "<" in word or ">" in word:
            self._inline_state(word)
            return word
        lead = len(word) - len(word.lstrip(_EDGE))
        core = word[lead:].rstrip(_EDGE)
        if not core or not _PLAIN.fullmatch(core) or not _HAS_LETTER.search(core):
            return word
        lo = start + lead
        written = sum(flags[lo : lo + len(core)])
        if 2 * written <= len(core):
            return word
        return f'{word[:lead]}<span class="{DRAFT_CLASS}">{core}</span>{word[lead + len(core):]}'

    def _inline_state(self, word: str) -> None:
        """What a word left unmarked opens or closes: a formula, a backtick span, an HTML tag."""
        for run in re.finditer(r"\$\$|`+|<|>", word):
            mark = run.group()
            if mark == "$$" and not self.code:
                self.formula = not self.formula
            elif mark.startswith("`") and not self.formula:
                self.code = 0 if self.code == len(mark) else (self.code or len(mark))
            elif mark == "<" and not (self.code or self.formula):
                self.tag = True
            elif mark == ">":
                self.tag = False


def _blocks(text: str, done: bool) -> tuple[str | None, list[tuple[str, int, int]], str]:
    """The reply's structure: (its mode, the blocks as (raw markup before it, start, end), the raw markup after the
    last). Mode "plain", "thinking" (a thinking block still open) or "answer" (the answer after a closed thinking
    block) can only grow; None: the next text may change the blocks (a thinking tag not yet decided, an answer not
    yet begun)."""
    lead = _LEAD.match(text).end()  # type: ignore[union-attr] - `\s*` always matches
    if not text.startswith(THINK_OPEN, lead):
        undecided = not done and len(text) - lead < len(THINK_OPEN) and THINK_OPEN.startswith(text[lead:])
        return (None if undecided else "plain"), [("", 0, len(text))], ""
    think_start = lead + len(THINK_OPEN)
    think_end = text.find(THINK_CLOSE, think_start)
    if think_end < 0:  # still thinking
        return "thinking", [(text[:think_start], think_start, len(text))], ""
    answer_start = think_end + len(THINK_CLOSE)
    blocks = [(text[:think_start], think_start, think_end)]
    if answer_start >= len(text):  # no empty answer block while the answer has not begun
        return None, blocks, THINK_CLOSE
    return "answer", [*blocks, (THINK_CLOSE, answer_start, len(text))], ""


class ReplyView:
    """A growing reply's Markdown with the draft's words marked, rendered incrementally: a step appends the words
    that have become whole, so the work per step follows what the step added, not the length of the answer. Where
    the blocks change (a thinking tag may still open, or closes now) the reply is rendered whole again; either way
    the Markdown is what `reply_markdown` gives for the same text."""

    def __init__(self) -> None:
        self.html = ""
        self._flags = bytearray()  # the draft's characters, as the runs arrived
        self._mode: str | None = None
        self._marker: _Marker | None = None  # the last block's, while the mode holds

    def update(self, text: str, new_runs: Sequence[Run], done: bool = False) -> str:
        """The Markdown of `text`, which extends the text seen last by the characters of `new_runs` (the runs that
        arrived since, in order). `done`: the reply has ended, its last word is whole."""
        draft_flags(new_runs, self._flags)
        mode, blocks, tail = _blocks(text, done)
        if self._marker is not None and mode is not None and mode == self._mode:
            self.html += self._marker.feed(text, self._flags, len(text), done)
            return self.html
        parts = []
        marker = None
        for i, (before, start, end) in enumerate(blocks):
            marker = _Marker(start)
            last = i == len(blocks) - 1 and not tail
            parts += [before, marker.feed(text, self._flags, end, done or not last)]
        self.html = "".join(parts) + tail
        self._mode, self._marker = mode, (marker if mode is not None else None)
        return self.html


def reply_markdown(text: str, runs: Sequence[Run], done: bool = True) -> str:
    """A reply (its text, and its runs in arrival order) as the chat shows it: Markdown with the draft's words marked
    (see the module doc). `done`: the reply has ended (else its last word waits until it is whole)."""
    return ReplyView().update(text, runs, done)


def open_fence(markdown: str) -> str | None:
    """The marker of a code fence the Markdown leaves open (an answer cut short inside code), or None."""
    marker = _Marker(0)
    marker.feed(markdown, bytearray(len(markdown)), len(markdown), final=True)
    return marker.fence


def with_badge(markdown: str, badge: str) -> str:
    """An answer's Markdown with its speed badge under it (a fence the answer left open closed first, so that the
    badge is not read as code)."""
    fence = open_fence(markdown)
    closing = f"\n{fence}" if fence else ""
    return f'{markdown}{closing}\n\n<span class="{BADGE_CLASS}">{escape(badge)}</span>'
