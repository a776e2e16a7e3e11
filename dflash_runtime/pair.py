"""The linked pair: target model + context, and a DFlash draft whose context borrows the target's through ctx_other."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import sys
import threading
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from llama_cpp import _logger
from llama_cpp import llama_cpp as ll

from . import methods
from .backends import load_backends
from .deprecated import renamed_keyword
from .errors import ContextCreationError, EngineClosedError, PairMismatchError
from .gguf_meta import GGUFInfo, read_gguf, sampling_defaults
from .native import DFlashApi, dflash_api
from .validation import DraftSpec, validate_pair
from .vocab import Vocabulary

MAX_PARALLEL = 64  # sequences per context (llama.cpp allows 256): 64 verify batches of 8 rows fill n_batch 512
CUDA_VERIFY_ROWS = 8  # CUDA's small-batch matrix-vector kernels take up to this many rows: verify batches stay there
DEFAULT_DRAFT_CAPACITY = CUDA_VERIFY_ROWS - 1  # a verify batch is id_last + the draft
# "exact": the CPU target takes kernels whose rows do not depend on their batch (see batch_invariant); "fast": the
# fastest kernels, answers exact up to near-ties (see divergence.py).
NUMERICS = ("exact", "fast")
_backend_ready = False
_live_handles = 0
_live_lock = threading.Lock()


def live_handles() -> int:
    """Native models and contexts created by this package and not yet freed (for leak checks)."""
    return _live_handles


def _count(delta: int) -> None:
    global _live_handles
    with _live_lock:
        _live_handles += delta


class NativeLog:
    """Keeps the last libllama log lines so a refused model or context can say why."""

    def __init__(self, size: int = 40) -> None:
        self.lines: deque[str] = deque(maxlen=size)
        self._forward = ll.llama_log_callback(self._on_log)  # keep the ctypes callback alive

    def _on_log(self, level: int, text: bytes, _user: Any) -> None:
        line = text.decode("utf-8", "replace")
        self.lines.append(line)
        # Same rule as llama-cpp-python's own callback: verbose=False shows errors only.
        if _logger.logger.level <= _logger.GGML_LOG_LEVEL_TO_LOGGING_LEVEL.get(level, 0):
            print(line, end="", flush=True, file=sys.stderr)

    def install(self) -> None:
        ll.llama_log_set(self._forward, ctypes.c_void_p(0))

    def errors(self) -> str:
        text = "".join(self.lines)
        hits = [ln.strip() for ln in text.splitlines() if any(w in ln.lower() for w in ("error", "fail", "requires"))]
        return "; ".join(hits[-3:])


_log = NativeLog()


def _init_backend() -> None:
    global _backend_ready
    if not _backend_ready:
        _log.install()
        load_backends()
        _backend_ready = True


@functools.cache
def _system_info() -> str:
    """libllama's build features (e.g. "CPU : AVX2 = 1 | ... | LLAMAFILE = 1 |"), after the backends are loaded."""
    return (ll.llama_print_system_info() or b"").decode("utf-8", "replace")


def matrix_products_invariant() -> bool:
    """Whether this build's CPU matrix products sum a row in one order whatever the row count: llamafile's sgemm
    for every row count (the wheel recipe's CPU build: SGEMM_ALL_ROWS), or ggml's own dot products for every row count
    (llamafile off). Upstream's llamafile build takes sgemm from two rows up only: a row decoded alone then differs."""
    info = _system_info()
    return "SGEMM_ALL_ROWS = 1" in info or "LLAMAFILE = 1" not in info


def matrix_products_summary() -> str:
    info = _system_info()
    if "SGEMM_ALL_ROWS = 1" in info:
        return "llamafile's sgemm for every row count"
    if "LLAMAFILE = 1" not in info:
        return "ggml's own dot products for every row count (llamafile off)"
    return "sum one row alone in another order than rows in a batch (llamafile's sgemm from two rows up)"


def init_native(verbose: bool = False) -> None:
    """ggml's backends loaded and libllama's log routed (errors only unless verbose), for callers such as
    `llama_model_quantize` that use libllama without opening a pair."""
    _logger.set_verbose(verbose)
    _init_backend()


