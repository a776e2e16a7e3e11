"""Why two temperature-0 answers to one prompt differ: a near-tie the kernels' rounding broke two ways, or a fault.

Both answers are greedy: every token the argmax of the target's logits at its row. On a batch-invariant build those
logits are the same however the row was batched, so two answers cannot differ. Where the kernels are not
batch-invariant (a GPU, a stock CPU build, `numerics="fast"`), a row's logits depend on its batch by a rounding error,
and a row whose top two logits are closer than that error may give another argmax in a verify batch than in a
one-row plain step: both answers are then valid greedy answers under their own numerics. A token that loses to
another by more than any rounding can move is a fault.

`explain` finds the first differing position N and scores its row twice on a scratch sequence: as plain decoding
computes it (the prefix decoded, then the row alone, one row) and as a verify batch does (the row first in a batch
of `verify_rows` rows, the other answer's tokens after it, as its draft). For the two candidates (each answer's token
at N) it reports their logits and margins under both scorings. The bound on what rounding can flip is stated with
the verdict: the larger of the output head's own float32 summation bound (n_embd · 2⁻²⁴ · max |logit|: one dot product
of length n_embd summed in another order) and four times the largest difference between the two scorings' logits
over the whole vocabulary (what this build's kernels actually moved at this row).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from ..errors import RequestError
from ..native.batches import TokenBatch, logits_row
from ..native.memory import SequenceMemory

FLOAT32_UNIT = 2.0**-24  # unit roundoff of float32
SPREAD_FACTOR = 4.0  # how far beyond the observed disagreement of two scorings a margin still counts as rounding
IDENTICAL, NEAR_TIE, FAULT = "identical", "near-tie", "fault"


@dataclass(frozen=True)
class Scoring:
    """One row's logits for the two candidates: `a` (the first answer's token at N) and `b` (the second's)."""

    how: str  # "plain" (one row after the prefix) or "verify" (the first row of a batch of `rows` rows)
    rows: int
    logit_a: float
    logit_b: float
    top: int  # the argmax of the row
    top_logit: float

    @property
    def margin(self) -> float:
        """logit(a) − logit(b): positive where the first answer's token wins."""
        return self.logit_a - self.logit_b


@dataclass(frozen=True)
class Divergence:
    """The first difference of two temperature-0 answers and what it is: "identical", "near-tie" or "fault"."""

    kind: str
    position: int | None = None  # index into the answers of the first differing token
    token_a: int | None = None
    token_b: int | None = None
    text_a: str = ""
    text_b: str = ""
    plain: Scoring | None = None
    verify: Scoring | None = None
    margin: float = 0.0  # near-tie: |logit(a) − logit(b)|; fault: how far the losing answer's token trails the top
    bound: float = 0.0
    spread: float = 0.0  # the largest |plain − verify| over the vocabulary at this row
    batch_invariant: bool = False

    @property
    def near_tie(self) -> bool:
        return self.kind == NEAR_TIE

    @property
    def fault(self) -> bool:
        return self.kind == FAULT

    def summary(self) -> str:
        """One line: "identical", "differs at token N: a near-tie (margin …), not a fault" or "… fault (margin …)"."""
        if self.kind == IDENTICAL:
            return "identical"
        where = f"differs at token {self.position}"
        if self.kind == NEAR_TIE:
            return f"{where}: a near-tie (margin {self.margin:.2g}, the kernels' rounding), not a fault"
        return f"{where}: fault (margin {self.margin:.3g})"

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["summary"] = self.summary()
        return out

    @staticmethod
    def from_dict(data: dict[str, Any]) -> Divergence:
        fields = {k: v for k, v in data.items() if k != "summary"}
        for key in ("plain", "verify"):
            if fields.get(key) is not None:
                fields[key] = Scoring(**fields[key])
        return Divergence(**fields)


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The first index where the answers differ (one ending early differs where it ended); None if equal."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def classify(plain: Scoring, verify: Scoring, spread: float, n_embd: int) -> tuple[str, float, float]:
    """(kind, margin, bound) of a divergence whose row scored so under the two scorings."""
    scale = max(abs(plain.top_logit), abs(verify.top_logit), abs(plain.logit_a), abs(plain.logit_b), 1.0)
    bound = max(n_embd * FLOAT32_UNIT * scale, SPREAD_FACTOR * spread)
    # Each answer's token must be its own scoring's argmax up to rounding, and the two candidates within rounding
    # of each other under both: then either is a valid greedy answer.
    trails = max(plain.top_logit - plain.logit_a, verify.top_logit - verify.logit_b,
                 plain.top_logit - plain.logit_b, verify.top_logit - verify.logit_a)  # fmt: skip
    gap = max(abs(plain.margin), abs(verify.margin))
    if not math.isfinite(trails) or trails > bound or gap > bound:
        return FAULT, max(trails, gap), bound
    return NEAR_TIE, gap, bound


class _ScratchRows:
    """Decodes on one sequence of the target context and reads one row's logits (the caller keeps that sequence
    idle and puts its state back afterwards)."""

    def __init__(self, ctx: Any, seq: int, n_batch: int, n_vocab: int) -> None:
        self._ctx = ctx
        self._seq = seq
        self._memory = SequenceMemory(ctx, "target", seq)
        self._n_batch = n_batch
        self._n_vocab = n_vocab

    def _decode(self, batch: TokenBatch, tokens: Sequence[int], pos0: int, outputs: str) -> None:
        batch.clear()
        batch.add(tokens, pos0, self._seq, outputs=outputs)
        batch.decode(self._ctx, "target")

    def row(self, prefix: Sequence[int], tail: Sequence[int]) -> np.ndarray:
        """The logits of the row of `prefix[-1]`, decoded first in a batch of itself + `tail` (all with outputs),
        after `prefix[:-1]` decoded in chunks of n_batch rows."""
        self._memory.clear()
        batch = TokenBatch(max(self._n_batch, 1 + len(tail)))
        try:
            head = list(prefix[:-1])
            for start in range(0, len(head), self._n_batch):
                self._decode(batch, head[start:start + self._n_batch], start, "none")
            self._decode(batch, [prefix[-1], *tail], len(head), "all")
            logits = logits_row(self._ctx, 0, self._n_vocab, "the target produced no logits for the scored row")
            return logits.astype(np.float64)
        finally:
            batch.free()
            self._memory.clear()


def _scoring(how: str, rows: int, logits: np.ndarray, a: int, b: int) -> Scoring:
    top = int(np.argmax(logits))
    return Scoring(how, rows, float(logits[a]), float(logits[b]), top, float(logits[top]))


def explain(ctx: Any, seq: int, *, n_batch: int, n_vocab: int, n_embd: int, eos: int, batch_invariant: bool,
            prompt: Sequence[int], a: Sequence[int], b: Sequence[int], verify_rows: int,
            piece: Any = None) -> Divergence:  # fmt: skip
    """The divergence of answers `a` and `b` to `prompt`, scored on sequence `seq` of the target context `ctx` (left
    empty). An answer that ended where the other goes on ended with `eos` there. `piece(token) -> str` names the
    candidates."""
    at = first_difference(a, b)
    if at is None:
        return Divergence(IDENTICAL, batch_invariant=batch_invariant)
    if not prompt:
        raise RequestError("the prompt is empty")
    token_a = a[at] if at < len(a) else eos
    token_b = b[at] if at < len(b) else eos
    prefix = [*prompt, *a[:at]]
    scratch = _ScratchRows(ctx, seq, n_batch, n_vocab)
    plain_logits = scratch.row(prefix, [])
    draft = [token_b, *b[at + 1:at + verify_rows - 1]][: max(0, verify_rows - 1)]
    verify_logits = scratch.row(prefix, draft)
    spread = float(np.max(np.abs(plain_logits - verify_logits)))
    plain = _scoring("plain", 1, plain_logits, token_a, token_b)
    verify = _scoring("verify", 1 + len(draft), verify_logits, token_a, token_b)
    kind, margin, bound = classify(plain, verify, spread, n_embd)
    name = piece or (lambda t: str(t))
    return Divergence(kind, at, token_a, token_b, name(token_a), name(token_b), plain, verify, margin, bound, spread,
                      batch_invariant)


__all__ = ["FAULT", "IDENTICAL", "NEAR_TIE", "Divergence", "Scoring", "classify", "explain", "first_difference"]
