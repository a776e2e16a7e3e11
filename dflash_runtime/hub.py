"""The model pair as a named preset read from environment variables, and its download from the Hugging Face Hub.

Every part of the default pair can be overridden without touching code:

| variable | meaning | default |
| --- | --- | --- |
| `DFLASH_PRESET_NAME` | name callers use to pick the pair | `qwen3.8-27b-dflash2` |
| `DFLASH_TARGET_REPO` / `_FILE` / `_REVISION` | target GGUF on the Hub | see `DEFAULT_TARGET` |
| `DFLASH_TARGET_PATH` | local target GGUF (skips the download) | unset |
| `DFLASH_DRAFT_REPO` / `_FILE` / `_REVISION` / `_PATH` | the same for the draft | see `DEFAULT_DRAFT` |
| `DFLASH_N_CTX` | context size in tokens | 16384 |
| `DFLASH_GPU_LAYERS` | layers offloaded to the GPU (-1 = all) | -1 |
| `DFLASH_DRAFT_MAX` | longest draft block | 7 |
| `DFLASH_CACHE_DIR` | download cache (else the Hugging Face cache) | unset |
| `HF_TOKEN` / `HF_ENDPOINT` | Hub token and endpoint, as for `huggingface_hub` | unset |
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from tqdm.std import tqdm

from .errors import DownloadError, ModelFileError

ProgressCallback = Callable[[int, int | None], None]
"""Called with (bytes done, total bytes or None) while a file downloads."""

DEFAULT_PRESET_NAME = "qwen3.8-27b-dflash2"
DEFAULT_N_CTX = 16384
DEFAULT_GPU_LAYERS = -1
DEFAULT_DRAFT_MAX = 7
_QUANT_PATTERN = re.compile(r"(NVFP4|MXFP4|IQ\d_[A-Z0-9_]+|Q\d_K(?:_[SML])?|Q\d_\d|BF16|F16|F32)", re.IGNORECASE)


@dataclass(frozen=True)
class ModelSource:
    """Where one GGUF file comes from: a local path, or a file of a Hub repository at a revision."""

    repo: str | None = None
    filename: str | None = None
    revision: str | None = None
    local_path: Path | None = None

    def describe(self) -> str:
        if self.local_path is not None:
            return str(self.local_path)
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


DEFAULT_TARGET = ModelSource(
    repo="utautako/Qwen3.8-27B-NVFP4-MTP-Q8attn-GGUF", filename="Qwen3.8-27B-NVFP4-MTP-Q8attn.gguf"
)
DEFAULT_DRAFT = ModelSource(repo="incoai/Qwen3.8-27B-DFlash2-GGUF", filename="Qwen3.8-27B-DFlash2-Q4_K_M.gguf")


@dataclass(frozen=True)
class PairPreset:
    """A named, fully configured target + draft pair: the only thing API callers can choose."""

    name: str
    label: str
    target: ModelSource
    draft: ModelSource
    n_ctx: int = DEFAULT_N_CTX
    n_gpu_layers: int = DEFAULT_GPU_LAYERS
    draft_max: int = DEFAULT_DRAFT_MAX
    random_weights: bool = False

    @property
    def quantisation(self) -> str:
        if self.random_weights:
            return "none (generated test weights)"
        return f"target {self.target.quantisation}, draft {self.draft.quantisation}"

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "label": self.label,
            "target": self.target.describe(),
            "draft": self.draft.describe(),
            "quantisation": self.quantisation,
            "n_ctx": self.n_ctx,
            "n_gpu_layers": self.n_gpu_layers,
            "draft_max": self.draft_max,
            "random_weights": self.random_weights,
        }


@dataclass(frozen=True)
class ResolvedPair:
    """Local paths of a preset's two files, ready for `load_pair`."""

    target_path: Path
    draft_path: Path


def _env_text(env: Mapping[str, str], name: str) -> str | None:
    value = env.get(name, "").strip()
    return value or None


