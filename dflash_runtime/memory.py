"""One sequence's cache in a context (libllama's `llama_memory_*`; a context holds `parallel` sequences, by id), with
the error a refused cut raises: the target, each drafter and the checkpoints cut through this, never through
libllama."""

from __future__ import annotations

from typing import Any

from llama_cpp import llama_cpp as ll

from .errors import RollbackError


class SequenceMemory:
    def __init__(self, ctx: Any, name: str, seq: int = 0) -> None:
        self._mem = ll.llama_get_memory(ctx)
        self.name = name  # "target", "draft", "MTP": how errors name this cache
        self.seq = seq

    def remove_from(self, pos: int) -> bool:
        """Remove positions ≥ pos; False when libllama refuses (a hybrid state beyond its snapshots)."""
        return bool(ll.llama_memory_seq_rm(self._mem, self.seq, pos, -1))

    def refused(self, doing: str) -> RollbackError:
        return RollbackError(f"the {self.name} cache refused to {doing}")

    def cut(self, n: int) -> None:
        """Keep positions < n, or raise RollbackError."""
        if not self.remove_from(n):
            raise self.refused(f"roll back to {n} tokens")

    def copy_to(self, seq: int) -> None:
        """Give sequence `seq` (emptied first) this sequence's cells. Across KV streams libllama copies the whole
        stream's buffer at the next decode; a recurrent state is shared as it is now, without a pending rollback
        (cache.PairCache.fork copies that part exactly)."""
        ll.llama_memory_seq_rm(self._mem, seq, -1, -1)
        ll.llama_memory_seq_cp(self._mem, self.seq, seq, -1, -1)

    def clear(self) -> None:
        """Remove every position of this sequence (the other sequences of the context keep theirs)."""
        if not ll.llama_memory_seq_rm(self._mem, self.seq, -1, -1):
            raise self.refused("clear")
