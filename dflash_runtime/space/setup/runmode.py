"""What this server runs: the configured pair, or the offline demo on generated tiny models, and why.

A bare `python app.py` on a laptop must not download 20 GB, and a Space whose installed llama-cpp-python cannot use
its GPU (a CPU-only build, or CUDA code for other GPUs) must not download the pair to run a 27B model on the CPU:
it serves the offline demo and says what is wrong and which command fixes it. Reads files and the start-up check's
facts only: nothing here touches CUDA.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .startup import arch_runs_on

DEMO_VALUES_TINY = ("tiny",)
DEMO_VALUES_REAL = ("off", "0", "false", "no", "real")
ZERO_GPU_CAPABILITY = (12, 0)  # ZeroGPU's RTX Pro 6000 Blackwell
FIX_COMMAND = "python prebuilt_wheels/build_wheel.py && python prebuilt_wheels/build_wheel.py publish --repo OWNER/NAME"
FIX_TEXT = (
    f"build and publish the CUDA wheel: `{FIX_COMMAND}` (OWNER/NAME: a public model repository of yours), "
    "then push the rewritten `requirements.txt` to the Space"
)


@dataclass(frozen=True)
class RunMode:
    """Whether the app serves generated tiny models (offline demo) or the configured pair, and why. `problems` are
    the reasons the configured pair cannot run on this machine's GPU, with `fix` the command that mends them."""

    tiny: bool
    reason: str
    problems: tuple[str, ...] = ()
    fix: str | None = None


def on_zero_gpu(env: Mapping[str, str] | None = None) -> bool:
    env = os.environ if env is None else env
    return env.get("SPACES_ZERO_GPU", "").lower() in ("1", "t", "true")


def cuda_device_present() -> bool:
    """An NVIDIA device node or driver entry exists; a file check only, so no CUDA context is created."""
    gpus = Path("/proc/driver/nvidia/gpus")
    return Path("/dev/nvidia0").exists() or (gpus.is_dir() and any(gpus.iterdir()))


def choose_run_mode(env: Mapping[str, str], overrides: Sequence[str], has_cuda: bool) -> RunMode:
    """DFLASH_DEMO=tiny forces the offline demo and DFLASH_DEMO=off the real pair; otherwise the real pair runs
    only where it can (ZeroGPU, a CUDA GPU, or model variables set), so a bare `python app.py` never starts a
    multi-GB download on a laptop."""
    demo = env.get("DFLASH_DEMO", "").strip().lower()
    if demo in DEMO_VALUES_TINY:
        return RunMode(True, "DFLASH_DEMO=tiny")
    if demo in DEMO_VALUES_REAL:
        return RunMode(False, f"DFLASH_DEMO={demo}")
    if demo not in ("", "auto"):
        raise ValueError(f"DFLASH_DEMO must be 'tiny', 'off' or 'auto', got {demo!r}")
    if on_zero_gpu(env):
        return RunMode(False, "running on ZeroGPU")
    if overrides:
        return RunMode(False, f"model variables set ({', '.join(overrides)})")
    if has_cuda:
        return RunMode(False, "a CUDA GPU is present")
    return RunMode(True, "no GPU, no ZeroGPU and no model variables")


def gpu_build_problems(build: Mapping[str, Any], zero_gpu: bool) -> list[str]:
    """Why the installed llama_cpp cannot run models on this machine's GPU ([] when it can), from the start-up
    check's facts. On ZeroGPU the web process sees no GPU, so the platform's own (compute 12.0) is assumed."""
    error = build.get("import_error") or build.get("probe_error")
    if error:
        return [f"llama-cpp-python does not load: {error}"]
    if not build.get("cuda_build"):
        return ["the installed llama-cpp-python is a CPU-only build: it has no CUDA backend, so the model pair "
                "would run on the CPU"]  # fmt: skip
    archs = build.get("compiled_architectures") or build.get("wheel_architectures") or []
    if zero_gpu:
        capabilities = [ZERO_GPU_CAPABILITY]
    else:
        capabilities = [tuple(device["compute_capability"]) for device in build.get("cuda_devices") or []]
    problems = []
    for major, minor in capabilities:
        if archs and not any(arch_runs_on(arch, (major, minor)) for arch in archs):
            problems.append(
                f"the installed llama-cpp-python has CUDA code for {', '.join(archs)} only, which does not run on "
                f"this GPU (compute {major}.{minor})"
            )
    return problems + [p for p in build.get("problems") or [] if p not in problems]


def settle_run_mode(mode: RunMode, build: Mapping[str, Any], *, zero_gpu: bool, has_cuda: bool,
                    n_gpu_layers: int) -> RunMode:  # fmt: skip
    """The run mode after the build check: where the pair should run on a GPU (ZeroGPU or a CUDA machine, layers
    offloaded) but this build cannot use it, the offline demo, with the problems and the fix."""
    if mode.tiny or not (zero_gpu or has_cuda) or n_gpu_layers == 0:
        return mode
    problems = gpu_build_problems(build, zero_gpu)
    if not problems:
        return mode
    where = "ZeroGPU" if zero_gpu else "this CUDA machine"
    return RunMode(True, f"the installed llama-cpp-python cannot use the GPU on {where}", tuple(problems), FIX_TEXT)
