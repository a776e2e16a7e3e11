"""Older spellings that still work, each with a DeprecationWarning: one rule for every renamed keyword and attribute.

Renamed so far: `draft_max=` → `draft_capacity=` (a pair's longest draft) and → `draft_length=` (a request's draft
length), `draft_policy=` → `draft_length=`, `Engine.draft_max` → `Engine.draft_capacity`, `Stats.draft_policy` →
`Stats.draft_length`.
"""

from __future__ import annotations

import warnings
from typing import Any

from .errors import RequestError


def renamed_keyword(old: str, new: str, old_value: Any, new_value: Any, default: Any, *, stacklevel: int = 3) -> Any:
    """The value of a renamed keyword: the new one, or the old one with a DeprecationWarning; both (and different) is
    an error (a RequestError, which is a ValueError)."""
    if old_value is None:
        return default if new_value is None else new_value
    renamed(f"{old}=", f"{new}=", stacklevel=stacklevel + 1)
    if new_value is not None and new_value != old_value:
        raise RequestError(f"give {new} or its older spelling {old}, not both")
    return old_value


def renamed(old: str, new: str, *, stacklevel: int = 2) -> None:
    """Warn that `old` is now spelled `new` (stacklevel counted from the caller of this function)."""
    warnings.warn(f"{old} is now {new}", DeprecationWarning, stacklevel=stacklevel + 1)
