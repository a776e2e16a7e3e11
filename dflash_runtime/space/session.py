"""One browser tab's conversation and the reply running for it (the value of the page's `gr.State`).

Stop and Clear reach the running reply through here, on the server, whatever order the page's events arrive in; Clear
also starts a new epoch, so an update of a reply from before the Clear can never bring the old conversation back.
"""

from __future__ import annotations

import threading
from typing import Any

from .requests import Message


class ChatSession:
    def __init__(self) -> None:
        self.messages: list[Message] = []  # as shown, thinking included (the request strips it)
        self._epoch = 0
        self._job: Any = None
        self._lock = threading.Lock()

    def __deepcopy__(self, memo: dict[int, Any]) -> ChatSession:
        return ChatSession()  # Gradio copies the State's initial value for each new tab: a new tab starts empty

    def start_turn(self, message: str) -> tuple[int, list[Message]]:
        """Show the user's message and an empty reply; returns the turn's epoch and the messages to show."""
        with self._lock:
            self.messages = [*self.messages, {"role": "user", "content": message}, {"role": "assistant", "content": ""}]
            return self._epoch, list(self.messages)

    def attach(self, job: Any) -> None:
        """The reply job now running for this tab (Stop and Clear cancel it)."""
        with self._lock:
            self._job = job

    def show_reply(self, epoch: int, text: str) -> list[Message] | None:
        """The messages with the reply so far, or None when the conversation was cleared since the turn began."""
        with self._lock:
            if epoch != self._epoch or not self.messages:
                return None
            self.messages = [*self.messages[:-1], {"role": "assistant", "content": text}]
            return list(self.messages)

    def undo_turn(self, epoch: int) -> list[Message] | None:
        """Take back a turn that failed (its message goes back to the input box); None after a Clear."""
        with self._lock:
            if epoch != self._epoch or len(self.messages) < 2:
                return None
            self.messages = self.messages[:-2]
            return list(self.messages)

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
        if job is not None:
            job.cancel()

    def last_prompt(self) -> tuple[str, list[Message]] | None:
        """The last user message and the conversation before it (what an A/B run repeats), if any."""
        with self._lock:
            users = [i for i, m in enumerate(self.messages) if m["role"] == "user"]
            if not users:
                return None
            return self.messages[users[-1]]["content"], list(self.messages[: users[-1]])
