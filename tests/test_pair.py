"""Opening a linked target/draft pair in the real libllama, and every way it can be refused."""

from __future__ import annotations

import ctypes
from pathlib import Path

import gguf
import llama_cpp
import numpy as np
import pytest
from llama_cpp import llama_cpp as ll
from pairs import ALL_PAIRS, PAIR_IDS, pair_files

from dflash_runtime import (
    ContextCreationError,
    MissingSymbolsError,
    ModelFileError,
    PairMismatchError,
    load_pair,
    methods,
)
from dflash_runtime.drafters.dflash import BlockDrafter
from dflash_runtime.files.gguf_meta import GGML_TYPE_SIZES, read_gguf
from dflash_runtime.native.batches import TokenBatch
from dflash_runtime.native.ext import DFlashApi, dflash_api, missing_symbols
from dflash_runtime.pair import LinkedPair, live_handles
from dflash_runtime.testing.tiny_models import write_broken_draft


@pytest.mark.parametrize(("target", "draft"), ALL_PAIRS, ids=PAIR_IDS)
def test_pair_links_draft_to_target(target: str, draft: str, no_leaks: None) -> None:
    files = pair_files(target, draft)
    header = read_gguf(files.draft)
    with LinkedPair(files.target, header, n_ctx=256, draft_capacity=7, draft_file=methods.draft_file(header)) as pair:
        api = dflash_api()
        assert api.get_ctx_other(pair.draft_ctx) == pair.target_ctx
        assert pair.spec is not None and pair.spec.is_dflash2 == (draft == "dflash2")
        assert pair.is_recurrent == (target == "hybrid")
        # Hybrid targets keep one recurrent snapshot per token that a rejection may roll back.
        assert pair.n_rs_seq == (7 if target == "hybrid" else 0)
        assert pair.n_ubatch > pair.n_rs_seq + 1
        assert tuple(api.target_layer_ids(pair.draft_model)) == pair.spec.target_layer_ids
    assert pair.closed and pair.draft_ctx is None


def test_target_alone(no_leaks: None) -> None:
    files = pair_files("dense", "dflash2")
    with load_pair(files.target, n_ctx=256) as eng:
        assert eng.draft_ctx is None and eng.spec is None
        assert eng.generate("hello", max_tokens=4).stats.drafted == 0


def test_stock_llama_cannot_open_a_draft_alone(no_leaks: None) -> None:
    files = pair_files("dense", "dflash2")
    with pytest.raises(ValueError, match="Failed to create llama_context"):
        llama_cpp.Llama(model_path=str(files.draft), n_ctx=256, verbose=False)
    with pytest.raises(PairMismatchError, match="must be opened together with its target"):
        load_pair(files.draft)


@pytest.mark.parametrize(
    ("kind", "error", "message"),
    [
        ("not_gguf", ModelFileError, "not a GGUF file"),
        ("vocab_size", PairMismatchError, "vocabulary mismatch"),
        ("special_tokens", PairMismatchError, "special token mismatch: target eos"),
        ("no_mask", PairMismatchError, "no mask token"),
        ("layer_out_of_range", PairMismatchError, "outside the target's layers"),
        ("width", PairMismatchError, "expects a target of width"),
        ("bad_block_size", PairMismatchError, "leaves no room"),
    ],
)
def test_each_bad_draft_has_its_own_message(kind: str, error: type, message: str, tmp_path: Path,
                                            no_leaks: None) -> None:
    files = pair_files("dense", "dflash2")
    bad = write_broken_draft(kind, tmp_path / f"{kind}.gguf", target=files)
    with pytest.raises(error, match=message):
        load_pair(files.target, bad, n_ctx=256, draft_capacity=3)


def test_missing_file_and_draft_capacity_range(tmp_path: Path, no_leaks: None) -> None:
    files = pair_files("dense", "dflash2")
    with pytest.raises(ModelFileError, match="not found"):
        load_pair(tmp_path / "nope.gguf", files.draft)
    for bad in (0, 8):  # the tiny drafts have block_size 8: 1..7 are valid
        with pytest.raises(PairMismatchError, match=r"outside 1\.\.7"):
            load_pair(files.target, files.draft, draft_capacity=bad)


