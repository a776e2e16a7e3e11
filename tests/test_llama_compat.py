"""DFlashLlama / DFlashDraftModel / ArrayDraft: the reported llama-cpp-python failures reproduced on stock
`llama_cpp.Llama`, then shown working through the drop-in classes (real libllama, generated tiny models)."""

from __future__ import annotations

import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from llama_cpp import Llama
from llama_cpp import llama_cpp as ll
from llama_cpp.llama_grammar import LlamaGrammar
from llama_cpp.llama_speculative import LlamaDraftModel, LlamaPromptLookupDecoding

from dflash_runtime import EngineClosedError, ModelFileError, PairMismatchError, RequestError
from dflash_runtime.llama_compat import ArrayDraft, DFlashDraftModel, DFlashLlama, as_intc_tokens
from dflash_runtime.testing.tiny_models import TinyPair, tiny_pair

TARGETS = ("dense", "hybrid")
N_CTX = 512
MESSAGES = [
    {"role": "system", "content": "you answer briefly."},
    {"role": "user", "content": "hello there, how are you?"},
]
PROMPT = "the quick brown fox jumps over the lazy dog."
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def pairs() -> dict[str, TinyPair]:
    """Dense and hybrid targets with DFlash 2 drafts whose heads accept some drafts and reject others."""
    return {target: tiny_pair(target, "dflash2", head="shaped") for target in TARGETS}


@pytest.fixture(scope="module")
def stock(pairs: dict[str, TinyPair]) -> Iterator[dict[str, Llama]]:
    """Plain llama-cpp-python on each target: the reference for what the drop-in must return."""
    models = {target: Llama(model_path=str(p.target), n_ctx=N_CTX, verbose=False) for target, p in pairs.items()}
    yield models
    for model in models.values():
        model.close()


@pytest.fixture(scope="module")
def dflash(pairs: dict[str, TinyPair]) -> Iterator[dict[str, DFlashLlama]]:
    models = {
        target: DFlashLlama(model_path=str(p.target), draft_model=DFlashDraftModel(p.draft), n_ctx=N_CTX, verbose=False)
        for target, p in pairs.items()
    }
    yield models
    for model in models.values():
        model.close()


class ListDraft(LlamaDraftModel):
    """A user draft that returns a plain list (as many hand-written drafts do), recording its calls."""

    def __init__(self, proposal: list[int]) -> None:
        self.proposal = proposal
        self.calls = 0

    def __call__(self, input_ids: Any, /, **kwargs: Any) -> list[int]:
        self.calls += 1
        return list(self.proposal)


def greedy_tokens(llm: Llama, prompt: str, n: int = MAX_TOKENS) -> list[int]:
    tokens = llm.tokenize(prompt.encode(), add_bos=True, special=True)
    out: list[int] = []
    for token in llm.generate(tokens, temp=0.0):
        out.append(token)
        if len(out) == n:
            break
    return out


def chat_text(chunks: list[dict[str, Any]]) -> str:
    return "".join(chunk["choices"][0]["delta"].get("content", "") for chunk in chunks)


# -- (1) a DFlash draft cannot be opened by Llama ---------------------------------------------------------------------


def test_stock_llama_cannot_open_a_dflash_draft(pairs: dict[str, TinyPair]) -> None:
    with pytest.raises(ValueError, match="llama_context"):
        Llama(model_path=str(pairs["dense"].draft), verbose=False)


def test_dflash_draft_is_linked_to_the_target(pairs: dict[str, TinyPair]) -> None:
    p = pairs["dense"]
    draft = DFlashDraftModel(p.draft)
    with DFlashLlama(model_path=str(p.target), draft_model=draft, n_ctx=N_CTX, verbose=False) as llm:
        info = llm.engine.info()
        assert info["draft"] == str(p.draft) and info["draft_kind"] == "dflash2"
        stats = llm.create_completion(PROMPT, max_tokens=MAX_TOKENS, temperature=0, draft_length=3)["dflash_stats"]
        assert stats["drafted"] > 0 and stats["accepted"] > 0
    for call in (lambda: llm.create_completion(PROMPT, max_tokens=4), lambda: llm.tokenize(b"hi"), llm.n_ctx):
        with pytest.raises(EngineClosedError, match=r"this DFlashLlama was closed; open a new one with DFlashLlama"):
            call()


