"""Drop-in replacements for `llama_cpp.Llama` code that used `draft_model=`.

- `DFlashLlama`: a `llama_cpp.Llama` whose `create_completion`, `create_chat_completion` and `__call__` run on
  this package's engine (the DFlash draft linked natively to the target), with llama-cpp-python's response shapes
  plus `"dflash_stats"`.
- `DFlashDraftModel`: the `LlamaDraftModel` to pass as `draft_model=` for a DFlash / DFlash 2 draft GGUF.
- `ArrayDraft`: makes any Python draft (one returning a list, a tuple or an array) safe for `Llama.generate`.

Why `DFlashLlama` does not call `Llama.__init__` when it has a DFlash draft: that constructor loads the target and
creates its context, and the engine needs its own target context (layer taps on, recurrent snapshots for hybrid
targets, one ubatch per verify batch). Building both would hold the weights once but two KV caches, and the
`Llama` context cannot take part in DFlash anyway. So the engine owns the only target model and context; the few
`Llama` methods that make sense (tokenize, detokenize, n_ctx, n_vocab, token_eos, ...) are re-implemented on it,
and the ones that need `Llama`'s own decode state (generate, eval, save_state, embeddings, ...) raise
`NotImplementedError`. Nothing allocates a host buffer of n_ctx × n_vocab logits.

A Python draft (not DFlash), e.g. `LlamaPromptLookupDecoding`, runs in llama-cpp-python's own loop instead: then
`DFlashLlama` *is* a plain `Llama` (its `__init__` is called) with the draft wrapped in `ArrayDraft` and
`logits_all=True` (that loop reads one logits row per drafted token; with the stock n_batch-row buffer it fails
once a request passes n_batch tokens). That loop keeps the n_ctx × n_vocab host buffer and cannot roll back the
recurrent state of a hybrid target, so such a target is refused.
"""

from __future__ import annotations

import fnmatch
import functools
import inspect
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
from llama_cpp import llama_cpp as ll
from llama_cpp.llama import Llama
from llama_cpp.llama_speculative import LlamaDraftModel

from ..deprecated import renamed_keyword
from ..engine import Engine
from ..errors import DownloadError, EngineClosedError, ModelFileError, PairMismatchError, RequestError
from ..native.backends import load_backends
from ..native.vocab import Vocabulary
from ..pair import DEFAULT_DRAFT_CAPACITY
from .openai import (
    CHAT_OPTIONS_OFF,
    COMPLETION_OPTIONS_OFF,
    ResponseIds,
    chat_chunks,
    chat_response,
    completion_chunks,
    completion_response,
    gather,
    reject_unsupported,
    sampling_kwargs,
)

__all__ = ["ArrayDraft", "DFlashDraftModel", "DFlashLlama", "as_intc_tokens"]

StrPath = str | os.PathLike[str]

# Llama constructor arguments the engine takes over; every other one must keep its `Llama` default.
_ENGINE_ARGUMENTS = ("n_ctx", "n_batch", "n_gpu_layers", "n_threads", "n_threads_batch", "verbose", "seed")
_LLAMA_DEFAULTS: dict[str, Any] = {
    name: parameter.default
    for name, parameter in inspect.signature(Llama.__init__).parameters.items()
    if parameter.kind is inspect.Parameter.KEYWORD_ONLY
}


def as_intc_tokens(tokens: Any) -> npt.NDArray[np.intc]:
    """A draft's proposal as the 1-D `np.intc` array `Llama.generate` expects (it calls `.astype` on it).

    Accepts an array, a list, a tuple, any iterable of integers, or None (no proposal)."""
    if tokens is None:
        return np.empty(0, dtype=np.intc)
    values = np.asarray(tokens if isinstance(tokens, (np.ndarray, list, tuple)) else list(tokens))
    if values.size == 0:
        return np.empty(0, dtype=np.intc)
    if values.ndim != 1 or not np.issubdtype(values.dtype, np.integer):
        raise TypeError(f"a draft must return a flat sequence of token ids, got {values.dtype} of shape {values.shape}")
    return values.astype(np.intc, copy=False)


