"""The request's sampler chain, a `llama_sampler` on the target context.

Sample-and-match draws exactly once per emitted token, so with the same seed speculative and plain decoding make
the same draws and emit the same text, at any temperature.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from llama_cpp import llama_cpp as ll

from .errors import RequestError


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 40
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None

    def check(self) -> None:
        if not self.temperature >= 0.0:
            raise RequestError(f"temperature must be ≥ 0 (got {self.temperature})")
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


class Sampler:
    """Owns one sampler chain; `sample(ctx, row)` draws from row `row` of the last decode and accepts the draw."""

    def __init__(self, params: SamplingParams) -> None:
        params.check()
        self._chain = ll.llama_sampler_chain_init(ll.llama_sampler_chain_default_params())
        for smpl in self._links(params):
            ll.llama_sampler_chain_add(self._chain, smpl)  # the chain takes ownership

    @staticmethod
    def _links(p: SamplingParams) -> list[Any]:
        if p.greedy:
            return [ll.llama_sampler_init_greedy()]
        links = []
        if p.top_k > 0:
            links.append(ll.llama_sampler_init_top_k(p.top_k))
        if p.top_p < 1.0:
            links.append(ll.llama_sampler_init_top_p(p.top_p, 1))
        if p.min_p > 0.0:
            links.append(ll.llama_sampler_init_min_p(p.min_p, 1))
        links.append(ll.llama_sampler_init_temp(p.temperature))
        links.append(ll.llama_sampler_init_dist(ll.LLAMA_DEFAULT_SEED if p.seed is None else p.seed))
        return links

    def sample(self, ctx: Any, row: int) -> int:
        return int(ll.llama_sampler_sample(self._chain, ctx, row))

    def free(self) -> None:
        if self._chain:
            ll.llama_sampler_free(self._chain)
            self._chain = None

    def __enter__(self) -> Sampler:
        return self

    def __exit__(self, *exc: object) -> None:
        self.free()