# -- (2) Llama.model has no setter -------------------------------------------------------------------------------------


def test_stock_model_property_has_no_setter(stock: dict[str, Llama]) -> None:
    with pytest.raises(AttributeError, match="no setter"):
        stock["dense"].model = None  # type: ignore[misc]


def test_linking_needs_no_model_assignment(dflash: dict[str, DFlashLlama]) -> None:
    llm = dflash["dense"]
    assert isinstance(llm.draft_model, DFlashDraftModel)
    assert ll.llama_model_n_embd(llm.model) == llm.n_embd() == llm.engine.info()["n_embd"]
    assert ll.llama_n_ctx(llm.ctx) == llm.n_ctx() == N_CTX
    with pytest.raises(AttributeError, match="draft_model=DFlashDraftModel"):
        llm.model = None  # type: ignore[misc]


# -- (3) LlamaDraftModel is abstract -----------------------------------------------------------------------------------


def test_stock_draft_model_is_abstract() -> None:
    with pytest.raises(TypeError, match="abstract"):
        LlamaDraftModel()  # type: ignore[abstract]


def test_dflash_draft_model_is_a_concrete_draft_model(pairs: dict[str, TinyPair], tmp_path: Path) -> None:
    draft = DFlashDraftModel(pairs["dense"].draft, num_pred_tokens=5)
    assert isinstance(draft, LlamaDraftModel) and draft.num_pred_tokens == 5
    with pytest.raises(ModelFileError):
        DFlashDraftModel(tmp_path / "missing.gguf")
    with pytest.raises(RequestError):
        DFlashDraftModel(pairs["dense"].draft, num_pred_tokens=0)


def test_dflash_draft_model_in_stock_llama_says_where_it_works(pairs: dict[str, TinyPair]) -> None:
    """Stock Llama gives drafts only the token ids, never the target's hidden states a DFlash draft reads."""
    p = pairs["dense"]
    llm = Llama(model_path=str(p.target), n_ctx=N_CTX, draft_model=DFlashDraftModel(p.draft), verbose=False)
    with pytest.raises(NotImplementedError, match="DFlashLlama"):
        llm.create_completion(PROMPT, max_tokens=4, temperature=0)
    llm.close()


# -- (4) a list-returning draft crashes Llama.generate -----------------------------------------------------------------


def test_stock_generate_crashes_on_a_list_draft(pairs: dict[str, TinyPair]) -> None:
    llm = Llama(model_path=str(pairs["dense"].target), n_ctx=N_CTX, draft_model=ListDraft([1, 2]), verbose=False)
    with pytest.raises(AttributeError, match="astype"):
        llm.create_completion(PROMPT, max_tokens=8, temperature=0)
    llm.close()


@pytest.mark.parametrize(
    ("proposal", "expected"),
    [([3, 1, 2], [3, 1, 2]), ((4,), [4]), (np.array([5, 6], dtype=np.int64), [5, 6]), ([], []), (None, [])],
)
def test_as_intc_tokens_normalises_proposals(proposal: Any, expected: list[int]) -> None:
    tokens = as_intc_tokens(proposal)
    assert tokens.dtype == np.intc and tokens.ndim == 1 and tokens.tolist() == expected
    assert as_intc_tokens(iter(expected)).tolist() == expected


@pytest.mark.parametrize("bad", [[1.5, 2.0], [[1, 2]], ["a"]])
def test_as_intc_tokens_rejects_non_token_proposals(bad: Any) -> None:
    with pytest.raises(TypeError, match="token ids"):
        as_intc_tokens(bad)


