"""One engine step for every running request, as llama.cpp's server steps its slots: the requests that join begin,
each drafting request plans its draft length, every method drafts for all its requests in one pass, and one target
decode holds every request's rows — verify rows, a plain request's single row, and prefill chunks under the step's
token budget (the shortest prompts first, so that a long prompt never stalls a short one) — after which every
drafter processes the decode and each request accepts what its verifier keeps.

A failure that belongs to one request (its owner switch, its verifier, its rollback) ends that request alone; a
failure of a shared pass (a draft or target decode) ends every request in it, each sequence cleared.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from dataclasses import dataclass

from ..drafters.drafting import DraftAsk, Rows
from ..drafters.method_list import MethodList, draft_all
from .request import Decoding, Parts, Planned


@dataclass
class StepCounters:
    """Engine-wide totals, for benchmarks: target decodes, the rows they held, and the time steps took."""

    decodes: int = 0
    rows: int = 0
    pad_rows: int = 0  # of `rows`: filler rows that evened out the requests' rows (see Steps._pad)
    step_ms: float = 0.0
    forks: int = 0  # tree paths given their request's state (cache/spares.py)
    fork_host_bytes: int = 0  # state those forks moved through host memory (0: all on the device)

    def to_dict(self) -> dict[str, float | int]:
        return {"decodes": self.decodes, "rows": self.rows, "pad_rows": self.pad_rows,
                "step_ms": round(self.step_ms, 3), "forks": self.forks, "fork_host_bytes": self.fork_host_bytes}


class Steps:
    def __init__(self, parts: Parts) -> None:
        self.parts = parts
        self.counters = StepCounters()

    def run(self, runs: Sequence[Decoding]) -> None:
        """One step for these requests (each one ready: not ended, its last event read)."""
        t_step = time.perf_counter()
        live = [r for r in runs if self._guard(r, self._admit)]
        generating = [r for r in live if not r.prefilling]
        prefilling = sorted((r for r in live if r.prefilling), key=lambda r: (r.prompt_left, r.seq))
        asks: list[tuple[MethodList, DraftAsk, Decoding]] = []
        rows = 0
        paths = len(self._free_spares(bool(prefilling)))  # the most tree paths this step can decode
        for run in sorted(generating, key=lambda r: r.seq):
            try:
                # The rows its decode will hold beside its own n + 1, as the last decode held them (every other
                # request's, the filler rows, prefill chunks); the first time, those planned before it.
                beside = run.rows_beside if run.rows_beside is not None else rows
                n_block, ask = run.plan_step(beside, paths)
            except Exception as error:
                run.fail(error)
                continue
            if ask is not None and run.method_list is not None:
                asks.append((run.method_list, ask, run))
            else:
                run.plain_step()
            rows += 1 + n_block
        if asks:
            self._draft(asks)
        self._pad([r for r in generating if r.planned is not None and not r.done])
        self._branch([r for r in generating if r.planned is not None and not r.done], bool(prefilling))
        budget = self.parts.pair.n_batch - sum(r.planned.decode_rows for r in generating if r.planned)
        if generating and prefilling:
            # Beside answers being written, the step's prompt tokens together take one chunk: a generating
            # request's step costs its own rows and one chunk however many prompts wait (the shortest first).
            budget = min(budget, max(r.req.prefill_chunk or budget for r in prefilling))
        for run in prefilling:  # a request's own bound on its chunks holds while others share the step
            planned = run.plan_prefill(min(budget, run.req.prefill_chunk or budget) if len(live) > 1 else budget)
            if planned is not None:
                budget -= len(planned.tokens)
        batch = [r for r in live if r.planned is not None and not r.done]  # a failed draft ended its requests
        if not batch:
            return
        t = time.perf_counter()
        if not self._decode(batch):
            return
        decode_ms = (time.perf_counter() - t) * 1000.0
        n_rows = sum(r.planned.decode_rows for r in batch if r.planned)
        n_pad = sum(r.planned.pad for r in batch if r.planned)
        step_s = time.perf_counter() - t_step
        for run in batch:
            self._guard(run, lambda r: r.after_prefill() if r.prefilling else r.after_step(decode_ms, step_s, n_rows))
        self.counters.decodes += 1
        self.counters.rows += n_rows
        self.counters.pad_rows += n_pad
        self.counters.step_ms += (time.perf_counter() - t_step) * 1000.0

    # -- the shared passes --------------------------------------------------------------------------------------

    def _draft(self, asks: list[tuple[MethodList, DraftAsk, Decoding]]) -> None:
        """Every drafting request's draft, each method in one pass; a failed pass ends the requests in it."""
        t = time.perf_counter()
        try:
            results = draft_all([(listed, ask) for listed, ask, _ in asks])
        except Exception as error:
            for _, _, run in asks:
                run.fail(error)
            return
        ms = (time.perf_counter() - t) * 1000.0
        for (_, _, run), (proposal, by) in zip(asks, results, strict=True):
            run.clock.s += ms / 1000.0
            run.set_draft(proposal, by, ms)

    def _pad(self, runs: list[Decoding]) -> None:
        """Give every generating request of the step as many rows as the widest one, with filler rows after its own.

        libllama splits a decode of several sequences into ubatches that hold an equal number of rows of each
        sequence (llama_batch_allocr::split_equal): requests of 1, 4 and 8 rows cost three passes of the model, where
        8 rows each cost one. The filler rows ask for no outputs, and go with the rejected drafts when the request
        cuts its cache after verifying (a row depends only on the rows before it in its own sequence, so they change
        nothing of the others). A hybrid target can take back at most n_rs_seq tokens of its last decode, and no row
        goes past the context's end: a request that cannot take the filler keeps its own rows."""
        if len(runs) < 2:
            return
        pair = self.parts.pair
        width = max(len(r.planned.tokens) for r in runs if r.planned)
        if pair.is_recurrent:
            width = min(width, pair.n_rs_seq + 1)
        for run in runs:
            planned = run.planned
            assert planned is not None and run.cache is not None
            if len(planned.tokens) < width and len(run.cache) + width <= pair.n_ctx:
                planned.pad = width - len(planned.tokens)

    def _free_spares(self, prefilling: bool) -> list[int]:
        """The spare target sequences a step may give tree paths: none on a hybrid target beside a prompt chunk (see
        _one_ubatch)."""
        return [] if self.parts.pair.is_recurrent and prefilling else list(self.parts.spares.seqs)

    def _branch(self, runs: list[Decoding], prefilling: bool) -> None:
        """Give the paths of each draft tree beside its spine a spare target sequence each, while there are spare
        sequences and room in the decode; a tree keeps the paths that got one (its first ones), and a tree that got
        none is its spine: a linear step. A hybrid target's paths run only where the whole decode is one ubatch of
        consecutive sequences (or the request is alone): see docs/how-it-works.md, "Draft trees"."""
        pair = self.parts.pair
        free = self._free_spares(prefilling) if not pair.is_recurrent or self._one_ubatch(runs, prefilling) else []
        room = pair.n_batch - sum(r.planned.decode_rows for r in runs if r.planned)
        for run in sorted(runs, key=lambda r: r.seq):
            planned = run.planned
            if planned is None or planned.tree is None:
                continue
            paths = planned.tree.paths()
            taken = 0
            for path in paths[1:]:
                branch = planned.branch(planned.tree.tokens(path[-1]))
                # As wide as the request's own rows (filler after the path): libllama then takes every sequence's
                # rows in one ubatch where their ids are consecutive, rather than a pass per path length.
                width = max(planned.rows, len(branch))
                if not free or width > room:
                    break
                room -= width
                taken += 1
                planned.branches.append((free.pop(0), branch))
                planned.branch_pad.append(width - len(branch))
            planned.tree = planned.tree.first_paths(1 + taken) if taken else None

    def _one_ubatch(self, runs: list[Decoding], prefilling: bool) -> bool:
        """Whether a hybrid target's decode may hold tree paths: no prompt chunk beside them (its rows go to another
        ubatch), and the request alone or every request's rows of one width with their sequences the last ones
        before the spare sequences' (libllama's sequential split then takes them all in one ubatch)."""
        if prefilling:
            return False
        if len(runs) == 1:
            return True
        parallel = self.parts.pair.parallel
        widths = {r.planned.rows for r in runs if r.planned is not None}
        return (len(widths) == 1
                and sorted(r.seq for r in runs) == list(range(parallel - len(runs), parallel)))

    def _decode(self, batch: list[Decoding]) -> bool:
        """The target decode of every request's planned rows, then every drafter's processing of it."""
        parts = self.parts
        tokens = parts.batch
        tokens.clear()
        ordered = sorted(batch, key=lambda r: r.seq)  # consecutive sequence ids share a ubatch in libllama's split
        forked: list[int] = []
        try:
            # A tree's other paths, each in a spare sequence that starts from the request's state. A hybrid target's
            # request whose sequence id does not precede the spare ones is split into two ubatches: the paths go
            # first, so that they leave the request's recurrent cell before the request's own rows run (see
            # docs/how-it-works.md, "Draft trees").
            paths_first = self._paths_first(ordered)
            if paths_first:
                self._add_paths(ordered, forked)
            for run in ordered:
                planned = run.planned
                assert planned is not None and run.cache is not None
                pos0 = len(run.cache)
                planned.row0 = tokens.add(planned.tokens, pos0, run.seq, outputs=planned.outputs, silent=planned.lead)
                if planned.pad:
                    tokens.add(planned.filler, pos0 + len(planned.tokens), run.seq, outputs="none")
            if not paths_first:
                self._add_paths(ordered, forked)
            t = time.perf_counter()
            try:
                tokens.decode(parts.pair.target_ctx, "target")
            finally:
                for cache in parts.caches:
                    if cache not in (run.cache for run in ordered):
                        cache.beside_decode()
            decode_s = time.perf_counter() - t
            for run in ordered:
                assert run.planned is not None and run.cache is not None
                pos0 = len(run.cache)
                for (seq, path), pad in zip(run.planned.branches, run.planned.branch_pad, strict=True):
                    parts.spares.decoded(seq, pos0 + len(path) + pad - 1)
                run.cache.decoded([*run.planned.tokens, *run.planned.filler])
            t = time.perf_counter()
            for drafter in parts.drafters.values():
                drafter.process([self._rows(run, run.planned, drafter in self._members(run))
                                 for run in ordered if run.planned is not None])
            inject_ms = (time.perf_counter() - t) * 1000.0
        except Exception as error:
            with contextlib.suppress(Exception):  # the failure that ended the step is the one to report
                parts.spares.drop(forked)  # whatever the failure left in them
            for run in ordered:
                run.fail(error)
            return False
        for run in ordered:
            run.clock.s += decode_s + inject_ms / 1000.0
            if not run.prefilling:
                run.stats.inject_ms += inject_ms
        return True

    def _paths_first(self, ordered: list[Decoding]) -> bool:
        """Whether the step's tree paths go before the requests' rows in the decode: on a hybrid target, for a
        request alone whose sequence id does not precede the spare ones (else all go in one ubatch, requests
        first: see _one_ubatch)."""
        pair = self.parts.pair
        return pair.is_recurrent and len(ordered) == 1 and ordered[0].seq != pair.parallel - 1

    def _add_paths(self, ordered: list[Decoding], forked: list[int]) -> None:
        """Each tree's paths into the step's batch, each spare sequence forked from its request's (and added to
        `forked`)."""
        parts, tokens = self.parts, self.parts.batch
        for run in ordered:
            planned = run.planned
            assert planned is not None and run.cache is not None
            if not planned.branches:
                continue
            seqs = [seq for seq, _ in planned.branches]
            forked += seqs
            host_bytes = parts.spares.fork(run.cache, seqs)
            run.stats.tree_host_bytes += host_bytes
            self.counters.forks += len(seqs)
            self.counters.fork_host_bytes += host_bytes
            planned.branch_row0 = []
            for (seq, path), pad in zip(planned.branches, planned.branch_pad, strict=True):
                planned.branch_row0.append(tokens.add(path, len(run.cache), seq, outputs="all", silent=planned.lead))
                if pad:
                    tokens.add([path[-1]] * pad, len(run.cache) + len(path), seq, outputs="none")

    @staticmethod
    def _rows(run: Decoding, planned: Planned, member: bool) -> Rows:
        """The request's own rows of the decode, for the drafters (the filler rows are none of theirs)."""
        assert run.cache is not None
        pos0 = len(run.cache) - planned.rows
        return Rows(run.seq, planned.tokens, pos0, planned.row0, eager=planned.eager and member)

    @staticmethod
    def _members(run: Decoding) -> list[object]:
        return list(run.method_list.members) if run.method_list is not None else []

    # -- per request --------------------------------------------------------------------------------------------

    def _admit(self, run: Decoding) -> None:
        if run.cache is None:
            run.begin()
        if run.cancelled():
            run.cancel_now()

    @staticmethod
    def _guard(run: Decoding, phase: object) -> bool:
        """Run one request's own phase; a failure ends that request alone. Whether it is still running."""
        try:
            phase(run)  # type: ignore[operator]
        except Exception as error:
            run.fail(error)
            return False
        return not run.done
