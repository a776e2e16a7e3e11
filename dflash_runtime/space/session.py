"""One browser tab's conversation and the reply running for it (the value of the page's `gr.State`).

Stop and Clear reach the running reply through here, on the server, whatever order the page's events arrive in; Clear
also starts a new epoch, so an update of a reply from before the Clear can never bring the old conversation back.

The conversation is kept as plain text (what the next request sends back) with, for each answer, the runs that say
which text the draft wrote; `shown()` renders it as the chat displays it, highlighted or not.
"""

from __future__ import annotations

import threading
from typing import Any

from .highlight import reply_html
from .provenance import Run
from .requests import Message


class ChatSession:
    def __init__(self) -> None:
        self.messages: list[Message] = []  # the text of each turn, thinking included (the request strips it)
        self.sources: dict[int, list[Run]] = {}  # message index -> its runs, in arrival order (answers only)
        self._html: dict[int, str] = {}  # message index -> its highlighted HTML (rendered once per change)
        self.highlight = True  # show the draft's text highlighted
        self._epoch = 0
        self._job: Any = None
        self._lock = threading.Lock()

    def __deepcopy__(self, memo: dict[int, Any]) -> ChatSession:
        return ChatSession()  # Gradio copies the State's initial value for each new tab: a new tab starts empty

    def start_turn(self, message: str) -> tuple[int, list[Message]]:
        """Show the user's message and an empty reply; returns the turn's epoch and the messages to show."""
        with self._lock:
            self.messages = [*self.messages, {"role": "user", "content": message}, {"role": "assistant", "content": ""}]
            self.sources[len(self.messages) - 1] = []
            return self._epoch, self._shown()

    def attach(self, job: Any) -> None:
        """The reply job now running for this tab (Stop and Clear cancel it)."""
        with self._lock:
            self._job = job

    def show_reply(self, epoch: int, text: str, runs: list[Run] | None = None) -> list[Message] | None:
        """The messages to show with the reply so far (`runs`: who wrote its text, in arrival order), or None when
        the conversation was cleared since the turn began."""
        with self._lock:
            if epoch != self._epoch or not self.messages:
                return None
            self.messages = [*self.messages[:-1], {"role": "assistant", "content": text}]
            index = len(self.messages) - 1
            self.sources[index] = list(runs or [])
            self._html[index] = reply_html(text, self.sources[index])
            return self._shown()

    def undo_turn(self, epoch: int) -> list[Message] | None:
        """Take back a turn that failed (its message goes back to the input box); None after a Clear."""
        with self._lock:
            if epoch != self._epoch or len(self.messages) < 2:
                return None
            self.messages = self.messages[:-2]
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
        if not self.highlight:
            return [dict(message) for message in self.messages]
        return [
            {**message, "content": self._html[i]} if self.sources.get(i) else dict(message)
            for i, message in enumerate(self.messages)
        ]

    def stop(self) -> None:
        with self._lock:
            job = self._job
        if job is not None:
            job.cancel()

    def clear(self) -> None:
        with self._lock:
            job, self._job = self._job, None
            self._epoch += 1
            self.messages = []
            self.sources, self._html = {}, {}
        if job is not None:
            job.cancel()

    def last_prompt(self) -> tuple[str, list[Message]] | None:
        """The last user message and the conversation before it (what an A/B run repeats), if any."""
        with self._lock:
            users = [i for i, m in enumerate(self.messages) if m["role"] == "user"]
            if not users:
                return None
            return self.messages[users[-1]]["content"], list(self.messages[: users[-1]])