def test_list_drafts_work_once_wrapped(pairs: dict[str, TinyPair], stock: dict[str, Llama]) -> None:
    """ArrayDraft fixes stock Llama; DFlashLlama wraps Python drafts itself. Both stay lossless on a dense target,
    and past n_batch tokens (DFlashLlama keeps every logits row the stock loop reads)."""
    target = str(pairs["dense"].target)
    reference = greedy_tokens(stock["dense"], PROMPT, n=48)
    proposal = reference[1:4]  # right for a while, then wrong: exercises acceptance and rejection
    wrapped = ListDraft(proposal)
    llm = Llama(model_path=target, n_ctx=N_CTX, draft_model=ArrayDraft(wrapped), logits_all=True, verbose=False)
    assert greedy_tokens(llm, PROMPT, n=48) == reference and wrapped.calls > 0
    llm.close()
    own = ListDraft(proposal)
    with DFlashLlama(model_path=target, draft_model=own, n_ctx=N_CTX, n_batch=16, verbose=False) as llm:
        assert llm.engine is None
        response = llm.create_completion(PROMPT, max_tokens=48, temperature=0)
        assert response["choices"][0]["text"] == llm.detokenize(reference).decode()
        assert own.calls > 0


def test_python_draft_on_a_hybrid_target_is_refused(pairs: dict[str, TinyPair]) -> None:
    with pytest.raises(PairMismatchError, match="roll back"):
        DFlashLlama(model_path=str(pairs["hybrid"].target), draft_model=ListDraft([1]), n_ctx=N_CTX, verbose=False)


# -- (5) the stock draft loop and the native DFlash pipeline -----------------------------------------------------------


def test_stock_draft_loop_cannot_roll_back_a_hybrid_target(pairs: dict[str, TinyPair], stock: dict[str, Llama]) -> None:
    """Measured: the stock loop is lossless on a dense target, but on a hybrid one the first rejected draft leaves
    the recurrent state un-rolled-back (seq_rm's refusal is ignored) and the next llama_decode fails."""
    outcomes = {}
    for target in TARGETS:
        reference = greedy_tokens(stock[target], PROMPT)
        draft = ArrayDraft(ListDraft([reference[0]] * 3))  # the target alternates two tokens: some drafts fail
        path = str(pairs[target].target)
        llm = Llama(model_path=path, n_ctx=N_CTX, draft_model=draft, logits_all=True, verbose=False)
        try:
            outcomes[target] = "lossless" if greedy_tokens(llm, PROMPT) == reference else "diverged"
        except RuntimeError as error:
            outcomes[target] = f"failed: {error}"
        llm.close()
    assert outcomes["dense"] == "lossless"
    assert outcomes["hybrid"].startswith("failed: llama_decode")


@pytest.mark.parametrize("target", TARGETS)
def test_native_pipeline_drafts_accepts_and_rolls_back(
    target: str, stock: dict[str, Llama], dflash: dict[str, DFlashLlama]
) -> None:
    expected = stock[target].create_completion(PROMPT, max_tokens=MAX_TOKENS, temperature=0)
    response = dflash[target].create_completion(PROMPT, max_tokens=MAX_TOKENS, temperature=0, draft_length=3)
    assert response["choices"][0]["text"] == expected["choices"][0]["text"]
    stats = response["dflash_stats"]
    assert 0 < stats["accepted"] < stats["drafted"]  # drafts accepted, and rejected ones rolled back


# -- response shapes and losslessness --------------------------------------------------------------------------------