def _copy_without_tensor(src: Path, dst: Path, drop: str) -> Path:
    """A real GGUF that passes header validation but that libllama refuses (a required tensor is missing)."""
    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(dst, arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        vtype = field.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            writer.add_array(name, field.contents())
        else:
            writer.add_key_value(name, field.contents(), vtype)
    for t in reader.tensors:
        if t.name != drop:
            writer.add_tensor(t.name, np.array(t.data), raw_shape=list(reversed(t.shape.tolist())),
                              raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def test_failure_midway_frees_everything(tmp_path: Path) -> None:
    files = pair_files("hybrid", "dflash2")
    bad = _copy_without_tensor(files.draft, tmp_path / "no-ffn.gguf", "blk.0.ffn_up.weight")
    before = live_handles()
    with pytest.raises(ContextCreationError, match="could not load"):
        load_pair(files.target, bad, n_ctx=256, draft_capacity=3)  # the target model and context exist by then
    assert live_handles() == before


def test_missing_symbols_are_named(tmp_path: Path) -> None:
    ggml = Path(llama_cpp.__file__).parent / "lib" / "libggml-base.so"
    foreign = ctypes.CDLL(str(ggml))
    missing = missing_symbols(foreign)
    assert {"llama_set_embeddings_layer_inp", "llama_model_target_layer_ids"} <= set(missing)
    with pytest.raises(MissingSymbolsError) as err:
        DFlashApi(foreign)
    text = str(err.value)
    assert "llama_get_embeddings_layer_inp" in text and llama_cpp.__version__ in text
    assert "libllama" in text and "pip install" in text
    assert missing_symbols() == []  # the installed build has them all


@pytest.mark.parametrize("target", ["dense", "hybrid"])
def test_tapped_features_have_the_expected_shape(target: str) -> None:
    files = pair_files(target, "dflash2")
    header = read_gguf(files.draft)
    with LinkedPair(files.target, header, n_ctx=256, draft_capacity=7, draft_file=methods.draft_file(header)) as pair:
        assert pair.spec is not None
        tokens = list(range(10, 23))
        batch = TokenBatch(len(tokens))
        batch.fill(tokens, 0, outputs="last")
        batch.decode(pair.target_ctx, "target")
        api = dflash_api()
        layers = []
        for lid in pair.spec.target_layer_ids:
            ptr = api.get_embeddings_layer_inp(pair.target_ctx, lid)
            assert ptr
            layers.append(np.ctypeslib.as_array(ptr, shape=(len(tokens), pair.n_embd)).copy())
        features = np.concatenate(layers, axis=1)
        assert features.shape == (len(tokens), len(pair.spec.target_layer_ids) * pair.n_embd)
        assert np.isfinite(features).all() and np.abs(features).sum() > 0
        batch.free()


@pytest.mark.parametrize("target", ["dense", "hybrid"])
def test_one_dflash2_block_gives_candidates_in_the_vocabulary(target: str) -> None:
    files = pair_files(target, "dflash2")
    with load_pair(files.target, files.draft, n_ctx=256, draft_capacity=7) as eng:
        assert eng.spec is not None
        prompt = eng.tokenize("hello world, the draft proposes tokens")
        eng.generate(prompt, max_tokens=1)  # prefill + first sample, features injected
        drafter = BlockDrafter(dflash_api(), eng.draft_ctx, eng.spec, eng.pair.n_embd_draft, eng.pair.n_vocab)
        pos0 = eng.info()["n_cached"]  # a speculative prefill injects every prompt chunk: nothing is pending
        before = ll.llama_memory_seq_pos_max(ll.llama_get_memory(eng.draft_ctx), 0)
        drafts = drafter.draft(eng.tokenize("a", add_special=False)[0], pos0, 7).tokens
        assert len(drafts) == 7 and all(0 <= t < eng.pair.n_vocab for t in drafts)
        # The block's cells are gone again: the draft cache ends where the target's does.
        assert ll.llama_memory_seq_pos_max(ll.llama_get_memory(eng.draft_ctx), 0) == before == pos0 - 1
        drafter.free()


def _gguf_reader_facts(path: Path) -> tuple[dict, dict, dict]:
    """What validation reads, decoded by gguf-py's full reader: the reference for the header reader."""
    reader = gguf.GGUFReader(path)
    keys = {}
    for name, field in reader.fields.items():
        if name.startswith("GGUF."):
            continue
        if field.types[0] == gguf.GGUFValueType.ARRAY:
            if field.types[1] == gguf.GGUFValueType.STRING or len(field.data) > 64:
                keys[name] = len(field.data)
            else:
                keys[name] = [int(v) if float(v).is_integer() else float(v) for v in field.contents()]
        else:
            keys[name] = field.contents()
    shapes = {t.name: tuple(int(d) for d in t.shape) for t in reader.tensors}
    return keys, shapes, {t.name: int(t.tensor_type) for t in reader.tensors}


@pytest.mark.parametrize(("target", "draft"), ALL_PAIRS, ids=PAIR_IDS)
def test_header_reader_agrees_with_gguf_py(target: str, draft: str) -> None:
    files = pair_files(target, draft)
    for path in (files.target, files.draft):
        info = read_gguf(path)
        assert (info.keys, info.tensor_shapes, info.tensor_types) == _gguf_reader_facts(path)


def test_the_type_size_table_is_gguf_py_s() -> None:
    known = {int(t): sizes for t, sizes in gguf.GGML_QUANT_SIZES.items()}
    shared = known.keys() & GGML_TYPE_SIZES.keys()
    assert {t: GGML_TYPE_SIZES[t] for t in shared} == {t: known[t] for t in shared} and len(shared) >= 30


def test_a_truncated_header_is_a_model_file_error(tmp_path: Path) -> None:
    source = pair_files("dense", "dflash2").draft.read_bytes()
    for cut in (6, 24, 1000, len(source) // 40):
        bad = tmp_path / f"cut-{cut}.gguf"
        bad.write_bytes(source[:cut])
        with pytest.raises(ModelFileError, match="not a readable GGUF file"):
            read_gguf(bad)


def test_a_load_reads_each_header_once(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The registry (which method claims the draft), the pair, the memory plan and the Space ask for the same
    headers during one load: each file is parsed once while it is unchanged, again once it changed."""
    from dflash_runtime.files import gguf_meta

    files = pair_files("dense", "dflash2")
    target, draft = tmp_path / "target.gguf", tmp_path / "draft.gguf"
    target.write_bytes(files.target.read_bytes())
    draft.write_bytes(files.draft.read_bytes())
    parsed: list[str] = []
    parse = gguf_meta._read_header
    monkeypatch.setattr(gguf_meta, "_read_header", lambda path: parsed.append(path.name) or parse(path))
    with load_pair(target, draft, n_ctx=256) as engine:
        assert engine.info()["draft_kind"] == "dflash2"
    read_gguf(target)
    assert sorted(parsed) == ["draft.gguf", "target.gguf"]
    draft.write_bytes(files.draft.read_bytes() + b"\0" * 32)  # changed: read again (and its check applies anew)
    read_gguf(draft)
    assert parsed.count("draft.gguf") == 2
