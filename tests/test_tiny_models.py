"""The tiny model generator: determinism, caching, GGUF contents, tokenizer, head recipes and broken drafts."""

from __future__ import annotations

import contextlib
import ctypes
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gguf
import jinja2
import llama_cpp
import numpy as np
import pytest

import dflash_runtime
from dflash_runtime import load_pair
from dflash_runtime.native.backends import load_backends
from dflash_runtime.testing import (
    BROKEN_KINDS,
    CONST_TOKEN,
    REGIME_TOKEN,
    SHAPED_TOKENS,
    TinyPair,
    default_cache_dir,
    tiny_pair,
    write_broken_draft,
)
from dflash_runtime.testing.heads import (
    BIAS_CHANNEL,
    HEADS,
    MTP_CONTROL_GAIN,
    REGIME_CHANNEL,
    TensorSource,
    build_head,
)
from dflash_runtime.testing.tokenizer import ENDOFTEXT, IM_END, IM_START, MASK, THINK_OPEN, TokenType, build_vocab
from dflash_runtime.testing.writers import SPEC_KEY

COMBOS = [(target, draft) for target in ("dense", "hybrid") for draft in ("dflash2", "dflash1", "dspark")]
TARGET_ARCH = {"dense": "qwen3", "hybrid": "qwen35"}
DFLASH2_KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
SELECTOR_TENSORS = ("selector_predecessor.weight", "selector_successor.weight", "selector_hidden.weight")


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tiny-cache")


def value(reader: gguf.GGUFReader, key: str) -> Any:
    field = reader.get_field(key)
    return None if field is None else field.contents()


def shapes(reader: gguf.GGUFReader) -> dict[str, tuple[int, ...]]:
    """Tensor shapes in ggml order (ne0 first), as libllama's loaders state them."""
    return {t.name: tuple(int(n) for n in t.shape) for t in reader.tensors}


def tensor(reader: gguf.GGUFReader, name: str) -> np.ndarray:
    """numpy view (n_out, n_in) of a 2-D tensor."""
    (found,) = [t for t in reader.tensors if t.name == name]
    return np.asarray(found.data, dtype=np.float32)


# --- determinism and cache ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("target", "draft"), COMBOS)
def test_same_parameters_give_the_same_bytes(tmp_path: Path, target: str, draft: str) -> None:
    first = tiny_pair(target, draft, head="regime", cache_dir=tmp_path / "a")
    second = tiny_pair(target, draft, head="regime", cache_dir=tmp_path / "b")
    assert first.target.name == second.target.name and first.draft.name == second.draft.name
    assert first.target.read_bytes() == second.target.read_bytes()
    assert first.draft.read_bytes() == second.draft.read_bytes()


@pytest.mark.parametrize(("target", "draft"), COMBOS)
def test_another_seed_changes_weights_not_shapes(cache: Path, target: str, draft: str) -> None:
    base = tiny_pair(target, draft, cache_dir=cache)
    other = tiny_pair(target, draft, seed=1, cache_dir=cache)
    for a, b in [(base.target, other.target), (base.draft, other.draft)]:
        assert a != b
        assert a.read_bytes() != b.read_bytes()
        assert shapes(gguf.GGUFReader(a)) == shapes(gguf.GGUFReader(b))


def test_cache_is_reused_and_shared_between_draft_kinds(tmp_path: Path) -> None:
    first = tiny_pair("dense", "dflash2", cache_dir=tmp_path)
    stamps = {p: p.stat().st_mtime_ns for p in (first.target, first.draft)}
    again = tiny_pair("dense", "dflash2", cache_dir=tmp_path)
    assert again == first
    assert {p: p.stat().st_mtime_ns for p in (again.target, again.draft)} == stamps

    v1 = tiny_pair("dense", "dflash1", cache_dir=tmp_path)
    assert v1.target == first.target and v1.draft != first.draft
    other_head = tiny_pair("dense", "dflash2", head="const", cache_dir=tmp_path)
    assert other_head.target != first.target and other_head.draft != first.draft
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        {p.name for pair in (first, v1, other_head) for p in (pair.target, pair.draft)}
    )


def test_a_deleted_file_is_regenerated_identically(tmp_path: Path) -> None:
    pair = tiny_pair("hybrid", "dflash2", cache_dir=tmp_path)
    original = pair.draft.read_bytes()
    pair.draft.unlink()
    assert tiny_pair("hybrid", "dflash2", cache_dir=tmp_path).draft.read_bytes() == original