class _Owned:
    """Native handles freed in reverse order of creation, whether construction finished or not."""

    def __init__(self) -> None:
        self._stack: list[tuple[Any, Callable[[Any], None]]] = []

    def push(self, handle: Any, free: Callable[[Any], None]) -> Any:
        self._stack.append((handle, free))
        _count(+1)
        return handle

    def free_all(self) -> None:
        while self._stack:
            handle, free = self._stack.pop()
            free(handle)
            _count(-1)


def _load_model(path: Path, n_gpu_layers: int, *, load_mtp: bool = False, repack: bool = True) -> Any:
    params = ll.llama_model_default_params()
    params.n_gpu_layers = n_gpu_layers
    params.use_extra_bufts = repack  # CPU weight repacking (Q4_0, Q4_K, IQ4_NL, ...): one kernel per row count
    params.load_mtp = load_mtp  # the nextn layers' tensors are skipped unless asked for
    _log.lines.clear()
    model = ll.llama_model_load_from_file(str(path).encode(), params)
    if not model:
        raise ContextCreationError(f"libllama could not load {path}: {_log.errors() or 'see the log above'}")
    return model


def _new_context(model: Any, params: Any, what: str) -> Any:
    _log.lines.clear()
    ctx = ll.llama_init_from_model(model, params)
    if not ctx:
        raise ContextCreationError(f"libllama could not create the {what} context: {_log.errors() or 'unknown'}")
    return ctx


def _meta_str(model: Any, key: str) -> str | None:
    size = 256
    while True:
        buf = ctypes.create_string_buffer(size)
        n = ll.llama_model_meta_val_str(model, key.encode(), buf, size)
        if n < 0:
            return None
        if n < size:
            return buf.value.decode("utf-8", "replace")
        size = n + 1  # the value was cut: n is its full length


