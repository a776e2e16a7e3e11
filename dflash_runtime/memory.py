"""One sequence's cache in a context (libllama's `llama_memory_*`), with the error a refused cut raises: the target,
each drafter and the checkpoints cut through this, never through libllama."""

from __future__ import annotations

from typing import Any

from llama_cpp import llama_cpp as ll

from .errors import RollbackError


class SequenceMemory:
    def __init__(self, ctx: Any, name: str) -> None:
        self._mem = ll.llama_get_memory(ctx)
        self.name = name  # "target", "draft", "MTP": how errors name this cache

    def remove_from(self, pos: int) -> bool:
        """Remove positions ≥ pos; False when libllama refuses (a hybrid state beyond its snapshots)."""
        return bool(ll.llama_memory_seq_rm(self._mem, 0, pos, -1))

    def refused(self, doing: str) -> RollbackError:
        return RollbackError(f"the {self.name} cache refused to {doing}")

    def cut(self, n: int) -> None:
        """Keep positions < n, or raise RollbackError."""
        if not self.remove_from(n):
            raise self.refused(f"roll back to {n} tokens")

    def clear(self) -> None:
        ll.llama_memory_clear(self._mem, True)