def test_concurrent_cli_processes_produce_the_same_files(tmp_path: Path) -> None:
    """Two processes (each with its own hash seed) generate into one cache at once; the result is what this
    process generates, and no temporary file is left behind."""
    shared = tmp_path / "shared"
    checkout = Path(dflash_runtime.__file__).resolve().parents[1]
    command = [
        sys.executable,
        "-m",
        "dflash_runtime.testing.tiny_models",
        "--out",
        str(shared),
        "--target",
        "hybrid",
        "--draft",
        "dflash2",
        "--head",
        "regime",
    ]
    procs = [
        subprocess.Popen(
            command, stdout=subprocess.PIPE, text=True, cwd=checkout, env={**os.environ, "PYTHONHASHSEED": str(i)}
        )
        for i in (1, 2)
    ]
    outputs = [proc.communicate(timeout=120)[0] for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0]
    local = tiny_pair("hybrid", "dflash2", head="regime", cache_dir=tmp_path / "local")
    for out in outputs:
        printed = [Path(line) for line in out.split()]
        assert printed == [shared / local.target.name, shared / local.draft.name]
    assert (shared / local.target.name).read_bytes() == local.target.read_bytes()
    assert (shared / local.draft.name).read_bytes() == local.draft.read_bytes()
    assert sorted(p.name for p in shared.iterdir()) == sorted([local.target.name, local.draft.name])


def test_default_cache_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("DFLASH_TINY_CACHE", str(tmp_path))
    assert default_cache_dir() == tmp_path
    monkeypatch.delenv("DFLASH_TINY_CACHE")
    checkout = Path(dflash_runtime.__file__).resolve().parents[1]
    assert default_cache_dir() == checkout / ".cache" / "tiny-models"


def test_invalid_parameters_are_refused(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="unknown tiny model override"):
        tiny_pair(cache_dir=tmp_path, n_layers=3)
    with pytest.raises(ValueError, match="head must be one of"):
        tiny_pair(head="bogus", cache_dir=tmp_path)
    with pytest.raises(ValueError, match="target_layers"):
        tiny_pair(target_layers=(1, 4), cache_dir=tmp_path)
    with pytest.raises(ValueError, match="block_size"):
        tiny_pair(block_size=1, cache_dir=tmp_path)
    with pytest.raises(ValueError, match="selector_top_k"):
        tiny_pair(n_embd=32, cache_dir=tmp_path, selector_top_k=6)
    with pytest.raises(ValueError, match=r"\['confidence_head'\] shape a dspark draft, not 'dflash2'"):
        tiny_pair(cache_dir=tmp_path, confidence_head=True)
    with pytest.raises(ValueError, match="markov_rank"):
        tiny_pair("dense", "dspark", cache_dir=tmp_path, markov_rank=0)
    assert list(tmp_path.iterdir()) == []


# --- GGUF contents ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(("target", "draft"), COMBOS)
def test_target_metadata_and_tensors(cache: Path, target: str, draft: str) -> None:
    pair = tiny_pair(target, draft, cache_dir=cache)
    arch = TARGET_ARCH[target]
    assert pair.target_arch == arch and pair.draft_kind == draft
    reader = gguf.GGUFReader(pair.target)
    n_vocab = len(value(reader, "tokenizer.ggml.tokens"))
    assert value(reader, "general.architecture") == arch
    assert (value(reader, f"{arch}.block_count"), value(reader, f"{arch}.embedding_length")) == (4, 128)
    assert value(reader, "tokenizer.ggml.mask_token_id") is None
    sizes = shapes(reader)
    assert sizes["token_embd.weight"] == sizes["output.weight"] == (128, n_vocab)
    if target == "hybrid":
        n_rot = value(reader, "qwen35.rope.dimension_count")
        assert sum(value(reader, "qwen35.rope.dimension_sections")) == n_rot // 2
        assert value(reader, "qwen35.full_attention_interval") == 2
        recurrent = [f"blk.{il}.attn_qkv.weight" in sizes for il in range(4)]
        assert recurrent == [True, False, True, False]
        assert sizes["blk.1.attn_q.weight"] == (128, 2 * 4 * 32)  # query + gate
        assert sizes["blk.0.ssm_out.weight"] == (16 * 4, 128)
    else:
        assert all(f"blk.{il}.attn_q.weight" in sizes for il in range(4))