class ArrayDraft(LlamaDraftModel):
    """Wraps a draft (any `LlamaDraftModel` or callable taking the token ids so far) so that it always returns a
    1-D `np.intc` array, as `Llama.generate` requires: `Llama(..., draft_model=ArrayDraft(my_draft))`."""

    def __init__(self, draft: Callable[..., Any]) -> None:
        if not callable(draft):
            raise TypeError(f"a draft must be callable with the token ids so far, got {type(draft).__name__}")
        self.draft = draft

    def __call__(self, input_ids: npt.NDArray[np.intc], /, **kwargs: Any) -> npt.NDArray[np.intc]:
        return as_intc_tokens(self.draft(input_ids, **kwargs))


class DFlashDraftModel(LlamaDraftModel):
    """A DFlash / DFlash 2 draft GGUF, proposing up to `num_pred_tokens` tokens per step.

    It drafts from the target's hidden states, so it only works inside `DFlashLlama`, which links it to the target
    natively (`ctx_other`). Nothing is loaded until then."""

    def __init__(self, draft_model_path: StrPath, num_pred_tokens: int = DEFAULT_DRAFT_CAPACITY) -> None:
        if not os.path.isfile(draft_model_path):
            raise ModelFileError(f"DFlash draft not found: {draft_model_path}")
        if isinstance(num_pred_tokens, bool) or not isinstance(num_pred_tokens, int) or num_pred_tokens < 1:
            raise RequestError(f"num_pred_tokens must be a positive integer (got {num_pred_tokens!r})")
        self.draft_model_path = os.fspath(draft_model_path)
        self.num_pred_tokens = num_pred_tokens

    def __call__(self, input_ids: npt.NDArray[np.intc], /, **kwargs: Any) -> npt.NDArray[np.intc]:
        raise NotImplementedError(
            "a DFlash draft needs the target's hidden states, which llama_cpp.Llama does not give to drafts: use "
            f"dflash_runtime.DFlashLlama(model_path=<target>, draft_model=DFlashDraftModel({self.draft_model_path!r}))"
        )

    def __repr__(self) -> str:
        return f"DFlashDraftModel({self.draft_model_path!r}, num_pred_tokens={self.num_pred_tokens})"


CLOSED_MESSAGE = "this DFlashLlama was closed; open a new one with DFlashLlama(...)"


def _engine_or_llama(method: Callable[..., Any]) -> Callable[..., Any]:
    """Runs `method` with a DFlash engine, and `Llama`'s method of the same name in llama-cpp-python's loop. After
    close() every method but close() raises EngineClosedError, in this class's words (not the engine's)."""
    llama_method = getattr(Llama, method.__name__)

    @functools.wraps(method)
    def dispatch(self: DFlashLlama, *args: Any, **kwargs: Any) -> Any:
        if self._engine is None:
            return llama_method(self, *args, **kwargs)
        if self._engine.closed and method.__name__ != "close":
            raise EngineClosedError(CLOSED_MESSAGE)
        return method(self, *args, **kwargs)

    return dispatch


def _llama_loop_only(name: str) -> Callable[..., Any]:
    """`Llama.<name>`, which needs `Llama`'s own context: refused with a DFlash engine, which owns the context."""
    llama_method = getattr(Llama, name)

    @functools.wraps(llama_method)
    def method(self: DFlashLlama, *args: Any, **kwargs: Any) -> Any:
        if self._engine is not None:
            raise NotImplementedError(
                f"DFlashLlama.{name}() is not available with a DFlash draft: the engine owns the target context; "
                "use create_completion / create_chat_completion (or .engine for the engine itself)"
            )
        return llama_method(self, *args, **kwargs)

    return method


def _bind(signature_of: Callable[..., Any], *args: Any, **kwargs: Any) -> dict[str, Any]:
    """The arguments of a call as `signature_of` receives them, defaults included."""
    bound = inspect.signature(signature_of).bind(*args, **kwargs)
    bound.apply_defaults()
    return bound.arguments