@pytest.mark.parametrize("target", TARGETS)
def test_chat_stream_has_llama_shapes_and_plain_text(
    target: str, stock: dict[str, Llama], dflash: dict[str, DFlashLlama]
) -> None:
    reference = list(stock[target].create_chat_completion(MESSAGES, temperature=0, max_tokens=MAX_TOKENS, stream=True))
    chunks = list(dflash[target].create_chat_completion(MESSAGES, temperature=0, max_tokens=MAX_TOKENS, stream=True))
    assert chat_text(chunks) == chat_text(reference) != ""
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant"}
    assert chunks[-1]["choices"][0]["delta"] == {}
    assert chunks[-1]["choices"][0]["finish_reason"] == reference[-1]["choices"][0]["finish_reason"] == "length"
    for chunk in chunks:
        assert set(chunk) - {"dflash_stats"} == set(reference[1])
        assert set(chunk["choices"][0]) == set(reference[1]["choices"][0])
        assert (chunk["id"], chunk["created"]) == (chunks[0]["id"], chunks[0]["created"])
        assert chunk["object"] == "chat.completion.chunk"
        assert chunk["id"].startswith("chatcmpl-") and chunk["choices"][0]["logprobs"] is None
    assert "dflash_stats" in chunks[-1] and all("dflash_stats" not in chunk for chunk in chunks[:-1])
    stats = chunks[-1]["dflash_stats"]
    assert stats["n_generated"] == MAX_TOKENS and stats["drafted"] > 0


@pytest.mark.parametrize("target", TARGETS)
def test_chat_response_is_token_identical_to_plain_decoding(
    target: str, stock: dict[str, Llama], dflash: dict[str, DFlashLlama]
) -> None:
    reference = stock[target].create_chat_completion(MESSAGES, temperature=0, max_tokens=MAX_TOKENS)
    response = dflash[target].create_chat_completion(MESSAGES, temperature=0, max_tokens=MAX_TOKENS, draft_length=5)
    plain = dflash[target].create_chat_completion(MESSAGES, temperature=0, max_tokens=MAX_TOKENS, speculative=False)
    assert set(response) - {"dflash_stats"} == set(reference)
    assert response["object"] == "chat.completion" and response["id"].startswith("chatcmpl-")
    assert response["choices"] == reference["choices"] == plain["choices"]
    assert response["usage"] == reference["usage"]
    assert response["dflash_stats"]["accepted"] > 0 and plain["dflash_stats"]["drafted"] == 0


def test_completion_call_and_stream_match_stock(stock: dict[str, Llama], dflash: dict[str, DFlashLlama]) -> None:
    reference = stock["dense"](PROMPT, max_tokens=MAX_TOKENS, temperature=0)
    response = dflash["dense"](PROMPT, max_tokens=MAX_TOKENS, temperature=0)
    assert set(response) - {"dflash_stats"} == set(reference)
    assert (response["object"], response["choices"], response["usage"]) == (
        reference["object"], reference["choices"], reference["usage"]
    )
    assert response["model"] == reference["model"] and response["id"].startswith("cmpl-")
    chunks = list(dflash["dense"].create_completion(PROMPT, max_tokens=MAX_TOKENS, temperature=0, stream=True))
    assert "".join(c["choices"][0]["text"] for c in chunks) == reference["choices"][0]["text"]
    assert [c["choices"][0]["finish_reason"] for c in chunks][-2:] == [None, "length"]
    assert all(c["object"] == "text_completion" and c["id"] == chunks[0]["id"] for c in chunks)


def test_stop_strings_and_echo_match_stock(stock: dict[str, Llama], dflash: dict[str, DFlashLlama]) -> None:
    stop = stock["dense"].create_completion(PROMPT, max_tokens=MAX_TOKENS, temperature=0)["choices"][0]["text"][8:14]
    for options in ({"stop": stop}, {"stop": [stop, "zzz"]}, {"echo": True}):
        reference = stock["dense"].create_completion(PROMPT, max_tokens=MAX_TOKENS, temperature=0, **options)
        response = dflash["dense"].create_completion(PROMPT, max_tokens=MAX_TOKENS, temperature=0, **options)
        assert response["choices"] == reference["choices"], options


def test_seeded_sampling_is_reproducible_and_lossless(dflash: dict[str, DFlashLlama]) -> None:
    llm = dflash["hybrid"]
    options = {"temperature": 0.9, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "seed": 1234, "max_tokens": MAX_TOKENS}
    first = llm.create_chat_completion(MESSAGES, **options)["choices"]
    assert llm.create_chat_completion(MESSAGES, **options)["choices"] == first
    assert llm.create_chat_completion(MESSAGES, speculative=False, **options)["choices"] == first


