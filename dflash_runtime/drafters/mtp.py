"""The MTP method: the target's own multi-token-prediction (nextn) head drafts, as llama.cpp's `draft-mtp` does.

The MTP context is a second context of the target model (`ctx_type = LLAMA_CONTEXT_TYPE_MTP`); its KV cache holds
the nextn layer only. Its input at position p is the pair (token_p, h_{p-1}), h being the target's nextn hidden row
(`llama_get_embeddings_nextn`, output for every row of every target decode). Drafting decodes `id_last` at pos0 with
h_{pos0-1}, takes the head's best token and its own hidden row, and goes on with them: n drafts cost n small decodes.
The drafted cells are removed afterwards; the verify batch's rows then come in through `process`, as in llama.cpp.

Every sequence of the engine drafts in the same decodes, token by token: step i holds row i of each drafting sequence.
The target's hidden rows are kept per sequence and position in host memory (n_embd floats per cached token), so
that after any cut of the caches — a rejected draft, a new request sharing a prefix — the row before the cut is at
hand, and rows of plain decoding can reach the MTP context later, in one batch, only when a request drafts with MTP.
Their tokens are read from each sequence's target cache, through the views the drafter is opened with. The decodes
and the bookkeeping are EAGLE-3's too (row_drafter.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from llama_cpp import llama_cpp as ll
from llama_cpp import llama_cpp_ext as lx

from ..errors import ContextCreationError, DecodeError, PairMismatchError
from ..files.gguf_meta import GGUFInfo
from ..pair import LinkedPair, Threads, new_context
from .drafting import MTP, Implementation, Rows
from .row_drafter import RowDecoder, RowDrafter


class NextnRows:
    """The MTP head's rows: the target's nextn hidden row of every decoded row (a `row_drafter.RowSource`)."""

    def __init__(self, target_ctx: Any, n_embd: int) -> None:
        self._target = target_ctx
        self._n_embd = n_embd

    def rows(self, decoded: Sequence[Rows]) -> list[np.ndarray]:
        ptr = lx.llama_get_embeddings_nextn(self._target)
        if not ptr:
            raise DecodeError("the target produced no nextn hidden rows (MTP needs them for every decoded row)")
        n_rows = max(r.row0 + len(r.tokens) for r in decoded)
        hidden = np.ctypeslib.as_array(ptr, shape=(n_rows, self._n_embd))
        return [hidden[r.row0:r.row0 + len(r.tokens)] for r in decoded]

    def free(self) -> None:
        pass


NEXTN = "nextn"  # what the pair holds once the MTP context is open


class MTPHead:
    """The MTP context, a part of the target the pair opens (pair.TargetPart): the target model again, its nextn
    head's graph, a KV cache of the nextn layer only."""

    needs = NEXTN

    def wanted(self, target: GGUFInfo, required: bool) -> bool:
        if required and target.n_nextn == 0:
            raise PairMismatchError(f"{target.path.name} has no MTP head (nextn_predict_layers is 0)")
        return target.n_nextn > 0

    def prepare_load(self, params: Any) -> None:
        params.load_mtp = True  # the nextn layers' tensors are skipped unless asked for

    def open_context(self, pair: LinkedPair, threads: Threads) -> Any:
        if int(ll.llama_model_n_layer_nextn(pair.target_model)) < 1:
            raise ContextCreationError("libllama reads no nextn layer in the target")
        params = pair.side_context_params(threads, n_ubatch=pair.n_ubatch)
        params.ctx_type = ll.LLAMA_CONTEXT_TYPE_MTP
        return new_context(pair.target_model, params, "MTP")

    def link(self, pair: LinkedPair, ctx: Any) -> None:
        # The target outputs its nextn hidden row for every decoded row (before its first decode: this re-reserves
        # the graph); the MTP context for its output rows only.
        lx.llama_set_embeddings_nextn(pair.target_ctx, True, False)
        lx.llama_set_embeddings_nextn(ctx, True, True)

    def placement(self, pair: LinkedPair) -> dict[str, Any]:
        trunk = pair.target_info.n_layer - pair.target_info.n_nextn
        return {"mtp_head": pair.target_layers.get(trunk)}


def open_drafter(pair: LinkedPair, views: Sequence[Sequence[int]], capacity: int) -> RowDrafter:
    """Cell p of the MTP context: (token_p, h_{p-1}), every drafting sequence's draft in the same decodes."""
    decoder = RowDecoder(pair.parts[NEXTN], "MTP", views, width=pair.n_embd_out, n_vocab=pair.n_vocab,
                         n_batch=pair.n_ubatch, capacity=capacity, lag=0)
    return RowDrafter(MTP, decoder, NextnRows(pair.target_ctx, pair.n_embd_out), capacity)


IMPLEMENTATION = Implementation(open_drafter, target_part=MTPHead())
