"""Copies of one sequence's state in a context (libllama's `llama_state_seq_*_ext`), checked byte for byte.

WHOLE copies everything the sequence holds (attention cells and recurrent state); PARTIAL_ONLY copies only the
recurrent part, which is all a context checkpoint needs (the attention part can be cut at any position).
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np
from llama_cpp import llama_cpp as ll

from ..errors import RollbackError

WHOLE = 0
PARTIAL_ONLY = ll.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY


def state_size(ctx: Any, flags: int, seq: int = 0) -> int:
    return int(ll.llama_state_seq_get_size_ext(ctx, seq, flags))


def save_seq(ctx: Any, flags: int, size: int | None = None, seq: int = 0) -> np.ndarray:
    """A host copy of one sequence's state."""
    size = state_size(ctx, flags, seq) if size is None else size
    data = np.empty(size, dtype=np.uint8)
    written = int(ll.llama_state_seq_get_data_ext(ctx, _u8(data), size, seq, flags)) if size else 0
    if written != size:
        raise RollbackError(f"saving a sequence state wrote {written} of {size} bytes")
    return data


def load_seq(ctx: Any, data: np.ndarray, flags: int, seq: int = 0) -> None:
    """Replace one sequence's state with a copy made by `save_seq` on the same context (from any of its sequences:
    a state carries no sequence id)."""
    if data.nbytes == 0:
        return
    read = int(ll.llama_state_seq_set_data_ext(ctx, _u8(data), data.nbytes, seq, flags))
    if read != data.nbytes:
        raise RollbackError(f"restoring a sequence state read {read} of {data.nbytes} bytes")


def _u8(data: np.ndarray) -> Any:
    return data.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8))
