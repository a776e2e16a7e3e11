"""Compare the engine with llama.cpp's own speculative loop, token for token and count for count.

For each generated tiny pair (target × draft × head) and each fixed draft length, this starts llama.cpp's
`llama-server --spec-type draft-dflash` (built from the same vendored llama.cpp as the wheel), sends every prompt as
token ids to /completion at temperature 0, and runs the same request through `load_pair(...).generate(...)`.
Draft `mtp` is the hybrid target's own MTP (nextn) block, no draft file: the server runs `--spec-type draft-mtp` on
the generated hybrid target with `mtp_layers=1`, the engine `load_pair(target, None)` with `method="mtp"`.
Drafts `ngram-mod`, `ngram-map-k`, `ngram-simple` and `ngram-map-k4v` are llama.cpp's n-gram self-speculation on
the target alone (`--spec-type T`, the key length `--ngram-n` and the draft length n as its
`--spec-T-{n-match,size-n}` and `--spec-T-{n-max,size-m}`, ngram-map-k4v's `--ngram-min-hits`; the engine the same
method with the same options). Drafts `ngram-cache`, `ngram-cache-static` and `ngram-cache-dynamic` are its lookup
decoding (`--spec-type ngram-cache`): with no file; with a static file `-lcs` that `llama-lookup-create` (beside the
server, or `--lookup-create-bin`) makes of `--lookup-corpus`, the engine reading the same file; and with a dynamic
file carried across two requests of each prompt: the engine answers the prompt twice, its second answer drafting from
what the first taught it, and the server answers the second with `-lcd` the file another engine wrote after the same
first request (the server reads that file and never writes it; the engine writes it when it closes). The server's
ngram-cache drafts 8 tokens whatever `--spec-draft-n-max` says (common/speculative.cpp: create_state_ngram_cache), so
these rows take draft lengths of 8 and more, which all give 8. The server keeps its n-gram tables for as long as it
runs, the engine rebuilds them from each request's tokens: the server is started afresh for every prompt of these
drafts.
Draft `draft-simple` is a small model of the target's vocabulary (the generator's `tiny_draft_model`: a dense
model of the target's head and seed; `draft-simple-hybrid`: a hybrid one, as a Qwen3.5 target's small sibling, whose
counts differ for the same reason as below): the server runs `-md DRAFT --spec-type draft-simple`, the engine
`load_pair(target, DRAFT)` with `method="draft-simple"`, the same n-max, n-min and p-min.
Draft `eagle3` is the generator's EAGLE-3 draft of the target: the server runs `-md DRAFT --spec-type draft-eagle3`,
the engine `load_pair(target, DRAFT)` with `method="eagle3"`.
Drafts `dspark` and `dspark-conf` are the generator's DSpark drafts (a DFlash draft with a Markov head; `dspark-conf`
with a confidence head too): the server runs `-md DRAFT --spec-type draft-dspark`, the engine `method="dspark"`. The
`dspark-conf` rows run at `--confidence-p-min` (default 0.5), so that the confidence head cuts drafts; the `dspark`
rows at `--p-min` (the server refuses a p-min above 0 for a draft without a confidence head).
On a hybrid target the server's `draft-simple` and n-gram counts differ by design, the tokens not: llama-server
classifies a hybrid memory for these as cut-only-whole (`need_n_rs_seq()` in common/common.h keeps recurrent states
per draft position for MTP, EAGLE3, DFlash and DSpark only), so after a partly accepted draft it loads its context
checkpoint and replays the accepted tokens and the correction in a step of their own (tools/server/server-context.cpp:
`slot.spec_is_replay`, `spec_draft` kept, `pre_decode` leaves such a slot out of `drafting`). That step drafts
nothing, so the server drafts only after a fully accepted step or a replay: about every other step where most drafts
are cut short (297 drafted in 101 steps against the engine's 590 in 180 on one such run); the replayed step also
tells the n-gram tables another acceptance (ngram-map-k's and k4v's next draft length), and the lookup decoding's
context cache counts other stretches. The engine puts the recurrent state back within the step (checkpoints, see
docs/how-it-works.md) and drafts at every step; the rows compare tokens there, and counts on dense targets.
`--server-only` runs the server side alone and prints its acceptance (for an engine without that method).
Both must emit the same tokens and text, and count the same drafted tokens, accepted tokens and verify steps
(the server's `timings.draft_n`, `timings.draft_n_accepted` and its `spec_decode_num_drafts_total` metric).
Each row also checks that the engine's output equals its own target-only decoding.

`--parallel N` compares parallel sequences: `llama-server -np N` (each slot n_ctx cells) gets N requests at once,
one thread each, and one engine opened with `load_pair(..., parallel=N)` runs the same N prompts as N concurrent
streams; every stream's tokens must equal the server's for that prompt and the engine's own plain decoding. With
`--scaling 1,2,4,8` (N defaults to the largest) it does so for each number of concurrent streams and reports the
aggregate tok/s of both (all streams' tokens / the wall time from the first request sent to the last answer; the
median of `--rounds` rounds, the engine's and the server's alternating) as a markdown table; `--json PATH` keeps
every figure, the server's own per-request `timings` (prompt_ms, predicted_ms, predicted_per_second, per slot) and
its `n_decode_total` included. The model drafts only (DFlash, MTP, draft-simple, EAGLE-3, DSpark).

Requests must end before the context does: there llama-server stops one cell early (it keeps room for a context
shift) and drops the accepted tokens of a step that reaches that cell, while the engine fills the context.

    python tools/compare_llama_server.py --server-bin /path/to/llama-server [--targets dense,hybrid]
        [--drafts dflash2,dflash1,mtp,draft-simple,eagle3,dspark,dspark-conf,ngram-mod,ngram-map-k,ngram-simple,
                  ngram-map-k4v,ngram-cache,ngram-cache-static,ngram-cache-dynamic] [--heads shaped,regime]
        [--n-max 3,7] [--confidence-p-min 0.5] [--max-tokens 48] [--n-embd 128] [--n-ctx 512] [--ngram-n 3]
        [--ngram-min-hits 1] [--lookup-corpus TEXT] [--lookup-create-bin PATH] [--server-only] [--parallel N]
        [--scaling 1,2,4,8] [--rounds 3] [--json PATH]

Exits 1 on any mismatch, 2 on a usage error or when llama-server fails.

Building llama-server (and llama-lookup-create, llama-lookup-merge) from the vendored tree, with the wheel recipe's
CPU kernels, from the sdist the wheel recipe keeps (as CI does; skipped when OUT holds this configuration's build):

    python tools/build_llama_server.py --out-dir OUT --jobs 2          # -> OUT/llama-server, OUT/llama-lookup-create

These give the server the CPU kernels of the wheel recipe's CPU build (prebuilt_wheels/build_wheel.py, see
docs/numerics.md), and the server runs with `-fa off` as the engine opens a CPU target, so that both sides compute the
same graphs with the same kernels: the patched sgemm sums one row as it sums many (a stock build leaves one-row
products to another path), and x86-64-v3 instead of `-DGGML_NATIVE=ON` (on a CPU with AVX-512 or AMX, a native
build's wider kernels make many-row decodes cheaper still). With other kernels the server's scaling with slots says
more about the kernels than about the speculative loop, and is incomparable with the engine's on the same machine;
a temperature-0 difference then is a near-tie or a fault, which `Engine.explain_divergence` tells apart.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file from a checkout

from dflash_runtime import load_pair
from dflash_runtime.cli.bench_concurrency import distinct_prompts, run_streams
from dflash_runtime.engine import Engine
from dflash_runtime.testing.heads import PHRASE
from dflash_runtime.testing.tiny_models import TinyPair, tiny_draft_model, tiny_pair

PROMPTS = (
    "Hello world",
    "The quick brown fox",
    "Once upon a time the",
    " hello",
    "In the beginning there was a small",
)
VERIFY_METRIC = "llamacpp:spec_decode_num_drafts_total"
DECODE_METRIC = "llamacpp:n_decode_total"  # the server's llama_decode calls (its speculative ones not counted)
DFLASH_DRAFTS = ("dflash2", "dflash1")
MTP = "mtp"  # the target's own nextn block
DRAFT_SIMPLE = "draft-simple"  # a small model of the target's vocabulary
DRAFT_SIMPLE_HYBRID = "draft-simple-hybrid"  # the same method with a small hybrid (qwen35) model as the draft
DRAFT_MODELS = {DRAFT_SIMPLE: "dense", DRAFT_SIMPLE_HYBRID: "hybrid"}  # draft-simple's rows: the draft model's kind
EAGLE3 = "eagle3"  # a one-layer draft reading three target layers (the server's draft-eagle3)
# DSpark drafts (the server's draft-dspark): the generator's overrides of each row kind
DSPARK_DRAFTS: dict[str, dict[str, Any]] = {"dspark": {}, "dspark-conf": {"confidence_head": True}}
DSPARK = "dspark"
# No draft file, the sequence drafts itself: each method's engine options for the key length and the draft length,
# which are also its llama-server flags (--spec-<method>-<option, dashed>).
NGRAM_SIZES = {"ngram-mod": ("n_match", "n_max"), "ngram-map-k": ("size_n", "size_m"),
               "ngram-simple": ("size_n", "size_m"), "ngram-map-k4v": ("size_n", "size_m")}
NGRAMS = tuple(NGRAM_SIZES)
# Lookup decoding (--spec-type ngram-cache): without files, with a static file (-lcs), with a dynamic one (-lcd).
NGRAM_CACHE, LOOKUP_STATIC, LOOKUP_DYNAMIC = "ngram-cache", "ngram-cache-static", "ngram-cache-dynamic"
NGRAM_CACHES = (NGRAM_CACHE, LOOKUP_STATIC, LOOKUP_DYNAMIC)
LOOKUP_DRAFT = 8  # llama-server's ngram-cache drafts this many tokens, whatever --spec-draft-n-max


@dataclass(frozen=True)
class Outcome:
    tokens: tuple[int, ...]
    text: str
    drafted: int
    accepted: int
    verify_steps: int


@dataclass(frozen=True)
class Row:
    pair: str
    n_max: int
    prompt: str
    server: Outcome
    engine: Outcome | None  # None: server side only
    plain_ok: bool  # the engine's output (or the server's, server side only) equals target-only decoding
    tokenize_ok: bool  # the server tokenizes the prompt text into the same ids

    @property
    def compared(self) -> tuple[str, ...]:
        """What must be equal: everything, but the counts of draft-simple and the n-gram drafts where a hybrid model
        is drafted for (the server replays a cut-short draft in a step that drafts nothing: see the module doc)."""
        target, draft = self.pair.split("/")[:2]
        if draft in DRAFT_MODELS and (target == "hybrid" or DRAFT_MODELS[draft] == "hybrid"):
            return ("tokens", "text")
        if draft in (*NGRAMS, *NGRAM_CACHES) and target == "hybrid":
            return ("tokens", "text")
        return ("tokens", "text", "drafted", "accepted", "verify_steps")

    def differences(self) -> list[str]:
        if self.engine is None:
            return []
        return [k for k in self.compared if getattr(self.server, k) != getattr(self.engine, k)]

    @property
    def ok(self) -> bool:
        return not self.differences() and self.plain_ok and self.tokenize_ok


class ServerError(RuntimeError):
    pass


class UsageError(ValueError):
    pass


class LlamaServer:
    """One llama-server process on 127.0.0.1 (one slot, or -np slots); stopped on exit."""

    def __init__(self, binary: Path, argv: Sequence[str], log: Path, timeout: float) -> None:
        self.port = _free_port()
        self.log = log
        self.timeout = timeout
        cmd = [str(binary), *argv, "--host", "127.0.0.1", "--port", str(self.port)]
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)

    def wait_ready(self) -> None:
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerError(f"llama-server exited with {self.proc.returncode}:\n{self.log_tail()}")
            with contextlib.suppress(OSError, ServerError):
                if self._get("/health").get("status") == "ok":
                    return
            time.sleep(0.2)
        raise ServerError(f"llama-server was not ready after {self.timeout:.0f} s:\n{self.log_tail()}")

    def complete(self, tokens: Sequence[int], n_predict: int, cache_prompt: bool) -> Outcome:
        before = self.metric(VERIFY_METRIC)
        body = {
            "prompt": list(tokens),
            "n_predict": n_predict,
            "temperature": 0.0,
            "cache_prompt": cache_prompt,  # off: a fresh cache per request, as the engine gets after reset()
            "return_tokens": True,
        }
        res = self._post("/completion", body)
        timings = res.get("timings", {})
        return Outcome(
            tokens=tuple(res["tokens"]),
            text=res["content"],
            drafted=int(timings.get("draft_n", 0)),
            accepted=int(timings.get("draft_n_accepted", 0)),
            verify_steps=round(self.metric(VERIFY_METRIC) - before),
        )

    def generate(self, tokens: Sequence[int], n_predict: int) -> dict[str, Any]:
        """One /completion at temperature 0 on a fresh cache: its tokens, the slot and the server's timings."""
        body = {"prompt": list(tokens), "n_predict": n_predict, "temperature": 0.0, "cache_prompt": False,
                "return_tokens": True}
        res = self._post("/completion", body)
        return {"tokens": list(res["tokens"]), "id_slot": res.get("id_slot"), "timings": res.get("timings", {})}

    def tokenize(self, text: str) -> list[int]:
        return list(self._post("/tokenize", {"content": text, "add_special": True, "parse_special": True})["tokens"])

    def metric(self, name: str) -> float:
        with urllib.request.urlopen(self._url("/metrics"), timeout=self.timeout) as r:
            for line in r.read().decode().splitlines():
                if line.startswith(name + " "):
                    return float(line.split()[1])
        raise ServerError(f"/metrics has no {name}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def log_tail(self, n: int = 30) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])

    def _url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def _get(self, path: str) -> dict[str, Any]:
        with urllib.request.urlopen(self._url(path), timeout=self.timeout) as r:
            return json.loads(r.read())

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        req = urllib.request.Request(self._url(path), json.dumps(body).encode(), {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            raise ServerError(f"{path}: HTTP {e.code}: {e.read().decode(errors='replace')}") from e


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def spec_args(args: argparse.Namespace, kind: str, draft: Path | None, n_max: int) -> list[str]:
    """llama-server's --spec-type and its settings for a draft kind (see the module doc)."""
    if kind in NGRAMS:
        flags = [[f"--spec-{kind}-{name.replace('_', '-')}", str(value)]
                 for name, value in ngram_options(args, kind, n_max).items()]
        return ["--spec-type", kind, *(part for flag in flags for part in flag)]
    if kind in NGRAM_CACHES:  # `draft`: its lookup file
        files = [] if draft is None else ["-lcs" if kind == LOOKUP_STATIC else "-lcd", str(draft)]
        return ["--spec-type", NGRAM_CACHE, *files]
    if kind in DRAFT_MODELS:
        assert draft is not None
        return ["-md", str(draft), "--spec-type", DRAFT_SIMPLE]
    if kind == EAGLE3:
        assert draft is not None
        return ["-md", str(draft), "--spec-type", "draft-eagle3"]
    if kind in DSPARK_DRAFTS:
        assert draft is not None
        return ["-md", str(draft), "--spec-type", "draft-dspark"]
    return ["--spec-type", "draft-mtp"] if draft is None else ["-md", str(draft), "--spec-type", "draft-dflash"]


def ngram_options(args: argparse.Namespace, kind: str, n_max: int) -> dict[str, int]:
    """An n-gram method's engine options (and llama-server's flags): the key length, the draft length, and ngram-mod's
    n_min or ngram-map-k4v's min_hits."""
    key, length = NGRAM_SIZES[kind]
    extra = {"ngram-mod": {"n_min": args.n_min}, "ngram-map-k4v": {"min_hits": args.ngram_min_hits}}.get(kind, {})
    return {key: args.ngram_n, length: n_max, **extra}


@contextlib.contextmanager
def running_server(
    args: argparse.Namespace, target: Path, kind: str, draft: Path | None, n_max: int, log: Path, n_parallel: int = 1
) -> Iterator[LlamaServer]:
    spec = spec_args(args, kind, draft, n_max)
    argv = [
        "-m", str(target), *spec,
        "--spec-draft-n-max", str(n_max), "--spec-draft-n-min", str(args.n_min),
        "--spec-draft-p-min", str(p_min_of(args, kind)),
        # -c is shared by the slots (a cache split per slot): each gets n_ctx cells, as each engine sequence does
        "-c", str(args.n_ctx * n_parallel), "-np", str(n_parallel), "-t", str(args.threads), "-ngl", "0",
        "--spec-draft-ngl", "0", "--metrics", "--no-warmup", "--no-webui",
        # the engine opens a CPU target without FlashAttention (pair.py: batch_invariant): the server's attention
        # the same kernels, so that both sides compute the same graph
        "-fa", "off",
    ]
    server = LlamaServer(args.server_bin, argv, log, args.timeout)
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


def p_min_of(args: argparse.Namespace, kind: str) -> float:
    """The p-min of a row kind: `--confidence-p-min` where a DSpark draft's confidence head cuts drafts."""
    return args.confidence_p_min if DSPARK_DRAFTS.get(kind, {}).get("confidence_head") else args.p_min


def engine_method(draft: str) -> str:
    """The engine's method for a row kind."""
    if draft in DRAFT_MODELS:
        return DRAFT_SIMPLE
    if draft in DSPARK_DRAFTS:
        return DSPARK
    return draft if draft in (MTP, EAGLE3, *NGRAMS, NGRAM_CACHE) else "dflash"


def generated_pair(args: argparse.Namespace, target: str, draft: str | None, head: str, **extra: Any) -> TinyPair:
    """The generated pair of a row: the tiny sizes, or from --n-embd 256 up the benchmarks' Qwen-like scaled ones;
    draft-simple: the target and a small model of its vocabulary as the draft."""
    if draft == DRAFT_SIMPLE_HYBRID and target == "dense":
        raise UsageError(f"{draft} on a dense target: llama-server aborts at the first partly accepted draft (it cuts "
                         "the rejected cells from the recurrent draft's context, which keeps no snapshot for "
                         "draft-simple): compare it on the hybrid target")
    if draft in DRAFT_MODELS:
        alone = generated_pair(args, target, None, head, **extra)
        return replace(alone, draft=tiny_draft_model(alone, kind=DRAFT_MODELS[draft]), draft_kind=DRAFT_SIMPLE)
    if draft in DSPARK_DRAFTS:
        draft, extra = DSPARK, {**DSPARK_DRAFTS[draft], **extra}
    return tiny_pair(target, draft, head=head, n_embd=args.n_embd, dims="scaled" if args.n_embd >= 256 else "tiny",
                     **extra)


def engine_outcome(engine: Engine, args: argparse.Namespace, tokens: list[int], n_max: int, draft: str) -> Outcome:
    if not args.reuse:
        engine.reset()
    common = dict(max_tokens=args.max_tokens, n_min=args.n_min, p_min=p_min_of(args, draft))
    r = engine.generate(tokens, method=engine_method(draft), draft_length=n_max, **common)
    s = r.stats
    return Outcome(tuple(r.tokens), r.text, s.drafted, s.accepted, s.verify_steps)


def plain_tokens(engine: Engine, tokens: list[int], n_predict: int) -> tuple[int, ...]:
    engine.reset()
    return tuple(engine.generate(tokens, max_tokens=n_predict, speculative=False).tokens)


def compare_pair(args: argparse.Namespace, target: str, draft: str, head: str, logs: Path) -> list[Row]:
    if draft == MTP:
        if target != "hybrid":
            raise UsageError(f"draft {MTP} needs the hybrid target (only qwen35 targets carry an MTP block)")
        pair = generated_pair(args, target, None, head, mtp_layers=1)
    elif draft in NGRAMS:
        return compare_ngram(args, target, draft, head, logs)
    elif draft in NGRAM_CACHES:
        return compare_lookup(args, target, draft, head, logs)
    else:
        pair = generated_pair(args, target, draft, head)
    opened = load_pair(pair.target, pair.draft, n_ctx=args.n_ctx, draft_capacity=max(args.n_max),
                       n_threads=args.threads)
    name = f"{target}/{draft}/{head}"
    rows: list[Row] = []
    with opened as eng:
        prompts = {p: eng.tokenize(p) for p in args.prompts}
        longest = max(len(ids) for ids in prompts.values())
        if longest + args.max_tokens >= eng.n_ctx - 1:
            raise UsageError(f"{longest} prompt tokens + --max-tokens {args.max_tokens} reach the context end "
                             f"({eng.n_ctx}): raise --n-ctx")
        plain = {p: plain_tokens(eng, ids, args.max_tokens) for p, ids in prompts.items()}
        for n_max in args.n_max:
            log = logs / f"{target}-{draft}-{head}-n{n_max}.log"
            eng.reset()  # like the freshly started server
            with running_server(args, pair.target, draft, pair.draft, n_max, log) as server:
                rows += [prompt_row(args, eng, server, name, n_max, draft, prompt, ids, plain[prompt])
                         for prompt, ids in prompts.items()]
    return rows


def prompt_row(args: argparse.Namespace, eng: Engine, server: LlamaServer, name: str, n_max: int, draft: str,
               prompt: str, ids: list[int], plain: tuple[int, ...]) -> Row:
    """One prompt on the server and the engine, the same draft length."""
    same_ids = server.tokenize(prompt) == ids
    srv = server.complete(ids, args.max_tokens, args.reuse)
    ours = None if args.server_only else engine_outcome(eng, args, ids, n_max, draft)
    lossless = (srv if ours is None else ours).tokens == plain
    return Row(name, n_max, prompt, srv, ours, lossless, same_ids)


def compare_ngram(args: argparse.Namespace, target: str, draft: str, head: str, logs: Path) -> list[Row]:
    """An n-gram draft on the target alone: one engine per draft length (the method drafts up to it, as the server's
    n_max), one server per prompt (its tables outlive requests, the engine's do not)."""
    pair = generated_pair(args, target, None, head)
    name = f"{target}/{draft}/{head}"
    rows: list[Row] = []
    for n_max in args.n_max:
        with load_pair(pair.target, None, n_ctx=args.n_ctx, draft_capacity=n_max, n_threads=args.threads,
                       method_options={draft: ngram_options(args, draft, n_max)}) as eng:
            prompts = {p: eng.tokenize(p) for p in args.prompts}
            plain = {p: plain_tokens(eng, ids, args.max_tokens) for p, ids in prompts.items()}
            for i, (prompt, ids) in enumerate(prompts.items()):
                log = logs / f"{target}-{draft}-{head}-n{n_max}-p{i}.log"
                with running_server(args, pair.target, draft, None, n_max, log) as server:
                    rows.append(prompt_row(args, eng, server, name, n_max, draft, prompt, ids, plain[prompt]))
    return rows


def compare_lookup(args: argparse.Namespace, target: str, draft: str, head: str, logs: Path) -> list[Row]:
    """ngram-cache on the target alone (see the module doc): one server per request, as for the n-gram drafts; for
    the dynamic file, each prompt twice."""
    if min(args.n_max) < LOOKUP_DRAFT:
        raise UsageError(f"llama-server's ngram-cache drafts {LOOKUP_DRAFT} tokens whatever its draft length: compare "
                         f"{draft} at --n-max {LOOKUP_DRAFT} or more")
    pair = generated_pair(args, target, None, head)
    name = f"{target}/{draft}/{head}"
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="lookup-") as tmp:
        static = lookup_create(args, pair.target, Path(tmp) / "static.bin", logs) if draft == LOOKUP_STATIC else None
        for n_max in args.n_max:
            for i, prompt in enumerate(args.prompts):
                dynamic = Path(tmp) / f"dynamic-n{n_max}-p{i}.bin"
                options = {LOOKUP_STATIC: {"lookup_cache_static": static},
                           LOOKUP_DYNAMIC: {"lookup_cache_dynamic": dynamic}}.get(draft, {})
                with load_pair(pair.target, None, n_ctx=args.n_ctx, draft_capacity=n_max, n_threads=args.threads,
                               method_options={NGRAM_CACHE: options}) as eng:
                    ids = eng.tokenize(prompt)
                    plain = plain_tokens(eng, ids, args.max_tokens)
                    log = logs / f"{target}-{draft}-{head}-n{n_max}-p{i}.log"
                    with running_server(args, pair.target, draft, static, n_max, log) as server:
                        rows.append(prompt_row(args, eng, server, name, n_max, NGRAM_CACHE, prompt, ids, plain))
                    if draft != LOOKUP_DYNAMIC:
                        continue
                    # The engine answers again, from what the first answer taught it; the server reads that from
                    # the file an engine wrote after the same first answer.
                    written = first_answer_file(args, pair.target, ids, n_max, Path(tmp) / f"first-{dynamic.name}")
                    with running_server(args, pair.target, draft, written, n_max, log.with_suffix(".2.log")) as srv:
                        srv_outcome = srv.complete(ids, args.max_tokens, args.reuse)
                        again = argparse.Namespace(**{**vars(args), "reuse": True})  # no reset: it keeps what it learnt
                        ours = None if args.server_only else engine_outcome(eng, again, ids, n_max, NGRAM_CACHE)
                    lossless = (srv_outcome if ours is None else ours).tokens == plain
                    rows.append(Row(name, n_max, f"{prompt} (again)", srv_outcome, ours, lossless, True))
    return rows


def lookup_create(args: argparse.Namespace, target: Path, out: Path, logs: Path) -> Path:
    """The static lookup cache `llama-lookup-create` makes of --lookup-corpus with the target's vocabulary."""
    binary = args.lookup_create_bin or args.server_bin.with_name("llama-lookup-create")
    cmd = [str(binary), "-m", str(target), "-p", args.lookup_corpus, "-lcs", str(out), "-c", str(args.n_ctx),
           "-t", str(args.threads)]
    log = logs / "llama-lookup-create.log"
    with open(log, "wb") as sink:
        done = subprocess.run(cmd, stdout=sink, stderr=subprocess.STDOUT, timeout=args.timeout, check=False)
    if done.returncode != 0 or not out.is_file():
        raise ServerError(f"{binary} exited with {done.returncode}:\n{log.read_text(errors='replace')[-3000:]}")
    return out


def first_answer_file(args: argparse.Namespace, target: Path, ids: list[int], n_max: int, path: Path) -> Path:
    """The dynamic lookup cache an engine writes after one answer to `ids` (at its close)."""
    with load_pair(target, None, n_ctx=args.n_ctx, draft_capacity=n_max, n_threads=args.threads,
                   method_options={NGRAM_CACHE: {"lookup_cache_dynamic": path}}) as eng:
        eng.generate(ids, method=NGRAM_CACHE, draft_length=n_max, max_tokens=args.max_tokens, n_min=args.n_min,
                     p_min=args.p_min)
    return path


def _counts(o: Outcome | None) -> str:
    return "-" if o is None else f"{o.drafted}/{o.accepted}/{o.verify_steps}"


def print_table(rows: Sequence[Row]) -> None:
    head = f"{'pair':<24} {'n':>2} {'prompt':<24} {'tok':>4} {'server d/a/v':>13} {'engine d/a/v':>13}  result"
    print(head)
    print("-" * len(head))
    for r in rows:
        diff = r.differences()
        if not r.plain_ok:
            diff.append("server≠plain" if r.engine is None else "engine≠plain")
        if not r.tokenize_ok:
            diff.append("tokenize")
        n_srv = len(r.server.tokens)
        n_eng = n_srv if r.engine is None else len(r.engine.tokens)
        n_tok = str(n_eng) if n_srv == n_eng else f"{n_srv}≠{n_eng}"
        verdict = "ok" if r.ok else "MISMATCH " + ",".join(diff)
        print(f"{r.pair:<24} {r.n_max:>2} {r.prompt[:24]!s:<24} {n_tok:>4} "
              f"{_counts(r.server):>13} {_counts(r.engine):>13}  {verdict}")


def print_acceptance(rows: Sequence[Row]) -> None:
    """Per pair and draft length, summed over the prompts: the server's acceptance and tokens per verify step,
    and whether the engine matched every count."""
    groups: dict[tuple[str, int], list[Row]] = {}
    for r in rows:
        groups.setdefault((r.pair, r.n_max), []).append(r)
    head = f"{'pair':<24} {'n':>2} {'drafted':>8} {'accepted':>8} {'accept':>7} {'steps':>6} {'tok/step':>8}  engine"
    print(head)
    print("-" * len(head))
    for (pair, n_max), group in groups.items():
        drafted = sum(r.server.drafted for r in group)
        accepted = sum(r.server.accepted for r in group)
        steps = sum(r.server.verify_steps for r in group)
        generated = sum(len(r.server.tokens) for r in group)
        rate = f"{accepted / drafted:.1%}" if drafted else "-"
        per_step = f"{generated / steps:.2f}" if steps else "-"
        engine = "n/a" if any(r.engine is None for r in group) else (
            "same" if all(not r.differences() for r in group) else "DIFFERENT")
        print(f"{pair:<24} {n_max:>2} {drafted:>8} {accepted:>8} {rate:>7} {steps:>6} {per_step:>8}  {engine}")


# -- parallel sequences: llama-server -np N against load_pair(..., parallel=N) --------------------------------------


@dataclass(frozen=True)
class Level:
    """One number of concurrent streams on one pair and draft length: both sides' round."""

    pair: str
    n_max: int
    streams: int
    ours: dict[str, Any]  # tokens (one list per stream), tok_s, wall_s, decodes, rows_per_decode, ttft_ms
    server: dict[str, Any]  # tokens, tok_s, wall_s, decodes, timings (the server's own, one per request)
    plain: tuple[tuple[int, ...], ...]  # the engine's plain decoding of each prompt
    stable: bool = True  # every round gave each side the same tokens as its median round

    @property
    def same(self) -> int:
        """Streams whose tokens equal the server's for the same prompt."""
        return sum(a == b for a, b in zip(self.ours["tokens"], self.server["tokens"], strict=True))

    @property
    def lossless(self) -> int:
        """Streams whose tokens equal the engine's plain decoding of the prompt."""
        return sum(tuple(a) == b for a, b in zip(self.ours["tokens"], self.plain, strict=True))

    @property
    def ok(self) -> bool:
        return self.same == self.lossless == self.streams and self.stable

    def to_dict(self) -> dict[str, Any]:
        drop = ("tokens",)
        return {"pair": self.pair, "n_max": self.n_max, "streams": self.streams, "same_as_server": self.same,
                "same_as_plain": self.lossless, "stable": self.stable,
                "ours": {k: v for k, v in self.ours.items() if k not in drop},
                "server": {k: v for k, v in self.server.items() if k not in drop}}


def _together(jobs: Sequence[Callable[[], Any]], timeout: float) -> list[tuple[float, float, Any]]:
    """Run the jobs at once, one thread each (a barrier starts them): (start, end, result) per job."""
    barrier = threading.Barrier(len(jobs), timeout=timeout)
    out: list[Any] = [None] * len(jobs)
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            barrier.wait()
            start = time.perf_counter()
            result = jobs[i]()
            out[i] = (start, time.perf_counter(), result)
        except BaseException as exc:  # re-raised below, on the caller's thread
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(jobs))]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    if errors:
        raise errors[0]
    if any(t.is_alive() for t in threads):
        raise ServerError(f"{len(jobs)} concurrent requests did not end within {timeout:.0f} s")
    return out


