"""One GGUF writer per model kind: dense `qwen3` target, hybrid `qwen35` target (optionally with an MTP block),
DFlash 2 / v1 draft, DSpark draft, EAGLE-3 draft.

Keys and tensor shapes follow libllama's loaders (src/models/qwen3.cpp, qwen35.cpp, dflash.cpp, eagle3.cpp) and, for
the MTP block, the layout convert_hf_to_gguf.py writes for Qwen3.5 (conversion/qwen.py, _QwenMtpMixin), for the
EAGLE-3 draft the one it writes for an EAGLE-3 checkpoint (conversion/llama.py, is_eagle3), for the DSpark draft the
one it writes for a DSpark checkpoint (conversion/qwen.py, DSparkModel).
numpy shapes are (n_out, n_in), i.e. ggml {n_in, n_out}.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

from .heads import (
    ATTENTION_WRITE_GAIN,
    BLIND_LAYERS,
    MTP_QUIET_GAIN,
    QK_GAIN,
    SELECTOR_SCALE,
    TensorSource,
    build_head,
    dspark_confidence,
    dspark_markov,
    mtp_input_projection,
    phrase_selector,
    plain_ids,
    reserved_channels,
    words_selector,
)
from .specs import DraftSpec, HybridDims, PairSpec, TargetSpec
from .tokenizer import CHAT_TEMPLATE, ENDOFTEXT, IM_END, MASK, TinyVocab, build_vocab

SPEC_KEY = "dflash_runtime.tiny_spec"  # JSON of the PairSpec, so a file can be regenerated with variations


class TensorSink:
    """A GGUF file being written. Weight matrices may be stored in f16; norms, biases, conv and selector tensors
    stay f32."""

    def __init__(self, path: Path, arch: str, weight_type: str) -> None:
        self.writer = gguf.GGUFWriter(path, arch)
        self.arch = arch
        self.half = weight_type == "f16"
        self.writer.add_uint32("general.file_type", int(gguf.LlamaFileType.MOSTLY_F16 if self.half else 0))

    def matrix(self, name: str, array: np.ndarray) -> None:
        self.writer.add_tensor(name, array.astype(np.float16) if self.half else array)

    def exact(self, name: str, array: np.ndarray) -> None:
        self.writer.add_tensor(name, np.ascontiguousarray(array, dtype=np.float32))

    def arch_u32(self, key: str, value: int) -> None:
        self.writer.add_uint32(f"{self.arch}.{key}", int(value))

    def finish(self) -> None:
        self.writer.write_header_to_file()
        self.writer.write_kv_data_to_file()
        self.writer.write_tensors_to_file()
        self.writer.close()


def add_tokenizer(sink: TensorSink, vocab: TinyVocab, *, eos_token: str, with_mask: bool, bos_template: bool) -> None:
    """`bos_template`: the vocabulary adds BOS and the chat template writes `bos_token` (as Llama-style models do)."""
    w = sink.writer
    w.add_string("tokenizer.ggml.model", "gpt2")
    w.add_string("tokenizer.ggml.pre", "qwen2")
    w.add_array("tokenizer.ggml.tokens", list(vocab.tokens))
    w.add_array("tokenizer.ggml.token_type", list(vocab.token_types))
    w.add_array("tokenizer.ggml.merges", list(vocab.merges))
    w.add_uint32("tokenizer.ggml.bos_token_id", vocab.id_of(ENDOFTEXT))
    w.add_uint32("tokenizer.ggml.eos_token_id", vocab.id_of(eos_token))
    w.add_uint32("tokenizer.ggml.padding_token_id", vocab.id_of(ENDOFTEXT))
    w.add_bool("tokenizer.ggml.add_bos_token", bos_template)
    if with_mask:
        w.add_uint32("tokenizer.ggml.mask_token_id", vocab.id_of(MASK))
    w.add_string("tokenizer.chat_template", ("{{- bos_token -}}" if bos_template else "") + CHAT_TEMPLATE)


# What the layer writers read (n_ctx, n_embd, n_layer, n_ff, n_head, n_head_kv, head_dim): a target or a draft.
LayerDims = TargetSpec | DraftSpec


def unit_gains(n: int) -> np.ndarray:
    """RMS-norm gains of one: norms that leave the residual stream's shape (and its control channels) alone."""
    return np.ones(n, np.float32)