class LinkedPair:
    """Owns the target model/context, optionally the DFlash draft model/context linked to it, and optionally the
    target's own MTP context (a second context of the target model running its nextn head).

    `draft_capacity` is the longest draft the pair is opened for: it sizes the verify ubatch and, for a hybrid
    (recurrent) target, the `n_rs_seq` recurrent-state snapshots that let rejected drafts be rolled back (pass
    `n_rs_seq` to override; 0 disables rollback, and speculative requests then fail loudly). A request may draft
    less (its `draft_length`), never more. `draft_max=` is the deprecated spelling of `draft_capacity`.
    `mtp`: None opens the MTP context when the target has an MTP head (a failure is kept in `mtp_error`), True
    requires it, False skips it. `parallel` is the number of sequences every context holds (requests that run at
    once); `n_ctx` is each sequence's context.
    Raw pointers are exposed as `.target_model`, `.target_ctx`, `.draft_model`, `.draft_ctx` for callers that
    drive libllama themselves. Free with `close()` or a `with` block; the draft goes before the target.
    """

    def __init__(
        self,
        target_path: str | os.PathLike[str],
        draft_path: str | os.PathLike[str] | None = None,
        *,
        n_ctx: int = 4096,
        n_gpu_layers: int = 0,
        draft_capacity: int | None = None,
        n_batch: int = 512,
        n_threads: int | None = None,
        n_rs_seq: int | None = None,
        verbose: bool = False,
        mtp: bool | None = None,
        draft_max: int | None = None,
        parallel: int = 1,
        numerics: str = "exact",
    ) -> None:
        capacity = renamed_keyword("draft_max", "draft_capacity", draft_max, draft_capacity, DEFAULT_DRAFT_CAPACITY,
                                   stacklevel=4)
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 0:
            raise ValueError(f"draft_capacity must be an integer ≥ 0 (got {capacity!r})")
        _logger.set_verbose(verbose)
        self.target_info: GGUFInfo = read_gguf(target_path)
        self.draft_info: GGUFInfo | None = read_gguf(draft_path) if draft_path is not None else None
        self.spec: DraftSpec | None = None
        if self.draft_info is not None:
            self.spec = validate_pair(self.target_info, self.draft_info, capacity)
        elif self.target_info.arch == "dflash":
            raise PairMismatchError(
                f"{self.target_info.path.name} is a DFlash draft: it has no embeddings or output head of its own and "
                "must be opened together with its target, load_pair(target_path, draft_path)"
            )
        if n_ctx < 16 or n_batch < 1:
            raise ValueError(f"n_ctx must be ≥ 16 and n_batch ≥ 1 (got n_ctx={n_ctx}, n_batch={n_batch})")
        if isinstance(parallel, bool) or not isinstance(parallel, int) or not 1 <= parallel <= MAX_PARALLEL:
            raise ValueError(f"parallel must be an integer in 1..{MAX_PARALLEL} (got {parallel!r})")
        if numerics not in NUMERICS:
            raise ValueError(f"numerics must be one of {', '.join(NUMERICS)} (got {numerics!r})")
        self.numerics_asked = numerics
        self.parallel = parallel
        # The MTP head: one nextn layer after the trunk (a failure to open it is kept when it is optional).
        n_nextn = int(self.target_info.keys.get(f"{self.target_info.arch}.nextn_predict_layers", 0) or 0)
        if mtp and n_nextn == 0:
            raise PairMismatchError(f"{self.target_info.path.name} has no MTP head (nextn_predict_layers is 0)")
        self.wants_mtp = n_nextn > 0 and mtp is not False
        self.mtp_error: str | None = None
        self._mtp_required = bool(mtp)
        self._capacity = capacity
        self.mtp_capacity = capacity if self.wants_mtp else 0
        self.draft_capacity = capacity if self.spec else 0
        self.n_gpu_layers = n_gpu_layers
        self._n_rs_seq_request = n_rs_seq
        self.api: DFlashApi | None = dflash_api() if self.spec else None
        self._owned = _Owned()
        self._closed = False
        self.target_model = self.target_ctx = self.draft_model = self.draft_ctx = self.mtp_ctx = None
        # Half the cores, as llama-cpp-python does: busy-waiting threads on a shared machine stall each other.
        threads = n_threads or max(1, (os.cpu_count() or 2) // 2)
        try:
            _init_backend()
            self._open_target(n_ctx, n_gpu_layers, n_batch, threads)
            if self.spec is not None:
                self._open_draft(n_gpu_layers, threads)
            if self.wants_mtp:
                self._open_mtp(threads)
        except BaseException:
            self._owned.free_all()
            self._closed = True
            raise

    # -- construction -------------------------------------------------------------------------------------------

    def _open_target(self, n_ctx: int, n_gpu_layers: int, n_batch: int, threads: int) -> None:
        self.target_model = self._owned.push(
            # On the CPU the target's rows must not depend on their batch (see batch_invariant): repacked weights
            # take a many-row kernel from four rows up and a one-row kernel below.
            _load_model(self.target_info.path, n_gpu_layers, load_mtp=self.wants_mtp, repack=not self._exact_cpu),
            ll.llama_model_free,
        )
        model = self.target_model
        self.is_recurrent = bool(ll.llama_model_is_recurrent(model) or ll.llama_model_is_hybrid(model))
        params = ll.llama_context_default_params()
        params.n_batch = n_batch
        # A sequence's whole verify batch must fit in one ubatch so that a hybrid target can roll it back (libllama
        # keeps a sequence's last n_rs_seq + 1 rows in one ubatch when it splits a batch of several sequences).
        capacity = self._capacity if any(m.wanted(self) for m in methods.REGISTRY) else 0
        params.n_ubatch = max(n_batch, capacity + 2)
        # One step's decode holds every sequence's verify rows, whatever the prefill budget.
        params.n_batch = max(params.n_ubatch, self.parallel * (capacity + 1))
        # One KV stream per sequence (kv_unified off), n_ctx cells each: a sequence's cells, and so its attention
        # sums, depend on its own history only, whatever the other sequences hold (see batch_invariant).
        params.n_seq_max = self.parallel
        params.kv_unified = False
        params.n_ctx = n_ctx * self.parallel
        params.n_threads = params.n_threads_batch = threads
        if self._exact_cpu:
            # Exactness across requests needs a row's numbers not to depend on the rows decoded beside it: the CPU
            # FlashAttention kernel tiles many-row batches and splits single rows across threads differently, the
            # plain attention path does neither (see batch_invariant).
            params.flash_attn_type = ll.LLAMA_FLASH_ATTN_TYPE_DISABLED
        # Recurrent state can be cut back only through snapshots, one per token that may be rejected.
        wanted = capacity if self._n_rs_seq_request is None else self._n_rs_seq_request
        params.n_rs_seq = wanted if (capacity and self.is_recurrent) else 0
        self.target_ctx = self._owned.push(_new_context(self.target_model, params, "target"), ll.llama_free)
        self.n_ctx = int(ll.llama_n_ctx_seq(self.target_ctx))  # per sequence
        self.n_batch = int(ll.llama_n_batch(self.target_ctx))
        self.n_ubatch = int(ll.llama_n_ubatch(self.target_ctx))
        self.n_rs_seq = int(ll.llama_n_rs_seq(self.target_ctx))
        self.vocab = ll.llama_model_get_vocab(self.target_model)  # the raw pointer, for callers driving libllama
        self.vocabulary = Vocabulary(self.vocab)
        self.n_vocab = self.vocabulary.n_tokens
        self.n_embd = int(ll.llama_model_n_embd(self.target_model))
        if self.spec is not None:
            assert self.api is not None
            # Taps must be on before the first decode: enabling them re-reserves the compute graph.
            for lid in self.spec.target_layer_ids:
                self.api.set_embeddings_layer_inp(self.target_ctx, lid, True)
        self.n_embd_out = int(ll.llama_model_n_embd_out(self.target_model))

    def _open_draft(self, n_gpu_layers: int, threads: int) -> None:
        assert self.spec is not None and self.draft_info is not None and self.api is not None
        self.draft_model = self._owned.push(_load_model(self.draft_info.path, n_gpu_layers), ll.llama_model_free)
        params = ll.llama_context_default_params()
        # One injection chunk per target ubatch, and every sequence's block in one ubatch.
        params.n_batch = params.n_ubatch = max(self.n_ubatch, self.parallel * (self.draft_capacity + 1))
        # A KV stream per sequence, as the target's (and llama-server's with -np N): a block attends to its own
        # sequence's cells only. Blocks of one size from consecutive sequences share a ubatch.
        params.n_seq_max = self.parallel
        params.kv_unified = False
        params.n_ctx = self.n_ctx * self.parallel
        params.n_rs_seq = 0
        params.n_threads = params.n_threads_batch = threads
        params.ctx_other = self.target_ctx
        self.draft_ctx = self._owned.push(_new_context(self.draft_model, params, "draft"), ll.llama_free)
        if self.api.get_ctx_other(self.draft_ctx) != self.target_ctx:
            raise ContextCreationError("the draft context is not linked to the target context (ctx_other)")
        top_k = int(self.api.model_dflash_selector_top_k(self.draft_model))
        if top_k != self.spec.selector_top_k:
            raise PairMismatchError(f"libllama reads selector_top_k={top_k}, the header {self.spec.selector_top_k}")
        layer_ids = tuple(self.api.target_layer_ids(self.draft_model))
        if layer_ids != self.spec.target_layer_ids:
            raise PairMismatchError(f"libllama reads layer ids {layer_ids}, the header {self.spec.target_layer_ids}")
        # DFlash 2 reads its candidate lattice from the nextn rows; v1 reads logits (masked nextn).
        self.api.set_embeddings_nextn(self.draft_ctx, True, not self.spec.is_dflash2)
        ll.llama_set_causal_attn(self.draft_ctx, self.spec.causal)
        self.draft_is_mrope = ll.llama_model_rope_type(self.draft_model) == ll.LLAMA_ROPE_TYPE_MROPE
        self.n_embd_draft = int(ll.llama_model_n_embd(self.draft_model))

    def _open_mtp(self, threads: int) -> None:
        """The MTP context: the target model again, its nextn head's graph, a KV cache of the nextn layer only."""
        from llama_cpp import llama_cpp_ext as lx

        params = ll.llama_context_default_params()
        params.ctx_type = ll.LLAMA_CONTEXT_TYPE_MTP
        params.n_batch = params.n_ubatch = self.n_ubatch
        params.n_seq_max = self.parallel
        params.kv_unified = False
        params.n_ctx = self.n_ctx * self.parallel
        params.n_rs_seq = 0
        params.n_threads = params.n_threads_batch = threads
        try:
            if int(ll.llama_model_n_layer_nextn(self.target_model)) < 1:
                raise ContextCreationError("libllama reads no nextn layer in the target")
            self.mtp_ctx = self._owned.push(_new_context(self.target_model, params, "MTP"), ll.llama_free)
        except ContextCreationError as error:
            if self._mtp_required:
                raise
            self.mtp_error, self.mtp_capacity = str(error), 0
            return
        # The target outputs its nextn hidden row for every decoded row (before its first decode: this re-reserves
        # the graph); the MTP context for its output rows only.
        lx.llama_set_embeddings_nextn(self.target_ctx, True, False)
        lx.llama_set_embeddings_nextn(self.mtp_ctx, True, True)

    @property
    def methods(self) -> tuple[str, ...]:
        """The draft methods (and listed chains) this pair can run, in the registry's order (methods.py)."""
        return methods.available(self)

    @property
    def default_method(self) -> str | None:
        return methods.default(self)

    def capacity(self, method: str) -> int:
        """The longest draft of a method or chain the pair runs (0 for one it does not)."""
        runs = methods.available(self)
        members = methods.split(method)
        return self._capacity if members and all(m in runs for m in members) else 0

    @property
    def _exact_cpu(self) -> bool:
        """The target runs on the CPU with the batch-invariant configuration (numerics="exact")."""
        return self.numerics_asked == "exact" and self.n_gpu_layers == 0

    @property
    def batch_invariant(self) -> bool:
        """Whether a target row's numbers are the same whatever rows share its batch and its cache's history, which is
        what makes a long-lived engine answer exactly as a fresh one (and speculative exactly as plain decoding).
        True on the CPU with numerics="exact": FlashAttention off (the CPU kernel tiles many-row batches and splits
        one row's cells across threads), weights not repacked (repacked types take another kernel from four rows
        up), and a build whose matrix products take one summation order for any row count (see
        `matrix_products_invariant`). GPU kernels (and a GPU build, which offloads large batches even with
        n_gpu_layers=0) are not batch-invariant: there every answer is a valid greedy answer of the target under
        its own batch's numerics, and a temperature-0 difference is a near-tie or a fault (divergence.py)."""
        return self._exact_cpu and not ll.llama_supports_gpu_offload() and matrix_products_invariant()

    @property
    def numerics(self) -> dict[str, Any]:
        """Which guarantee holds and why: `asked` ("exact" or "fast"), `holds` ("exact": bit-identical whatever the
        batch and history; "exact up to near-ties": a temperature-0 answer may differ from plain decoding only where
        the target's top two logits are within the kernels' rounding), `why`."""
        if self.batch_invariant:
            holds, why = "exact", (
                "CPU kernels whose rows do not depend on their batch: " + matrix_products_summary()
                + ", FlashAttention off, weights not repacked")
        elif self.numerics_asked == "fast":
            holds, why = "exact up to near-ties", ("numerics='fast': FlashAttention and repacked weights, kernels "
                                                   "chosen per batch size")
        elif self.n_gpu_layers != 0 or ll.llama_supports_gpu_offload():
            holds, why = "exact up to near-ties", "GPU kernels are chosen per batch size (not batch-invariant)"
        else:
            holds, why = "exact up to near-ties", "this build's CPU matrix products " + matrix_products_summary()
        return {"asked": self.numerics_asked, "holds": holds, "why": why}

    def sampling_defaults(self) -> dict[str, float | int]:
        """The model's recommended sampling (`general.sampling.*`, as llama.cpp reads them): only keys present."""
        return sampling_defaults(self.meta)

    # -- lifetime -----------------------------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._closed

    def check_open(self) -> None:
        if self._closed:
            raise EngineClosedError("this engine was closed; open a new one with load_pair(...)")

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._owned.free_all()
            self.target_model = self.target_ctx = self.draft_model = self.draft_ctx = self.mtp_ctx = None

    def __enter__(self) -> LinkedPair:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()

    @property
    def verify_cap(self) -> int:
        """The most drafts a verify batch may hold: CUDA's small-batch matrix-vector kernels take a few rows only, so
        a GPU target stays within CUDA_VERIFY_ROWS; on the CPU, one ubatch."""
        on_gpu = self.n_gpu_layers != 0 and bool(ll.llama_supports_gpu_offload())
        return CUDA_VERIFY_ROWS - 1 if on_gpu else self.n_ubatch - 1

    def chat_template_source(self) -> str | None:
        """The target's chat template text (`tokenizer.chat_template`), None without one."""
        raw = ll.llama_model_chat_template(self.target_model, None)
        return raw.decode("utf-8", "replace") if raw else self.meta("tokenizer.chat_template")

    def meta(self, key: str, draft: bool = False) -> str | None:
        """A GGUF metadata value as libllama reads it."""
        model = self.draft_model if draft else self.target_model
        return _meta_str(model, key) if model else None