REQUEST_EXTRAS = {"speculative": True, "method": None, "draft_length": None, "verify": "sample"}


def _pop_extras(kwargs: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    extras = {name: kwargs.pop(name, default) for name, default in defaults.items()}
    if "draft_max" in kwargs:  # the deprecated spelling of draft_length
        extras["draft_length"] = renamed_keyword("draft_max", "draft_length", kwargs.pop("draft_max"),
                                                  extras["draft_length"], None, stacklevel=4)
    return extras


class DFlashLlama(Llama):
    """`llama_cpp.Llama` with DFlash 2 speculative decoding on this package's engine.

        llm = DFlashLlama(model_path="target.gguf", draft_model=DFlashDraftModel("draft.gguf"))
        for chunk in llm.create_chat_completion(messages, stream=True): ...

    `create_completion`, `create_chat_completion` and `__call__` take llama-cpp-python's parameters with its
    defaults and return its shapes, plus `"dflash_stats"` on the response (and on the last streamed chunk).
    Sampling honours max_tokens, temperature, top_k, top_p, min_p, seed and stop; options that need host logits
    (logprobs, grammar, penalties, logits processors, logit_bias, ...) raise `RequestError` when turned on.
    Extra keywords: `speculative=False` (target only), `method` (one of `methods`, or a method list "a,b"),
    `draft_length` (an int ≤ the pair's capacity, 0 for no draft, or "auto"; `draft_max` is its deprecated spelling),
    `verify` ("sample": rejection sampling, or "match", above temperature 0) and, for chats, `enable_thinking`. Chats
    use the target GGUF's own template; message content never becomes control tokens.

    Constructor: `draft_model_path` or `draft_model=DFlashDraftModel(...)` (neither: the target runs alone, or with
    its own MTP head when it has one); `draft_capacity`: the longest draft the pair is opened for (default: the
    draft model's `num_pred_tokens`, 7; `draft_max=` is its deprecated spelling). Of `Llama`'s arguments
    n_ctx, n_batch, n_gpu_layers, n_threads, n_threads_batch, seed and verbose apply; any other must keep its
    default.
    A Python draft (any other `LlamaDraftModel`) runs in llama-cpp-python's own loop, see the module docstring.
    """

    def __init__(
        self,
        model_path: StrPath,
        *,
        draft_model_path: StrPath | None = None,
        draft_model: LlamaDraftModel | None = None,
        draft_capacity: int | None = None,
        draft_max: int | None = None,
        **llama_kwargs: Any,
    ) -> None:
        self._engine: Any = None  # first: every dispatched method reads it, even from Llama.__init__
        capacity = renamed_keyword("draft_max", "draft_capacity", draft_max, draft_capacity, None)
        if draft_model is not None and not isinstance(draft_model, DFlashDraftModel):
            if draft_model_path is not None or capacity is not None:
                raise RequestError("draft_model_path and draft_capacity apply to DFlash drafts, not to a Python draft")
            self._init_llama_loop(model_path, draft_model, llama_kwargs)
        else:
            self._init_engine(model_path, _dflash_draft(draft_model_path, draft_model, capacity), llama_kwargs)

    # -- construction ---------------------------------------------------------------------------------------------

    def _init_engine(self, model_path: StrPath, draft: DFlashDraftModel | None, llama_kwargs: dict[str, Any]) -> None:
        options = _engine_options(llama_kwargs)
        self.model_path = os.fspath(model_path)
        self.draft_model = draft
        self.verbose = options["verbose"]
        self.cache = None
        self._seed = options["seed"]
        self._engine = Engine(
            model_path,
            draft.draft_model_path if draft else None,
            n_ctx=options["n_ctx"],
            n_gpu_layers=options["n_gpu_layers"],
            draft_capacity=draft.num_pred_tokens if draft else DEFAULT_DRAFT_CAPACITY,
            n_batch=options["n_batch"],
            n_threads=options["n_threads"],
            n_threads_batch=options["n_threads_batch"],
            verbose=options["verbose"],
        )
        self.n_batch = self._engine.n_batch

    def _init_llama_loop(self, model_path: StrPath, draft: LlamaDraftModel, llama_kwargs: dict[str, Any]) -> None:
        safe_draft = draft if isinstance(draft, ArrayDraft) else ArrayDraft(draft)
        load_backends()  # a build with loadable backends registers none by itself
        super().__init__(os.fspath(model_path), **{**llama_kwargs, "draft_model": safe_draft, "logits_all": True})
        if self._is_hybrid or self._is_recurrent:
            self.close()
            raise PairMismatchError(
                f"{os.path.basename(model_path)} is a hybrid/recurrent target: llama-cpp-python's draft loop cannot "
                "roll back its state after a rejected draft token (llama_decode fails). Use a DFlash draft "
                "(draft_model=DFlashDraftModel(...)) or no draft."
            )

    @classmethod
    def from_pretrained(  # type: ignore[override]
        cls,
        repo_id: str,
        filename: str,
        draft_repo_id: str | None = None,
        draft_filename: str | None = None,
        *,
        revision: str | None = None,
        draft_revision: str | None = None,
        cache_dir: StrPath | None = None,
        token: str | None = None,
        **kwargs: Any,
    ) -> DFlashLlama:
        """Download a target (and its DFlash draft) from the Hugging Face Hub, then open them like `__init__`.

        `filename` / `draft_filename` may be glob patterns matching exactly one file, as in `Llama.from_pretrained`;
        `draft_repo_id` defaults to `repo_id`. Needs the `huggingface_hub` package."""
        if draft_repo_id is not None and draft_filename is None:
            raise RequestError("draft_repo_id needs draft_filename (the draft GGUF in that repository)")
        hub = {"cache_dir": cache_dir, "token": token}
        model_path = _hub_file(repo_id, filename, revision, "target", **hub)
        draft_path = None
        if draft_filename is not None:
            draft_path = _hub_file(draft_repo_id or repo_id, draft_filename, draft_revision, "draft", **hub)
        return cls(model_path=model_path, draft_model_path=draft_path, **kwargs)

    # -- the engine -----------------------------------------------------------------------------------------------

    @property
    def engine(self) -> Any:
        """The `dflash_runtime.Engine` behind this object (None in llama-cpp-python's loop)."""
        return self._engine

    @property
    def ctx(self) -> ll.llama_context_p:
        """The target context (owned by the engine: read it, do not decode into it)."""
        return Llama.ctx.fget(self) if self._engine is None else self._engine.target_ctx  # type: ignore[attr-defined]

    @property
    def model(self) -> ll.llama_model_p:
        """The target model (owned by the engine)."""
        return Llama.model.fget(self) if self._engine is None else self._engine.target_model  # type: ignore[attr-defined]

    @model.setter
    def model(self, value: Any) -> None:
        raise AttributeError(
            "DFlashLlama.model is read-only: the DFlash draft is linked to the target natively; pass "
            "draft_model=DFlashDraftModel(<draft.gguf>) (or draft_model_path=...) to DFlashLlama instead"
        )

    # -- completions ----------------------------------------------------------------------------------------------

    @_engine_or_llama
    def create_completion(self, prompt: str | list[int], *args: Any, **kwargs: Any) -> Any:
        """`Llama.create_completion`'s parameters and response shapes, on the engine (see the class docstring)."""
        extras = _pop_extras(kwargs, REQUEST_EXTRAS)
        options = _bind(Llama.create_completion, self, prompt, *args, **kwargs)
        reject_unsupported({name: options[name] for name in COMPLETION_OPTIONS_OFF}, COMPLETION_OPTIONS_OFF)
        ids = ResponseIds.new(options["model"] or self.model_path, chat=False)
        echo = self._echo_text(prompt) if options["echo"] else ""
        events = self._engine.stream(prompt, **self._sampling(options), **extras)
        if options["stream"]:
            return completion_chunks(ids, events, echo)
        outcome = gather(events)
        outcome.text = echo + outcome.text
        return completion_response(ids, outcome)

    @_engine_or_llama
    def create_chat_completion(self, messages: Sequence[dict[str, Any]], *args: Any, **kwargs: Any) -> Any:
        """`Llama.create_chat_completion`'s parameters and response shapes, on the engine, with the target GGUF's
        chat template (see the class docstring)."""
        extras = _pop_extras(kwargs, {**REQUEST_EXTRAS, "enable_thinking": None})
        options = _bind(Llama.create_chat_completion, self, messages, *args, **kwargs)
        reject_unsupported({name: options[name] for name in CHAT_OPTIONS_OFF}, CHAT_OPTIONS_OFF)
        ids = ResponseIds.new(options["model"] or self.model_path, chat=True)
        events = self._engine.stream_chat(messages, **self._sampling(options), **extras)
        if options["stream"]:
            return chat_chunks(ids, events)
        return chat_response(ids, gather(events))

    def _sampling(self, options: dict[str, Any]) -> dict[str, Any]:
        seed = options["seed"]
        if seed is None and self._seed != ll.LLAMA_DEFAULT_SEED:
            seed = self._seed  # the constructor's seed, as Llama(seed=...) fixes the draws
        return sampling_kwargs(
            max_tokens=options["max_tokens"],
            no_limit=self._engine.n_ctx,  # "until the context is full": the engine stops there with "length"
            temperature=options["temperature"],
            top_p=options["top_p"],
            top_k=options["top_k"],
            min_p=options["min_p"],
            seed=seed,
            stop=options["stop"],
        )

    def _echo_text(self, prompt: str | list[int]) -> str:
        return prompt if isinstance(prompt, str) else self._engine.detokenize(prompt)

    @property
    def methods(self) -> tuple[str, ...]:
        """The draft methods this model can run (the engine's: "dflash" with a DFlash draft, "mtp" with the target's
        MTP head, the n-gram methods, the listed method lists)."""
        return self._engine.methods if self._engine is not None else ()

    # -- Llama methods re-implemented on the engine ---------------------------------------------------------------

    @_engine_or_llama
    def tokenize(self, text: bytes, add_bos: bool = True, special: bool = False) -> list[int]:
        return self._engine.tokenize(text.decode("utf-8"), add_special=add_bos, parse_special=special)

    @_engine_or_llama
    def detokenize(self, tokens: list[int], prev_tokens: list[int] | None = None, special: bool = False) -> bytes:
        return self._vocabulary().detokenize(tokens, special=special)

    @_engine_or_llama
    def n_ctx(self) -> int:
        self._engine.check_open()
        return int(self._engine.n_ctx)

    @_engine_or_llama
    def n_vocab(self) -> int:
        return int(self._engine.info()["n_vocab"])

    @_engine_or_llama
    def n_embd(self) -> int:
        return int(self._engine.info()["n_embd"])

    @_engine_or_llama
    def token_eos(self) -> int:
        return self._vocabulary().eos

    @_engine_or_llama
    def token_bos(self) -> int:
        return self._vocabulary().bos

    @_engine_or_llama
    def token_nl(self) -> int:
        return self._vocabulary().nl

    @_engine_or_llama
    def reset(self) -> None:
        """Forget the cached prompt prefix."""
        self._engine.reset()

    @_engine_or_llama
    def set_cache(self, cache: Any) -> None:
        if cache is not None:
            raise NotImplementedError("DFlashLlama keeps its own prefix cache; Llama state caches are not supported")

    @_engine_or_llama
    def close(self) -> None:
        self._engine.close()

    def __del__(self) -> None:
        if self.__dict__.get("_engine") is not None or "_stack" in self.__dict__:
            self.close()

    def __enter__(self) -> DFlashLlama:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _vocabulary(self) -> Vocabulary:
        self._engine.check_open()  # after close() the vocabulary is freed: raise EngineClosedError, never read it
        return self._engine.pair.vocabulary

    # -- Llama methods that need Llama's own decode state ---------------------------------------------------------

    generate = _llama_loop_only("generate")
    eval = _llama_loop_only("eval")
    sample = _llama_loop_only("sample")
    create_embedding = _llama_loop_only("create_embedding")
    embed = _llama_loop_only("embed")
    save_state = _llama_loop_only("save_state")
    load_state = _llama_loop_only("load_state")
    tokenizer = _llama_loop_only("tokenizer")
    pooling_type = _llama_loop_only("pooling_type")
    __getstate__ = _llama_loop_only("__getstate__")


def _dflash_draft(
    draft_model_path: StrPath | None, draft_model: DFlashDraftModel | None, capacity: int | None
) -> DFlashDraftModel | None:
    """The DFlash draft from either argument, its length overridden by an explicit capacity."""
    if (
        draft_model is not None
        and draft_model_path is not None
        and os.path.abspath(draft_model_path) != os.path.abspath(draft_model.draft_model_path)
    ):
        raise RequestError("draft_model_path and draft_model name different drafts: give one of them")
    path = draft_model.draft_model_path if draft_model is not None else draft_model_path
    if path is None:
        if capacity is not None:
            raise RequestError("draft_capacity needs a DFlash draft (draft_model_path=... or draft_model=...)")
        return None
    default = draft_model.num_pred_tokens if draft_model else DEFAULT_DRAFT_CAPACITY
    length = capacity if capacity is not None else default
    if draft_model is not None and length == draft_model.num_pred_tokens:
        return draft_model
    return DFlashDraftModel(path, num_pred_tokens=length)


def _engine_options(llama_kwargs: dict[str, Any]) -> dict[str, Any]:
    """The engine's share of `Llama`'s constructor arguments (with `Llama`'s defaults); any other argument set to
    something else than its default is refused, since the engine would not honour it."""
    unknown = sorted(set(llama_kwargs) - set(_LLAMA_DEFAULTS))
    if unknown:
        raise TypeError(f"DFlashLlama() got unexpected keyword argument(s): {', '.join(unknown)}")
    changed = sorted(
        name for name, value in llama_kwargs.items()
        if name not in _ENGINE_ARGUMENTS and not _same(value, _LLAMA_DEFAULTS[name])
    )
    if changed:
        raise RequestError(
            f"DFlashLlama with a DFlash draft does not support {', '.join(changed)}: only "
            f"{', '.join(_ENGINE_ARGUMENTS)} apply (chats use the target GGUF's own template)"
        )
    options = {name: llama_kwargs.get(name, _LLAMA_DEFAULTS[name]) for name in _ENGINE_ARGUMENTS}
    if options["n_ctx"] == 0:
        raise RequestError("n_ctx=0 (the model's training context) is not supported: pass the context size")
    return options


def _same(value: Any, default: Any) -> bool:
    try:
        return bool(value == default)
    except (TypeError, ValueError):  # e.g. an array compared with None
        return False


def _hub_file(
    repo_id: str,
    pattern: str,
    revision: str | None,
    role: str,
    *,
    cache_dir: StrPath | None,
    token: str | None,
) -> str:
    """Local path of the one file of `repo_id` that `pattern` names (a glob pattern is resolved on the Hub)."""
    from ..files.hub import ModelSource, fetch_model_file

    filename = pattern
    if any(char in pattern for char in "*?["):
        from huggingface_hub import HfApi

        files = HfApi().list_repo_files(repo_id, revision=revision, token=token)
        matches = [name for name in files if fnmatch.fnmatch(name, pattern)]
        if len(matches) != 1:
            found = "no file" if not matches else f"{len(matches)} files ({', '.join(matches[:5])})"
            raise DownloadError(f"{pattern!r} matches {found} in {repo_id}: name exactly one {role} GGUF")
        filename = matches[0]
    source = ModelSource(repo=repo_id, filename=filename, revision=revision)
    cache = Path(cache_dir) if cache_dir is not None else None
    return str(fetch_model_file(source, role, token=token, cache_dir=cache))
