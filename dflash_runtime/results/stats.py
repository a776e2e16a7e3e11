"""Live statistics of one request, JSON-serialisable."""

from __future__ import annotations

import copy
import json
from dataclasses import asdict, dataclass, field
from typing import Any

from ..deprecated import renamed


def tokens_per_verify(emitted: int | float, verify_steps: int | float) -> float:
    """The mean accepted length: tokens per verify step, the target's own one (after the accepted drafts) included.
    1.0 where no step verified a draft: every token was then the target's own, one a step, as in plain decoding (one
    definition for the engine, the Space, the benchmarks and the pages: nothing accepted reads 1.0 everywhere)."""
    return emitted / verify_steps if verify_steps else 1.0


@dataclass
class Stats:
    n_prompt: int = 0               # prompt tokens of the request
    n_reused: int = 0               # of which found in the KV cache from the previous request
    n_prefilled: int = 0            # of which decoded now (n_prompt − n_reused)
    n_generated: int = 0            # tokens emitted (end-of-generation token excluded)
    verify_steps: int = 0           # target decodes that checked at least one drafted token
    plain_steps: int = 0            # target decodes of a single token (no draft)
    drafted: int = 0                # drafted tokens sent to verification
    accepted: int = 0               # of which the target accepted
    verify_emitted: int = 0         # tokens emitted by verify steps (accepted drafts + the token after them)
    accepted_per_position: list[int] = field(default_factory=list)  # [i]: times draft position i+1 was accepted
    drafted_per_position: list[int] = field(default_factory=list)   # [i]: times draft position i+1 was verified
    draft_lengths: list[int] = field(default_factory=list)          # draft length chosen at each round
    drafted_by: list[str] = field(default_factory=list)  # the method that drafted each verify step (a list's member)
    prefill_ms: float = 0.0
    draft_ms: float = 0.0           # draft block decode + lattice walk
    inject_ms: float = 0.0          # target features → draft cache
    verify_ms: float = 0.0          # target decode of [id_last, drafts] + sampling, at every step (plain ones too)
    plain_ms: float = 0.0           # of which the plain steps' (one row, no draft)
    native_ms: float = 0.0          # time inside libllama calls after the prefill
    decode_ms: float = 0.0          # wall time after the prefill
    speculative: bool = True
    method: str | None = None       # the draft method or method list ("dflash", "ngram-mod,dflash"); None: plain
    draft_capacity: int = 0         # the method's longest draft
    draft_length: int | str = 0     # the request's draft length: "auto" or a fixed length
    verify_mode: str = "plain"      # "greedy" (temperature 0), "sample" or "match" (above it), "plain" (no draft)
    checkpoint_restored_at: int | None = None  # a hybrid target went back through the checkpoint at this position
    checkpoint_restore_ms: float = 0.0
    checkpoints_saved: int = 0      # recurrent-state checkpoints saved during the request
    checkpoint_bytes: int = 0       # their size
    checkpoint_save_ms: float = 0.0
    controller: dict[str, Any] = field(default_factory=dict)
    tree_steps: int = 0             # verify steps of a draft tree (method "dflash-tree"; counted in verify_steps too)
    tree_nodes: int = 0             # the nodes those trees held
    tree_rows: int = 0              # the verify rows they took (each path's copy of the rows it shares included)
    tree_accepted: int = 0          # accepted path lengths, summed
    tree_off_spine: int = 0         # trees whose accepted path left the spine (decoded before the next step's rows)
    tree_host_bytes: int = 0        # target state the trees' paths got through host memory (0: on the device)

    @property
    def draft_policy(self) -> int | str:
        """The older name of `draft_length`."""
        renamed("Stats.draft_policy", "Stats.draft_length")
        return self.draft_length

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per verify step, the token after the accepted drafts included (see `tokens_per_verify`)."""
        return tokens_per_verify(self.verify_emitted, self.verify_steps)

    @property
    def decode_tok_s(self) -> float:
        return self.n_generated / (self.decode_ms / 1000.0) if self.decode_ms > 0 else 0.0

    @property
    def host_ms(self) -> float:
        """Time spent in Python between native calls after the prefill."""
        return max(0.0, self.decode_ms - self.native_ms)

    @property
    def target_steps(self) -> int:
        return self.verify_steps + self.plain_steps

    def record_verify(self, n_drafted: int, n_accepted: int, n_emitted: int, method: str | None = None) -> None:
        self.verify_steps += 1
        if method is not None:
            self.drafted_by.append(method)
        self.drafted += n_drafted
        self.accepted += n_accepted
        self.verify_emitted += n_emitted
        grow = n_drafted - len(self.drafted_per_position)
        if grow > 0:
            self.drafted_per_position.extend([0] * grow)
            self.accepted_per_position.extend([0] * grow)
        for i in range(n_drafted):
            self.drafted_per_position[i] += 1
        for i in range(n_accepted):
            self.accepted_per_position[i] += 1

    def record_tree(self, n_nodes: int, n_rows: int, n_accepted: int, off_spine: bool) -> None:
        self.tree_steps += 1
        self.tree_nodes += n_nodes
        self.tree_rows += n_rows
        self.tree_accepted += n_accepted
        self.tree_off_spine += int(off_spine)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(
            acceptance_rate=round(self.acceptance_rate, 4),
            mean_accepted_length=round(self.mean_accepted_length, 4),
            decode_tok_s=round(self.decode_tok_s, 2),
            host_ms=round(self.host_ms, 3),
            target_steps=self.target_steps,
        )
        for k in ("prefill_ms", "draft_ms", "inject_ms", "verify_ms", "plain_ms", "native_ms", "decode_ms",
                  "checkpoint_restore_ms", "checkpoint_save_ms"):
            d[k] = round(d[k], 3)
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    def snapshot(self) -> Stats:
        """A copy taken at every stream event: shallow, lists copied (asdict would deep-copy per element)."""
        snap = copy.copy(self)
        for name in ("accepted_per_position", "drafted_per_position", "draft_lengths", "drafted_by"):
            setattr(snap, name, list(getattr(self, name)))
        snap.controller = dict(self.controller)
        return snap