def test_closing_a_stream_early_leaves_the_model_usable(dflash: dict[str, DFlashLlama]) -> None:
    llm = dflash["dense"]
    stream = llm.create_chat_completion(MESSAGES, temperature=0, max_tokens=200, stream=True)
    assert next(stream)["choices"][0]["delta"] == {"role": "assistant"}
    assert next(stream)["choices"][0]["delta"]["content"]
    stream.close()
    response = llm.create_chat_completion(MESSAGES, temperature=0, max_tokens=4)
    assert response["usage"]["completion_tokens"] == 4


def test_target_alone(pairs: dict[str, TinyPair], stock: dict[str, Llama]) -> None:
    reference = stock["hybrid"].create_completion(PROMPT, max_tokens=MAX_TOKENS, temperature=0)
    with DFlashLlama(model_path=str(pairs["hybrid"].target), n_ctx=N_CTX, verbose=False) as llm:
        response = llm.create_completion(PROMPT, max_tokens=MAX_TOKENS, temperature=0)
    assert response["choices"] == reference["choices"]
    assert response["dflash_stats"]["speculative"] is False and response["dflash_stats"]["drafted"] == 0


# -- what the engine cannot honour is refused ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "option",
    [
        {"grammar": "root"},
        {"logprobs": 1},
        {"logit_bias": {1: 2.0}},
        {"repeat_penalty": 1.1},
        {"presence_penalty": 0.5},
        {"mirostat_mode": 2},
        {"typical_p": 0.5},
        {"suffix": "!"},
        {"logits_processor": [lambda ids, scores: scores]},
    ],
    ids=lambda option: next(iter(option)),
)
def test_unsupported_completion_options_are_refused(option: dict[str, Any], dflash: dict[str, DFlashLlama]) -> None:
    if "grammar" in option:
        option = {"grammar": LlamaGrammar.from_string('root ::= "a"', verbose=False)}
    with pytest.raises(RequestError, match=next(iter(option))):
        dflash["dense"].create_completion(PROMPT, max_tokens=4, **option)


@pytest.mark.parametrize(
    "option",
    [
        {"logprobs": True},
        {"top_logprobs": 2},
        {"response_format": {"type": "json_object"}},
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]},
        {"frequency_penalty": 0.3},
    ],
    ids=lambda option: next(iter(option)),
)
def test_unsupported_chat_options_are_refused(option: dict[str, Any], dflash: dict[str, DFlashLlama]) -> None:
    with pytest.raises(RequestError, match=next(iter(option))):
        dflash["dense"].create_chat_completion(MESSAGES, max_tokens=4, **option)


def test_options_left_off_are_accepted(dflash: dict[str, DFlashLlama]) -> None:
    off = {"logit_bias": {}, "repeat_penalty": 1.0, "logprobs": False, "response_format": {"type": "text"}}
    response = dflash["dense"].create_chat_completion(MESSAGES, max_tokens=4, temperature=0, **off)
    assert response["usage"]["completion_tokens"] == 4


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"chat_format": "chatml"}, RequestError),
        ({"logits_all": True}, RequestError),
        ({"embedding": True}, RequestError),
        ({"n_ctx": 0}, RequestError),
        ({"no_such_option": 1}, TypeError),
        ({"draft_capacity": 3, "draft_model": LlamaPromptLookupDecoding()}, RequestError),
    ],
    ids=["chat_format", "logits_all", "embedding", "n_ctx_0", "unknown", "draft_capacity_with_python_draft"],
)
def test_unsupported_constructor_arguments_are_refused(
    kwargs: dict[str, Any], error: type[Exception], pairs: dict[str, TinyPair]
) -> None:
    kwargs = {"draft_model_path": pairs["dense"].draft, **kwargs} if "draft_model" not in kwargs else kwargs
    with pytest.raises(error):
        DFlashLlama(model_path=str(pairs["dense"].target), verbose=False, **kwargs)


