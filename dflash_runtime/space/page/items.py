"""What one /chat item carries: what changed since the item before, so that a stream's bytes grow with the answer's
length, not with its square nor with the digits of its running totals.

An item is (the text one step added, its statistics). Its statistics hold:

- `added`: the counts and times that grew since the item before, by how much (`n_generated`, `drafted`,
  `accepted`, `verify_steps`, `decode_ms`, ..., per-position counts element by element), only those that grew;
  summed over the items they are the answer's totals;
- `source_runs` and `draft_lengths`: who wrote this item's text, and the draft lengths of its steps (concatenated,
  the answer's);
- every other figure whose value changed since the item before (all of them on the first item): the rates so far
  (`decode_tok_s`, `acceptance_rate`, `mean_accepted_length`), `notice`, `method`, ...;
- on the last item (`finish_reason` set): the complete statistics as well, as /generate returns them, so a client
  that reads only the last item has everything. `drafted_by` (one entry per step) and `controller` (the adaptive
  draft length's model: about a kilobyte, new at every step) come there only.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# Counts and times that only grow during an answer: an item sends what they grew by, under `added`.
GROWING = ("n_generated", "verify_steps", "plain_steps", "target_steps", "drafted", "accepted", "verify_emitted",
           "prefill_ms", "draft_ms", "inject_ms", "verify_ms", "plain_ms", "native_ms", "decode_ms", "host_ms",
           "checkpoint_restore_ms", "checkpoints_saved", "checkpoint_bytes", "checkpoint_save_ms",
           "tree_steps", "tree_nodes", "tree_rows", "tree_accepted", "tree_off_spine", "tree_host_bytes",
           "gpu_seconds_used")  # fmt: skip
GROWING_PER_POSITION = ("accepted_per_position", "drafted_per_position")
# What an item carries for its own text only (the reply's statistics hold them for the whole answer).
ITEM_OWN = ("source_runs", "draft_lengths")
# Sent on the last item only: `drafted_by` grows by one entry per step, `controller` is a diagnostic of about a
# kilobyte that changes at every step (it would be most of an item's bytes).
LAST_ONLY = ("drafted_by", "controller")
# What an item sends otherwise than as its new value.
NOT_AS_VALUES = frozenset({*GROWING, *GROWING_PER_POSITION, *ITEM_OWN, *LAST_ONLY})


def grown_by(now: Any, before: Any) -> Any:
    """How much a count or a time grew (0 where it did not, or is not a number yet)."""
    if not isinstance(now, int | float) or isinstance(now, bool):
        return 0
    base = before if isinstance(before, int | float) and not isinstance(before, bool) else 0
    if isinstance(now, int) and isinstance(base, int):
        return now - base
    return round(now - base, 3)


def grown_per_position(now: Any, before: Any) -> list[int]:
    """How much each position's count grew, trailing zeros left out ([] where none grew)."""
    now, before = list(now or []), list(before or [])
    grown = [value - (before[i] if i < len(before) else 0) for i, value in enumerate(now)]
    while grown and grown[-1] == 0:
        grown.pop()
    return grown


def added_since(stats: Mapping[str, Any], before: Mapping[str, Any]) -> dict[str, Any]:
    """The counts and times that grew from `before` to `stats`, by how much."""
    added: dict[str, Any] = {}
    for key in GROWING:
        if key in stats and (grown := grown_by(stats[key], before.get(key))):
            added[key] = grown
    for key in GROWING_PER_POSITION:
        if key in stats and (per_position := grown_per_position(stats[key], before.get(key))):
            added[key] = per_position
    return added


def item_stats(stats: Mapping[str, Any], before: Mapping[str, Any], own: Mapping[str, Any],
               finished: bool) -> dict[str, Any]:  # fmt: skip
    """One /chat item's statistics (see the module doc). `stats`: the answer's statistics after this item; `before`:
    after the item before ({} for the first); `own`: this item's own `source_runs` and `draft_lengths`; `finished`:
    whether this is the answer's last item."""
    item: dict[str, Any] = {"added": added_since(stats, before)}
    if finished:
        item.update(stats)
    else:
        item.update({key: value for key, value in stats.items()
                     if key not in NOT_AS_VALUES and (key not in before or before[key] != value)})  # fmt: skip
    item.update({key: own[key] for key in ITEM_OWN})
    return item
