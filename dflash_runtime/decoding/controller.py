"""Draft-length policies: a fixed length, or "auto", which picks each round the length that maximises expected
tokens per second from measured round costs and per-position acceptance, and drops to plain decoding (length 0)
when drafting does not pay, probing now and then (with back-off) to notice when it pays again.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable
from typing import Any, Protocol


class DraftPolicy(Protocol):
    def choose(self, pos0: int, limit: int, others: int = 0) -> int:
        """The draft length for the round at `pos0`, at most `limit` (the room left in the context and the request);
        `others` is how many rows the same target decode holds beside the round's n + 1 (the other sequences', the
        filler rows that even them out, prefill chunks: steps.py passes what the last decode held)."""
        ...

    def observe(self, n_block: int, n_drafted: int, n_accepted: int, seconds: float,
                rows: int | None = None) -> None:
        """A round's outcome; `rows` is what its target decode held in all (default n_block + 1: itself alone)."""
        ...

    def describe(self) -> dict[str, Any]: ...

    def begin_request(self) -> None: ...

    @property
    def tree(self) -> TreeOrLinear:
        """Whether a step drafts a tree or a linear draft (method "dflash-tree", tree_nodes="auto")."""
        ...


class FixedLength:
    """Always draft n tokens, like llama.cpp's fixed draft length."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.tree = TreeOrLinear()

    def choose(self, pos0: int, limit: int, others: int = 0) -> int:
        return min(self.n, limit)

    def observe(self, n_block: int, n_drafted: int, n_accepted: int, seconds: float,
                rows: int | None = None) -> None:
        pass

    def describe(self) -> dict[str, Any]:
        return {"policy": "fixed", "draft_length": self.n}

    def begin_request(self) -> None:
        pass


class AdaptiveLength:
    """Chooses n ∈ 0..n_max maximising E[tokens | n] / cost(n).

    E[tokens | n] = 1 + Σ_{i≤n} Π_{j≤i} a_j, with a_j the decayed rate at which draft position j is accepted when
    reached, shrunk towards a_{j-1} (position 1: towards `prior`) so that positions not reached lately follow the
    ones that were instead of keeping stale values. Evidence fades per drafting round (`decay`) and, more slowly,
    per plain round (`plain_decay`), so a probe after a long plain stretch weighs enough to bring drafting back.
    cost(n) is a decayed mean of measured round times by the rows the round's target decode holds (n + 1, plus every
    row beside them: the other sequences', the filler rows, prefill chunks — the decode it pays for), quick to fall
    and slow to rise;
    unmeasured row counts are interpolated between measured ones, or scaled by the number of rows.
    While plain (n = 0) it re-plans only at probes: at the start of each request and every `probe_interval`
    plain rounds. While drafting it takes a plain round every `plain_every` rounds, and at the second round of each
    request: the plain cost moves with the load as every cost does, and what an answer measures of it is what tells
    how much faster than plain decoding the answer runs (one round in `plain_every` costs about 1 / plain_every of the
    speed-up). A probe whose drafts are all accepted doubles its length each round while that lasts, so drafting
    comes back within a few rounds; the wait doubles after each probe that never beat plain decoding (up to
    `probe_max`) and resets after one that did.
    """

    def __init__(self, n_max: int, *, decay: float = 0.9, plain_decay: float = 0.98, cost_decay: float = 0.8,
                 probe_every: int = 8, probe_max: int = 64, prior: float = 0.5, shrink: float = 2.0,
                 plain_every: int = 32) -> None:
        self.n_max = n_max
        self.decay = decay
        self.plain_decay = plain_decay
        self.cost_decay = cost_decay
        self.probe_base = probe_every
        self.probe_max = probe_max
        self.probe_interval = probe_every
        self.prior = prior
        self.shrink = shrink
        self.since_draft = 0
        self.plain_every = plain_every
        self.since_plain = 0  # drafting rounds since the last plain one
        self.hits = [0.0] * (n_max + 1)        # index j ≥ 1: decayed accepted count at position j
        self.reached = [0.0] * (n_max + 1)     # decayed times position j was verified with 1..j-1 accepted
        self.cost: list[float | None] = [None] * (n_max + 1)  # by own length, whatever shared the decode
        self.row_cost: dict[int, float] = {}  # by the rows of the whole target decode
        self.others = 0  # rows beside the round's own n + 1 in the decode being planned
        self.history: list[int] = []
        self._probing = False
        self._ramping = False
        self._episode_paid = False
        self._new_request = False  # plan at the next round (a new request, or both ends just measured)
        self.tree = TreeOrLinear()

    # -- estimates ----------------------------------------------------------------------------------------------

    def acceptance(self) -> list[float]:
        rates, prev = [], self.prior
        for j in range(1, self.n_max + 1):
            prev = (self.hits[j] + self.shrink * prev) / (self.reached[j] + self.shrink)
            rates.append(prev)
        return rates

    def expected_tokens(self) -> list[float]:
        """E[tokens | n] for every n in 0..n_max, in one pass."""
        out, total, run = [1.0], 1.0, 1.0
        for a in self.acceptance():
            run *= a
            total += run
            out.append(total)
        return out

    def estimated_cost(self, n: int) -> float | None:
        rows = n + 1 + self.others  # a round decodes n + 1 target rows beside the others'
        exact = self.row_cost.get(rows)
        if exact is not None:
            return exact
        known = sorted(self.row_cost.items())
        if not known:
            return None
        below = [(k, c) for k, c in known if k < rows]
        above = [(k, c) for k, c in known if k > rows]
        if below and above:
            (k0, c0), (k1, c1) = below[-1], above[0]
            return c0 + (c1 - c0) * (rows - k0) / (k1 - k0)
        k, c = below[-1] if below else above[0]
        return c * rows / k

    def rates(self) -> list[float]:
        """Expected tokens per second for each length (0 where the cost is unknown)."""
        costs = [self.estimated_cost(n) for n in range(self.n_max + 1)]
        return [e / c if c else 0.0 for e, c in zip(self.expected_tokens(), costs, strict=True)]

    def best_length(self) -> int:
        rates = self.rates()
        return max(range(len(rates)), key=rates.__getitem__)

    # -- policy -------------------------------------------------------------------------------------------------

    def begin_request(self) -> None:
        self._new_request = True
        self.since_plain = max(self.since_plain, self.plain_every - 1)  # a plain round after the first one

    def choose(self, pos0: int, limit: int, others: int = 0) -> int:
        self.others = others
        planned, self._new_request = self._plan()
        n = min(planned, limit)
        self.history.append(n)
        return n

    def _plan(self) -> tuple[int, bool]:
        """The length to draft, and whether the next round must plan again (not wait for a probe)."""
        self._probing = False
        if self.cost[self.n_max] is None:
            n = self.n_max  # first round: learn every position's acceptance and the longest round's cost
        elif self.cost[0] is None or (self.since_plain >= self.plain_every and self.history[-1:] != [0]):
            return 0, True  # the plain cost (re)measured by this round: plan at the next one, not at a probe
        elif self._ramping:
            n = min(self.n_max, max(self.best_length(), 2 * self.history[-1]))  # drafts pay again: climb fast
        elif self.history and self.history[-1] == 0:
            n = 0  # plain rounds teach only the plain cost: re-plan at probes only
            if self._new_request or self.since_draft >= self.probe_interval:
                rates = self.rates()
                n = max(range(len(rates)), key=rates.__getitem__)
                if n == 0:
                    n = max(range(1, len(rates)), key=rates.__getitem__)
                    self._probing = True
        else:
            n = self.best_length()
        return n, False

    def observe(self, n_block: int, n_drafted: int, n_accepted: int, seconds: float,
                rows: int | None = None) -> None:
        self.cost[n_block] = self._follow(self.cost[n_block], seconds)
        rows = n_block + 1 if rows is None else rows
        self.row_cost[rows] = self._follow(self.row_cost.get(rows), seconds)
        fade = self.plain_decay if n_block == 0 else self.decay
        for j in range(1, self.n_max + 1):
            self.hits[j] *= fade
            self.reached[j] *= fade
        if n_block == 0:
            self.since_draft += 1
            self.since_plain = 0
            return
        self.since_draft = 0
        self.since_plain += 1
        for j in range(1, min(n_accepted + 1, n_drafted) + 1):
            self.reached[j] += 1.0
            self.hits[j] += 1.0 if j <= n_accepted else 0.0
        # A probe, and the rounds that double its length while every draft is accepted, form one episode.
        exploring = self._probing or self._ramping
        plain = self.row_cost.get(rows - n_block)  # one row beside the same others
        self._episode_paid |= plain is not None and (n_accepted + 1) * plain > seconds  # beat a plain step?
        self._ramping = exploring and 0 < n_drafted == n_accepted and n_drafted < self.n_max
        if exploring and not self._ramping:
            # An episode that never beat plain decoding waits twice as long next time; one that did resets the wait.
            paid, self._episode_paid = self._episode_paid, False
            self.probe_interval = self.probe_base if paid else min(self.probe_max, self.probe_interval * 2)

    def _follow(self, old: float | None, seconds: float) -> float:
        # Timing noise is mostly added time (another process, a first-time allocation): follow drops quickly and
        # rises slowly, so the estimate tracks the cost of the work rather than its worst moments.
        keep = self.cost_decay if old is None or seconds > old else 1 - self.cost_decay
        return seconds if old is None else keep * old + (1 - keep) * seconds

    def describe(self) -> dict[str, Any]:
        return {
            "policy": "auto",
            "n_max": self.n_max,
            "acceptance_by_position": [round(a, 4) for a in self.acceptance()],
            "cost_ms_by_length": [None if c is None else round(c * 1000, 4) for c in self.cost],
            "expected_tokens_by_length": [round(e, 4) for e in self.expected_tokens()],
            "best_length": self.best_length() if self.cost[0] is not None else None,
            "probe_interval": self.probe_interval,
            "recent_lengths": self.history[-64:],
            "decode_rows_costed": sorted(self.row_cost),  # the target decodes' row counts its cost model has seen
        }


class TreeOrLinear:
    """Whether a step drafts a tree or a linear draft, one path (method "dflash-tree" with tree_nodes="auto"): each
    arm's measured tokens per second — a tree step's emitted tokens and time, plus the time the next step spends on
    the rows of an accepted path off its spine (request.py) — as decayed sums; the better arm runs, the other is tried
    every `probe_every` steps, twice as seldom after each probe that did not change the choice (up to `probe_max`;
    the first `warmup` steps of each arm are taken in turn, the linear draft's first). It lives with the request's
    draft policy, so it carries over to the owner's next request. A tree costs more rows than the linear draft (on a
    CPU about in proportion; on a GPU nearly nothing up to its small-batch limit), so which wins is measured, not
    assumed.

    A step emits at most its draft length + 1 tokens, tree or linear, and a tree's step costs at least the linear
    draft's: while the linear steps fill that ceiling so nearly that even a tree at their cost could not be `margin`
    faster, the tree is not tried at all (a draft the target already takes whole leaves a tree nothing to add)."""

    ARMS = ("linear", "tree")

    def __init__(self, *, decay: float = 0.9, probe_every: int = 16, probe_max: int = 256, warmup: int = 2,
                 margin: float = 0.05) -> None:
        self.decay, self.probe_every, self.probe_max, self.warmup = decay, probe_every, probe_max, warmup
        self.margin = margin
        self._probe_first = probe_every
        self._probing: str | None = None  # the arm a probe tried
        self.tokens = dict.fromkeys(self.ARMS, 0.0)
        self.seconds = dict.fromkeys(self.ARMS, 0.0)
        self.steps = dict.fromkeys(self.ARMS, 0)
        self._fill = self._fill_weight = 0.0  # the linear steps' tokens over their ceilings, decayed
        self._since_probe = 0
        self.chosen: str = "linear"

    def rate(self, arm: str) -> float:
        return self.tokens[arm] / self.seconds[arm] if self.seconds[arm] > 0 else 0.0

    def fill(self) -> float | None:
        """How full the linear steps run: emitted tokens over draft length + 1, decayed (None: none seen)."""
        return self._fill / self._fill_weight if self._fill_weight > 0 else None

    def tree_has_room(self) -> bool:
        fill = self.fill()
        return fill is None or fill * (1 + self.margin) < 1

    def choose(self) -> str:
        """The arm for the next step."""
        if self.steps["linear"] < self.warmup or not self.tree_has_room():
            self._probing = None
            self.chosen = "linear"
            return self.chosen
        if self.steps["tree"] < self.warmup:
            self.chosen = "tree"
            return self.chosen
        best = max(self.ARMS, key=self.rate)
        if self._probing is not None:  # the probe's outcome: back off while it does not change the leader
            self.probe_every = self._probe_first if best == self._probing else min(2 * self.probe_every,
                                                                                   self.probe_max)
            self._probing = None
        self._since_probe += 1
        if self._since_probe >= self.probe_every:
            self._since_probe = 0
            best = "linear" if best == "tree" else "tree"
            self._probing = best
        self.chosen = best
        return best

    def observe(self, arm: str, tokens: int, seconds: float, *, more: bool = False, ceiling: int = 0) -> None:
        """A step of `arm`: its emitted tokens and time (`more`: the rest of a step already counted, not a step);
        `ceiling`: the most a linear step could emit (its draft length + 1)."""
        if not more:
            self.steps[arm] += 1
            for name in self.ARMS:
                self.tokens[name] *= self.decay
                self.seconds[name] *= self.decay
        self.tokens[arm] += tokens
        self.seconds[arm] += seconds
        if arm == "linear" and ceiling > 0:
            self._fill = self._fill * self.decay + min(1.0, tokens / ceiling)
            self._fill_weight = self._fill_weight * self.decay + 1

    def describe(self) -> dict[str, Any]:
        fill = self.fill()
        return {"tree_or_linear": self.chosen, "tok_s": {arm: round(self.rate(arm), 2) for arm in self.ARMS},
                "steps": dict(self.steps), "linear_fill": None if fill is None else round(fill, 4)}


def make_policy(draft_length: int | str, capacity: int, *, verify_cap: int) -> DraftPolicy:
    """The policy for a request's draft length: "auto" or a fixed length, within the method's capacity."""
    if draft_length == "auto":
        return AdaptiveLength(max(0, min(capacity, verify_cap)))
    return FixedLength(int(draft_length))


POLICIES_KEPT = 64  # adaptive policies per (owner, method, length), least recently used first out


class Policies:
    """The draft policies kept across requests, one per (owner, method, draft length): what "auto" measured about a
    conversation carries over to its next request, and nobody else's (least recently used first out). A request that
    runs while another of the same key holds its policy gets one of its own, not kept."""

    def __init__(self, verify_cap: int, kept: int = POLICIES_KEPT) -> None:
        self._verify_cap = verify_cap
        self._kept = kept
        self._policies: OrderedDict[tuple[Hashable, str, str], DraftPolicy] = OrderedDict()
        self._in_use: set[int] = set()
        self._lock = threading.Lock()

    def kept(self, owner: Hashable, method: str, draft_length: int | str) -> dict[str, Any] | None:
        """What the policy kept for (owner, method, length) has learnt (its describe()), or None: none is kept."""
        with self._lock:
            policy = self._policies.get((owner, method, str(draft_length)))
            return None if policy is None else policy.describe()

    def get(self, owner: Hashable, method: str, draft_length: int | str, capacity: int) -> DraftPolicy:
        key = (owner, method, str(draft_length))
        with self._lock:
            policy = self._policies.get(key)
            if policy is not None and id(policy) in self._in_use:
                policy = make_policy(draft_length, capacity, verify_cap=self._verify_cap)
            else:
                if policy is None:
                    policy = make_policy(draft_length, capacity, verify_cap=self._verify_cap)
                self._policies.pop(key, None)
                self._policies[key] = policy  # most recently used last
                while len(self._policies) > self._kept:
                    self._policies.popitem(last=False)
            self._in_use.add(id(policy))
            return policy

    def give_back(self, policy: DraftPolicy) -> None:
        """The request that held `policy` ended."""
        with self._lock:
            self._in_use.discard(id(policy))