def add_llm_keys(sink: TensorSink, dims: LayerDims, rope_base: float) -> None:
    sink.writer.add_string("general.name", f"tiny-{sink.arch}")
    sink.arch_u32("context_length", dims.n_ctx)
    sink.arch_u32("embedding_length", dims.n_embd)
    sink.arch_u32("block_count", dims.block_count)
    sink.arch_u32("feed_forward_length", dims.n_ff)
    sink.arch_u32("attention.head_count", dims.n_head)
    sink.arch_u32("attention.head_count_kv", dims.n_head_kv)
    sink.arch_u32("attention.key_length", dims.head_dim)
    sink.arch_u32("attention.value_length", dims.head_dim)
    sink.writer.add_float32(f"{sink.arch}.attention.layer_norm_rms_epsilon", 1e-6)
    sink.writer.add_float32(f"{sink.arch}.rope.freq_base", rope_base)


def _add_attention(
    sink: TensorSink, src: TensorSource, prefix: str, dims: LayerDims, *, gated: bool, write_gain: float = 1.0,
    qk_gain: float = 1.0, blind: tuple[int, ...] = (),
) -> None:
    """Attention with QK-norm; a gated query projection (qwen35) also carries the output gate. `write_gain` scales
    what the layer writes into the residual stream; `qk_gain` the QK-norm gains (sharper attention above 1); the
    projections read nothing from the `blind` channels."""
    q_rows = dims.n_head * dims.head_dim
    kv_rows = dims.n_head_kv * dims.head_dim
    sink.matrix(prefix + "attn_q.weight", _blind(src.matrix(2 * q_rows if gated else q_rows, dims.n_embd), blind))
    sink.matrix(prefix + "attn_k.weight", _blind(src.matrix(kv_rows, dims.n_embd), blind))
    sink.matrix(prefix + "attn_v.weight", _blind(src.matrix(kv_rows, dims.n_embd), blind))
    sink.matrix(prefix + "attn_output.weight", write_gain * src.residual_write(dims.n_embd, q_rows, dims.n_layer))
    sink.exact(prefix + "attn_q_norm.weight", qk_gain * unit_gains(dims.head_dim))
    sink.exact(prefix + "attn_k_norm.weight", qk_gain * unit_gains(dims.head_dim))


def _blind(weight: np.ndarray, channels: tuple[int, ...]) -> np.ndarray:
    weight[:, list(channels)] = 0.0
    return weight


def _add_ffn(sink: TensorSink, src: TensorSource, prefix: str, dims: LayerDims, *, write_gain: float = 1.0,
             blind: tuple[int, ...] = ()) -> None:
    sink.matrix(prefix + "ffn_gate.weight", _blind(src.matrix(dims.n_ff, dims.n_embd), blind))
    sink.matrix(prefix + "ffn_up.weight", _blind(src.matrix(dims.n_ff, dims.n_embd), blind))
    sink.matrix(prefix + "ffn_down.weight", write_gain * src.residual_write(dims.n_embd, dims.n_ff, dims.n_layer))


def _target_sink(path: Path, spec: PairSpec, rope_base: float) -> TensorSink:
    """Keys, spec record, tokenizer, embedding and head: everything a target has besides its layers."""
    t = spec.target
    sink = TensorSink(path, t.arch, t.weight_type)
    add_llm_keys(sink, t, rope_base)
    sink.writer.add_string(SPEC_KEY, spec.target_json())
    vocab = build_vocab()
    add_tokenizer(sink, vocab, eos_token=IM_END, with_mask=False, bos_template=t.bos_template)
    plan = build_head(t.head, vocab, t.n_embd, TensorSource(t.seed, f"head-{t.kind}"))
    sink.matrix("token_embd.weight", plan.token_embd)
    sink.exact("output_norm.weight", unit_gains(t.n_embd))
    sink.matrix("output.weight", plan.output)
    return sink


