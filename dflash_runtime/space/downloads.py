"""Hugging Face Hub downloads of a preset's files, with progress readable from any thread and a retry after a
failure. `HF_TOKEN` / `HF_ENDPOINT` / `DFLASH_CACHE_DIR` configure the client."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from tqdm.std import tqdm

from ..errors import DownloadError, ModelFileError
from .presets import ModelSource, PairPreset, ResolvedPair, draft_unavailable, env_text, has_mtp_head

log = logging.getLogger(__name__)

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


def _drafts_alone(target: Path) -> bool:
    """Whether the target can accelerate without its draft (an MTP head); an unreadable header says no (the load
    reports it)."""
    try:
        return has_mtp_head(target)
    except ModelFileError:
        return False


@dataclass
class FileProgress:
    role: str
    name: str
    bytes_done: int = 0
    bytes_total: int | None = None
    done: bool = False
    local: bool = False  # a configured local file: nothing to download

    @property
    def fraction(self) -> float | None:
        if self.done:
            return 1.0
        if not self.bytes_total:
            return None
        return min(self.bytes_done / self.bytes_total, 1.0)


@dataclass
class DownloadStatus:
    """A copy of the download state, safe to read from any thread."""

    state: str  # "idle", "running", "done" or "failed"
    files: list[FileProgress] = field(default_factory=list)
    error: str | None = None

    def summary(self) -> str:
        if self.state == "failed":
            return f"Download failed: {self.error}"
        parts = []
        for item in self.files:
            if item.local:
                parts.append(f"{item.role} {item.name}: local file")
                continue
            fraction = item.fraction
            percent = "…" if fraction is None else f"{fraction:.0%}"
            size = f"{item.bytes_done / 1e9:.2f}/{item.bytes_total / 1e9:.2f} GB" if item.bytes_total else ""
            parts.append(f"{item.role} {item.name}: {percent} {size}".rstrip())
        return "; ".join(parts) if parts else self.state


class PairDownload:
    """Fetches a preset's two files in a background thread, with progress readable at any time and a retry after a
    failure. huggingface_hub resumes a dropped transfer within one attempt and never leaves a partial file in the
    cache, so a retry starts clean; a file that completed stays cached and is not fetched again."""

    def __init__(
        self,
        preset: PairPreset,
        *,
        token: str | None = None,
        cache_dir: Path | None = None,
        endpoint: str | None = None,
    ) -> None:
        self.preset = preset
        self._token = token
        self._cache_dir = cache_dir
        self._endpoint = endpoint
        self._lock = threading.Lock()
        self._finished = threading.Event()
        self._thread: threading.Thread | None = None
        self._state = "idle"
        self._error: str | None = None
        self._result: ResolvedPair | None = None
        self._files = [
            FileProgress("target", preset.target.display_name),
            FileProgress("draft", preset.draft.display_name),
        ]

    @classmethod
    def from_env(cls, preset: PairPreset, env: Mapping[str, str] | None = None) -> PairDownload:
        env = os.environ if env is None else env
        cache_dir = env_text(env, "DFLASH_CACHE_DIR")
        return cls(
            preset,
            token=env_text(env, "HF_TOKEN"),
            cache_dir=Path(cache_dir) if cache_dir else None,
            endpoint=env_text(env, "HF_ENDPOINT"),
        )

    def start(self) -> None:
        """Begin (or, after a failure, retry) the download; does nothing while one runs or once it is done."""
        with self._lock:
            if self._state in ("running", "done"):
                return
            self._state, self._error = "running", None
            self._finished.clear()
            self._thread = threading.Thread(target=self._run, name="dflash-download", daemon=True)
            self._thread.start()

    def wait(self, timeout: float | None = None) -> ResolvedPair:
        """Start if needed, block until both files are local, and return their paths."""
        resolved = self.poll(timeout)
        if resolved is None:
            raise DownloadError(f"The model download is still running after {timeout} s: {self.status().summary()}")
        return resolved

    def poll(self, timeout: float | None) -> ResolvedPair | None:
        """Start if needed and wait up to `timeout` s: the paths when ready, None while running; raises on failure."""
        self.start()
        if not self._finished.wait(timeout):
            return None
        with self._lock:
            if self._result is None:
                raise DownloadError(self._error or "The model download failed")
            return self._result

    def status(self) -> DownloadStatus:
        with self._lock:
            files = [replace(item) for item in self._files]
            return DownloadStatus(self._state, files, self._error)

    def _run(self) -> None:
        try:
            target = self._fetch(0, self.preset.target)
            result = self._with_draft(target)
        except (DownloadError, ModelFileError) as error:
            with self._lock:
                self._state, self._error = "failed", str(error)
        else:
            with self._lock:
                self._state, self._result = "done", result
        finally:
            self._finished.set()

    def _with_draft(self, target: Path) -> ResolvedPair:
        """The pair with its draft; without it (and why) when the draft cannot be had but the target drafts with its
        own MTP head."""
        try:
            return ResolvedPair(target, self._fetch(1, self.preset.draft))
        except (DownloadError, ModelFileError) as error:
            if not _drafts_alone(target):
                raise
            log.warning("%s", draft_unavailable(str(error)))
            return ResolvedPair(target, None, draft_problem=str(error))

    def _fetch(self, index: int, source: ModelSource) -> Path:
        item = self._files[index]

        def record(done: int, total: int | None) -> None:
            with self._lock:
                item.bytes_done, item.bytes_total = done, total

        path = fetch_model_file(
            source,
            item.role,
            token=self._token,
            cache_dir=self._cache_dir,
            endpoint=self._endpoint,
            on_progress=record,
        )
        with self._lock:
            item.done, item.local = True, source.local_path is not None
            if item.bytes_total is None:
                item.bytes_total = item.bytes_done = path.stat().st_size
        return path
