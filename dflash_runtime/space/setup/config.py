"""What the Space serves, read once at start from the environment and the start-up check's facts: the run mode, the
pair and its download, the build, where it runs and the public layer's settings, with the server's paths cut from
what a visitor reads."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from ..scrub import scrub_paths
from . import presets
from .downloads import PairDownload
from .presets import DemoFiles, PairPreset
from .runmode import RunMode, choose_run_mode, cuda_device_present, on_zero_gpu, settle_run_mode
from .settings import PublicSettings, queue_size

BUILD_KEYS = ("llama_cpp_version", "cuda_build", "gpu_offload", "cuda_devices", "wheel_architectures",
              "compiled_architectures", "dflash_missing_symbols", "problems", "ok")  # fmt: skip


@dataclass(frozen=True)
class SpaceConfig:
    mode: RunMode
    preset: PairPreset
    download: PairDownload
    build_status: str
    build: Mapping[str, Any]  # the start-up check's facts that /info and the page show (BUILD_KEYS)
    zero_gpu: bool = False
    gpu_size: str | None = None  # the ZeroGPU slice asked for
    show_diagnostics: bool = False  # DFLASH_DIAGNOSTICS: the processes' facts in /info, for the operator
    settings: PublicSettings = field(default_factory=PublicSettings)

    @classmethod
    def from_env(cls, build_status: str, build: Mapping[str, Any], env: Mapping[str, str] | None = None,
                 demo_files: DemoFiles | None = None, gpu_size: str | None = None) -> SpaceConfig:  # fmt: skip
        """The configuration, given the start-up check's result; `demo_files` makes the offline demo's models."""
        env = os.environ if env is None else env
        zero_gpu, has_cuda = on_zero_gpu(env), cuda_device_present()
        mode = choose_run_mode(env, presets.overrides_in_env(env), has_cuda)
        mode = settle_run_mode(mode, build, zero_gpu=zero_gpu, has_cuda=has_cuda,
                               n_gpu_layers=presets.configured_preset(False, env).n_gpu_layers)  # fmt: skip
        parallel, fit = presets.parallel_from_env(env, zero_gpu)
        preset = replace(presets.configured_preset(mode.tiny, env, demo_files), parallel=parallel, parallel_fit=fit)
        return cls(replace(mode, problems=tuple(map(scrub_paths, mode.problems))), preset,
                   PairDownload.from_env(preset, env), scrub_paths(build_status),
                   {key: _scrubbed(build.get(key)) for key in BUILD_KEYS}, zero_gpu, gpu_size,
                   env.get("DFLASH_DIAGNOSTICS", "").strip() in ("1", "true", "yes"),
                   PublicSettings.from_env(env, queue_size(env)))


def _scrubbed(value: Any) -> Any:
    if isinstance(value, str):
        return scrub_paths(value)
    return [_scrubbed(item) for item in value] if isinstance(value, list) else value
