"""Owning wrappers of the native batches the engine feeds: token rows, target-feature rows, and (token, row) pairs."""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any

import numpy as np
from llama_cpp import llama_cpp as ll

from ..errors import DecodeError
from .rpc import raise_if_lost


def decode_error(what: str, rc: int, n_rows: int) -> DecodeError:
    reason = {1: "no free KV slot (the context is full)", 2: "aborted", -1: "invalid batch"}.get(rc, "backend error")
    return DecodeError(f"{what} decode of {n_rows} rows failed with status {rc}: {reason}")


def logits_row(ctx: Any, row: int, n_vocab: int, missing: str) -> np.ndarray:
    """Row `row`'s logits of the context's last decode, a view of libllama's buffer (valid until its next decode);
    DecodeError(`missing`) when the decode kept none for that row."""
    ptr = ll.llama_get_logits_ith(ctx, row)
    if not ptr:
        raise DecodeError(missing)
    return np.ctypeslib.as_array(ptr, shape=(n_vocab,))


class TokenBatch:
    """A `llama_batch` of token ids, filled through numpy views (no per-token ctypes calls): one sequence's rows
    (`fill`), or several sequences' rows one after another (`clear`, then `add` per sequence)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._batch = ll.llama_batch_init(capacity, 0, 1)
        b = self._batch
        self._tokens = np.ctypeslib.as_array(b.token, shape=(capacity,))
        self._pos = np.ctypeslib.as_array(b.pos, shape=(capacity,))
        self._logits = np.ctypeslib.as_array(b.logits, shape=(capacity,))
        np.ctypeslib.as_array(b.n_seq_id, shape=(capacity,))[:] = 1
        self._seq = [0] * capacity  # what each row's seq_id slot holds, to write only the rows that change
        for i in range(capacity):
            b.seq_id[i][0] = 0
        self.n_rows = 0

    def fill(self, tokens: Sequence[int], pos0: int, *, outputs: str) -> int:
        """Rows of sequence 0 at positions pos0..; outputs is "all", "last" or "none". Returns the row count."""
        if not 0 < len(tokens) <= self.capacity:
            raise ValueError(f"batch of {len(tokens)} rows does not fit capacity {self.capacity}")
        self.clear()
        self.add(tokens, pos0, 0, outputs=outputs)
        return self.n_rows

    def clear(self) -> None:
        self.n_rows = 0
        self._batch.n_tokens = 0

    def add(self, tokens: Sequence[int], pos0: int, seq: int, *, outputs: str, silent: int = 0) -> int:
        """Append one sequence's rows at positions pos0..; returns the batch index of its first row. `outputs` says
        which rows ask for outputs ("all", "last", "none"), after the first `silent` rows, which ask for none."""
        start, n = self.n_rows, len(tokens)
        if n == 0 or start + n > self.capacity:
            raise ValueError(f"{n} more rows do not fit a batch of {start} rows with capacity {self.capacity}")
        stop = start + n
        self._tokens[start:stop] = tokens
        self._pos[start:stop] = np.arange(pos0, pos0 + n, dtype=np.int32)
        self._logits[start:stop] = 1 if outputs == "all" else 0
        if outputs == "last":
            self._logits[stop - 1] = 1
        self._logits[start:start + min(silent, n)] = 0
        for i in range(start, stop):
            if self._seq[i] != seq:
                self._batch.seq_id[i][0] = self._seq[i] = seq
        self.n_rows = stop
        self._batch.n_tokens = stop
        return start

    def decode(self, ctx: Any, what: str) -> None:
        rc = ll.llama_decode(ctx, self._batch)
        raise_if_lost(ctx)  # a remote device that went away: its numbers (and the status) mean nothing
        if rc != 0:
            raise decode_error(what, rc, self._batch.n_tokens)

    def free(self) -> None:
        if self._batch is not None:
            ll.llama_batch_free(self._batch)
            self._batch = None


class FeatureBatch:
    """A `llama_batch_ext` of embedding rows (tapped target features) decoded into the draft's KV cache."""

    def __init__(self, ctx: Any, row_width: int, capacity: int) -> None:
        self._ctx = ctx
        self.row_width = row_width
        self.capacity = capacity
        self._batch = ll.llama_batch_ext_init(ctx)
        if not self._batch:
            raise DecodeError("llama_batch_ext_init failed for the draft context")
        # Four positions per row: M-RoPE drafts read {p, p, p, 0}; others read the first only.
        self._pos = np.zeros((capacity, 4), dtype=np.int32)
        self._pos_ptr = self._pos.ctypes.data
        self._pos_type = ctypes.POINTER(ll.llama_pos)

    def decode(self, rows: np.ndarray, positions: np.ndarray, seqs: np.ndarray | None = None) -> None:
        """Decode `rows` (n × row_width float32, C-contiguous) at `positions` (of sequences `seqs`, default 0) into
        the draft, no outputs."""
        n = rows.shape[0]
        if n == 0:
            return
        if n > self.capacity or rows.shape[1] != self.row_width or not rows.flags.c_contiguous:
            raise ValueError(f"feature rows {rows.shape} do not fit ({self.capacity}, {self.row_width})")
        self._pos[:n, :3] = positions[:, None]
        ll.llama_batch_ext_clear(self._batch)
        base = rows.ctypes.data
        stride = rows.strides[0]
        f32p = ctypes.POINTER(ctypes.c_float)
        for i in range(n):
            embd = ll.llama_embd(ctypes.cast(base + i * stride, f32p), 1, self.row_width)
            idx = ll.llama_batch_ext_add_embd(self._batch, 0 if seqs is None else int(seqs[i]), embd)
            if idx < 0:
                raise DecodeError(f"could not add feature row {i} to the draft batch (status {idx})")
            pos = ctypes.cast(self._pos_ptr + i * 16, self._pos_type)
            if not ll.llama_batch_ext_set_pos(self._batch, idx, pos):
                raise DecodeError(f"could not set the position of feature row {i}")
        rc = ll.llama_process(self._ctx, ll.LLAMA_PROCESS_TYPE_DECODE, self._batch)
        raise_if_lost(self._ctx)
        if rc != 0:
            raise decode_error("draft feature injection", rc, n)

    def free(self) -> None:
        if self._batch:
            ll.llama_batch_ext_free(self._batch)
            self._batch = None