@pytest.mark.parametrize(("target", "draft"), COMBOS)
def test_draft_metadata_and_tensors(cache: Path, target: str, draft: str) -> None:
    pair = tiny_pair(target, draft, cache_dir=cache)
    reader, target_reader = gguf.GGUFReader(pair.draft), gguf.GGUFReader(pair.target)
    assert value(reader, "general.architecture") == "dflash"
    layers = value(reader, "dflash.target_layers")
    assert layers == [1, 3] and max(layers) < value(target_reader, f"{TARGET_ARCH[target]}.block_count")
    assert value(reader, "dflash.block_size") == 8
    assert value(reader, "dflash.attention.causal") is False
    vocab = build_vocab()
    assert value(reader, "tokenizer.ggml.mask_token_id") == vocab.id_of(MASK)
    for key in ("tokens", "token_type", "merges", "eos_token_id", "bos_token_id", "model", "pre"):
        assert value(reader, f"tokenizer.ggml.{key}") == value(target_reader, f"tokenizer.ggml.{key}")
    sizes = shapes(reader)
    assert "token_embd.weight" not in sizes and "output.weight" not in sizes
    assert sizes["fc.weight"] == (2 * 128, 128)
    sections = value(reader, "dflash.rope.dimension_sections")
    assert sections == ([16, 0, 0, 0] if target == "hybrid" else None)
    has_dflash2_parts = [value(reader, f"dflash.{key}") is not None for key in DFLASH2_KEYS] + [
        name in sizes for name in (*SELECTOR_TENSORS, "blk.0.attn_conv_base", "blk.1.ffn_conv_proj.weight")
    ]
    assert has_dflash2_parts == [draft == "dflash2"] * len(has_dflash2_parts)
    if draft == "dflash2":
        top_k, group = value(reader, "dflash.selector_top_k"), value(reader, "dflash.conv_group_size")
        assert top_k > 0 and top_k * (top_k + 1) <= 128 and 128 % group == 0
        rank, kernel = value(reader, "dflash.selector_rank"), value(reader, "dflash.conv_kernel_size")
        assert sizes["selector_successor.weight"] == (rank, vocab.n_vocab)
        assert sizes["selector_hidden.weight"] == (128, rank)
        assert sizes["blk.0.attn_conv_base"] == (128, kernel, 2)
        assert sizes["blk.0.attn_conv_proj.weight"] == (128, 2 * kernel * 128 // group)


def test_scaled_family_and_overrides(cache: Path) -> None:
    pair = tiny_pair("hybrid", "dflash2", n_embd=256, dims="scaled", cache_dir=cache, n_layer=8, weight_type="f16")
    reader = gguf.GGUFReader(pair.target)
    got = {
        key: value(reader, f"qwen35.{key}")
        for key in (
            "feed_forward_length",
            "attention.head_count",
            "attention.head_count_kv",
            "attention.key_length",
            "full_attention_interval",
            "ssm.state_size",
        )
    }
    assert got == {
        "feed_forward_length": 768,
        "attention.head_count": 2,
        "attention.head_count_kv": 1,
        "attention.key_length": 128,
        "full_attention_interval": 4,
        "ssm.state_size": 128,
    }
    sizes = shapes(reader)
    assert [il for il in range(8) if f"blk.{il}.attn_q.weight" in sizes] == [3, 7]
    types = {t.name: t.tensor_type for t in reader.tensors}
    assert types["blk.0.ffn_up.weight"] == gguf.GGMLQuantizationType.F16
    assert types["blk.0.attn_norm.weight"] == gguf.GGMLQuantizationType.F32
    draft = gguf.GGUFReader(pair.draft)
    assert value(draft, "dflash.target_layers") == [1, 3, 5, 7]
    assert shapes(draft)["fc.weight"] == (4 * 256, 256)

    custom = tiny_pair("dense", "dflash1", cache_dir=cache, block_size=16, draft_layers=1, target_layers=(2,))
    draft = gguf.GGUFReader(custom.draft)
    assert (value(draft, "dflash.block_size"), value(draft, "dflash.block_count")) == (16, 1)
    assert value(draft, "dflash.target_layers") == [2]


@pytest.mark.parametrize(("target", "draft"), COMBOS)
def test_layers_never_write_the_control_channels(cache: Path, target: str, draft: str) -> None:
    """The head shapes rely on it: every projection into the residual stream has zero rows there."""
    pair = tiny_pair(target, draft, head="regime", cache_dir=cache)
    for path in (pair.target, pair.draft):
        reader = gguf.GGUFReader(path)
        writers = [
            t.name
            for t in reader.tensors
            if t.name.endswith(("attn_output.weight", "ffn_down.weight", "ssm_out.weight"))
        ]
        assert writers
        for name in writers:
            rows = tensor(reader, name)[[REGIME_CHANNEL, BIAS_CHANNEL]]
            assert not rows.any(), name


# --- tokenizer ---------------------------------------------------------------------------------------------


def test_merges_are_coherent() -> None:
    vocab = build_vocab()
    produced = set()
    for merge in vocab.merges:
        left, right = merge.split(" ")
        for token in (left, right, left + right):
            vocab.id_of(token)
        produced.add(left + right)
    normal = [t for t, kind in zip(vocab.tokens, vocab.token_types, strict=True) if kind == TokenType.NORMAL]
    assert set(normal[256:]) == produced
    assert len(set(vocab.tokens)) == vocab.n_vocab


def test_every_normal_token_encodes_to_itself() -> None:
    vocab = build_vocab()
    for token_id in range(256, vocab.n_vocab):
        if vocab.token_types[token_id] == TokenType.NORMAL:
            assert vocab.encode(vocab.token_text(token_id).decode()) == [token_id]
    for text in (CONST_TOKEN, REGIME_TOKEN, *SHAPED_TOKENS):
        assert len(vocab.encode(text)) == 1


@pytest.fixture(scope="module")
def llama_vocab(cache: Path) -> Iterator[Any]:
    pair = tiny_pair("hybrid", "dflash2", cache_dir=cache)
    params = llama_cpp.llama_model_default_params()
    params.vocab_only = True
    model = llama_cpp.llama_model_load_from_file(str(pair.target).encode(), params)
    assert model, "libllama refused the generated target"
    yield llama_cpp.llama_model_get_vocab(model)
    llama_cpp.llama_model_free(model)


def llama_tokenize(vocab: Any, text: str, parse_special: bool = False) -> list[int]:
    raw = text.encode()
    buf = (llama_cpp.llama_token * (len(raw) + 8))()
    n = llama_cpp.llama_tokenize(vocab, raw, len(raw), buf, len(buf), False, parse_special)
    assert n >= 0
    return list(buf[:n])


def llama_piece(vocab: Any, token_id: int, special: bool) -> bytes:
    buf = ctypes.create_string_buffer(64)
    n = llama_cpp.llama_token_to_piece(vocab, token_id, buf, len(buf), 0, special)
    return buf.raw[:n]


def test_libllama_tokenizer_agrees_with_the_vocabulary(llama_vocab: Any) -> None:
    vocab = build_vocab()
    assert llama_cpp.llama_vocab_n_tokens(llama_vocab) == vocab.n_vocab
    for token_id in range(vocab.n_vocab):
        if vocab.token_types[token_id] == TokenType.NORMAL:
            assert llama_piece(llama_vocab, token_id, special=False) == vocab.token_text(token_id)
            if token_id >= 256:
                assert llama_tokenize(llama_vocab, vocab.token_text(token_id).decode()) == [token_id]
    for sentence in ("Hello world! The draft proposes, the target verifies.", "it's 42\n\n  done?", "ünïcode"):
        assert llama_tokenize(llama_vocab, sentence) == vocab.encode(sentence)
    chat = f"{IM_START}user\nhi{IM_END}"
    assert llama_tokenize(llama_vocab, chat, parse_special=True)[0] == vocab.id_of(IM_START)
    assert llama_cpp.llama_vocab_eos(llama_vocab) == vocab.id_of(IM_END)
    assert llama_cpp.llama_vocab_mask(llama_vocab) == -1  # targets carry no mask token id
    assert llama_piece(llama_vocab, vocab.id_of(THINK_OPEN), special=False) == THINK_OPEN.encode()
    assert llama_piece(llama_vocab, vocab.id_of(ENDOFTEXT), special=False) == b""


def test_chat_template_switches_thinking(cache: Path) -> None:
    pair = tiny_pair(cache_dir=cache)
    for path in (pair.target, pair.draft):
        source = value(gguf.GGUFReader(path), "tokenizer.chat_template")
        template = jinja2.Environment().from_string(source)
        messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
        base = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        assert template.render(messages=messages, add_generation_prompt=True) == base
        assert template.render(messages=messages, add_generation_prompt=True, enable_thinking=True) == base
        no_think = template.render(messages=messages, add_generation_prompt=True, enable_thinking=False)
        assert no_think == base + "<think>\n\n</think>\n\n"
        assert template.render(messages=messages, add_generation_prompt=False) == base.rsplit("<|im_start|>", 1)[0]


# --- head shapes (greedy choice from the residual stream, layers simulated by noise) ------------------------


def greedy_after(head: str, seed: int = 0) -> tuple[np.ndarray, Any]:
    """Greedy next token after every input token when the layers add unit noise outside the control channels."""
    vocab = build_vocab()
    plan = build_head(head, vocab, 128, TensorSource(seed, "head-test"))
    stream = plan.token_embd.copy()
    noise = np.random.default_rng(seed).standard_normal(stream.shape).astype(np.float32)
    noise[:, [REGIME_CHANNEL, BIAS_CHANNEL]] = 0.0
    stream += noise
    normed = stream / np.sqrt((stream**2).mean(axis=1, keepdims=True))
    return np.argmax(normed @ plan.output.T, axis=1), vocab


@pytest.mark.parametrize("head", HEADS)
def test_greedy_choice_is_always_plain_text(head: str) -> None:
    choice, vocab = greedy_after(head)
    blocked = set(vocab.added_ids) | {i for i in range(256) if not (32 <= i < 127 or i == 10)}
    assert not set(choice.tolist()) & blocked


def test_const_head_always_picks_its_token() -> None:
    choice, vocab = greedy_after("const")
    assert set(choice.tolist()) == {vocab.id_of_text(CONST_TOKEN)}


def test_shaped_head_alternates_and_the_mask_proposes_the_first() -> None:
    choice, vocab = greedy_after("shaped")
    proposed, other = (vocab.id_of_text(text) for text in SHAPED_TOKENS)
    assert set(choice.tolist()) == {proposed, other}
    assert (choice[proposed], choice[other], choice[vocab.id_of(MASK)]) == (other, proposed, proposed)


def test_regime_head_repeats_its_token_only_after_it() -> None:
    choice, vocab = greedy_after("regime")
    regime = vocab.id_of_text(REGIME_TOKEN)
    assert choice[regime] == regime and choice[vocab.id_of(MASK)] == regime
    others = np.delete(choice, [regime, vocab.id_of(MASK)])
    assert regime not in others
    assert len(set(others.tolist())) > 20  # chaotic, not a fixed continuation


def test_random_head_has_no_fixed_choice() -> None:
    choice, _ = greedy_after("random")
    assert len(set(choice.tolist())) > 20


# --- libllama loads every file; broken drafts are broken in exactly one way ---------------------------------


def load_model(path: Path) -> bool:
    load_backends()  # the CPU backend is a loadable module: nothing else in this file may have loaded it yet
    model = llama_cpp.llama_model_load_from_file(str(path).encode(), llama_cpp.llama_model_default_params())
    if not model:
        return False
    llama_cpp.llama_model_free(model)
    return True


@pytest.mark.parametrize(("target", "draft"), COMBOS)
def test_libllama_loads_both_files(cache: Path, target: str, draft: str) -> None:
    pair = tiny_pair(target, draft, head="const", cache_dir=cache)
    assert load_model(pair.target) and load_model(pair.draft)


def draft_profile(path: Path) -> dict[str, Any]:
    try:
        reader = gguf.GGUFReader(path)
    except ValueError:
        return {"gguf": False}
    arch = value(reader, "general.architecture")
    return {
        "gguf": True,
        "arch": arch,
        "n_embd": value(reader, f"{arch}.embedding_length"),
        "n_vocab": len(value(reader, "tokenizer.ggml.tokens")),
        "eos": value(reader, "tokenizer.ggml.eos_token_id"),
        "mask": value(reader, "tokenizer.ggml.mask_token_id"),
        "target_layers": value(reader, f"{arch}.target_layers"),
        "block_size": value(reader, f"{arch}.block_size"),
        "fc": shapes(reader).get("fc.weight"),
    }


EXPECTED_BREAKS = {
    "vocab_size": {"n_vocab": build_vocab().n_vocab + 1},
    "special_tokens": {"eos": build_vocab().id_of(ENDOFTEXT)},
    "no_mask": {"mask": None},
    "layer_out_of_range": {"target_layers": [1, 4]},
    "width": {"n_embd": 256, "fc": (2 * 256, 256)},
    "bad_block_size": {"block_size": 1},
}


def changes(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    return {key: after.get(key) for key in before.keys() | after.keys() if before.get(key) != after.get(key)}


@pytest.mark.parametrize(("target", "draft"), [("dense", "dflash2"), ("hybrid", "dflash1")])
@pytest.mark.parametrize("kind", BROKEN_KINDS)
def test_broken_draft_differs_in_exactly_one_way(
    cache: Path, tmp_path: Path, kind: str, target: str, draft: str
) -> None:
    pair = tiny_pair(target, draft, cache_dir=cache)
    broken = write_broken_draft(kind, tmp_path / f"{kind}.gguf", target=pair)
    assert broken == tmp_path / f"{kind}.gguf" and broken.exists()
    if kind == "not_gguf":
        raw = broken.read_bytes()
        assert raw[:4] != b"GGUF" and raw.decode("ascii") and draft_profile(broken) == {"gguf": False}
        assert not load_model(broken)
    elif kind == "arch_not_dflash":
        assert broken.read_bytes() == pair.target.read_bytes()
        assert draft_profile(broken)["arch"] == TARGET_ARCH[target]
    else:
        assert changes(draft_profile(pair.draft), draft_profile(broken)) == EXPECTED_BREAKS[kind]
        # a real, self-consistent file: libllama loads it on its own, only the pairing is wrong
        assert load_model(broken)


def test_broken_draft_from_paths_alone_matches(cache: Path, tmp_path: Path) -> None:
    """A TinyPair built from paths (no spec) still works: the draft records its spec in its metadata."""
    pair = tiny_pair("hybrid", "dflash2", cache_dir=cache)
    bare = TinyPair(target=pair.target, draft=pair.draft, target_arch=pair.target_arch, draft_kind=pair.draft_kind)
    with_spec = write_broken_draft("width", tmp_path / "a.gguf", target=pair)
    from_file = write_broken_draft("width", tmp_path / "b.gguf", target=bare)
    assert with_spec.read_bytes() == from_file.read_bytes()
    with pytest.raises(ValueError, match="kind must be one of"):
        write_broken_draft("nonsense", tmp_path / "c.gguf", target=pair)


# --- hybrid targets with an MTP (nextn) block -----------------------------------------------------------------

# Digests of specs written before targets could carry an MTP block: they name cached files, so they must not move.
PINNED_DIGESTS = {
    ("dense", "dflash2", "shaped"): ("7aba3c34a7936404", "71d7d5cb6584ff67"),
    ("dense", "dflash1", "phrase"): ("7c81a66679b91780", "cc6e1bd0ef5bdde0"),
    ("hybrid", "dflash2", "shaped"): ("9654815e2628a577", "90c74927c6cde9eb"),
    ("hybrid", "dflash2", "random"): ("6f207fea13959cf2", "ea02bec5d12a75de"),
    ("hybrid", "dflash1", "phrase"): ("2191259e608622e8", "486771596ec2e2a0"),
}
MTP_TENSORS = (
    "nextn.eh_proj.weight", "nextn.enorm.weight", "nextn.hnorm.weight", "nextn.shared_head_norm.weight",
    "attn_norm.weight", "post_attention_norm.weight", "attn_q.weight", "attn_k.weight", "attn_v.weight",
    "attn_output.weight", "attn_q_norm.weight", "attn_k_norm.weight", "ffn_gate.weight", "ffn_up.weight",
    "ffn_down.weight",
)


@pytest.mark.parametrize(("target", "draft", "head"), sorted(PINNED_DIGESTS))
def test_specs_without_mtp_keep_their_digests(tmp_path: Path, target: str, draft: str, head: str) -> None:
    pair = tiny_pair(target, draft, head=head, cache_dir=tmp_path)
    target_digest, draft_digest = PINNED_DIGESTS[(target, draft, head)]
    assert pair.spec is not None and (pair.spec.target_digest(), pair.spec.draft_digest()) == PINNED_DIGESTS[
        (target, draft, head)
    ]
    assert pair.target.name == f"target-{target}-{head}-e128-{target_digest}.gguf"
    assert pair.draft is not None and pair.draft.name == f"draft-{draft}-{target}-{head}-e128-{draft_digest}.gguf"
    assert "mtp_layers" not in value(gguf.GGUFReader(pair.target), SPEC_KEY)
    assert value(gguf.GGUFReader(pair.target), "qwen35.nextn_predict_layers") is None


def tensor_bytes(reader: gguf.GGUFReader) -> dict[str, bytes]:
    return {t.name: bytes(np.asarray(t.data).tobytes()) for t in reader.tensors}


def test_hybrid_target_with_mtp_layout(cache: Path) -> None:
    """block_count counts the nextn block after the 4 trunk layers; the trunk and everything else are the bytes of
    the same target without it, so plain decoding is unchanged."""
    pair = tiny_pair("hybrid", None, head="shaped", mtp_layers=1, cache_dir=cache)
    assert pair.draft is None and pair.draft_kind is None and pair.mtp_layers == 1
    assert pair.target.name.startswith("target-hybrid-shaped-e128-mtp1-")
    reader = gguf.GGUFReader(pair.target)
    assert (value(reader, "qwen35.block_count"), value(reader, "qwen35.nextn_predict_layers")) == (5, 1)
    assert '"mtp_layers": 1' in value(reader, SPEC_KEY)
    sizes = shapes(reader)
    assert sorted(name for name in sizes if name.startswith("blk.4.")) == sorted(f"blk.4.{n}" for n in MTP_TENSORS)
    assert sizes["blk.4.nextn.eh_proj.weight"] == (2 * 128, 128)  # reads concat(enorm(embedding), hnorm(hidden))
    assert sizes["blk.4.attn_q.weight"] == (128, 2 * 4 * 32)  # gated attention: query + gate
    assert sizes["blk.4.ffn_down.weight"] == (256, 128)
    assert not any(name.startswith("blk.5.") for name in sizes)

    plain = tiny_pair("hybrid", None, head="shaped", cache_dir=cache)
    plain_reader = gguf.GGUFReader(plain.target)
    with_mtp, without = tensor_bytes(reader), tensor_bytes(plain_reader)
    assert {name: data for name, data in with_mtp.items() if not name.startswith("blk.4.")} == without
    keys = {k for k in reader.fields if not k.startswith("GGUF.")}
    assert keys - {k for k in plain_reader.fields if not k.startswith("GGUF.")} == {"qwen35.nextn_predict_layers"}


def test_mtp_block_copies_the_token_embedding_on_structured_heads(cache: Path) -> None:
    """Structured heads decide the next token from the current token's control channels: eh_proj passes the
    embedding half through, reads the hidden half a little (never into reserved channels) and the block writes
    little. On the random head it is a random projection."""
    shaped = gguf.GGUFReader(tiny_pair("hybrid", None, head="shaped", mtp_layers=1, cache_dir=cache).target)
    eh = tensor(shaped, "blk.4.nextn.eh_proj.weight")
    expected = np.eye(128, dtype=np.float32)
    expected[[REGIME_CHANNEL, BIAS_CHANNEL], [REGIME_CHANNEL, BIAS_CHANNEL]] = MTP_CONTROL_GAIN
    assert np.array_equal(eh[:, :128], expected)
    assert not eh[[REGIME_CHANNEL, BIAS_CHANNEL], 128:].any() and eh[2:, 128:].any()
    trunk_write = np.abs(tensor(shaped, "blk.3.ffn_down.weight")).mean()
    assert np.abs(tensor(shaped, "blk.4.ffn_down.weight")).mean() < 0.2 * trunk_write
    random = gguf.GGUFReader(tiny_pair("hybrid", None, head="random", mtp_layers=1, cache_dir=cache).target)
    eh_random = tensor(random, "blk.4.nextn.eh_proj.weight")
    assert abs(float(np.trace(eh_random[:, :128]))) < 20 and eh_random[BIAS_CHANNEL, BIAS_CHANNEL] == 1.0


def test_mtp_target_with_a_dflash_draft(cache: Path) -> None:
    """One MTP target serves the target-only and the DFlash pair; the draft taps trunk layers only and has the
    weights of the draft of the same target without MTP."""
    alone = tiny_pair("hybrid", None, head="phrase", mtp_layers=1, cache_dir=cache)
    pair = tiny_pair("hybrid", "dflash2", head="phrase", mtp_layers=1, cache_dir=cache)
    plain = tiny_pair("hybrid", "dflash2", head="phrase", cache_dir=cache)
    assert pair.target == alone.target and pair.mtp_layers == 1 and plain.mtp_layers == 0
    assert pair.draft is not None and plain.draft is not None
    assert pair.draft.name.startswith("draft-dflash2-hybrid-phrase-e128-mtp1-") and pair.draft != plain.draft
    target_reader, draft_reader = gguf.GGUFReader(pair.target), gguf.GGUFReader(pair.draft)
    trunk = value(target_reader, "qwen35.block_count") - value(target_reader, "qwen35.nextn_predict_layers")
    assert trunk == 4 and max(value(draft_reader, "dflash.target_layers")) < trunk
    assert tensor_bytes(draft_reader) == tensor_bytes(gguf.GGUFReader(plain.draft))


def test_mtp_options_are_checked(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="only hybrid"):
        tiny_pair("dense", "dflash2", mtp_layers=1, cache_dir=tmp_path)
    with pytest.raises(ValueError, match="mtp_layers must lie in"):
        tiny_pair("hybrid", None, mtp_layers=2, cache_dir=tmp_path)
    with pytest.raises(ValueError, match="target_layers must lie in"):
        tiny_pair("hybrid", "dflash2", mtp_layers=1, target_layers=(1, 4), cache_dir=tmp_path)  # 4 is the MTP block
    assert list(tmp_path.iterdir()) == []
    alone = tiny_pair("hybrid", None, mtp_layers=1, cache_dir=tmp_path)
    with pytest.raises(ValueError, match="needs a pair with a draft"):
        write_broken_draft("width", tmp_path / "broken.gguf", target=alone)


def test_cli_writes_a_target_alone(tmp_path: Path) -> None:
    checkout = Path(dflash_runtime.__file__).resolve().parents[1]
    command = [sys.executable, "-m", "dflash_runtime.testing.tiny_models", "--out", str(tmp_path), "--target",
               "hybrid", "--draft", "none", "--head", "const", "--mtp-layers", "1"]
    out = subprocess.run(command, stdout=subprocess.PIPE, text=True, cwd=checkout, timeout=120, check=True).stdout
    assert out.split() == [str(tiny_pair("hybrid", None, head="const", mtp_layers=1, cache_dir=tmp_path).target)]


@contextlib.contextmanager
def loaded(path: Path, *, load_mtp: bool) -> Iterator[Any]:
    load_backends()
    params = llama_cpp.llama_model_default_params()
    params.load_mtp = load_mtp
    model = llama_cpp.llama_model_load_from_file(str(path).encode(), params)
    assert model, f"libllama refused {path.name} (load_mtp={load_mtp})"
    try:
        yield model
    finally:
        llama_cpp.llama_model_free(model)


@contextlib.contextmanager
def context(model: Any, *, mtp: bool, other: Any = None, n_ctx: int = 256) -> Iterator[Any]:
    params = llama_cpp.llama_context_default_params()
    params.n_ctx = params.n_batch = params.n_ubatch = n_ctx
    params.n_threads = params.n_threads_batch = 1
    params.ctx_type = llama_cpp.LLAMA_CONTEXT_TYPE_MTP if mtp else llama_cpp.LLAMA_CONTEXT_TYPE_DEFAULT
    if mtp:
        params.n_rs_seq = 0
    if other is not None:
        params.ctx_other = other
    ctx = llama_cpp.llama_init_from_model(model, params)
    try:
        yield ctx
    finally:
        if ctx:
            llama_cpp.llama_free(ctx)


def test_libllama_loads_the_mtp_target_and_makes_an_mtp_context(cache: Path) -> None:
    pair = tiny_pair("hybrid", "dflash2", head="const", mtp_layers=1, cache_dir=cache)
    assert pair.draft is not None and load_model(pair.draft)
    with loaded(pair.target, load_mtp=False) as model:  # a plain load skips the nextn block
        assert llama_cpp.llama_model_n_layer_nextn(model) == 1
    with loaded(pair.target, load_mtp=True) as model:
        assert llama_cpp.llama_model_n_layer_nextn(model) == 1
        with context(model, mtp=False) as target_ctx:
            assert target_ctx
            with context(model, mtp=True, other=target_ctx) as mtp_ctx:
                assert mtp_ctx
    plain = tiny_pair("hybrid", None, head="const", cache_dir=cache)
    with loaded(plain.target, load_mtp=True) as model:
        assert llama_cpp.llama_model_n_layer_nextn(model) == 0
        with context(model, mtp=True) as mtp_ctx:
            assert not mtp_ctx  # libllama refuses an MTP context on a target without the block


def greedy_with_hidden(model: Any, ctx: Any, prompt: list[int], n_new: int) -> tuple[list[int], np.ndarray]:
    """Plain greedy decoding one token at a time; returns prompt + new tokens and the target's nextn hidden row at
    every position (what llama.cpp's draft-mtp pairs with the next token)."""
    from llama_cpp import llama_cpp_ext

    llama_cpp_ext.llama_set_embeddings_nextn(ctx, True, False)
    n_embd = llama_cpp.llama_model_n_embd(model)
    n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))
    tokens, hidden = list(prompt), []
    batch = llama_cpp.llama_batch_init(len(prompt), 0, 1)
    try:
        pending, pos = list(prompt), 0
        while True:
            batch.n_tokens = len(pending)
            for i, token in enumerate(pending):
                batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = token, pos + i, 1, True
                batch.seq_id[i][0] = 0
            assert llama_cpp.llama_decode(ctx, batch) == 0
            rows = llama_cpp_ext.llama_get_embeddings_nextn(ctx)
            hidden.append(np.ctypeslib.as_array(rows, shape=(len(pending), n_embd)).copy())
            pos += len(pending)
            if len(tokens) == len(prompt) + n_new:
                return tokens, np.concatenate(hidden)
            logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, -1), shape=(n_vocab,))
            pending = [int(np.argmax(logits))]
            tokens.append(pending[0])
    finally:
        llama_cpp.llama_batch_free(batch)


