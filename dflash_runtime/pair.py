"""The pair: the target model and its context, the parts of the target that methods open (MTP's context of the
nextn head), and the draft model of the method whose file the draft is, in the context that method opens (a DFlash
draft's borrows the target's through ctx_other).

The pair knows no method by name: the methods with a model of their own declare a `DraftFile` (their checks, what
the target must do for them, their context) or a `TargetPart` (a context of the target model), and whoever opens the
pair hands it those (the engine: the registry's, methods.py, which also says which method a draft file is).
The pair's settings come grouped (`PairOptions`: sizes, `Threads`, numerics, `Placement`).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import re
import sys
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Protocol

from llama_cpp import _logger
from llama_cpp import llama_cpp as ll

from .deprecated import renamed_keyword
from .errors import ContextCreationError, EngineClosedError, PairMismatchError, RemoteDeviceError
from .files.gguf_meta import GGUFInfo, read_gguf, sampling_defaults
from .native.backends import load_backends
from .native.ext import dflash_api
from .native.placement import DeviceList, layer_ranges
from .native.rpc import REPLY_TIMEOUT_S, RemoteDevices, unwatch, watch
from .native.vocab import Vocabulary

MAX_PARALLEL = 64  # sequences per context (llama.cpp allows 256): 64 verify batches of 8 rows fill n_batch 512
MAX_BRANCHES = 16  # target sequences for draft-tree paths (each a KV stream of n_ctx cells and a recurrent state)
CUDA_VERIFY_ROWS = 8  # CUDA's small-batch matrix-vector kernels take up to this many rows: verify batches stay there
DEFAULT_DRAFT_CAPACITY = CUDA_VERIFY_ROWS - 1  # a verify batch is id_last + the draft
# "exact": the CPU target takes kernels whose rows do not depend on their batch (see batch_invariant); "fast": the
# fastest kernels, answers exact up to near-ties (see decoding/divergence.py).
NUMERICS = ("exact", "fast")
_backend_ready = False
_live_handles = 0
_live_lock = threading.Lock()
_LAYER_LINE = re.compile(r"load_tensors: layer +(\d+) assigned to device (\S+),")


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
        self.layer_devices: dict[int, str] = {}  # the last model load's account of where each layer went
        self._forward = ll.llama_log_callback(self._on_log)  # keep the ctypes callback alive

    def _on_log(self, level: int, text: bytes, _user: Any) -> None:
        line = text.decode("utf-8", "replace")
        self.lines.append(line)
        placed = _LAYER_LINE.search(line)
        if placed:
            self.layer_devices[int(placed.group(1))] = placed.group(2)
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


def load_model(path: Path, n_gpu_layers: int, *, repack: bool = True, devices: DeviceList | None = None,
               prepare: Sequence[Callable[[Any], None]] = ()) -> Any:
    """Load a model; `prepare`: what the parts opened on it set in its load parameters (e.g. loading the nextn
    layers' tensors, which are skipped unless asked for)."""
    params = ll.llama_model_default_params()
    params.n_gpu_layers = n_gpu_layers
    params.use_extra_bufts = repack  # CPU weight repacking (Q4_0, Q4_K, IQ4_NL, ...): one kernel per row count
    for step in prepare:
        step(params)
    if devices is not None:
        devices.apply(params)
    _log.lines.clear()
    _log.layer_devices.clear()
    model = ll.llama_model_load_from_file(str(path).encode(), params)
    if not model:
        raise ContextCreationError(f"libllama could not load {path}: {_log.errors() or 'see the log above'}")
    return model


def new_context(model: Any, params: Any, what: str) -> Any:
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


def available_cores() -> int:
    """The CPUs this process may run on (its affinity where the platform says, else the machine's)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


@dataclass(frozen=True)
class Threads:
    """The CPU threads of a context, as llama.cpp takes them: `decode` for a one-row decode (a plain step), `batch`
    for more rows (a verify, a draft block, a prompt chunk, several sequences' rows). A row's numbers do not depend
    on either (the exact build's CPU kernels share work between threads by output rows: tests/test_threads.py)."""

    decode: int
    batch: int

    @classmethod
    def default(cls, decode: int | None = None, batch: int | None = None) -> Threads:
        """Half the cores for one-row decodes, as llama-cpp-python (busy-waiting threads on a shared machine stall
        each other), and as many for batches: a plain step and a verify then run on the same threads, so a speed-up
        is the method's, not a core that plain decoding left idle. (llama-cpp-python gives batches every core; pass
        `batch` for more.) 0 or None: the default."""
        decode = decode or max(1, available_cores() // 2)
        return cls(decode, batch or decode)

    def __post_init__(self) -> None:
        for name in ("decode", "batch"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"n_threads{'' if name == 'decode' else '_batch'} must be an integer ≥ 1 "
                                 f"(got {value!r})")  # fmt: skip

    def apply(self, params: Any) -> None:
        """Set a context's parameters to these threads."""
        params.n_threads, params.n_threads_batch = self.decode, self.batch


BRANCHES = "branches"  # what a pair with spare target sequences holds (`PairOptions.branches`)


class DraftFile(Protocol):
    """What a method with a model of its own declares to the pair (its module implements it, drafting.Implementation
    names it). Which files are its drafts is said by its registry line (methods.py: `claims`, `priority`), read
    from headers without libllama."""

    needs: str  # what the pair holds once such a draft is open, as the registry's methods name it (methods.py)
    kind: str  # the file in words
    runs_alone: bool  # whether such a file opens as a model by itself (a DFlash draft does not: no output head)

    def validate(self, target: GGUFInfo, draft: GGUFInfo, capacity: int) -> Any:
        """The draft's spec, checked against the target; PairMismatchError says what does not fit."""
        ...

    def prepare_target(self, pair: LinkedPair) -> None:
        """What the target's context must do for this draft before its first decode (e.g. layer taps)."""
        ...

    def open_context(self, pair: LinkedPair, threads: Threads) -> Any:
        """A context of `pair.draft_model` (the pair owns and frees it)."""
        ...

    def describe(self, spec: Any) -> dict[str, Any]:
        """The draft's facts for `Engine.info()`: draft_kind, block_size, target_layer_ids."""
        ...


class TargetPart(Protocol):
    """What a method that drafts from a part of the target declares to the pair (drafting.Implementation's
    `target_part`): e.g. MTP's context of the target's nextn head."""

    needs: str  # what the pair holds once the part is open (`pair.parts[needs]` is its context)

    def wanted(self, target: GGUFInfo, required: bool) -> bool:
        """Whether to open it on this target; PairMismatchError when `required` and the target lacks it."""
        ...

    def prepare_load(self, params: Any) -> None:
        """The target model's load parameters (`llama_model_params`), before it loads."""
        ...

    def open_context(self, pair: LinkedPair, threads: Threads) -> Any:
        """A context of `pair.target_model` (the pair owns and frees it); ContextCreationError: not available."""
        ...

    def link(self, pair: LinkedPair, ctx: Any) -> None:
        """What the target's context and the part's own must set once it is open (before the first decode)."""
        ...

    def placement(self, pair: LinkedPair) -> dict[str, Any]:
        """The part's entries in `pair.placement()`."""
        ...


@dataclass(frozen=True)
class Placement:
    """Where the layers go: `n_gpu_layers` of the target (and `draft_gpu_layers` of the draft, default the same) to
    the local GPUs and the devices of the `rpc` servers, weighted by `tensor_split`; `rpc_cpu`: the servers compute
    with this build's CPU backend; `rpc_timeout_s`: how long a server's reply may take."""

    n_gpu_layers: int = 0
    draft_gpu_layers: int | None = None
    rpc: Sequence[str] | None = None
    tensor_split: Sequence[float] | None = None
    rpc_cpu: bool = False
    rpc_timeout_s: float = REPLY_TIMEOUT_S


@dataclass(frozen=True)
class PairOptions:
    """A pair's settings, grouped: the contexts' sizes, their threads, the numerics asked, the placement."""

    n_ctx: int = 4096
    n_batch: int = 512
    draft_capacity: int = DEFAULT_DRAFT_CAPACITY
    n_rs_seq: int | None = None
    parallel: int = 1
    branches: int = 0  # spare target sequences for the paths of draft trees
    numerics: str = "exact"
    verbose: bool = False
    threads: Threads | None = None  # None: Threads.default()
    placement: Placement = field(default_factory=Placement)

    _PLACEMENT = ("n_gpu_layers", "draft_gpu_layers", "rpc", "tensor_split", "rpc_cpu", "rpc_timeout_s")

    @classmethod
    def from_keywords(cls, *, n_threads: int | None = None, n_threads_batch: int | None = None,
                      draft_max: int | None = None, draft_capacity: int | None = None, **keywords: Any) -> PairOptions:
        """The options from `load_pair`'s flat keywords (n_ctx, n_gpu_layers, n_threads, rpc, ...); TypeError names
        an unknown one. `draft_max=` is the deprecated spelling of `draft_capacity=`."""
        capacity = renamed_keyword("draft_max", "draft_capacity", draft_max, draft_capacity, DEFAULT_DRAFT_CAPACITY,
                                   stacklevel=4)
        placement = {k: keywords.pop(k) for k in cls._PLACEMENT if k in keywords}
        unknown = sorted(set(keywords) - {f.name for f in fields(cls)})
        if unknown:
            raise TypeError(f"unknown pair options {unknown}")
        return cls(draft_capacity=capacity, threads=Threads.default(n_threads, n_threads_batch),
                   placement=Placement(**placement), **keywords)

    def check(self) -> None:
        capacity = self.draft_capacity
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 0:
            raise ValueError(f"draft_capacity must be an integer ≥ 0 (got {capacity!r})")
        if self.n_ctx < 16 or self.n_batch < 1:
            raise ValueError(f"n_ctx must be ≥ 16 and n_batch ≥ 1 (got n_ctx={self.n_ctx}, n_batch={self.n_batch})")
        parallel = self.parallel
        if isinstance(parallel, bool) or not isinstance(parallel, int) or not 1 <= parallel <= MAX_PARALLEL:
            raise ValueError(f"parallel must be an integer in 1..{MAX_PARALLEL} (got {parallel!r})")
        if self.numerics not in NUMERICS:
            raise ValueError(f"numerics must be one of {', '.join(NUMERICS)} (got {self.numerics!r})")
        branches = self.branches
        if isinstance(branches, bool) or not isinstance(branches, int) or not 0 <= branches <= MAX_BRANCHES:
            raise ValueError(f"branches must be an integer in 0..{MAX_BRANCHES} (got {branches!r})")


def _info(path: str | os.PathLike[str] | GGUFInfo) -> GGUFInfo:
    return path if isinstance(path, GGUFInfo) else read_gguf(path)


class LinkedPair:
    """Owns the target model/context, optionally a draft model and the context its method opens (`draft_file`:
    what the method that claims the draft declares, methods.draft_file), and the parts of the target that methods
    open (`target_parts`: each a `TargetPart` and whether it is required; an optional one that fails to open is
    kept in `part_errors`). The files are paths or their headers as read already (`GGUFInfo`: read once per load).

    `options` (`PairOptions`, or its flat keywords as `load_pair` takes them): `draft_capacity` is the longest draft
    the pair is opened for: it sizes the verify ubatch and, for a hybrid (recurrent) target, the `n_rs_seq`
    recurrent-state snapshots that let rejected drafts be rolled back (pass `n_rs_seq` to override; 0 disables
    rollback, and speculative requests then fail loudly). A request may draft less (its `draft_length`), never
    more. `parallel` is the number of sequences every context holds (requests that run at once); `n_ctx` is each
    sequence's context. `placement.rpc`: RPC servers ("host:port", started with `python -m dflash_runtime
    rpc-server`) whose devices join the local GPUs, remote first; `n_gpu_layers` layers go to those devices,
    weighted by `tensor_split` (one weight per device, remote first; default: by free memory), the rest stay on the
    local CPU (see native/placement.py, native/rpc.py). The draft's layers follow `draft_gpu_layers` (default
    `n_gpu_layers`) on the same devices (its graph reads the target's output head and token embeddings wherever
    they are), on the local GPUs where there are some. `rpc_cpu=True` says the servers compute with the CPU backend
    of this same build, so the pair keeps its CPU numerics (and batch invariance). `branches`: spare target
    sequences for the paths of draft trees (drafters/dflash_tree.py), each a KV stream of `n_ctx` cells and a
    recurrent state of its own; no request holds one.
    Raw pointers are exposed as `.target_model`, `.target_ctx`, `.draft_model`, `.draft_ctx` for callers that
    drive libllama themselves. Free with `close()` or a `with` block; the draft goes before the target.
    """

    def __init__(
        self,
        target_path: str | os.PathLike[str] | GGUFInfo,
        draft_path: str | os.PathLike[str] | GGUFInfo | None = None,
        options: PairOptions | None = None,
        *,
        draft_file: DraftFile | None = None,
        target_parts: Sequence[tuple[TargetPart, bool]] = (),
        **keywords: Any,
    ) -> None:
        if options is None:
            options = PairOptions.from_keywords(**keywords)
        elif keywords:
            raise TypeError(f"pass either options or keywords, not both (got {sorted(keywords)})")
        options.check()
        self.options = options
        _logger.set_verbose(options.verbose)
        capacity = options.draft_capacity
        self.target_info: GGUFInfo = _info(target_path)
        self.draft_info: GGUFInfo | None = _info(draft_path) if draft_path is not None else None
        self.spec: Any = None  # the draft's, as its method's validation returns it
        self.draft_file: DraftFile | None = draft_file if self.draft_info is not None else None
        if self.draft_info is not None:
            if draft_file is None:
                raise PairMismatchError(f"{self.draft_info.path.name} came without the draft file declaration of "
                                        "the method that claims it (methods.draft_file)")
            self.spec = draft_file.validate(self.target_info, self.draft_info, capacity)
        self.numerics_asked = options.numerics
        self.parallel = options.parallel
        self._parts = [(part, required) for part, required in target_parts
                       if part.wanted(self.target_info, required)]
        self.parts: dict[str, Any] = {}  # needs → the context of an open target part
        self.part_errors: dict[str, str] = {}  # needs → why an optional part did not open
        # Target sequences beside the requests' for the paths of a draft tree (drafters/dflash_tree.py): ids
        # parallel.. on.
        self.branch_seqs = tuple(range(options.parallel, options.parallel + options.branches))
        self.longest_draft = capacity  # every method's drafts, and so the verify batches and rollback snapshots
        self.draft_capacity = capacity if self.draft_file else 0
        placement = options.placement
        self.n_gpu_layers = n_gpu_layers = placement.n_gpu_layers
        self._n_rs_seq_request = options.n_rs_seq
        self._owned = _Owned()
        self._closed = False
        self.target_model = self.target_ctx = self.draft_model = self.draft_ctx = None
        self.remote: RemoteDevices | None = None
        self.devices: DeviceList | None = None
        self.target_layers: dict[int, str] = {}
        self.draft_layers: dict[int, str] = {}
        self.cpu_kernels = n_gpu_layers == 0
        self.threads = threads = options.threads or Threads.default()
        try:
            _init_backend()
            if placement.rpc is not None:
                self.remote = RemoteDevices(placement.rpc, reply_timeout_s=placement.rpc_timeout_s)
            if self.remote is not None or placement.tensor_split is not None:
                self.devices = DeviceList(self.remote, placement.tensor_split)
            # The CPU's numerics rules hold when every layer runs ggml's CPU kernels (see batch_invariant).
            self.cpu_kernels = n_gpu_layers == 0 or (self.remote is not None and placement.rpc_cpu
                                                     and not self.devices.local_gpus)
            self._open_target(options.n_ctx, n_gpu_layers, options.n_batch, threads)
            if self.draft_file is not None:
                draft_layers = placement.draft_gpu_layers
                self._open_draft(self.draft_file, n_gpu_layers if draft_layers is None else draft_layers, threads)
            for part, required in self._parts:
                self._open_part(part, required, threads)
            if self.remote is not None:
                self.remote.raise_if_lost()
            # Read once: a description that changed between requests would tell one visitor of another's.
            self.device_memory = (self.devices or DeviceList(None, None)).memory()
        except BaseException as error:
            self._unwatch()
            self._owned.free_all()
            self._closed = True
            why = self.remote.lost() if self.remote is not None else None
            if why is not None and not isinstance(error, RemoteDeviceError):
                raise RemoteDeviceError(why) from error
            raise

    @property
    def holds(self) -> frozenset[str]:
        """What the open pair holds for the methods (the parts of their `needs`): its open target parts, its draft
        (the draft file's `needs` and the draft's kind, as `describe` names it: "dflash2", "eagle3", ...) and
        "branches" where it keeps spare target sequences for a draft tree's paths."""
        held = set(self.parts)
        if self.draft_ctx is not None and self.draft_file is not None:
            held |= {self.draft_file.needs, self.draft_file.describe(self.spec)["draft_kind"]}
        if self.branch_seqs:
            held.add(BRANCHES)
        return frozenset(held)

    # -- construction -------------------------------------------------------------------------------------------

    def _open_target(self, n_ctx: int, n_gpu_layers: int, n_batch: int, threads: Threads) -> None:
        self.target_model = self.own(
            # On the CPU the target's rows must not depend on their batch (see batch_invariant): repacked weights
            # take a many-row kernel from four rows up and a one-row kernel below.
            load_model(self.target_info.path, n_gpu_layers, repack=not self._exact_cpu, devices=self.devices,
                       prepare=[part.prepare_load for part, _ in self._parts]),
            ll.llama_model_free,
        )
        self.target_layers = dict(_log.layer_devices)
        model = self.target_model
        self.is_recurrent = bool(ll.llama_model_is_recurrent(model) or ll.llama_model_is_hybrid(model))
        params = ll.llama_context_default_params()
        params.n_batch = n_batch
        # A sequence's whole verify batch must fit in one ubatch so that a hybrid target can roll it back (libllama
        # keeps a sequence's last n_rs_seq + 1 rows in one ubatch when it splits a batch of several sequences).
        # (Every pair runs a method: the n-gram methods need no file.)
        capacity = self.longest_draft
        params.n_ubatch = max(n_batch, capacity + 2)
        # One step's decode holds every sequence's verify rows (and every tree path's), whatever the prefill budget;
        # with tree paths, a request's rows may start with a path accepted off the spine (up to a draft's length).
        n_seq = self.parallel + len(self.branch_seqs)
        leads = self.parallel * capacity if self.branch_seqs else 0
        params.n_batch = max(params.n_ubatch, n_seq * (capacity + 1) + leads)
        # One KV stream per sequence (kv_unified off), n_ctx cells each: a sequence's cells, and so its attention
        # sums, depend on its own history only, whatever the other sequences hold (see batch_invariant).
        params.n_seq_max = n_seq
        params.kv_unified = False
        params.n_ctx = n_ctx * n_seq
        threads.apply(params)
        if self._exact_cpu:
            # Exactness across requests needs a row's numbers not to depend on the rows decoded beside it: the CPU
            # FlashAttention kernel tiles many-row batches and splits single rows across threads differently, the
            # plain attention path does neither (see batch_invariant).
            params.flash_attn_type = ll.LLAMA_FLASH_ATTN_TYPE_DISABLED
        # Recurrent state can be cut back only through snapshots, one per token that may be rejected.
        wanted = capacity if self._n_rs_seq_request is None else self._n_rs_seq_request
        params.n_rs_seq = wanted if (capacity and self.is_recurrent) else 0
        self.target_ctx = self.own(new_context(self.target_model, params, "target"), ll.llama_free)
        self._watch(self.target_ctx)
        self.n_ctx = int(ll.llama_n_ctx_seq(self.target_ctx))  # per sequence
        self.n_batch = int(ll.llama_n_batch(self.target_ctx))
        self.n_ubatch = int(ll.llama_n_ubatch(self.target_ctx))
        self.n_rs_seq = int(ll.llama_n_rs_seq(self.target_ctx))
        self.vocab = ll.llama_model_get_vocab(self.target_model)  # the raw pointer, for callers driving libllama
        self.vocabulary = Vocabulary(self.vocab)
        self.n_vocab = self.vocabulary.n_tokens
        self.n_embd = int(ll.llama_model_n_embd(self.target_model))
        if self.draft_file is not None:
            self.draft_file.prepare_target(self)
        self.n_embd_out = int(ll.llama_model_n_embd_out(self.target_model))

    def _open_draft(self, draft_file: DraftFile, n_gpu_layers: int, threads: Threads) -> None:
        assert self.draft_info is not None
        devices = self.devices.for_draft() if self.devices is not None else None
        self.draft_model = self.own(load_model(self.draft_info.path, n_gpu_layers, devices=devices),
                                    ll.llama_model_free)
        self.draft_layers = dict(_log.layer_devices)
        self.n_embd_draft = int(ll.llama_model_n_embd(self.draft_model))
        self.draft_ctx = self.own(draft_file.open_context(self, threads), ll.llama_free)
        self._watch(self.draft_ctx)

    def side_context_params(self, threads: Threads, *, n_ubatch: int | None = None) -> Any:
        """The parameters of a context beside the target's (a draft's, MTP's): a KV stream per sequence, as the
        target's (and llama-server's with -np N), so that a sequence's rows attend to its own cells only; `n_ubatch`
        rows a pass (default: a target ubatch's, to catch up or inject in one pass, and at least every sequence's
        draft rows at once)."""
        params = ll.llama_context_default_params()
        params.n_batch = params.n_ubatch = n_ubatch or max(self.n_ubatch, self.parallel * (self.draft_capacity + 1))
        params.n_seq_max = self.parallel
        params.kv_unified = False
        params.n_ctx = self.n_ctx * self.parallel
        params.n_rs_seq = 0
        if self._exact_cpu:  # the target's attention kernels (see _open_target), as llama-server gives its draft
            params.flash_attn_type = ll.LLAMA_FLASH_ATTN_TYPE_DISABLED
        threads.apply(params)
        return params

    def linked_draft_context(self, params: Any, what: str, layer_ids: tuple[int, ...],
                             check: Callable[[Any], None] | None = None) -> Any:
        """The draft model's context linked to the target's through `ctx_other` (the draft borrows the target's token
        embedding and head), checked: the link holds, libllama reads the target layers `layer_ids` of the header, and
        `check(ctx)` passes. Freed when a check fails."""
        api = dflash_api()
        params.ctx_other = self.target_ctx
        ctx = new_context(self.draft_model, params, what)
        try:
            if api.get_ctx_other(ctx) != self.target_ctx:
                raise ContextCreationError("the draft context is not linked to the target context (ctx_other)")
            read = tuple(api.target_layer_ids(self.draft_model))
            if read != tuple(layer_ids):
                raise PairMismatchError(f"libllama reads layer ids {read}, the header {tuple(layer_ids)}")
            if check is not None:
                check(ctx)
        except BaseException:
            ll.llama_free(ctx)
            raise
        return ctx

    def own(self, handle: Any, free: Callable[[Any], None]) -> Any:
        """Take a native handle into the pair: freed with it, in reverse order of creation."""
        return self._owned.push(handle, free)

    def _open_part(self, part: TargetPart, required: bool, threads: Threads) -> None:
        """A part of the target that a method opens (a failure is kept in `part_errors` when it is optional)."""
        try:
            ctx = self.own(part.open_context(self, threads), ll.llama_free)
        except ContextCreationError as error:
            if required:
                raise
            self.part_errors[part.needs] = str(error)
            return
        self._watch(ctx)
        self.parts[part.needs] = ctx
        part.link(self, ctx)

    @property
    def _exact_cpu(self) -> bool:
        """The target runs on the CPU with the batch-invariant configuration (numerics="exact")."""
        return self.numerics_asked == "exact" and self.cpu_kernels

    @property
    def batch_invariant(self) -> bool:
        """Whether a target row's numbers are the same whatever rows share its batch and its cache's history, which is
        what makes a long-lived engine answer exactly as a fresh one (and speculative exactly as plain decoding).
        True on the CPU with numerics="exact": FlashAttention off (the CPU kernel tiles many-row batches and splits
        one row's cells across threads), weights not repacked (repacked types take another kernel from four rows
        up), and a build whose matrix products take one summation order for any row count (see
        `matrix_products_invariant`). GPU kernels (and a GPU build, which offloads large batches even with
        n_gpu_layers=0) are not batch-invariant: there every answer is a valid greedy answer of the target under
        its own batch's numerics, and a temperature-0 difference is a near-tie or a fault (decoding/divergence.py)."""
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
            self._unwatch()
            self._owned.free_all()
            self.target_model = self.target_ctx = self.draft_model = self.draft_ctx = None
            self.parts = {}

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
        on_gpu = not self.cpu_kernels and (bool(ll.llama_supports_gpu_offload()) or self.remote is not None)
        return CUDA_VERIFY_ROWS - 1 if on_gpu else self.n_ubatch - 1

    def chat_template_source(self) -> str | None:
        """The target's chat template text (`tokenizer.chat_template`), None without one."""
        raw = ll.llama_model_chat_template(self.target_model, None)
        return raw.decode("utf-8", "replace") if raw else self.meta("tokenizer.chat_template")

    # -- remote devices -----------------------------------------------------------------------------------------

    def _watch(self, ctx: Any) -> None:
        """A context that computes on remote devices: its decodes check that the servers are still there."""
        if self.remote is not None:
            watch(ctx, self.remote)

    def _unwatch(self) -> None:
        for ctx in (self.target_ctx, self.draft_ctx, *self.parts.values()):
            if ctx:
                unwatch(ctx)

    def placement(self) -> dict[str, Any]:
        """Which layers live on which device (libllama's own account at load), each device's memory when the pair was
        opened, and for remote devices the traffic through their relays since the process began."""
        out: dict[str, Any] = {
            "devices": self.device_memory,
            "target": layer_ranges(self.target_layers, self.target_info.n_layer),
            "draft": layer_ranges(self.draft_layers, self.draft_info.n_layer) if self.draft_info else [],
        }
        for part, _ in self._parts:
            if part.needs in self.parts:
                out.update(part.placement(self))
        if self.remote is not None:
            out["rpc"] = self.remote.traffic()
        return out

    def meta(self, key: str, draft: bool = False) -> str | None:
        """A GGUF metadata value as libllama reads it."""
        model = self.draft_model if draft else self.target_model
        return _meta_str(model, key) if model else None