def server_round(server: LlamaServer, prompts: Sequence[list[int]], n_predict: int, timeout: float) -> dict[str, Any]:
    before = server.metric(DECODE_METRIC)
    done = _together([lambda ids=ids: server.generate(ids, n_predict) for ids in prompts], timeout)
    wall = max(d[1] for d in done) - min(d[0] for d in done)
    tokens = [d[2]["tokens"] for d in done]
    return {"tokens": tokens, "tok_s": sum(map(len, tokens)) / wall, "wall_s": wall,
            "decodes": round(server.metric(DECODE_METRIC) - before),
            "timings": [{"id_slot": d[2]["id_slot"], **d[2]["timings"]} for d in done]}


def engine_round(eng: Engine, prompts: Sequence[list[int]], options: dict[str, Any], timeout: float
                 ) -> dict[str, Any]:
    runs, delta = run_streams(eng, prompts, [options] * len(prompts), timeout)
    wall = max(r.end for r in runs) - min(r.start for r in runs)
    decodes = int(delta["decodes"])
    return {"tokens": [r.ids for r in runs], "tok_s": sum(r.tokens for r in runs) / wall, "wall_s": wall,
            "decodes": decodes, "rows_per_decode": delta["rows"] / decodes if decodes else 0.0,
            "ttft_ms": [1000.0 * ((r.first or r.end) - r.start) for r in runs]}


