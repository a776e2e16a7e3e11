"""The model pair as a named preset read from environment variables, or the offline demo's generated test models
(the run mode that picks between them: dflash_runtime.space.setup.runmode).

| variable | meaning | default |
| --- | --- | --- |
| `DFLASH_PRESET_NAME` | name callers use to pick the pair | `qwen3.8-27b-dflash2` |
| `DFLASH_TARGET_REPO` / `_FILE` / `_REVISION` | target GGUF on the Hub | see `DEFAULT_TARGET` |
| `DFLASH_TARGET_PATH` | local target GGUF (skips the download) | unset |
| `DFLASH_DRAFT_REPO` / `_FILE` / `_REVISION` / `_PATH` | the same for the draft | see `DEFAULT_DRAFT` |
| `DFLASH_N_CTX` | context size in tokens | 16384 |
| `DFLASH_GPU_LAYERS` | layers offloaded to the GPU (-1 = all) | -1 |
| `DFLASH_DRAFT_CAPACITY` | longest draft the pair is opened for (old name `DFLASH_DRAFT_MAX` still read) | 7 |
| `DFLASH_DEMO` | `tiny` = offline demo, `off` = the configured pair, unset = decide | unset |
| `DFLASH_DEMO_PAIR` | the offline demo's pair: `dense`, or `methods` (hybrid, MTP head + DFlash 2) | `dense` |
| `DFLASH_PARALLEL` | answers the engine runs at once (>= 1, or `auto`: 1 on ZeroGPU, else what fits, <= 4) | `auto` |
| `DFLASH_RPC` | comma list of RPC servers (`host:port`) whose devices take layers (docs/rpc.md) | unset |
| `DFLASH_NUMERICS` | `exact`: batch-invariant CPU kernels (bit-exact); `fast`: exact up to near-ties | `exact` |
| `DFLASH_BRANCHES` | spare target sequences for draft trees: with some, the menu offers DFlash 2 tree | `0` |
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ... import methods
from ...files.hub import ModelSource
from ..scrub import scrub_paths

log = logging.getLogger(__name__)
DEFAULT_PRESET_NAME = "qwen3.8-27b-dflash2"
DEFAULT_N_CTX = 16384
DEFAULT_GPU_LAYERS = -1
DEFAULT_DRAFT_CAPACITY = 7


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
    draft_capacity: int = DEFAULT_DRAFT_CAPACITY  # the longest draft the pair is opened for
    random_weights: bool = False
    parallel: int = 1  # the engine's parallel sequences: answers that run at once (see parallel_from_env)
    parallel_fit: bool = False  # `parallel` is a most: the engine opens as many sequences as fit in memory, up to it
    rpc: tuple[str, ...] = ()  # RPC servers whose devices take part of the layers (DFLASH_RPC)
    numerics: str = "exact"  # load_pair(numerics=...): "exact" (batch-invariant CPU kernels) or "fast"
    branches: int = 0  # spare target sequences for draft trees (DFLASH_BRANCHES): with some, "dflash-tree" runs

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
            "draft_capacity": self.draft_capacity,
            "random_weights": self.random_weights,
            "parallel": self.parallel,
            "parallel_fit": self.parallel_fit,
            "numerics": self.numerics,
            "branches": self.branches,
        }


@dataclass(frozen=True)
class ResolvedPair:
    """Local paths of a preset's two files, ready for `load_pair`; no draft (and why) when it could not be had and
    the target drafts with its own MTP head instead."""

    target_path: Path
    draft_path: Path | None
    draft_problem: str | None = None


def fallback_methods(target_path: Path) -> tuple[str, ...]:
    """The methods with a model that the target runs without its draft (the registry's `target_alone`: MTP with a
    nextn head), from its header: no model is opened. Where the draft is unusable, the pair opens without it when
    there is one."""
    from ...files.gguf_meta import read_gguf

    return methods.target_alone(read_gguf(target_path))


def pair_methods(target_path: Path, draft_path: Path | None, branches: int = 0) -> list[str]:
    """The methods a pair of these files runs, from their headers (the registry's `from_headers`), opened with
    `branches` spare target sequences."""
    from ...files.gguf_meta import read_gguf

    draft = read_gguf(draft_path) if draft_path else None
    return list(methods.from_headers(read_gguf(target_path), draft, branches=branches))


def draft_unavailable(why: str, fallback: Sequence[str]) -> str:
    """What the Space says when the pair drafts without its draft file, with the target's own `fallback` methods."""
    known = methods.registry()
    drafting = " or ".join(known[m].source or known[m].label for m in fallback if m in known) or "the target alone"
    return f"Draft unavailable: {why}; drafting with {drafting}"


def header_sampling_defaults(target_path: Path) -> dict[str, float | int]:
    """The target's recommended sampling from its GGUF header, read in the web process without opening the model."""
    from ...files.gguf_meta import read_gguf, sampling_defaults

    return sampling_defaults(read_gguf(target_path).keys.get)


def file_facts(files: ResolvedPair, branches: int, real: bool) -> tuple[dict[str, Any], dict[str, float | int]]:
    """What a pair's files tell from their headers, before any load: its methods and why it drafts without its draft
    (`draft_problem`), and a real target's recommended sampling."""
    fallback = fallback_methods(files.target_path)
    problem = files.draft_problem and draft_unavailable(scrub_paths(files.draft_problem), fallback)
    facts = {"methods": pair_methods(files.target_path, files.draft_path, branches), "draft_problem": problem or None}
    return facts, header_sampling_defaults(files.target_path) if real else {}


def env_text(env: Mapping[str, str], name: str) -> str | None:
    value = env.get(name, "").strip()
    return value or None


def env_int(env: Mapping[str, str], name: str, default: int, minimum: int) -> int:
    text = env_text(env, name)
    if text is None:
        return default
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {text!r}") from None
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


# DFLASH_PARALLEL=auto off ZeroGPU: a few answers share the engine, batched into one target decode per step, so a
# visitor does not wait for another's whole answer; more would make each answer slower for little more throughput.
# Fewer when fewer sequences fit in the memory that is free when the engine loads (footprint.plan_parallel).
AUTO_PARALLEL = 4
# On ZeroGPU `spaces` runs each concurrent call of the GPU function in a worker process of its own (its
# generator_function_wrapper forks a new Worker when the cached one is taken), so no two answers can share one engine.
ZERO_GPU_PARALLEL = 1


def parallel_from_env(env: Mapping[str, str], zero_gpu: bool) -> tuple[int, bool]:
    """DFLASH_PARALLEL: how many answers the engine runs at once, an integer >= 1 or `auto`, and whether that is a
    most that the free memory may lower (`auto` off ZeroGPU: up to AUTO_PARALLEL, as many as fit). On ZeroGPU only 1
    can take effect (see ZERO_GPU_PARALLEL): another value is an error at start."""
    text = (env_text(env, "DFLASH_PARALLEL") or "auto").lower()
    if text == "auto":
        return (ZERO_GPU_PARALLEL, False) if zero_gpu else (AUTO_PARALLEL, True)
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"DFLASH_PARALLEL must be an integer >= 1 or 'auto', got {text!r}") from None
    if value < 1:
        raise ValueError(f"DFLASH_PARALLEL must be an integer >= 1 or 'auto', got {value}")
    if zero_gpu and value != ZERO_GPU_PARALLEL:
        raise ValueError(
            f"DFLASH_PARALLEL={value} cannot take effect on ZeroGPU: `spaces` runs each concurrent GPU call in a "
            "worker process of its own, so answers cannot share one engine there; set DFLASH_PARALLEL=1 or auto"
        )
    return value, False


