"""DFlash / DFlash 2 block-diffusion speculative decoding over llama-cpp-python's libllama."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

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

if TYPE_CHECKING:
    from .engine import Engine, load_pair

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # Heavy modules load on first use, so `import dflash_runtime` never touches libllama by itself.
    if name in ("Engine", "load_pair"):
        from . import engine

        return getattr(engine, name)
    if name in ("SessionPolicy",):
        from .cache.sessions import SessionPolicy

        return SessionPolicy
    if name in ("Verifiers",):
        from .decoding.verify import Verifiers

        return Verifiers
    if name in ("Stats",):
        from .results.stats import Stats

        return Stats
    if name in ("Result", "StreamEvent"):
        from .results import events

        return getattr(events, name)
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
