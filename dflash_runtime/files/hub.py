"""Model files from the Hugging Face Hub (or a local path), for the Space and the llama-cpp-python drop-in alike: a
source, and one resumable, cached download with progress and a message that says what to fix. `HF_TOKEN` /
`HF_ENDPOINT` configure the client."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm.std import tqdm

from ..errors import DownloadError, ModelFileError

_QUANT_PATTERN = re.compile(r"(NVFP4|MXFP4|IQ\d_[A-Z0-9_]+|Q\d_K(?:_[SML])?|Q\d_\d|BF16|F16|F32)", re.IGNORECASE)


@dataclass(frozen=True)
class ModelSource:
    """Where one GGUF file comes from: a local path, or a file of a Hub repository at a revision."""

    repo: str | None = None
    filename: str | None = None
    revision: str | None = None
    local_path: Path | None = None

    def describe(self) -> str:
        """Where the file comes from, as visitors may read it: the Hub repo and file, or a local file's name (the
        server's directories stay private)."""
        if self.local_path is not None:
            return f"local file {self.local_path.name}"
        revision = f"@{self.revision}" if self.revision else ""
        return f"{self.repo}/{self.filename}{revision}"

    @property
    def display_name(self) -> str:
        return self.local_path.name if self.local_path is not None else str(self.filename)

    @property
    def quantisation(self) -> str:
        """Quantisation read from the file name (GGUF names carry it by convention); "unknown" when absent."""
        match = _QUANT_PATTERN.search(self.display_name)
        return match.group(1).upper() if match else "unknown"


ProgressCallback = Callable[[int, int | None], None]
"""Called with (bytes done, total bytes or None) while a file downloads."""


def _progress_bar_class(on_progress: ProgressCallback) -> type[tqdm]:
    """A tqdm class that reports every update to `on_progress` (huggingface_hub accepts one per download)."""

    class ReportingBar(tqdm):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs.pop("name", None)
            super().__init__(*args, **kwargs)
            self.bytes_done = int(kwargs.get("initial") or 0)
            on_progress(self.bytes_done, self.total)

        def update(self, n: float | None = 1) -> bool | None:
            self.bytes_done += int(n or 0)
            on_progress(self.bytes_done, self.total)
            return super().update(n)

    return ReportingBar


def _http_status(error: BaseException | None) -> int | None:
    """The HTTP status behind a Hub client error (itself or its cause), if any."""
    while error is not None:
        response = getattr(error, "response", None)
        status = getattr(response, "status_code", None)
        if isinstance(status, int):
            return status
        error = error.__cause__ or error.__context__
    return None


def _explain_hub_failure(source: ModelSource, role: str, error: Exception) -> str:
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RemoteEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    env_prefix = f"DFLASH_{role.upper()}"
    status = _http_status(error)
    # Most specific first: GatedRepoError is a RepositoryNotFoundError, and every "not found" class is an HTTP error.
    if isinstance(error, GatedRepoError):
        hint = "the repository is gated: accept its terms on the Hub and set HF_TOKEN"
    elif isinstance(error, RepositoryNotFoundError):
        hint = f"no such repository (or it is private: set HF_TOKEN); check {env_prefix}_REPO"
    elif isinstance(error, RevisionNotFoundError):
        hint = f"no such revision; check {env_prefix}_REVISION"
    elif isinstance(error, RemoteEntryNotFoundError):
        hint = f"no such file in the repository; check {env_prefix}_FILE"
    elif status is not None and status >= 500:
        # A Hub outage: the client retried and gave up (LocalEntryNotFoundError wraps it when the HEAD failed).
        hint = f"the Hub answered HTTP {status} (a Hub outage, not a problem with the configuration); retry later"
    elif isinstance(error, LocalEntryNotFoundError):
        hint = "the Hub is unreachable and the file is not cached yet; check the network and retry"
    else:
        hint = "the transfer failed (dropped connections are resumed, so the Hub kept failing); retry later"
    return f"Could not download the {role} {source.describe()}: {hint} ({type(error).__name__}: {error})"


def fetch_model_file(
    source: ModelSource,
    role: str,
    *,
    token: str | None = None,
    cache_dir: Path | None = None,
    endpoint: str | None = None,
    on_progress: ProgressCallback | None = None,
) -> Path:
    """Local path of one model file: the configured path, or a cached (resumable) Hub download."""
    if source.local_path is not None:
        if not source.local_path.is_file():
            env_name = f"DFLASH_{role.upper()}_PATH"
            raise ModelFileError(f"{env_name} points at {source.local_path}, which is not a file")
        return source.local_path
    if not source.repo or not source.filename:
        raise DownloadError(f"The {role} has no repository or file name; set DFLASH_{role.upper()}_REPO and _FILE")
    from huggingface_hub import hf_hub_download

    try:
        path = hf_hub_download(
            repo_id=source.repo,
            filename=source.filename,
            revision=source.revision,
            token=token,
            cache_dir=cache_dir,
            endpoint=endpoint,
            tqdm_class=_progress_bar_class(on_progress) if on_progress else None,
        )
    except Exception as error:  # the Hub client raises HTTP, OS and validation errors alike
        raise DownloadError(_explain_hub_failure(source, role, error)) from error
    return Path(path)