def source_from_env(env: Mapping[str, str], role: str, default: ModelSource) -> ModelSource:
    """Read DFLASH_<ROLE>_{REPO,FILE,REVISION,PATH}; a local path wins over the Hub."""
    prefix = f"DFLASH_{role.upper()}_"
    local_path = env_text(env, prefix + "PATH")
    return ModelSource(
        repo=env_text(env, prefix + "REPO") or default.repo,
        filename=env_text(env, prefix + "FILE") or default.filename,
        revision=env_text(env, prefix + "REVISION") or default.revision,
        local_path=Path(local_path).expanduser() if local_path else None,
    )


def overrides_in_env(env: Mapping[str, str]) -> list[str]:
    """Names of the model-source variables that are set (they mean "run this pair", not the offline demo)."""
    roles = ("TARGET", "DRAFT")
    parts = ("REPO", "FILE", "REVISION", "PATH")
    return [f"DFLASH_{r}_{p}" for r in roles for p in parts if env_text(env, f"DFLASH_{r}_{p}")]


def preset_from_env(env: Mapping[str, str] | None = None) -> PairPreset:
    """The configured pair: the defaults above with every variable that is set applied."""
    env = os.environ if env is None else env
    target = source_from_env(env, "target", DEFAULT_TARGET)
    draft = source_from_env(env, "draft", DEFAULT_DRAFT)
    return PairPreset(
        name=env_text(env, "DFLASH_PRESET_NAME") or DEFAULT_PRESET_NAME,
        label=f"{target.display_name} + {draft.display_name}",
        target=target,
        draft=draft,
        n_ctx=env_int(env, "DFLASH_N_CTX", DEFAULT_N_CTX, minimum=256),
        n_gpu_layers=env_int(env, "DFLASH_GPU_LAYERS", DEFAULT_GPU_LAYERS, minimum=-1),
        draft_capacity=draft_capacity_from_env(env),
        rpc=rpc_from_env(env),
        numerics=numerics_from_env(env),
        branches=env_int(env, "DFLASH_BRANCHES", 0, minimum=0),
    )


