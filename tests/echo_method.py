"""A draft method that exists only for tests, registered from outside the package as any third-party method would:
one module and one registry line. It proposes the last token again, `repeat` times (the test's only option)."""

from __future__ import annotations

from collections.abc import Sequence

from dflash_runtime import methods
from dflash_runtime.drafters.drafting import Implementation, PerSequence, TokenView
from dflash_runtime.drafters.proposal import DraftSampling, Proposal

NAME = "echo"
LABEL = "Echo (test)"
HELP = "test-only: proposes the last token again"
ABOUT = "Echo (a test-only method registered from outside the package)"


class EchoDrafter:
    method = NAME

    def __init__(self, capacity: int, repeat: int) -> None:
        self.capacity = capacity
        self.repeat = repeat

    def begin(self) -> None:
        pass

    def draft(self, id_last: int, pos0: int, n: int, *, n_min: int = 0, p_min: float = 0.0,
              sampling: DraftSampling | None = None) -> Proposal:
        tokens = [id_last] * min(n, self.repeat)
        return Proposal(tokens) if len(tokens) >= max(n_min, 1) else Proposal.start(sampling)

    def accept(self, n_accepted: int) -> None:
        pass

    def clear(self) -> None:
        pass


def _open(pair: object, views: Sequence[TokenView], capacity: int, *, repeat: int = 2) -> PerSequence:
    return PerSequence([EchoDrafter(capacity, repeat) for _ in views])


IMPLEMENTATION = Implementation(_open, options={"repeat": 2})
LINE = methods.Method(NAME, LABEL, methods.NOTHING, lambda: IMPLEMENTATION, auto=False, help=HELP, about=ABOUT)


def register() -> None:
    if NAME not in methods.names():
        methods.register(LINE)