def compare_parallel(args: argparse.Namespace, target: str, draft: str, head: str, logs: Path) -> list[Level]:
    """Every level of --scaling on one server (-np N) and one engine (parallel=N), for each draft length."""
    if draft in (*NGRAMS, *NGRAM_CACHES):
        raise UsageError("--parallel compares the model drafts (dflash2, dflash1, mtp, draft-simple, eagle3, dspark), "
                         "not the n-gram ones")
    if draft == MTP and target != "hybrid":
        raise UsageError(f"draft {MTP} needs the hybrid target (only qwen35 targets carry an MTP block)")
    if draft == MTP:
        pair = generated_pair(args, target, None, head, mtp_layers=1)
    else:
        pair = generated_pair(args, target, draft, head)
    n_par = args.parallel
    name = f"{target}/{draft}/{head}"
    levels: list[Level] = []
    with load_pair(pair.target, pair.draft, n_ctx=args.n_ctx, draft_capacity=max(args.n_max), n_threads=args.threads,
                   parallel=n_par) as eng:
        ids = [eng.tokenize(p) for p in distinct_prompts(args.prompts, max(args.scaling))]
        if max(map(len, ids)) + args.max_tokens >= eng.n_ctx - 1:
            raise UsageError(f"prompt + --max-tokens {args.max_tokens} reach the context end ({eng.n_ctx})")
        plain = tuple(plain_tokens(eng, x, args.max_tokens) for x in ids)
        for n_max in args.n_max:
            options = dict(max_tokens=args.max_tokens, n_min=args.n_min, p_min=p_min_of(args, draft),
                           draft_length=n_max, method=engine_method(draft))
            log = logs / f"{target}-{draft}-{head}-n{n_max}-np{n_par}.log"
            with running_server(args, pair.target, draft, pair.draft, n_max, log, n_parallel=n_par) as server:
                server.generate(ids[0], 8)  # warm-up, both sides: first-touch of the weights
                eng.generate(ids[0], max_tokens=8)
                for c in args.scaling:
                    rounds: tuple[list[dict[str, Any]], list[dict[str, Any]]] = ([], [])
                    for _ in range(args.rounds):  # alternating, so that drifts of the machine hit both alike
                        rounds[0].append(engine_round(eng, ids[:c], options, args.timeout))
                        rounds[1].append(server_round(server, ids[:c], args.max_tokens, args.timeout))
                    ours, srv = (_median_round(r) for r in rounds)
                    stable = all(r["tokens"] == m["tokens"] for rs, m in zip(rounds, (ours, srv), strict=True)
                                 for r in rs)
                    levels.append(Level(name, n_max, c, ours, srv, plain[:c], stable))
    return levels


