"""Target layer taps → draft KV injection.

After every target decode the tapped layer inputs are valid only until the next decode, so they are copied at once,
one memcpy per layer, into a host buffer of rows `[layer_0 | layer_1 | ...]`. Rows are injected into the draft right
away, or kept pending (rounds that do not draft) and injected in one batch when drafting resumes.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .batches import FeatureBatch
from .errors import DecodeError
from .native import DFlashApi


class FeatureBridge:
    def __init__(self, api: DFlashApi, target_ctx: Any, draft_ctx: Any, layer_ids: tuple[int, ...], n_embd: int,
                 capacity: int) -> None:
        self._api = api
        self._target_ctx = target_ctx
        self._layer_ids = layer_ids
        self._n_embd = n_embd
        self.row_width = len(layer_ids) * n_embd
        self.capacity = capacity
        self._batch = FeatureBatch(draft_ctx, self.row_width, capacity)
        self._rows = np.empty((capacity, self.row_width), dtype=np.float32)
        self._positions = np.empty(capacity, dtype=np.int32)
        self.n_pending = 0

    def capture(self, n_rows: int, pos0: int) -> None:
        """Copy the features of the last target decode (rows 0..n_rows-1 at pos0..) into the pending buffer."""
        if self.n_pending + n_rows > self.capacity:
            self.flush()
        start = self.n_pending
        dst = self._rows[start:start + n_rows]
        w = self._n_embd
        for k, lid in enumerate(self._layer_ids):
            ptr = self._api.get_embeddings_layer_inp(self._target_ctx, lid)
            if not ptr:
                raise DecodeError(f"target layer {lid} features were not extracted (taps not enabled?)")
            src = np.ctypeslib.as_array(ptr, shape=(n_rows, w))
            dst[:, k * w:(k + 1) * w] = src
        self._positions[start:start + n_rows] = np.arange(pos0, pos0 + n_rows, dtype=np.int32)
        self.n_pending += n_rows

    def flush(self) -> None:
        """Inject every pending row into the draft cache in one decode."""
        if self.n_pending:
            n, self.n_pending = self.n_pending, 0
            self._batch.decode(self._rows[:n], self._positions[:n])

    def drop_from(self, pos: int) -> None:
        """Forget pending rows at positions ≥ pos (they were rolled back on the target)."""
        if self.n_pending:
            keep = int(np.searchsorted(self._positions[:self.n_pending], pos))
            self.n_pending = keep

    def free(self) -> None:
        self._batch.free()
