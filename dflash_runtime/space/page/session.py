"""One browser tab's conversation and the reply running for it (the value of the page's `gr.State`).

Stop and Clear reach the running reply through here, on the server, whatever order the page's events arrive in; Clear
also starts a new epoch, so an update of a reply from before the Clear can never bring the old conversation back.

The conversation is kept as plain text (what the next request sends back) with, for each answer, the runs that say
which text the draft wrote; `shown()` gives it as the chat displays it, highlighted or not (a running answer's HTML
grows step by step, see highlight.ReplyView). A visitor's own messages are shown as typed: a `<think>` in them is
text, not a tag the chat would fold.

Each session is its own cache owner (`owner`): the engine reuses the cached prompt of this conversation for its next
turn, and nobody else's.
"""

from __future__ import annotations

import secrets
import threading
from typing import Any

from ..provenance import Run
from ..requests import THINK_CLOSE, THINK_OPEN, ChatRequest, Message
from .highlight import ReplyView

_TAGS = {THINK_OPEN: "&lt;think&gt;", THINK_CLOSE: "&lt;/think&gt;"}


def shown_user_text(text: str) -> str:
    """A visitor's message as the chat shows it: thinking tags escaped, so they read as typed and fold nothing."""
    for tag, escaped in _TAGS.items():
        text = text.replace(tag, escaped)
    return text


class ChatSession:
    def __init__(self) -> None:
        self.messages: list[Message] = []  # the text of each turn, thinking included (the request strips it)
        self.sources: dict[int, list[Run]] = {}  # message index -> its runs, in arrival order (answers only)
        self._html: dict[int, str] = {}  # message index -> its highlighted HTML (rendered once per change)
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

    def start_turn(self, message: str, request: ChatRequest | None = None) -> tuple[int, list[Message]]:
        """Show the user's message and an empty reply; returns the turn's epoch and the messages to show. With
        `request`, the turn waits for `take_pending` (the answering event, which may wait in the queue)."""
        with self._lock:
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

    def show_reply(self, epoch: int, text: str, runs: list[Run] | None = None) -> list[Message] | None:
        """The messages to show with the reply so far (`runs`: who wrote its text, in arrival order; the list only
        grows while the reply runs), or None when the conversation was cleared since the turn began."""
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
            self._html[index] = view.update(text, runs, new_runs)
            return self._shown()

    def undo_turn(self, epoch: int) -> list[Message] | None:
        """Take back a turn that failed (its message goes back to the input box); None after a Clear."""
        with self._lock:
            if epoch != self._epoch or len(self.messages) < 2:
                return None
            self.messages = self.messages[:-2]
            self._pending, self._view, self.last_stats = None, None, {}
            self.sources = {i: runs for i, runs in self.sources.items() if i < len(self.messages)}
            self._html = {i: html for i, html in self._html.items() if i < len(self.messages)}
            return self._shown()

    def set_highlight(self, on: bool) -> list[Message]:
        """Turn the draft highlight on or off; the messages to show now (a running reply follows on its next step)."""
        with self._lock:
            self.highlight = on
            return self._shown()

    def shown(self) -> list[Message]:
        with self._lock:
            return self._shown()

    def _shown(self) -> list[Message]:
        """The conversation as the chat shows it: answers with draft runs as highlighted HTML when the highlight is
        on, every other message as its plain text. Call with the lock held."""
        shown = []
        for i, message in enumerate(self.messages):
            if message["role"] == "user":
                shown.append({"role": "user", "content": shown_user_text(message["content"])})
            elif self.highlight and self.sources.get(i):
                shown.append({"role": "assistant", "content": self._html[i]})
            else:
                shown.append(dict(message))
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
            self.messages = []
            self.sources, self._html, self._view, self.last_stats = {}, {}, None, {}
        if job is not None:
            job.cancel()

    def last_prompt(self) -> tuple[str, list[Message]] | None:
        """The last user message and the conversation before it (what an A/B run repeats), if any."""
        with self._lock:
            users = [i for i, m in enumerate(self.messages) if m["role"] == "user"]
            if not users:
                return None
            return self.messages[users[-1]]["content"], list(self.messages[: users[-1]])
