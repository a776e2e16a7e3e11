"""Hugging Face Hub downloads of a preset's files, with progress readable from any thread and a retry after a
failure. `HF_TOKEN` / `HF_ENDPOINT` / `DFLASH_CACHE_DIR` configure the client."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

from ...errors import DownloadError, ModelFileError
from ...files.hub import ModelSource, fetch_model_file
from .presets import PairPreset, ResolvedPair, draft_unavailable, env_text, fallback_methods

log = logging.getLogger(__name__)

def _drafts_alone(target: Path) -> tuple[str, ...]:
    """The methods with a model that the target runs without its draft (an MTP head); an unreadable header says none
    (the load reports it)."""
    try:
        return fallback_methods(target)
    except ModelFileError:
        return ()


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
            fallback = _drafts_alone(target)
            if not fallback:
                raise
            log.warning("%s", draft_unavailable(str(error), fallback))
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