def _median_round(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """The round of median aggregate tok/s, with every round's tok/s."""
    ordered = sorted(rounds, key=lambda r: r["tok_s"])
    return {**ordered[(len(ordered) - 1) // 2], "rounds_tok_s": [r["tok_s"] for r in rounds]}


def scaling_table(levels: Sequence[Level]) -> str:
    """Markdown, one table per pair and draft length: streams | ours tok/s | ours ×1 | server tok/s | server ×1, then
    each side's target decodes (the server's `n_decode_total`), the engine's rows per decode and the token check."""
    groups: dict[tuple[str, int], list[Level]] = {}
    for lv in levels:
        groups.setdefault((lv.pair, lv.n_max), []).append(lv)
    out = []
    for (pair, n_max), group in groups.items():
        one = next((lv for lv in group if lv.streams == 1), None)
        base_ours = one.ours["tok_s"] if one else 0.0
        base_srv = one.server["tok_s"] if one else 0.0
        out += [f"{pair}, draft length {n_max}:", "",
                "| streams | ours tok/s | ours ×1 | server tok/s | server ×1 | decodes ours / server "
                "| ours rows/decode | same tokens |", "|---:|---:|---:|---:|---:|---:|---:|:---|"]
        for lv in group:
            ours, srv = lv.ours["tok_s"], lv.server["tok_s"]
            rel_ours = f"{ours / base_ours:.2f}" if base_ours else "-"
            rel_srv = f"{srv / base_srv:.2f}" if base_srv else "-"
            verdict = "yes" if lv.ok else f"server {lv.same}/{lv.streams}, plain {lv.lossless}/{lv.streams}"
            decodes = f"{lv.ours['decodes']} / {lv.server['decodes']}"
            out.append(f"| {lv.streams} | {ours:.1f} | {rel_ours} | {srv:.1f} | {rel_srv} | {decodes} | "
                       f"{lv.ours['rows_per_decode']:.2f} | {verdict} |")
        out.append("")
    return "\n".join(out)


def each_pair(args: argparse.Namespace, logs: Path, compare: Callable[..., list[Any]],
              report: Callable[[list[Any]], None]) -> list[Any] | None:
    """`compare(args, target, draft, head, logs)` for every pair asked for, its results in one list; None (after
    saying why, and reporting what was compared) on a usage error or when llama-server fails."""
    results: list[Any] = []
    try:
        for target in args.targets:
            for draft in args.drafts:
                for head in args.heads:
                    results += compare(args, target, draft, head, logs)
    except UsageError as e:
        print(e, file=sys.stderr)
        return None
    except ServerError as e:
        report(results)
        print(f"\nllama-server failed: {e}", file=sys.stderr)
        return None
    return results


def main_parallel(args: argparse.Namespace, logs: Path) -> int:
    levels = each_pair(args, logs, compare_parallel, lambda done: print(scaling_table(done)))
    if levels is None:
        return 2
    print(scaling_table(levels))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps([lv.to_dict() for lv in levels], indent=2))
        print(f"wrote {args.json}")
    bad = sum(not lv.ok for lv in levels)
    print(f"{len(levels) - bad}/{len(levels)} levels identical (every stream = the server's = plain decoding)")
    return 1 if bad else 0


def _csv(kind: Callable[[str], Any]) -> Callable[[str], list[Any]]:
    return lambda s: [kind(x) for x in s.split(",") if x]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--server-bin", type=Path, required=True, help="llama-server built from the vendored llama.cpp")
    p.add_argument("--targets", type=_csv(str), default=["dense", "hybrid"])
    p.add_argument("--drafts", type=_csv(str), default=list(DFLASH_DRAFTS),
                   help=f"{', '.join(DFLASH_DRAFTS)} (draft files), {MTP} (the hybrid target's nextn block), "
                        f"{DRAFT_SIMPLE} (a small model of the target's vocabulary; {DRAFT_SIMPLE_HYBRID}: a hybrid "
                        f"one), {EAGLE3} (an EAGLE-3 draft), {', '.join(DSPARK_DRAFTS)} (DSpark drafts, the second "
                        f"with a confidence head) or {', '.join((*NGRAMS, *NGRAM_CACHES))} (the target alone)")
    p.add_argument("--heads", type=_csv(str), default=["shaped", "regime"])
    p.add_argument("--n-max", type=_csv(int), default=[3, 7], help="fixed draft lengths")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--n-embd", type=int, default=128,
                   help="the generated models' width (256 and up: the benchmarks' scaled sizes)")
    p.add_argument("--n-min", type=int, default=0, help="drop drafts shorter than this")
    p.add_argument("--p-min", type=float, default=0.0, help="stop a draft at a less confident position")
    p.add_argument("--confidence-p-min", type=float, default=0.5,
                   help="the p-min of the dspark-conf rows: where the DSpark confidence head cuts a draft")
    p.add_argument("--n-ctx", type=int, default=512)
    p.add_argument("--ngram-n", type=int, default=3, help="n-gram drafts: the key length (n_match / size_n)")
    p.add_argument("--ngram-min-hits", type=int, default=1, help="ngram-map-k4v: the hits a key needs to draft")
    p.add_argument("--lookup-corpus", default="".join(PHRASE) * 4,
                   help="ngram-cache-static: the text llama-lookup-create makes the static file of (default: the "
                        "phrase head's phrase, four times)")
    p.add_argument("--lookup-create-bin", type=Path, default=None,
                   help="llama-lookup-create (default: beside --server-bin)")
    p.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) // 2))
    p.add_argument("--prompts", type=lambda s: s.split("|"), default=list(PROMPTS), help="'|'-separated")
    p.add_argument("--reuse", action="store_true",
                   help="keep the cache between prompts (server cache_prompt, engine prefix reuse)")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds per server start or request")
    p.add_argument("--logs", type=Path, default=None, help="keep the server logs here")
    p.add_argument("--server-only", action="store_true",
                   help="run llama-server alone (checked against plain decoding) and print its acceptance")
    p.add_argument("--parallel", type=int, default=None,
                   help="parallel sequences: llama-server -np N against load_pair(..., parallel=N), N requests at once")
    p.add_argument("--scaling", type=_csv(int), default=None,
                   help="with --parallel (default N = the largest): concurrent streams per level, e.g. 1,2,4,8")
    p.add_argument("--rounds", type=int, default=3,
                   help="--parallel: rounds per level, alternating the engine and the server; the median is reported")
    p.add_argument("--json", type=Path, default=None, help="--parallel: write every level's figures here")
    args = p.parse_args(argv)
    if args.scaling and args.parallel is None:
        args.parallel = max(args.scaling)
    if args.parallel is not None:
        args.scaling = args.scaling or [args.parallel]
        if min(args.scaling) < 1 or max(args.scaling) > args.parallel:
            p.error(f"--scaling levels must lie in 1..--parallel ({args.parallel})")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if not args.server_bin.is_file():
        print(f"no llama-server at {args.server_bin}", file=sys.stderr)
        return 2
    kinds = (*DFLASH_DRAFTS, MTP, *DRAFT_MODELS, EAGLE3, *DSPARK_DRAFTS, *NGRAMS, *NGRAM_CACHES)
    unknown = sorted(set(args.drafts) - set(kinds))
    if unknown:
        print(f"unknown draft(s) {unknown}: choose from {', '.join(kinds)}",
              file=sys.stderr)
        return 2
    with contextlib.ExitStack() as stack:
        logs = args.logs or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="llama-server-")))
        logs.mkdir(parents=True, exist_ok=True)
        if args.parallel is not None:
            return main_parallel(args, logs)
        rows = each_pair(args, logs, compare_pair, print_table)
        if rows is None:
            return 2
    print_table(rows)
    print()
    print_acceptance(rows)
    bad = sum(not r.ok for r in rows)
    print(f"\n{len(rows) - bad}/{len(rows)} rows identical")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
