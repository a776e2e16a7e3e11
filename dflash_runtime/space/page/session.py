"""One browser tab's conversation and the reply running for it (the value of the page's `gr.State`).

Stop and Clear reach the running reply through here, on the server, whatever order the page's events arrive in; Clear
also starts a new epoch, so an update of a reply from before the Clear can never bring the old conversation back.

The conversation is kept as plain text (what the next request sends back) with, for each answer, the runs that say
which text the draft wrote and, once it has ended, its speed badge; `shown()` gives it as the chat displays it,
highlighted or not (a running answer's Markdown grows step by step, see highlight.ReplyView). A visitor's own
messages are shown as typed: a `<think>` in them is text, not a tag the chat would fold.

A turn can be taken back (undo), or taken back and sent again as it was (retry) or edited: `start_turn(keep=...)`
keeps the conversation before it, so the new turn is a new message after those turns, sent the way every message is.

Each session is its own cache owner (`owner`): the engine reuses the cached prompt of this conversation for its next
turn, and nobody else's.
"""

from __future__ import annotations

import secrets
import threading
from typing import Any

from ..provenance import Run
from ..requests import THINK_CLOSE, THINK_OPEN, ChatRequest, Message
from .highlight import ReplyView, with_badge

_TAGS = {THINK_OPEN: "&lt;think&gt;", THINK_CLOSE: "&lt;/think&gt;"}


def shown_user_text(text: str) -> str:
    """A visitor's message as the chat shows it: thinking tags escaped, so they read as typed and fold nothing."""
    for tag, escaped in _TAGS.items():
        text = text.replace(tag, escaped)
    return text


def typed_user_text(shown: str) -> str:
    """A visitor's message as typed, from the chat's text of it (an edit arrives as the chat shows it)."""
    for tag, escaped in _TAGS.items():
        shown = shown.replace(escaped, tag)
    return shown


