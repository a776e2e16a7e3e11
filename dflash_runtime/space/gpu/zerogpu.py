"""The GPU function: where generation runs. On ZeroGPU, `@spaces.GPU` runs it in a worker process forked from the web
process and keeps that worker (and this module's engine host, with the loaded model) for the next call as long as no
exception escapes; elsewhere the decorator is a no-op and it runs in the web process itself.

One function serves chats and A/B comparisons, so both share one worker and one loaded engine.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

from ..gpu_job import GpuJob, ReplyChunk
from ..setup.settings import PublicSettings
from .host import EngineHost

try:  # ZeroGPU provides `spaces`; elsewhere its decorator is a no-op, and without it an identity stands in
    import spaces

    gpu: Callable[..., Any] = spaces.GPU
except ImportError:

    def gpu(task: Callable[..., Any] | None = None, **_settings: Any) -> Any:
        return task if callable(task) else (lambda function: function)


GPU_SIZES = ("large", "xlarge")


def gpu_size_from_env() -> str | None:
    """DFLASH_GPU_SIZE: "large" (half a card, ZeroGPU's default) or "xlarge" (the whole card)."""
    size = os.environ.get("DFLASH_GPU_SIZE", "").strip() or None
    if size is not None and size not in GPU_SIZES:
        raise ValueError(f"DFLASH_GPU_SIZE must be one of {GPU_SIZES}, got {size!r}")
    return size


def _load_pair(*args: Any, **kwargs: Any) -> Any:
    from ...engine import load_pair  # imported where generation runs: the web process of a ZeroGPU Space never loads it

    return load_pair(*args, **kwargs)


GPU_SIZE = gpu_size_from_env()
HOST = EngineHost(_load_pair, PublicSettings.from_env())  # the Space's one wait for the engine


def _requested_seconds(job: GpuJob) -> int:
    return job.gpu_seconds


@gpu(duration=_requested_seconds, size=GPU_SIZE)
def run_on_gpu(job: GpuJob) -> Iterator[ReplyChunk]:
    """Stream the job's reply. Runtime errors arrive as a final chunk (see EngineHost.run): the worker stays."""
    yield from HOST.run(job)


def quota_seconds(duration_s: int) -> int | None:
    """What ZeroGPU checks against the visitor's quota for `duration_s` (the platform's factor applied, as `spaces`
    computes it), or None off ZeroGPU, where nothing is charged."""
    if not hasattr(run_on_gpu, "zerogpu"):  # `spaces` marks the functions it wrapped for ZeroGPU
        return None
    from datetime import timedelta

    from spaces.zero import client

    return round(client.get_duration_seconds(timedelta(seconds=duration_s), GPU_SIZE))