def mtp_predictions(model: Any, mtp_ctx: Any, tokens: list[int], hidden: np.ndarray) -> list[int]:
    """The MTP block's greedy guess of token k + 1 from (token k, target hidden k - 1), for every k, fed the way
    llama.cpp's draft-mtp does (token ids with the hidden row as their embedding, zeros before the first)."""
    from llama_cpp import llama_cpp_ext

    llama_cpp_ext.llama_set_embeddings_nextn(mtp_ctx, True, True)
    n_embd = hidden.shape[1]
    n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))
    rows = np.ascontiguousarray(np.concatenate([np.zeros((1, n_embd), np.float32), hidden[:-1]]))
    batch = llama_cpp.llama_batch_ext_init(mtp_ctx)
    assert batch
    f32p = ctypes.POINTER(ctypes.c_float)
    try:
        for k, token in enumerate(tokens):
            idx = llama_cpp.llama_batch_ext_add_token(batch, 0, token)
            assert idx == k
            pos = llama_cpp.llama_pos(k)
            embd = llama_cpp.llama_embd(ctypes.cast(rows.ctypes.data + k * rows.strides[0], f32p), 1, n_embd)
            assert llama_cpp.llama_batch_ext_set_pos(batch, idx, ctypes.byref(pos))
            assert llama_cpp.llama_batch_ext_set_embd_token(batch, idx, embd)
            assert llama_cpp.llama_batch_ext_set_output_logits(batch, idx, True)
        assert llama_cpp.llama_process(mtp_ctx, llama_cpp.LLAMA_PROCESS_TYPE_DECODE, batch) == 0
        return [
            int(np.argmax(np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(mtp_ctx, k), shape=(n_vocab,))))
            for k in range(len(tokens))
        ]
    finally:
        llama_cpp.llama_batch_ext_free(batch)


