"""One exception family: every failure mode of the runtime has its own class and a message that says what to do."""

from __future__ import annotations


class DFlashError(Exception):
    """Base class of every error raised by dflash_runtime."""


class MissingSymbolsError(DFlashError, ImportError):
    """The loaded libllama lacks the DFlash ext functions (an old or foreign llama-cpp-python build)."""


class ModelFileError(DFlashError, ValueError):
    """A model file is missing, unreadable or not a GGUF file of the expected kind."""


class PairMismatchError(DFlashError, ValueError):
    """The draft does not fit the target (architecture, vocabulary, layer ids, width, mask token, draft length)."""


class ContextCreationError(DFlashError, RuntimeError):
    """libllama refused to create a model or a context."""


class PromptTooLongError(DFlashError, ValueError):
    """The prompt does not fit in the context window."""


class RequestError(DFlashError, ValueError):
    """A request parameter is out of range (temperature, max_tokens, draft_max, empty prompt, ...)."""


class DecodeError(DFlashError, RuntimeError):
    """A native decode returned a non-zero status."""


class RollbackError(DFlashError, RuntimeError):
    """The target or draft memory refused to roll back (e.g. a hybrid target opened without snapshots)."""


class EngineClosedError(DFlashError, RuntimeError):
    """The engine was used after close()."""


class EngineBusyError(DFlashError, RuntimeError):
    """The engine is serving another request: this thread holds a suspended stream, or the wait timed out."""


class DownloadError(DFlashError, OSError):
    """A model file could not be fetched from the Hub."""


class RemoteDeviceError(DFlashError, RuntimeError):
    """An RPC server that holds part of the pair cannot be reached, or went away during a request (the message names
    its endpoint); the engine that used it must be closed, and a new one loaded once the server is back."""