def write_dense_target(path: Path, spec: PairSpec) -> None:
    t = spec.target
    sink = _target_sink(path, spec, rope_base=1e6)
    src = TensorSource(t.seed, "target-dense", reserved_channels(t.head))
    blind = src.reserved if t.head in BLIND_LAYERS else ()
    for il in range(t.n_layer):
        prefix = f"blk.{il}."
        sink.exact(prefix + "attn_norm.weight", unit_gains(t.n_embd))
        _add_attention(sink, src, prefix, t, gated=False, qk_gain=QK_GAIN.get(t.head, 1.0),
                       write_gain=ATTENTION_WRITE_GAIN.get(t.head, 1.0), blind=blind)
        sink.exact(prefix + "ffn_norm.weight", unit_gains(t.n_embd))
        _add_ffn(sink, src, prefix, t, blind=blind)
    sink.finish()


def _add_hybrid_keys(sink: TensorSink, h: HybridDims) -> None:
    half = h.n_rot // 2  # IMROPE sections sum to n_rot / 2 (Qwen3.5: [11, 11, 10, 0] for 64 rotary dims)
    sink.writer.add_array(f"{sink.arch}.rope.dimension_sections", [half - 2 * (half // 3), half // 3, half // 3, 0])
    sink.arch_u32("rope.dimension_count", h.n_rot)
    sink.arch_u32("ssm.conv_kernel", h.ssm_conv_kernel)
    sink.arch_u32("ssm.inner_size", h.ssm_state_size * h.ssm_time_step_rank)
    sink.arch_u32("ssm.state_size", h.ssm_state_size)
    sink.arch_u32("ssm.time_step_rank", h.ssm_time_step_rank)
    sink.arch_u32("ssm.group_count", h.ssm_group_count)
    sink.arch_u32("full_attention_interval", h.full_attention_interval)


def _add_mtp_block(sink: TensorSink, spec: PairSpec, il: int) -> None:
    """A Qwen3.5 MTP (nextn) block at index `il`, after the trunk: a gated-attention decoder block fed by
    eh_proj(concat(enorm(token embedding), hnorm(target hidden))), ending in shared_head_norm; it shares the
    target's token embedding and output head (no nextn.embed_tokens / shared_head_head, as the converter writes
    Qwen3.5). Its own tensor stream, so the trunk's weights are those of the same target without the block."""
    t = spec.target
    src = TensorSource(t.seed, f"target-hybrid-mtp{il - t.n_layer}", reserved_channels(t.head))
    write_gain = 1.0 if t.head == "random" else MTP_QUIET_GAIN
    prefix = f"blk.{il}."
    sink.matrix(prefix + "nextn.eh_proj.weight", mtp_input_projection(t.head, t.n_embd, src))
    sink.exact(prefix + "nextn.enorm.weight", unit_gains(t.n_embd))
    sink.exact(prefix + "nextn.hnorm.weight", unit_gains(t.n_embd))
    sink.exact(prefix + "attn_norm.weight", unit_gains(t.n_embd))
    sink.exact(prefix + "post_attention_norm.weight", unit_gains(t.n_embd))
    _add_attention(sink, src, prefix, t, gated=True, write_gain=write_gain)
    _add_ffn(sink, src, prefix, t, write_gain=write_gain)
    sink.exact(prefix + "nextn.shared_head_norm.weight", unit_gains(t.n_embd))


def _add_delta_net(sink: TensorSink, src: TensorSource, prefix: str, t: TargetSpec, h: HybridDims) -> None:
    """A Gated DeltaNet layer: fused QKV, output gate, short conv, decay/step parameters, gated norm."""
    value_dim = h.ssm_state_size * h.ssm_time_step_rank
    conv_dim = 2 * h.ssm_state_size * h.ssm_group_count + value_dim
    n_v_heads = h.ssm_time_step_rank
    sink.matrix(prefix + "attn_qkv.weight", src.matrix(conv_dim, t.n_embd))
    sink.matrix(prefix + "attn_gate.weight", src.matrix(value_dim, t.n_embd))
    sink.exact(prefix + "ssm_conv1d.weight", src.normal(conv_dim, h.ssm_conv_kernel, std=0.5))
    sink.exact(prefix + "ssm_dt.bias", src.normal(n_v_heads, std=0.5))
    sink.exact(prefix + "ssm_a", -np.exp(src.normal(n_v_heads, std=0.5)))  # -exp(A_log): decays in (0, 1)
    sink.matrix(prefix + "ssm_beta.weight", src.matrix(n_v_heads, t.n_embd))
    sink.matrix(prefix + "ssm_alpha.weight", src.matrix(n_v_heads, t.n_embd))
    sink.exact(prefix + "ssm_norm.weight", unit_gains(h.ssm_state_size))
    sink.matrix(prefix + "ssm_out.weight", src.residual_write(t.n_embd, value_dim, t.n_layer))


def write_hybrid_target(path: Path, spec: PairSpec) -> None:
    """Trunk layers with (il + 1) % full_attention_interval != 0 are Gated DeltaNet, the others gated attention;
    mtp_layers MTP blocks follow the trunk (block_count = n_layer + mtp_layers, nextn_predict_layers = mtp_layers)."""
    t = spec.target
    if t.hybrid is None:
        raise ValueError("a hybrid target needs HybridDims")
    sink = _target_sink(path, spec, rope_base=1e7)
    _add_hybrid_keys(sink, t.hybrid)
    if t.mtp_layers:
        sink.arch_u32("nextn_predict_layers", t.mtp_layers)
    src = TensorSource(t.seed, "target-hybrid", reserved_channels(t.head))
    for il in range(t.n_layer):
        prefix = f"blk.{il}."
        sink.exact(prefix + "attn_norm.weight", unit_gains(t.n_embd))
        sink.exact(prefix + "post_attention_norm.weight", unit_gains(t.n_embd))
        if (il + 1) % t.hybrid.full_attention_interval != 0:
            _add_delta_net(sink, src, prefix, t, t.hybrid)
        else:
            _add_attention(sink, src, prefix, t, gated=True)
        _add_ffn(sink, src, prefix, t)
    for il in range(t.n_layer, t.block_count):
        _add_mtp_block(sink, spec, il)
    sink.finish()


def _add_draft_keys(sink: TensorSink, d: DraftSpec) -> None:
    sink.writer.add_array(f"{sink.arch}.target_layers", list(d.target_layers))  # INT32 array
    sink.arch_u32("block_size", d.block_size)
    sink.writer.add_bool(f"{sink.arch}.attention.causal", False)
    if d.mrope:  # degenerate sections: the draft follows only the temporal position of an M-RoPE target
        sink.writer.add_array(f"{sink.arch}.rope.dimension_sections", [d.head_dim // 2, 0, 0, 0])
    if d.is_dflash2:
        sink.arch_u32("conv_kernel_size", d.conv_kernel_size)
        sink.arch_u32("conv_group_size", d.conv_group_size)
        sink.arch_u32("selector_rank", d.selector_rank)
        sink.arch_u32("selector_top_k", d.selector_top_k)
    if d.is_dspark:  # the converter writes both, always
        sink.writer.add_bool(f"{sink.arch}.sample_from_anchor", d.sample_from_anchor)
        sink.writer.add_bool(f"{sink.arch}.has_confidence_head", d.confidence_head)


def _add_dynamic_conv(sink: TensorSink, src: TensorSource, name: str, d: DraftSpec) -> None:
    """DFlash 2 two-sided dynamic depthwise conv: base {n_embd, kernel, 2} (tap 0 ≈ identity) and projection."""
    base = np.zeros((2, d.conv_kernel_size, d.n_embd), np.float32)
    base[:, 0, :] = 1.0
    base[:, 1:, :] = src.normal(2, d.conv_kernel_size - 1, d.n_embd, std=0.1)
    sink.exact(f"{name}_conv_base", base)
    n_projected = 2 * d.conv_kernel_size * (d.n_embd // d.conv_group_size)
    sink.exact(f"{name}_conv_proj.weight", src.normal(n_projected, d.n_embd, std=0.02))


def _add_selector(sink: TensorSink, src: TensorSource, d: DraftSpec, vocab: TinyVocab, head: str) -> None:
    if head == "phrase":
        predecessor, successor, hidden = phrase_selector(vocab, d.n_embd, d.selector_rank, src)
    elif head == "words":
        predecessor, successor, hidden = words_selector(vocab, d.n_embd, d.selector_rank, src)
    else:
        scale = SELECTOR_SCALE[head]
        predecessor = src.normal(vocab.n_vocab, d.selector_rank, std=scale)
        successor = src.normal(vocab.n_vocab, d.selector_rank, std=scale)
        hidden = src.normal(d.selector_rank, d.n_embd, std=scale)
    sink.exact("selector_predecessor.weight", predecessor)
    sink.exact("selector_successor.weight", successor)
    sink.exact("selector_hidden.weight", hidden)


def write_draft(path: Path, spec: PairSpec) -> None:
    """A DFlash draft without token_embd/output: libllama borrows the target's through ctx_other. An EAGLE-3 draft
    as `write_eagle3_draft` writes it."""
    d = spec.draft
    if d is None:
        raise ValueError("a target-only spec has no draft to write")
    if d.is_eagle3:
        write_eagle3_draft(path, spec)
        return
    vocab = build_vocab(d.extra_tokens)
    sink = TensorSink(path, "dflash", d.weight_type)
    add_llm_keys(sink, d, rope_base=1e6)
    _add_draft_keys(sink, d)
    sink.writer.add_string(SPEC_KEY, spec.to_json())
    add_tokenizer(sink, vocab, eos_token=d.eos_token, with_mask=d.with_mask, bos_template=spec.target.bos_template)
    # A DSpark draft is the DFlash v1 draft of the same spec (the same bytes) with its heads added.
    backbone = "dflash1" if d.is_dspark else d.kind
    src = TensorSource(d.seed, f"draft-{spec.target.kind}-{backbone}", reserved_channels(spec.target.head))
    sink.matrix("fc.weight", src.matrix(d.n_embd, len(d.target_layers) * d.n_embd))
    sink.exact("enc.output_norm.weight", unit_gains(d.n_embd))
    sink.exact("output_norm.weight", unit_gains(d.n_embd))
    for il in range(d.n_layer):
        prefix = f"blk.{il}."
        sink.exact(prefix + "attn_norm.weight", unit_gains(d.n_embd))
        _add_attention(sink, src, prefix, d, gated=False)
        sink.exact(prefix + "ffn_norm.weight", unit_gains(d.n_embd))
        _add_ffn(sink, src, prefix, d)
        if d.is_dflash2:
            _add_dynamic_conv(sink, src, prefix + "attn", d)
            _add_dynamic_conv(sink, src, prefix + "ffn", d)
    if d.is_dflash2:
        _add_selector(sink, src, d, vocab, spec.target.head)
    if d.is_dspark:
        _add_dspark_heads(sink, spec, vocab)
    sink.finish()


def _add_dspark_heads(sink: TensorSink, spec: PairSpec, vocab: TinyVocab) -> None:
    """DSpark's Markov head (`markov_w1` {rank, n_vocab}: the token before a row; `markov_w2` {rank, n_vocab}: its bias
    over the vocabulary) and, as a variant, its confidence head (`conf_proj` {n_embd + rank, 1} with a bias): the
    converter's names for `markov_head.markov_w1/2` and `confidence_head.proj`. Each head from a stream of its own,
    so the drafts with and without a confidence head share every other byte."""
    d, head = spec.draft, spec.target.head
    assert d is not None
    w1, w2 = dspark_markov(head, vocab, d.markov_rank, TensorSource(d.seed, f"dspark-markov-{spec.target.kind}"))
    sink.exact("markov_w1.weight", w1)
    sink.exact("markov_w2.weight", w2)
    if d.confidence_head:
        weight, bias = dspark_confidence(head, vocab, d.n_embd, d.markov_rank,
                                         TensorSource(d.seed, f"dspark-confidence-{spec.target.kind}"))
        sink.exact("conf_proj.weight", weight)
        sink.exact("conf_proj.bias", bias)


def write_eagle3_draft(path: Path, spec: PairSpec) -> None:
    """An EAGLE-3 draft as the converter writes one for a Llama-3.1-style checkpoint: arch `eagle3`, the target's
    tokenizer, `target_layers` / `target_hidden_size` / `norm_before_residual` / `norm_before_fc`, the fusion `fc`
    over three taps, one decoder layer whose attention reads concat(attn_norm(token embedding), hidden_norm(g))
    (`attn_norm_2`), its own head over a draft vocabulary and `d2t` (absolute target ids, I64); no token_embd, which
    libllama borrows from the target through ctx_other.

    The draft vocabulary is the target's plain-text tokens, their head rows the target's. `fc` copies the first tap's
    control channels (heads.py) into g, and nothing the layer writes touches them, so the draft predicts what the
    target's head says after the tapped position's token: on `const` and `regime` (once in it) the target's next
    tokens, on `random` chance, on `shaped` the token the target just said (never accepted)."""
    d = spec.draft
    t = spec.target
    if d is None or not d.is_eagle3:
        raise ValueError("write_eagle3_draft needs an eagle3 draft spec")
    vocab = build_vocab(d.extra_tokens)
    sink = TensorSink(path, "eagle3", d.weight_type)
    add_llm_keys(sink, d, rope_base=1e6)
    sink.arch_u32("vocab_size", vocab.n_vocab)
    sink.arch_u32("rope.dimension_count", d.head_dim)
    sink.writer.add_array(f"{sink.arch}.target_layers", list(d.target_layers))  # INT32 array
    sink.arch_u32("target_hidden_size", t.n_embd)
    sink.writer.add_bool(f"{sink.arch}.norm_before_residual", False)
    sink.writer.add_bool(f"{sink.arch}.norm_before_fc", False)
    sink.writer.add_string(SPEC_KEY, spec.to_json())
    add_tokenizer(sink, vocab, eos_token=d.eos_token, with_mask=False, bos_template=t.bos_template)
    reserved = reserved_channels(t.head)
    src = TensorSource(d.seed, f"draft-{t.kind}-eagle3", reserved)
    n_in = len(d.target_layers) * t.n_embd
    fc = src.matrix(d.n_embd, n_in)
    fc[list(reserved), :] = 0.0
    fc[list(reserved), list(reserved)] = 1.0  # the first tap's control channels, as they are
    sink.matrix("fc.weight", fc)
    prefix = "blk.0."
    sink.exact(prefix + "attn_norm.weight", unit_gains(d.n_embd))
    sink.exact(prefix + "attn_norm_2.weight", unit_gains(d.n_embd))  # the checkpoint's hidden_norm
    q_rows, kv_rows = d.n_head * d.head_dim, d.n_head_kv * d.head_dim
    sink.matrix(prefix + "attn_q.weight", src.matrix(q_rows, 2 * d.n_embd))
    sink.matrix(prefix + "attn_k.weight", src.matrix(kv_rows, 2 * d.n_embd))
    sink.matrix(prefix + "attn_v.weight", src.matrix(kv_rows, 2 * d.n_embd))
    sink.matrix(prefix + "attn_output.weight", src.residual_write(d.n_embd, q_rows, 1))
    sink.exact(prefix + "ffn_norm.weight", unit_gains(d.n_embd))
    _add_ffn(sink, src, prefix, d)
    sink.exact("output_norm.weight", unit_gains(d.n_embd))
    head = build_head(t.head, build_vocab(), t.n_embd, TensorSource(t.seed, f"head-{t.kind}"))
    d2t = plain_ids(vocab).astype(np.int64)
    sink.matrix("output.weight", head.output[d2t])
    sink.writer.add_tensor("d2t", d2t, raw_dtype=gguf.GGMLQuantizationType.I64)
    sink.finish()


TARGET_WRITERS = {"dense": write_dense_target, "hybrid": write_hybrid_target}