@pytest.mark.parametrize(("head", "lowest", "highest"), [("shaped", 1.0, 1.0), ("const", 1.0, 1.0),
                                                         ("phrase", 0.2, 1.0), ("random", 0.0, 0.1)])
def test_mtp_block_predicts_the_target(cache: Path, head: str, lowest: float, highest: float) -> None:
    """Driven as llama.cpp's draft-mtp drives it, the MTP block guesses the target's next greedy token always on
    the shaped and const heads, on phrase while the target stays in the phrase (a third of the tokens here), and
    about never on random."""
    pair = tiny_pair("hybrid", None, head=head, mtp_layers=1, cache_dir=cache)
    vocab = build_vocab()
    prompt = vocab.encode("The quick brown fox" if head != "phrase" else " hello world the draft")
    n_new = 40
    with loaded(pair.target, load_mtp=True) as model, context(model, mtp=False) as target_ctx:
        tokens, hidden = greedy_with_hidden(model, target_ctx, prompt, n_new)
        with context(model, mtp=True, other=target_ctx) as mtp_ctx:
            guesses = mtp_predictions(model, mtp_ctx, tokens, hidden)
    new = range(len(prompt) - 1, len(tokens) - 1)  # guesses of generated tokens
    rate = sum(guesses[k] == tokens[k + 1] for k in new) / len(new)
    assert lowest <= rate <= highest, (head, rate)


def test_the_mtp_block_leaves_the_trunk_alone(cache: Path) -> None:
    """The engine, plain or with the DFlash draft (which taps trunk layers), runs the MTP target exactly as the same
    target without the block: same tokens, same drafted, accepted and verify-step counts."""
    runs = []
    for mtp_layers in (1, 0):
        pair = tiny_pair("hybrid", "dflash2", head="phrase", mtp_layers=mtp_layers, cache_dir=cache)
        with load_pair(pair.target, pair.draft, n_ctx=256, draft_capacity=7) as engine:
            fast = engine.generate("Hello world", max_tokens=32, method="dflash", draft_length=7)
            engine.reset()
            plain = engine.generate("Hello world", max_tokens=32, speculative=False)
        assert fast.tokens == plain.tokens
        runs.append((fast.tokens, fast.stats.drafted, fast.stats.accepted, fast.stats.verify_steps))
    assert runs[0] == runs[1] and runs[0][2] > 0