def rpc_from_env(env: Mapping[str, str]) -> tuple[str, ...]:
    """DFLASH_RPC: host:port endpoints, comma separated (checked here, so a typo stops the start)."""
    from ...native.rpc import parse_endpoint

    endpoints = tuple(e.strip() for e in (env_text(env, "DFLASH_RPC") or "").split(",") if e.strip())
    for endpoint in endpoints:
        parse_endpoint(endpoint)
    return endpoints


def numerics_from_env(env: Mapping[str, str]) -> str:
    """DFLASH_NUMERICS: "exact" (default) or "fast" (see dflash_runtime.pair: numerics)."""
    value = env_text(env, "DFLASH_NUMERICS") or "exact"
    if value not in ("exact", "fast"):
        raise ValueError(f"DFLASH_NUMERICS must be exact or fast, got {value!r}")
    return value


def draft_capacity_from_env(env: Mapping[str, str]) -> int:
    """DFLASH_DRAFT_CAPACITY, or its old name DFLASH_DRAFT_MAX (with a logged deprecation warning)."""
    if env_text(env, "DFLASH_DRAFT_CAPACITY") is None and env_text(env, "DFLASH_DRAFT_MAX") is not None:
        log.warning("DFLASH_DRAFT_MAX is deprecated: set DFLASH_DRAFT_CAPACITY (the same meaning)")
        return env_int(env, "DFLASH_DRAFT_MAX", DEFAULT_DRAFT_CAPACITY, minimum=1)
    return env_int(env, "DFLASH_DRAFT_CAPACITY", DEFAULT_DRAFT_CAPACITY, minimum=1)


def with_local_files(preset: PairPreset, target_path: Path, draft_path: Path, **changes: Any) -> PairPreset:
    """A copy of `preset` that points at files already on disk (used for generated test models)."""
    return replace(
        preset, target=ModelSource(local_path=target_path), draft=ModelSource(local_path=draft_path), **changes
    )


TINY_PRESET_NAME = "tiny-random"
TINY_N_CTX = 4096
# The offline demo's generated pair (dflash_runtime.testing: heads.py, words.py): a dense qwen3 target of width 512
# whose "words" head writes English words from a small Markov chain (the usual next word most of the time, another one
# where its context says so), and a one-layer DFlash 2 draft that proposes the chain's usual words: about as many
# tokens per verify as published DFlash 2 runs of the real pair keep, falling with the depth of the block as theirs do.
DEMO_PAIR: dict[str, Any] = {"target": "dense", "draft": "dflash2", "head": "words", "n_embd": 512, "dims": "scaled",
                             "draft_layers": 1}
# DFLASH_DEMO_PAIR=methods: a hybrid qwen35 target that carries an MTP block, with the "phrase" head (stretches of a
# phrase cycle that both drafts predict, random text between), so the demo runs both draft methods (the A/B shows
# plain / DFlash 2 / MTP).
DEMO_PAIRS: dict[str, tuple[dict[str, Any], str]] = {
    "dense": (DEMO_PAIR, "dense qwen3 target writing the words of a small Markov chain + DFlash 2 draft"),
    "methods": ({"target": "hybrid", "draft": "dflash2", "head": "phrase", "n_embd": 512, "dims": "scaled",
                 "mtp_layers": 1}, "hybrid qwen35 target with an MTP head, writing predictable stretches and random "
                 "text + DFlash 2 draft"),
}


# Makes (or finds) the offline demo's files for one of DEMO_PAIRS' specs: (target, draft). app.py hands in
# dflash_runtime.testing's generator, which the Space itself does not import.
DemoFiles = Callable[[Mapping[str, Any]], tuple[Path, Path]]


def configured_preset(tiny: bool, env: Mapping[str, str] | None = None,
                      demo_files: DemoFiles | None = None) -> PairPreset:
    """The pair this server offers: the environment's, or in the offline demo generated tiny models (CPU), made by
    `demo_files`."""
    env = os.environ if env is None else env
    preset = preset_from_env(env)
    if not tiny:
        return preset
    choice = env_text(env, "DFLASH_DEMO_PAIR") or "dense"
    if choice not in DEMO_PAIRS:
        raise ValueError(f"DFLASH_DEMO_PAIR must be one of {', '.join(DEMO_PAIRS)}, got {choice!r}")
    if demo_files is None:
        raise ValueError("the offline demo needs a maker of its generated models (demo_files); app.py hands it in")
    spec, description = DEMO_PAIRS[choice]
    target, draft = demo_files(spec)
    return with_local_files(
        preset,
        target,
        draft,
        name=TINY_PRESET_NAME,
        label=f"random-weight test models ({description}, generated)",
        n_ctx=preset.n_ctx if env.get("DFLASH_N_CTX", "").strip() else TINY_N_CTX,
        n_gpu_layers=preset.n_gpu_layers if preset.rpc else 0,  # with servers, DFLASH_GPU_LAYERS goes to them
        random_weights=True,
    )