class TokenRowBatch:
    """A `llama_batch_ext` of tokens each with an embedding row (the MTP head's and EAGLE-3's decoder input: the
    token with the target's or the encoder's row), decoded into a drafter's context (drafters/row_drafter.py)."""

    def __init__(self, ctx: Any, name: str, width: int) -> None:
        self._ctx = ctx
        self.name = name
        self.width = width
        self._pos = (ll.llama_pos * 4)()
        self._batch = ll.llama_batch_ext_init(ctx)
        if not self._batch:
            raise DecodeError(f"libllama could not create a batch for the {name} context")

    def clear(self) -> None:
        ll.llama_batch_ext_clear(self._batch)

    def add(self, seq: int, token: int, pos: int, row: np.ndarray, *, output: bool) -> None:
        """One row: `token` at `pos` of `seq` with `row` (float32, `width`, kept alive until the decode)."""
        batch = self._batch
        idx = ll.llama_batch_ext_add_token(batch, seq, token)
        if idx < 0:
            raise DecodeError(f"the {self.name} batch refused token {token} (error {idx})")
        self._pos[0] = pos
        embd = ll.llama_embd(row.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), 1, self.width)
        ok = ll.llama_batch_ext_set_pos(batch, idx, self._pos) and ll.llama_batch_ext_set_embd_token(batch, idx, embd)
        if ok and output:
            ok = ll.llama_batch_ext_set_output_logits(batch, idx, True)
        if not ok:
            raise DecodeError(f"the {self.name} batch refused the row of position {pos}")

    def process(self, what: str) -> None:
        rc = int(ll.llama_process(self._ctx, ll.LLAMA_PROCESS_TYPE_DECODE, self._batch))
        raise_if_lost(self._ctx)
        if rc != 0:
            raise decode_error(what, rc, 0)

    def free(self) -> None:
        if self._batch:
            ll.llama_batch_ext_free(self._batch)
            self._batch = None
