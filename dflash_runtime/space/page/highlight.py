"""The chat's draft highlight: a reply as HTML in which the text the draft wrote (and the target accepted) is marked,
the legend that says so, and the page's CSS for both.

Model output is untrusted: every character of it is escaped here, and the only markup is ours (a `div` per block of
text, a `span` per draft run, `<br>` for line breaks). The highlighted view shows the text as written: it is one HTML
block, so the chat's Markdown (and its LaTeX) leave it alone; with the highlight off the chat renders the plain text
as Markdown, as before. A thinking block keeps the chat's own `<think>` tags around it, so it still folds.

The HTML of a growing reply only grows: each run is rendered as it arrived and the last block is left open (the
browser closes it), so what was sent before stays a prefix and Gradio streams only the new part.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..provenance import DRAFT, Run
from ..requests import THINK_CLOSE, THINK_OPEN

DRAFT_CLASS = "dflash-draft"
TEXT_CLASS = "dflash-text"
CSS = f"""
.{TEXT_CLASS} {{ white-space: pre-wrap; }}
.{DRAFT_CLASS} {{ background: rgba(250, 190, 40, 0.35); border-radius: 2px; }}
#draft-legend {{ font-size: var(--text-sm); }}
"""
LEGEND = (
    f'<span class="{DRAFT_CLASS}">highlighted</span>: written by the draft and accepted by the target; '
    "the rest: the target's own tokens (the token after each accepted draft, corrections, plain steps). "
    "The highlighted view shows the text as written, without Markdown formatting."
)
_ESCAPES = {"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;", "$": "&#36;", "\n": "<br>"}
_TABLE = str.maketrans(_ESCAPES)


def escape(text: str) -> str:
    """Text as HTML that shows it verbatim: markup characters escaped, `$` too (the chat would read `$$...$$` as
    LaTeX), line breaks as `<br>` (a blank line would end the HTML block and hand the rest to Markdown)."""
    return text.translate(_TABLE)


def _block(text: str, runs: Sequence[Run], start: int, end: int, close: bool) -> str:
    """The characters start..end of `text` in a text block, draft runs marked."""
    parts, offset = [f'<div class="{TEXT_CLASS}">'], 0
    for n, source in runs:
        lo, hi = max(offset, start), min(offset + n, end)
        offset += n
        if lo >= hi:
            continue
        piece = escape(text[lo:hi])
        parts.append(f'<span class="{DRAFT_CLASS}">{piece}</span>' if source == DRAFT else piece)
    if offset < end:  # text the runs do not cover yet (never, when they are whole): shown, unmarked
        parts.append(escape(text[max(offset, start) : end]))
    if close:
        parts.append("</div>")
    return "".join(parts)


def reply_html(text: str, runs: Sequence[Run]) -> str:
    """A reply (cumulative text, its runs in arrival order) as HTML with the draft's text highlighted. A reply that
    opens with a thinking tag keeps the tags raw around its thinking, so the chat folds it."""
    lead = len(text) - len(text.lstrip())
    if not text[lead:].startswith(THINK_OPEN):
        return _block(text, runs, 0, len(text), close=False)
    think_start = lead + len(THINK_OPEN)
    think_end = text.find(THINK_CLOSE, think_start)
    if think_end < 0:  # still thinking
        return THINK_OPEN + _block(text, runs, think_start, len(text), close=False)
    answer_start = think_end + len(THINK_CLOSE)
    html = THINK_OPEN + _block(text, runs, think_start, think_end, close=True) + THINK_CLOSE
    if answer_start < len(text):  # no empty answer block while the answer has not begun
        html += _block(text, runs, answer_start, len(text), close=False)
    return html


class ReplyView:
    """A growing reply's highlighted HTML, rendered incrementally: a step appends the escaped text of its own runs,
    so the work per step follows what the step added, not the length of the answer. Where the blocks change (a
    thinking tag may still open, or closes now) the reply is rendered whole again; either way the HTML is the same as
    `reply_html` of the whole reply."""

    def __init__(self) -> None:
        self.html = ""
        self._text_len = 0
        self._mode: str | None = None  # "plain", "thinking" or "answer": the open last block appends; None: render

    def update(self, text: str, runs: Sequence[Run], new_runs: Sequence[Run]) -> str:
        """The HTML of `text` (all its `runs`, in arrival order), which extends the text rendered last by the
        characters of `new_runs` (the runs that arrived since)."""
        added = text[self._text_len :]
        closes_now = self._mode == "thinking" and THINK_CLOSE in text[max(0, self._text_len - len(THINK_CLOSE)) :]
        if self._mode is not None and sum(n for n, _ in new_runs) == len(added) and not closes_now:
            parts, offset = [self.html], self._text_len
            for n, source in new_runs:
                piece = escape(text[offset : offset + n])
                parts.append(f'<span class="{DRAFT_CLASS}">{piece}</span>' if source == DRAFT else piece)
                offset += n
            self.html = "".join(parts)
        else:
            self.html = reply_html(text, runs)
            self._mode = _open_block(text) if sum(n for n, _ in runs) == len(text) else None
        self._text_len = len(text)
        return self.html


def _open_block(text: str) -> str | None:
    """Which block of `text` stays open at its end and can only grow ("plain", "thinking", "answer"), or None when
    the next text may change the blocks (a thinking tag not yet decided, an answer not yet begun)."""
    head = text.lstrip()
    if not head.startswith(THINK_OPEN):
        return "plain" if len(head) >= len(THINK_OPEN) else None
    close = text.find(THINK_CLOSE, len(text) - len(head) + len(THINK_OPEN))
    if close < 0:
        return "thinking"
    return "answer" if close + len(THINK_CLOSE) < len(text) else None
