"""DFlash / DFlash 2 block-diffusion speculative decoding over llama-cpp-python's libllama."""

from __future__ import annotations

from typing import Any

from .errors import (
    ContextCreationError,
    DecodeError,
    DFlashError,
    DownloadError,
    EngineBusyError,
    EngineClosedError,
    MissingSymbolsError,
    ModelFileError,
    PairMismatchError,
    PromptTooLongError,
    RemoteDeviceError,
    RequestError,
    RollbackError,
)

__version__ = "0.1.0"


def load_pair(target_path: Any, draft_path: Any = None, *, numerics: str = "exact", **kwargs: Any) -> Any:
    """Open a target and (optionally) its DFlash draft, linked, and the target's MTP head when it has one; returns an
    Engine (see dflash_runtime.engine). `load_pair(target)` on a target with an MTP head gives an MTP engine.

    `numerics`: "exact" (default) opens a CPU target on kernels whose rows do not depend on their batch, so every
    temperature-0 answer is bit-identical to plain decoding's after any history; "fast" takes the fastest kernels
    (FlashAttention, repacked weights), exact up to near-ties. `engine.info()["numerics"]` says which holds and why
    (a GPU's kernels are never batch-invariant); docs/numerics.md."""
    from .engine import Engine

    return Engine(target_path, draft_path, numerics=numerics, **kwargs)


def __getattr__(name: str) -> Any:
    # Heavy modules load on first use, so `import dflash_runtime` never touches libllama by itself.
    if name in ("Engine",):
        from .engine import Engine

        return Engine
    if name in ("SessionPolicy",):
        from .sessions import SessionPolicy

        return SessionPolicy
    if name in ("Verifiers",):
        from .verify import Verifiers

        return Verifiers
    if name in ("Stats",):
        from .stats import Stats

        return Stats
    if name in ("Result", "StreamEvent"):
        from . import results

        return getattr(results, name)
    if name in ("DFlashLlama", "DFlashDraftModel", "ArrayDraft"):
        from . import llama_compat

        return getattr(llama_compat, name)
    raise AttributeError(name)


__all__ = [
    "ContextCreationError",
    "DFlashDraftModel",
    "DFlashError",
    "DFlashLlama",
    "DecodeError",
    "DownloadError",
    "Engine",
    "EngineBusyError",
    "EngineClosedError",
    "MissingSymbolsError",
    "ModelFileError",
    "PairMismatchError",
    "PromptTooLongError",
    "RemoteDeviceError",
    "RequestError",
    "Result",
    "RollbackError",
    "SessionPolicy",
    "Stats",
    "StreamEvent",
    "Verifiers",
    "load_pair",
]