class ChatSession:
    def __init__(self) -> None:
        self.messages: list[Message] = []  # the text of each turn, thinking included (the request strips it)
        self.sources: dict[int, list[Run]] = {}  # message index -> its runs, in arrival order (answers only)
        self._html: dict[int, str] = {}  # message index -> its highlighted Markdown (rendered once per change)
        self.badges: dict[int, str] = {}  # message index -> its speed badge (answers that have ended)
        self._view: ReplyView | None = None  # the running answer's HTML, grown step by step
        self.highlight = True  # show the draft's text highlighted
        self.owner = secrets.token_hex(16)  # this conversation's cache owner (see the module doc)
        self._epoch = 0
        self._job: Any = None
        self._pending: tuple[int, ChatRequest] | None = None  # a turn shown and waiting for the engine
        self.last_stats: dict[str, Any] = {}  # the running (or last) answer's statistics, for Stop's summary
        self._lock = threading.Lock()

    def __deepcopy__(self, memo: dict[int, Any]) -> ChatSession:
        return ChatSession()  # Gradio copies the State's initial value for each new tab: a new tab starts empty

    def busy(self) -> bool:
        """Whether a turn of this conversation waits for the engine or runs (a new message must wait for it)."""
        with self._lock:
            return self._pending is not None or self._job is not None

    def start_turn(self, message: str, request: ChatRequest | None = None,
                   keep: int | None = None) -> tuple[int, list[Message]]:  # fmt: skip
        """Show the user's message and an empty reply; returns the turn's epoch and the messages to show. With
        `request`, the turn waits for `take_pending` (the answering event, which may wait in the queue). `keep`: the
        conversation's first messages the turn follows (the rest is taken back: a retry, an edit); all by default."""
        with self._lock:
            if keep is not None:
                self._cut(keep)
            self.messages = [*self.messages, {"role": "user", "content": message}, {"role": "assistant", "content": ""}]
            self.sources[len(self.messages) - 1] = []
            self._view = ReplyView()
            self.last_stats = {}
            if request is not None:
                self._pending = (self._epoch, request)
            return self._epoch, self._shown()

    def is_current(self, epoch: int) -> bool:
        """Whether the conversation is still the one of `epoch` (no Clear since)."""
        with self._lock:
            return epoch == self._epoch

    def take_pending(self) -> tuple[int, ChatRequest] | None:
        """The turn waiting to be answered (and its epoch), once; None when there is none (stopped or cleared while
        it waited in the queue)."""
        with self._lock:
            pending, self._pending = self._pending, None
            return pending

    def attach(self, job: Any) -> None:
        """The reply job now running for this tab (Stop and Clear cancel it)."""
        with self._lock:
            self._job = job

    def detach(self, job: Any) -> None:
        """The job has ended: the conversation takes a new message."""
        with self._lock:
            if self._job is job:
                self._job = None

    def show_reply(self, epoch: int, text: str, runs: list[Run] | None = None,
                   done: bool = False) -> list[Message] | None:  # fmt: skip
        """The messages to show with the reply so far (`runs`: who wrote its text, in arrival order; the list only
        grows while the reply runs; `done`: the reply has ended), or None when the conversation was cleared since
        the turn began."""
        with self._lock:
            if epoch != self._epoch or not self.messages:
                return None
            self.messages[-1] = {"role": "assistant", "content": text}
            index = len(self.messages) - 1
            runs = list(runs or [])
            new_runs = runs[len(self.sources.get(index, [])) :]
            self.sources[index] = runs
            view = self._view or ReplyView()
            self._view = view
            self._html[index] = view.update(text, new_runs, done)
            return self._shown()

    def end_reply(self, epoch: int, badge: str) -> list[Message] | None:
        """The reply has ended (also stopped part way): its last word shows, and its speed badge under it. None when
        the conversation was cleared since the turn began."""
        with self._lock:
            if epoch != self._epoch or not self.messages or self.messages[-1]["role"] != "assistant":
                return None
            index = len(self.messages) - 1
            if self._view is not None:
                self._html[index] = self._view.update(self.messages[index]["content"], [], done=True)
            self.badges[index] = badge
            return self._shown()

    def undo_turn(self, epoch: int) -> list[Message] | None:
        """Take back a turn that failed (its message goes back to the input box); None after a Clear."""
        with self._lock:
            if epoch != self._epoch or len(self.messages) < 2:
                return None
            self._pending = None
            self._cut(len(self.messages) - 2)
            return self._shown()

    def user_turn(self, k: int) -> tuple[str, int] | None:
        """The k-th user message (0-based; -1: the last) and how many messages come before it, or None."""
        with self._lock:
            users = [i for i, m in enumerate(self.messages) if m["role"] == "user"]
            if not users or not -len(users) <= k < len(users):
                return None
            return self.messages[users[k]]["content"], users[k]

    def take_back(self, keep: int) -> list[Message]:
        """Take back every message from `keep` on (an undo: the visitor's message goes back to the box); the
        messages to show."""
        with self._lock:
            self._cut(keep)
            return self._shown()

    def _cut(self, keep: int) -> None:
        """The conversation's first `keep` messages, nothing of the rest left. Call with the lock held."""
        self.messages = self.messages[:keep]
        self._view, self.last_stats = None, {}
        self.sources = {i: runs for i, runs in self.sources.items() if i < keep}
        self._html = {i: html for i, html in self._html.items() if i < keep}
        self.badges = {i: badge for i, badge in self.badges.items() if i < keep}

    def set_highlight(self, on: bool) -> list[Message]:
        """Turn the draft highlight on or off; the messages to show now (a running reply follows on its next step)."""
        with self._lock:
            self.highlight = on
            return self._shown()

    def shown(self) -> list[Message]:
        with self._lock:
            return self._shown()

    def _shown(self) -> list[Message]:
        """The conversation as the chat shows it: answers with draft runs as highlighted Markdown when the highlight is
        on, every other message as its plain text; an answer that has ended with its speed badge under it. Call with
        the lock held."""
        shown = []
        for i, message in enumerate(self.messages):
            if message["role"] == "user":
                shown.append({"role": "user", "content": shown_user_text(message["content"])})
                continue
            content = self._html[i] if self.highlight and self.sources.get(i) else message["content"]
            if i in self.badges:
                content = with_badge(content, self.badges[i])
            shown.append({"role": "assistant", "content": content})
        return shown

    def stop(self) -> None:
        """Stop the running answer (it stays as far as it got), or the turn still waiting in the queue."""
        with self._lock:
            job, self._pending = self._job, None
        if job is not None:
            job.cancel()

    def clear(self) -> None:
        with self._lock:
            job, self._job, self._pending = self._job, None, None
            self._epoch += 1
            self._cut(0)
        if job is not None:
            job.cancel()

    def last_prompt(self) -> tuple[str, list[Message]] | None:
        """The last user message and the conversation before it (what an A/B run repeats), if any."""
        with self._lock:
            users = [i for i, m in enumerate(self.messages) if m["role"] == "user"]
            if not users:
                return None
            return self.messages[users[-1]]["content"], list(self.messages[: users[-1]])
