"""Where the Space's environment settings are read: numbers from the environment (`env_number`), checked once, and
the one wait for the engine both processes share (`busy_timeout_from_env`). Each part's own settings (limits, the
HTTP gate, GPU time, clients) are read with these, where that part declares its defaults."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping

BUSY_TIMEOUT_S = 120.0  # DFLASH_BUSY_TIMEOUT_S unless set: a job's wait for the engine, in either process


def env_number(env: Mapping[str, str], name: str, default: float) -> float:
    """A positive number from the environment, `default` where it is unset or blank; ValueError names the setting."""
    text = env.get(name, "").strip()
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{name} must be a number, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a positive number, got {text!r}")
    return value


def busy_timeout_from_env(env: Mapping[str, str] | None = None) -> float:
    """DFLASH_BUSY_TIMEOUT_S: how long a job waits for the engine (the web process's seats, the engine host's)."""
    return env_number(os.environ if env is None else env, "DFLASH_BUSY_TIMEOUT_S", BUSY_TIMEOUT_S)