def _env_int(env: Mapping[str, str], name: str, default: int, minimum: int) -> int:
    text = _env_text(env, name)
    if text is None:
        return default
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {text!r}") from None
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def source_from_env(env: Mapping[str, str], role: str, default: ModelSource) -> ModelSource:
    """Read DFLASH_<ROLE>_{REPO,FILE,REVISION,PATH}; a local path wins over the Hub."""
    prefix = f"DFLASH_{role.upper()}_"
    local_path = _env_text(env, prefix + "PATH")
    return ModelSource(
        repo=_env_text(env, prefix + "REPO") or default.repo,
        filename=_env_text(env, prefix + "FILE") or default.filename,
        revision=_env_text(env, prefix + "REVISION") or default.revision,
        local_path=Path(local_path).expanduser() if local_path else None,
    )


def overrides_in_env(env: Mapping[str, str]) -> list[str]:
    """Names of the model-source variables that are set (they mean "run this pair", not the offline demo)."""
    roles = ("TARGET", "DRAFT")
    parts = ("REPO", "FILE", "REVISION", "PATH")
    return [f"DFLASH_{r}_{p}" for r in roles for p in parts if _env_text(env, f"DFLASH_{r}_{p}")]


def preset_from_env(env: Mapping[str, str] | None = None) -> PairPreset:
    """The configured pair: the defaults above with every variable that is set applied."""
    env = os.environ if env is None else env
    target = source_from_env(env, "target", DEFAULT_TARGET)
    draft = source_from_env(env, "draft", DEFAULT_DRAFT)
    return PairPreset(
        name=_env_text(env, "DFLASH_PRESET_NAME") or DEFAULT_PRESET_NAME,
        label=f"{target.display_name} + {draft.display_name}",
        target=target,
        draft=draft,
        n_ctx=_env_int(env, "DFLASH_N_CTX", DEFAULT_N_CTX, minimum=256),
        n_gpu_layers=_env_int(env, "DFLASH_GPU_LAYERS", DEFAULT_GPU_LAYERS, minimum=-1),
        draft_max=_env_int(env, "DFLASH_DRAFT_MAX", DEFAULT_DRAFT_MAX, minimum=1),
    )


def with_local_files(preset: PairPreset, target_path: Path, draft_path: Path, **changes: Any) -> PairPreset:
    """A copy of `preset` that points at files already on disk (used for generated test models)."""
    return replace(
        preset, target=ModelSource(local_path=target_path), draft=ModelSource(local_path=draft_path), **changes
    )


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


def _explain_hub_failure(source: ModelSource, role: str, error: Exception) -> str:
    from huggingface_hub.errors import (
        EntryNotFoundError,
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    env_prefix = f"DFLASH_{role.upper()}"
    if isinstance(error, GatedRepoError):
        hint = "the repository is gated: accept its terms on the Hub and set HF_TOKEN"
    elif isinstance(error, RepositoryNotFoundError):
        hint = f"no such repository (or it is private: set HF_TOKEN); check {env_prefix}_REPO"
    elif isinstance(error, RevisionNotFoundError):
        hint = f"no such revision; check {env_prefix}_REVISION"
    elif isinstance(error, EntryNotFoundError):
        hint = f"no such file in the repository; check {env_prefix}_FILE"
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
        cache_dir = _env_text(env, "DFLASH_CACHE_DIR")
        return cls(
            preset,
            token=_env_text(env, "HF_TOKEN"),
            cache_dir=Path(cache_dir) if cache_dir else None,
            endpoint=_env_text(env, "HF_ENDPOINT"),
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
            draft = self._fetch(1, self.preset.draft)
        except (DownloadError, ModelFileError) as error:
            with self._lock:
                self._state, self._error = "failed", str(error)
        else:
            with self._lock:
                self._state, self._result = "done", ResolvedPair(target, draft)
        finally:
            self._finished.set()

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
