"""Draft-length policies: a fixed length, or "auto", which picks each round the length that maximises expected
tokens per second from measured round costs and per-position acceptance, and drops to plain decoding (length 0)
when drafting does not pay, probing now and then (with back-off) to notice when it pays again.
"""

from __future__ import annotations

from typing import Any, Protocol


class DraftPolicy(Protocol):
    eager_inject: bool

    def choose(self, pos0: int) -> int: ...

    def observe(self, n_block: int, n_drafted: int, n_accepted: int, seconds: float) -> None: ...

    def describe(self) -> dict[str, Any]: ...


class FixedLength:
    """Always draft n tokens, like llama.cpp's fixed draft length."""

    eager_inject = True  # inject every verify batch at once, as llama.cpp does

    def __init__(self, n: int) -> None:
        self.n = n

    def choose(self, pos0: int) -> int:
        return self.n

    def observe(self, n_block: int, n_drafted: int, n_accepted: int, seconds: float) -> None:
        pass

    def describe(self) -> dict[str, Any]:
        return {"policy": "fixed", "draft_max": self.n}


class AdaptiveLength:
    """Chooses n ∈ 0..n_max maximising E[tokens | n] / cost(n).

    E[tokens | n] = 1 + Σ_{i≤n} Π_{j≤i} a_j, with a_j the decayed rate at which draft position j is accepted when
    reached. cost(n) is a decayed mean of measured round times per length; unmeasured lengths are interpolated
    between measured ones, or scaled by the number of rows the round decodes.
    """

    eager_inject = False  # rows of plain rounds wait and reach the draft in one batch when drafting resumes

    def __init__(self, n_max: int, *, decay: float = 0.9, cost_decay: float = 0.8, probe_every: int = 8,
                 probe_max: int = 256, prior: float = 0.5) -> None:
        self.n_max = n_max
        self.decay = decay
        self.cost_decay = cost_decay
        self.probe_base = probe_every
        self.probe_max = probe_max
        self.probe_interval = probe_every
        self.since_draft = 0
        self.hits = [prior] * (n_max + 1)      # index j ≥ 1: decayed accepted count at position j
        self.reached = [1.0] * (n_max + 1)     # decayed times position j was verified with 1..j-1 accepted
        self.cost: list[float | None] = [None] * (n_max + 1)
        self.history: list[int] = []
        self._probing = False

    # -- estimates ----------------------------------------------------------------------------------------------

    def acceptance(self) -> list[float]:
        return [self.hits[j] / self.reached[j] for j in range(1, self.n_max + 1)]

    def expected_tokens(self, n: int) -> float:
        total, run = 1.0, 1.0
        for a in self.acceptance()[:n]:
            run *= a
            total += run
        return total

    def estimated_cost(self, n: int) -> float | None:
        known = [(k, c) for k, c in enumerate(self.cost) if c is not None]
        if not known:
            return None
        exact = self.cost[n]
        if exact is not None:
            return exact
        below = [(k, c) for k, c in known if k < n]
        above = [(k, c) for k, c in known if k > n]
        if below and above:
            (k0, c0), (k1, c1) = below[-1], above[0]
            return c0 + (c1 - c0) * (n - k0) / (k1 - k0)
        k, c = (below or above)[-1 if below else 0]
        return c * (n + 1) / (k + 1)  # a round decodes n + 1 target rows

    def best_length(self) -> int:
        best, best_rate = 0, -1.0
        for n in range(self.n_max + 1):
            cost = self.estimated_cost(n)
            if cost is None or cost <= 0:
                continue
            rate = self.expected_tokens(n) / cost
            if rate > best_rate:
                best, best_rate = n, rate
        return best

    # -- policy -------------------------------------------------------------------------------------------------

    def choose(self, pos0: int) -> int:
        self._probing = False
        if self.cost[self.n_max] is None:
            n = self.n_max  # first round: learn every position's acceptance and the longest round's cost
        elif self.cost[0] is None:
            n = 0
        elif self.history and self.history[-1] == 0 and self.since_draft < self.probe_interval:
            n = 0  # plain rounds change only the plain cost: no need to re-plan until the next probe
        else:
            n = self.best_length()
            if n == 0 and self.since_draft >= self.probe_interval:
                n, self._probing = max(1, self._best_positive()), True
        self.history.append(n)
        return n

    def _best_positive(self) -> int:
        rates = [(self.expected_tokens(n) / c, n) for n in range(1, self.n_max + 1)
                 if (c := self.estimated_cost(n)) is not None and c > 0]
        return max(rates)[1] if rates else 1

    def observe(self, n_block: int, n_drafted: int, n_accepted: int, seconds: float) -> None:
        old = self.cost[n_block]
        self.cost[n_block] = seconds if old is None else self.cost_decay * old + (1 - self.cost_decay) * seconds
        if n_block == 0:
            self.since_draft += 1
            return
        self.since_draft = 0
        for j in range(1, self.n_max + 1):
            self.hits[j] *= self.decay
            self.reached[j] *= self.decay
        for j in range(1, min(n_accepted + 1, n_drafted) + 1):
            self.reached[j] += 1.0
            self.hits[j] += 1.0 if j <= n_accepted else 0.0
        if self._probing:
            # A probe that found nothing waits twice as long next time; one that paid resets the wait.
            self.probe_interval = self.probe_base if n_accepted else min(self.probe_max, self.probe_interval * 2)

    def describe(self) -> dict[str, Any]:
        return {
            "policy": "auto",
            "n_max": self.n_max,
            "acceptance_by_position": [round(a, 4) for a in self.acceptance()],
            "cost_ms_by_length": [None if c is None else round(c * 1000, 4) for c in self.cost],
            "expected_tokens_by_length": [round(self.expected_tokens(n), 4) for n in range(self.n_max + 1)],
            "best_length": self.best_length() if self.cost[0] is not None else None,
            "probe_interval": self.probe_interval,
            "recent_lengths": self.history[-64:],
        }


def make_policy(draft_max: int | str, pair_max: int, *, verify_cap: int) -> DraftPolicy:
    if draft_max == "auto":
        return AdaptiveLength(max(0, min(pair_max, verify_cap)))
    return FixedLength(int(draft_max))
