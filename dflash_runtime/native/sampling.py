"""The request's sampler: llama.cpp's `llama_sampler` on the target context, and the same sampler as probabilities.

`Sampler` draws with llama.cpp's samplers in a row (greedy, or top-k → top-p → min-p → temperature → dist): plain
decoding and sample-and-match verification use it. `SamplerDistribution` runs the same stages (llama.cpp's own
samplers, minus the final draw) over a logits row and returns the distribution the sampler would draw from, as numpy
arrays over the candidates it keeps: rejection-sampling verification compares that p with the draft's q.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any

import numpy as np
from llama_cpp import llama_cpp as ll

from ..errors import RequestError

VERIFY_MODES = ("sample", "match")
TOKEN_DATA = np.dtype([("id", np.int32), ("logit", np.float32), ("p", np.float32)], align=True)


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 40
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None

    def check(self) -> None:
        if not self.temperature >= 0.0 or self.temperature == float("inf"):
            raise RequestError(f"temperature must be a finite number ≥ 0 (got {self.temperature})")
        if self.top_k < 0:
            raise RequestError(f"top_k must be ≥ 0 (got {self.top_k}; 0 disables it)")
        if not 0.0 < self.top_p <= 1.0:
            raise RequestError(f"top_p must be in (0, 1] (got {self.top_p})")
        if not 0.0 <= self.min_p < 1.0:
            raise RequestError(f"min_p must be in [0, 1) (got {self.min_p})")
        if self.seed is not None and not 0 <= self.seed < 2**32:
            raise RequestError(f"seed must be in [0, 2^32) (got {self.seed})")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _stages(p: SamplingParams) -> list[Any]:
    """The sampler's stages before the draw, in llama.cpp's order."""
    stages = []
    if p.top_k > 0:
        stages.append(ll.llama_sampler_init_top_k(p.top_k))
    if p.top_p < 1.0:
        stages.append(ll.llama_sampler_init_top_p(p.top_p, 1))
    if p.min_p > 0.0:
        stages.append(ll.llama_sampler_init_min_p(p.min_p, 1))
    stages.append(ll.llama_sampler_init_temp(p.temperature))
    return stages


def _native_sampler(stages: list[Any]) -> Any:
    """One llama_sampler running `stages` in order (llama.cpp's `llama_sampler_chain`)."""
    sampler = ll.llama_sampler_chain_init(ll.llama_sampler_chain_default_params())
    for stage in stages:
        ll.llama_sampler_chain_add(sampler, stage)  # the sampler takes ownership
    return sampler


class Sampler:
    """Owns one native sampler; `sample(ctx, row)` draws from row `row` of the last decode and accepts the draw."""

    def __init__(self, params: SamplingParams) -> None:
        params.check()
        if params.greedy:
            stages = [ll.llama_sampler_init_greedy()]
        else:
            seed = ll.LLAMA_DEFAULT_SEED if params.seed is None else params.seed
            stages = [*_stages(params), ll.llama_sampler_init_dist(seed)]
        self._native = _native_sampler(stages)

    def sample(self, ctx: Any, row: int) -> int:
        return int(ll.llama_sampler_sample(self._native, ctx, row))

    def free(self) -> None:
        if self._native:
            ll.llama_sampler_free(self._native)
            self._native = None

    def __enter__(self) -> Sampler:
        return self

    def __exit__(self, *exc: object) -> None:
        self.free()


class SamplerDistribution:
    """The distribution the request's sampler draws from, for any logits row (temperature > 0 only)."""

    def __init__(self, params: SamplingParams, capacity: int) -> None:
        params.check()
        if params.greedy:
            raise ValueError("temperature 0 has no distribution to compare: it is greedy")
        self._native = _native_sampler(_stages(params))
        self._data = np.zeros(capacity, dtype=TOKEN_DATA)
        self._ids = np.arange(capacity, dtype=np.int32)
        self._array = ll.llama_token_data_array()
        self._data_type = ctypes.POINTER(ll.llama_token_data)

    def __call__(self, logits: np.ndarray, ids: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(token ids, probabilities) kept by the sampler for `logits` (over `ids`, default 0..len-1), probabilities
        in float64 and summing to 1."""
        n = logits.shape[0]
        data = self._data[:n]
        data["id"] = self._ids[:n] if ids is None else ids
        data["logit"] = logits
        data["p"] = 0.0
        arr = self._array
        arr.data = data.ctypes.data_as(self._data_type)
        arr.size, arr.selected, arr.sorted = n, -1, False
        ll.llama_sampler_apply(self._native, ctypes.byref(arr))
        # Samplers may point `data` at a buffer of their own: read what the array says, not our copy.
        kept = np.ctypeslib.as_array(ctypes.cast(arr.data, ctypes.POINTER(ctypes.c_uint8)),
                                     shape=(arr.size * TOKEN_DATA.itemsize,)).view(TOKEN_DATA)
        out_ids = kept["id"].astype(np.int64)
        z = kept["logit"].astype(np.float64)
        z -= z.max()
        probs = np.exp(z)
        probs /= probs.sum()
        return out_ids, probs

    def free(self) -> None:
        if self._native:
            ll.llama_sampler_free(self._native)
            self._native = None