def test_methods_needing_llamas_own_context_are_refused(dflash: dict[str, DFlashLlama]) -> None:
    llm = dflash["dense"]
    for call in (lambda: llm.generate([1]), lambda: llm.eval([1]), lambda: llm.save_state(), lambda: llm.embed("a")):
        with pytest.raises(NotImplementedError, match="DFlash draft"):
            call()


# -- host memory -----------------------------------------------------------------------------------------------------


def largest_numpy_block(snapshot: tracemalloc.Snapshot) -> int:
    numpy_domain = np.lib.tracemalloc_domain
    return max((t.size for t in snapshot.traces if t.domain == numpy_domain), default=0)


def test_no_n_ctx_by_n_vocab_logits_buffer(pairs: dict[str, TinyPair]) -> None:
    """The stock draft loop needs logits_all=True (else it fails past n_batch tokens), which allocates
    n_ctx × n_vocab floats on the host; DFlashLlama allocates nothing of the kind."""
    p, n_ctx = pairs["dense"], 16384
    llm = Llama(model_path=str(p.target), n_ctx=256, n_batch=16, draft_model=LlamaPromptLookupDecoding(), verbose=False)
    with pytest.raises(ValueError, match="broadcast"):
        llm.create_completion(PROMPT, max_tokens=40, temperature=0)
    llm.close()

    tracemalloc.start()
    try:
        llm = Llama(model_path=str(p.target), n_ctx=n_ctx, draft_model=LlamaPromptLookupDecoding(), logits_all=True,
                    verbose=False)
        logits_bytes = n_ctx * llm.n_vocab() * np.dtype(np.single).itemsize
        assert largest_numpy_block(tracemalloc.take_snapshot()) >= logits_bytes
        llm.close()
        del llm
        tracemalloc.clear_traces()
        tracemalloc.reset_peak()
        with DFlashLlama(model_path=str(p.target), draft_model_path=p.draft, n_ctx=n_ctx, verbose=False) as ours:
            chunks = list(ours.create_chat_completion(MESSAGES, temperature=0, max_tokens=64, stream=True))
            assert chunks[-1]["dflash_stats"]["drafted"] > 0
            peak = tracemalloc.get_traced_memory()[1]
            largest = largest_numpy_block(tracemalloc.take_snapshot())
    finally:
        tracemalloc.stop()
    assert largest < logits_bytes / 16 and peak < logits_bytes / 8


# -- from_pretrained -------------------------------------------------------------------------------------------------


def test_from_pretrained_fetches_target_and_draft(pairs: dict[str, TinyPair], monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub

    p = pairs["dense"]
    hub = {("org/target", "target-Q8_0.gguf"): p.target, ("org/draft", "draft-Q4_K_M.gguf"): p.draft}
    fetched: list[tuple[str, str]] = []

    def fake_download(repo_id: str, filename: str, **kwargs: Any) -> str:
        fetched.append((repo_id, filename))
        return str(hub[(repo_id, filename)])

    def fake_list(self: Any, repo_id: str, **kwargs: Any) -> list[str]:
        return [name for repo, name in hub if repo == repo_id] + ["README.md"]

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake_download)
    monkeypatch.setattr(huggingface_hub.HfApi, "list_repo_files", fake_list)
    llm = DFlashLlama.from_pretrained("org/target", "*Q8_0.gguf", "org/draft", "draft-Q4_K_M.gguf", n_ctx=N_CTX,
                                      verbose=False)
    with llm:
        assert fetched == list(hub)
        assert llm.engine.info()["draft"] == str(p.draft)
        assert llm.create_completion(PROMPT, max_tokens=4, temperature=0)["usage"]["completion_tokens"] == 4
    with pytest.raises(RequestError, match="draft_filename"):
        DFlashLlama.from_pretrained("org/target", "*Q8_0.gguf", draft_repo_id="org/draft")
