"""The Space's settings table: every per-client limit and time of the public layer, with its environment variable, its
default and why it is what it is (`PublicSettings`), read once; docs/settings.md's table is this one
(tests/test_settings_table.py). `env_number` reads the other parts' numbers (limits, presets) the same way."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

KIB = 1024


def env_number(env: Mapping[str, str], name: str, default: float, off: bool = False) -> float:
    """A positive number (or 0 where `off` allows it) from the environment, `default` where it is unset or blank;
    ValueError names the setting."""
    text = env.get(name, "").strip()
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{name} must be a number, got {text!r}") from None
    if not math.isfinite(value) or value < 0 or (value == 0 and not off):
        raise ValueError(f"{name} must be a {'non-negative' if off else 'positive'} number, got {text!r}")
    return value


def setting(default: float, env: str, why: str, shown: str = "", off: bool = False) -> Any:
    """A row of the table: a field's default, its variable, one line of why, how the docs show the default."""
    return field(default=default, metadata={"env": env, "why": why, "shown": shown or f"{default:g}", "off": off})


@dataclass(frozen=True)
class PublicSettings:
    """The public layer's settings (docs/public-space.md says where each rule uses them)."""

    client_jobs: int = setting(8, "DFLASH_CLIENT_JOBS", "answers one client (its address) may have queued or running: "
                               "room for a conversation and an A/B run, not for a crowd of its own")
    session_jobs: int = setting(3, "DFLASH_SESSION_JOBS", "the same for one session: a tab runs one answer and an A/B")
    total_jobs: int = setting(64, "DFLASH_TOTAL_JOBS", "the same for everybody, at most Gradio's queue "
                              "(`DFLASH_QUEUE_SIZE`): each admitted answer holds a handler thread")
    client_events: int = setting(4, "DFLASH_CLIENT_EVENTS", "waiting events of the page's other queued functions per "
                                 "client: a page has one or two at once, a flood holds no queue")
    max_body_bytes: int = setting(1 << 20, "DFLASH_MAX_BODY_BYTES", "the longest request body: the longest history the "
                                  "limits keep fits, a 34 MB one is never read", "1 MiB")
    session_hash_chars: int = setting(128, "DFLASH_SESSION_HASH_CHARS", "the longest session hash (Gradio's are 11 "
                                      "characters, gradio_client's 36): a key, not a payload")
    reader_timeout_s: float = setting(3.0, "DFLASH_READER_TIMEOUT_S", "how long an answer may wait or run with nobody "
                                      "reading it: a page opens its stream within a second")
    busy_timeout_s: float = setting(120.0, "DFLASH_BUSY_TIMEOUT_S", "the one wait for the engine (a job for its seat, "
                                    "a GPU call for the worker's engine), counted while its client is not served")
    quantum_s: float = setting(1.0, "DFLASH_QUANTUM_S", "a turn: how long an answer keeps its seat before it yields "
                               "to a client holding one fewer (a newcomer's first item within ⌈C / S⌉ turns; a yield "
                               "costs a park and one token again)")
    poll_s: float = setting(0.5, "DFLASH_POLL_S", "how often a waiting job looks at its turn and its readers (it "
                            "looks at once when a transition changes a turn, and when a seat holder's quantum ends)")
    prefill_chunk: int = setting(8, "DFLASH_PREFILL_CHUNK", "the most prompt tokens of one answer an engine step takes "
                                 "while other answers share it, about a verify step's rows: a long prompt costs their "
                                 "steps little and may yield at each chunk (a GPU, whose rows cost little, may take "
                                 "more; 0: the step's whole budget)", off=True)
    probe_bytes_s: float = setting(48 * KIB, "DFLASH_READER_PROBE_BYTES_S", "the least traffic of a running answer's "
                                   "stream, so that a reader that stops reading fills its window within seconds "
                                   "(0: off, where a proxy notices)", "48 KiB/s", off=True)
    probe_client_bytes_s: float = setting(96 * KIB, "DFLASH_READER_PROBE_CLIENT_BYTES_S", "the most padding a second "
                                          "for all the streams of one client", "96 KiB/s")
    probe_total_bytes_s: float = setting(512 * KIB, "DFLASH_READER_PROBE_TOTAL_BYTES_S", "the most padding a second "
                                         "for every stream", "512 KiB/s")
    probe_per_item: float = setting(1.0, "DFLASH_READER_PROBE_PER_ITEM", "beyond its first 10 s of floor, a stream's "
                                    "padding is at most this many times its items' bytes (the whole floor while its "
                                    "answer sends nothing): its bytes follow its answer's length, not its time")
    trusted_proxy_hops: int = setting(0, "DFLASH_TRUSTED_PROXY_HOPS", "hops at the end of `X-Forwarded-For` that "
                                      "trusted proxies added (the client is the first of them)", "1 on a Space, else 0",
                                      off=True)
    parked_per_client: int = setting(2, "DFLASH_PARKED_PER_CLIENT", "conversations' cache states one client keeps "
                                     "parked (of the engine's 8): its newer sessions evict its own older ones")
    active_share: float = setting(0.5, "DFLASH_ACTIVE_SHARE", "the share of parked states kept for conversations in "
                                  "use (their owner came back): one-off calls make room among themselves first")
    estimate_window: int = setting(32, "DFLASH_ESTIMATE_WINDOW", "recent clients whose votes make each GPU-time figure")
    estimate_per_client: int = setting(3, "DFLASH_ESTIMATE_PER_CLIENT", "a client's answers behind its one vote")
    estimate_voters: int = setting(3, "DFLASH_ESTIMATE_VOTERS", "distinct clients a figure waits for before it moves "
                                   "from its default: one visitor's calls tell nothing of their text through /info")
    gpu_seconds_max: int = setting(240, "DFLASH_GPU_SECONDS_MAX", "the most GPU time a request asks ZeroGPU for")
    gpu_seconds_base: float = setting(5.0, "DFLASH_GPU_SECONDS_BASE", "slack added to every request's GPU time")
    gpu_load_s: float = setting(30.0, "DFLASH_GPU_LOAD_SECONDS", "a new worker's model load, until measured")
    gpu_decode_tok_s: float = setting(20.0, "DFLASH_GPU_DECODE_TOK_S", "decode speed, until three clients' answers "
                                      "measured it")
    gpu_prefill_tok_s: float = setting(500.0, "DFLASH_GPU_PREFILL_TOK_S", "prefill speed, until measured so")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, queue_size: int | None = None) -> PublicSettings:
        env = os.environ if env is None else env
        defaults = replace(cls(), trusted_proxy_hops=1 if env.get("SPACE_ID") else 0)
        values = {f.name: type(f.default)(_counted(f.type in ("int", int), f.metadata["env"], env_number(
            env, f.metadata["env"], getattr(defaults, f.name), f.metadata["off"]))) for f in fields(cls)}  # fmt: skip
        if queue_size:
            values["total_jobs"] = min(values["total_jobs"], queue_size)
        return cls(**values)


def queue_size(env: Mapping[str, str] | None = None) -> int:
    """Gradio's queue (`DFLASH_QUEUE_SIZE`, 64 events waiting at once): the answers counted never exceed it."""
    env = os.environ if env is None else env
    return int(_counted(True, "DFLASH_QUEUE_SIZE", env_number(env, "DFLASH_QUEUE_SIZE", 64)))


def _counted(count: bool, name: str, value: float) -> float:
    """`value`, a whole number where the setting is a count (never rounded down: 0.5 answers is not 0)."""
    if count and not float(value).is_integer():
        raise ValueError(f"{name} must be a whole number, got {value}")
    return value


def settings_table() -> str:
    """The table as docs/settings.md shows it."""
    rows = [f"| `{f.metadata['env']}` | {f.metadata['shown']} | {f.metadata['why']} |" for f in fields(PublicSettings)]
    return "\n".join(["| variable | default | why |", "| --- | --- | --- |", *rows])
