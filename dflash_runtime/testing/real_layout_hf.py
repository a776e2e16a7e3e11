"""Tiny Hugging Face checkpoints laid out like the real pair, for llama.cpp's own converter (see real_layout.py).

Runs in the converter's venv (torch, transformers, the vendored gguf-py), not the project's: it imports nothing
from dflash_runtime. Two steps, each a sub-command:

    python real_layout_hf.py --llama-cpp DIR --out DIR [--seed S] write
        target/ : Qwen3_5ForConditionalGeneration (text_config; Gated DeltaNet ×3 + gated attention groups,
                  M-RoPE, one MTP layer `mtp.*`), a ModelOpt mixed-precision checkpoint: NVFP4 MLPs, FP8
                  attention and DeltaNet projections, BF16 embeddings / head / MTP; the Qwen3.5 vocabulary layout
                  (248,044 byte-level BPE tokens, 33 added tokens at their real ids, padding to 248,320 rows),
                  the real chat template, and generation_config.json with Qwen's recommended sampling.
        draft/  : DFlash2DraftModel (block 8, non-causal, sliding window, mask token 248070, dynamic convs and a
                  candidate selector), BF16, no embeddings or head of its own.
    python real_layout_hf.py --llama-cpp DIR convert -- <convert_hf_to_gguf.py arguments>
        the vendored converter, its pre-tokenizer check answered with "qwen35" (a generated vocabulary cannot
        match the real tokenizer's hash).
"""

from __future__ import annotations

import argparse
import json
import random
import runpy
import sys
from pathlib import Path

# The Qwen3.5 layout: a 248,044-token byte-level BPE, 33 added tokens from 248044, rows padded to 248,320.
N_BPE = 248_044
N_VOCAB = 248_320
N_QWEN2_BPE = 151_643  # real Qwen2/3 BPE strings and merges, read from the sdist's ggml-vocab-qwen35.gguf
ADDED_TOKENS = [  # (text, special) from id 248044 on, as the real tokenizer_config.json lists them
    ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True), ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True), ("<|box_start|>", True), ("<|box_end|>", True), ("<|quad_start|>", True),
    ("<|quad_end|>", True), ("<|vision_start|>", True), ("<|vision_end|>", True), ("<|vision_pad|>", True),
    ("<|image_pad|>", True), ("<|video_pad|>", True), ("<tool_call>", False), ("</tool_call>", False),
    ("<|fim_prefix|>", False), ("<|fim_middle|>", False), ("<|fim_suffix|>", False), ("<|fim_pad|>", False),
    ("<|repo_name|>", False), ("<|file_sep|>", False), ("<tool_response>", False), ("</tool_response>", False),
    ("<think>", False), ("</think>", False), ("<|audio_start|>", True), ("<|audio_end|>", True),
    ("<tts_pad>", True), ("<tts_text_bos>", True), ("<tts_text_eod>", True), ("<tts_text_bos_single>", True),
    ("<|audio_pad|>", True),
]
BOS_ID, IM_START_ID, EOS_ID, MASK_ID = N_BPE, N_BPE + 1, N_BPE + 2, N_BPE + 26
PRETOKENIZER_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|"
    r"\s*[\r\n]+|\s+(?!\S)|\s+"
)
SAMPLING = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.0}  # Qwen's recommended (thinking mode)

# Scaled sizes. Widths divide by 256 so that the draft's K-quants apply to every matrix, as in the real file (the
# selector's rank stays the real 256 for the same reason).
WIDTH = 256
TARGET = {
    "n_layer": 8, "n_ff": 512, "n_head": 4, "n_head_kv": 1, "head_dim": 256, "lin_k_heads": 2, "lin_v_heads": 6,
    "lin_head_dim": 128, "conv_kernel": 4,
}
DRAFT = {
    "n_layer": 5, "n_ff": 512, "n_head": 4, "n_head_kv": 1, "head_dim": 128, "block_size": 8, "conv_kernel": 2,
    "conv_group": 16, "selector_rank": 256, "sliding_window": 2048,
    # libllama needs width ≥ top_k × (top_k + 1) for the selector lattice: 15 is the largest for 256 (real: 16)
    "selector_top_k": 15,
    "target_layer_ids": [0, 2, 3, 5, 6],  # HF ids; the GGUF stores them + 1
}


def build_vocab(llama_cpp: Path, seed: int) -> tuple[list[str], list[str]]:
    """248,044 byte-level BPE strings and their merges: the real Qwen2/3 ones, then generated word merges."""
    sys.path.insert(0, str(llama_cpp / "gguf-py"))
    from gguf import GGUFReader

    reader = GGUFReader(llama_cpp / "models" / "ggml-vocab-qwen35.gguf")
    fields = reader.fields
    tokens = [bytes(fields["tokenizer.ggml.tokens"].parts[i]).decode() for i in fields["tokenizer.ggml.tokens"].data]
    merges = [bytes(fields["tokenizer.ggml.merges"].parts[i]).decode() for i in fields["tokenizer.ggml.merges"].data]
    tokens = tokens[:N_QWEN2_BPE]
    known = set(tokens)
    words = [t for t in tokens if t.startswith("Ġ") and t[1:].isascii() and t[1:].isalpha()]
    tails = [t for t in tokens if t.isascii() and t.isalpha() and t.islower() and len(t) >= 2]
    rng = random.Random(seed)
    while len(tokens) < N_BPE:
        left, right = rng.choice(words), rng.choice(tails)
        joined = left + right
        if joined not in known and len(joined) <= 24:
            known.add(joined)
            tokens.append(joined)
            merges.append(f"{left} {right}")
    return tokens, merges


def write_tokenizer(out: Path, llama_cpp: Path, seed: int) -> None:
    tokens, merges = build_vocab(llama_cpp, seed)
    added = [
        {"id": N_BPE + i, "content": text, "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": False, "special": special}
        for i, (text, special) in enumerate(ADDED_TOKENS)
    ]
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    tokenizer = {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": PRETOKENIZER_REGEX}, "behavior": "Isolated", "invert": False},
            byte_level,
        ]},
        "post_processor": byte_level, "decoder": byte_level,
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": "",
                  "end_of_word_suffix": "", "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": {t: i for i, t in enumerate(tokens)}, "merges": merges},
    }
    (out / "tokenizer.json").write_text(json.dumps(tokenizer, ensure_ascii=False))
    template = (llama_cpp / "models" / "templates" / "Qwen3.5-4B.jinja").read_text()
    config = {
        "add_bos_token": False, "add_prefix_space": False, "errors": "replace", "split_special_tokens": False,
        "bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "unk_token": None,
        "model_max_length": 262144, "tokenizer_class": "Qwen2Tokenizer", "chat_template": template,
        "added_tokens_decoder": {str(a["id"]): {k: v for k, v in a.items() if k != "id"} for a in added},
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False, indent=1))


class Weights:
    """Seeded random tensors collected for one safetensors file."""

    def __init__(self, seed: int) -> None:
        import torch

        self.torch = torch
        self.gen = torch.Generator().manual_seed(seed)
        self.tensors: dict[str, object] = {}

    def normal(self, *shape: int, std: float = 0.02):
        return self.torch.randn(*shape, generator=self.gen) * std

    def bf16(self, name: str, *shape: int, std: float = 0.02) -> None:
        self.tensors[name] = self.normal(*shape, std=std).to(self.torch.bfloat16)

    def f32(self, name: str, value) -> None:
        self.tensors[name] = value.to(self.torch.float32).contiguous()

    def fp8(self, name: str, rows: int, cols: int) -> None:
        """ModelOpt FP8: e4m3 weights and one float32 scale per tensor."""
        torch = self.torch
        self.tensors[name + ".weight"] = self.normal(rows, cols, std=1.0).clamp(-8, 8).to(torch.float8_e4m3fn)
        self.tensors[name + ".weight_scale"] = torch.tensor(0.02, dtype=torch.float32)
        self.tensors[name + ".input_scale"] = torch.tensor(0.05, dtype=torch.float32)

    def nvfp4(self, name: str, rows: int, cols: int) -> None:
        """ModelOpt NVFP4: packed e2m1 nibbles, an e4m3 scale per 16 values, a float32 scale per tensor."""
        torch = self.torch
        self.tensors[name + ".weight"] = torch.randint(0, 256, (rows, cols // 2), generator=self.gen,
                                                       dtype=torch.int32).to(torch.uint8)
        scales = torch.rand(rows, cols // 16, generator=self.gen) * 1.5 + 0.5
        self.tensors[name + ".weight_scale"] = scales.to(torch.float8_e4m3fn)
        self.tensors[name + ".weight_scale_2"] = torch.tensor(0.006, dtype=torch.float32)
        self.tensors[name + ".input_scale"] = torch.tensor(0.05, dtype=torch.float32)

    def save(self, path: Path) -> None:
        from safetensors.torch import save_file

        save_file(self.tensors, str(path), metadata={"format": "pt"})


def _target_layer(w: Weights, p: str, full: bool, quantized: dict[str, dict]) -> None:
    t, d = TARGET, WIDTH
    w.bf16(p + "input_layernorm.weight", d, std=0.0)  # Qwen3.5 norms are zero-centred: the converter adds 1
    w.bf16(p + "post_attention_layernorm.weight", d, std=0.0)
    if full:
        q_rows, kv_rows = t["n_head"] * t["head_dim"], t["n_head_kv"] * t["head_dim"]
        for name, rows, cols in (("q_proj", 2 * q_rows, d), ("k_proj", kv_rows, d), ("v_proj", kv_rows, d),
                                 ("o_proj", d, q_rows)):
            w.fp8(p + "self_attn." + name, rows, cols)
            quantized[p + "self_attn." + name] = {"quant_algo": "FP8"}
        w.bf16(p + "self_attn.q_norm.weight", t["head_dim"], std=0.0)
        w.bf16(p + "self_attn.k_norm.weight", t["head_dim"], std=0.0)
    else:
        k_dim, v_dim = t["lin_k_heads"] * t["lin_head_dim"], t["lin_v_heads"] * t["lin_head_dim"]
        conv_dim = 2 * k_dim + v_dim
        for name, rows, cols in (("in_proj_qkv", conv_dim, d), ("in_proj_z", v_dim, d), ("out_proj", d, v_dim)):
            w.fp8(p + "linear_attn." + name, rows, cols)
            quantized[p + "linear_attn." + name] = {"quant_algo": "FP8"}
        w.bf16(p + "linear_attn.in_proj_a.weight", t["lin_v_heads"], d)
        w.bf16(p + "linear_attn.in_proj_b.weight", t["lin_v_heads"], d)
        w.bf16(p + "linear_attn.conv1d.weight", conv_dim, 1, t["conv_kernel"], std=0.5)
        w.f32(p + "linear_attn.dt_bias", w.normal(t["lin_v_heads"], std=0.5))
        w.f32(p + "linear_attn.A_log", w.normal(t["lin_v_heads"], std=0.5))
        w.f32(p + "linear_attn.norm.weight", w.torch.ones(t["lin_head_dim"]))
    for name, rows, cols in (("gate_proj", t["n_ff"], d), ("up_proj", t["n_ff"], d), ("down_proj", d, t["n_ff"])):
        w.nvfp4(p + "mlp." + name, rows, cols)
        quantized[p + "mlp." + name] = {"quant_algo": "NVFP4", "group_size": 16}


def _mtp_layer(w: Weights) -> None:
    """One MTP block in BF16: the fused projection, its norms and a full (gated) attention layer."""
    t, d = TARGET, WIDTH
    w.bf16("mtp.fc.weight", d, 2 * d)
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        w.bf16(f"mtp.{norm}.weight", d, std=0.0)
    p = "mtp.layers.0."
    w.bf16(p + "input_layernorm.weight", d, std=0.0)
    w.bf16(p + "post_attention_layernorm.weight", d, std=0.0)
    q_rows, kv_rows = t["n_head"] * t["head_dim"], t["n_head_kv"] * t["head_dim"]
    w.bf16(p + "self_attn.q_proj.weight", 2 * q_rows, d)
    w.bf16(p + "self_attn.k_proj.weight", kv_rows, d)
    w.bf16(p + "self_attn.v_proj.weight", kv_rows, d)
    w.bf16(p + "self_attn.o_proj.weight", d, q_rows)
    w.bf16(p + "self_attn.q_norm.weight", t["head_dim"], std=0.0)
    w.bf16(p + "self_attn.k_norm.weight", t["head_dim"], std=0.0)
    w.bf16(p + "mlp.gate_proj.weight", t["n_ff"], d)
    w.bf16(p + "mlp.up_proj.weight", t["n_ff"], d)
    w.bf16(p + "mlp.down_proj.weight", d, t["n_ff"])


def write_target(out: Path, llama_cpp: Path, seed: int) -> None:
    out.mkdir(parents=True, exist_ok=True)
    t, d = TARGET, WIDTH
    w = Weights(seed)
    w.bf16("model.language_model.embed_tokens.weight", N_VOCAB, d)
    w.bf16("lm_head.weight", N_VOCAB, d)
    w.bf16("model.language_model.norm.weight", d, std=0.0)
    quantized: dict[str, dict] = {}
    layer_types = []
    for il in range(t["n_layer"]):
        full = (il + 1) % 4 == 0
        layer_types.append("full_attention" if full else "linear_attention")
        _target_layer(w, f"model.language_model.layers.{il}.", full, quantized)
    _mtp_layer(w)
    w.save(out / "model.safetensors")
    quant = {"quant_method": "modelopt", "quant_algo": "MIXED_PRECISION", "kv_cache_quant_algo": None,
             "quantized_layers": quantized}
    text_config = {
        "model_type": "qwen3_5_text", "hidden_size": d, "intermediate_size": t["n_ff"],
        "num_hidden_layers": t["n_layer"], "num_attention_heads": t["n_head"],
        "num_key_value_heads": t["n_head_kv"], "head_dim": t["head_dim"], "layer_types": layer_types,
        "full_attention_interval": 4, "linear_num_key_heads": t["lin_k_heads"],
        "linear_num_value_heads": t["lin_v_heads"], "linear_key_head_dim": t["lin_head_dim"],
        "linear_value_head_dim": t["lin_head_dim"], "linear_conv_kernel_dim": t["conv_kernel"],
        "mtp_num_hidden_layers": 1, "max_position_embeddings": 262144, "rms_norm_eps": 1e-6,
        "vocab_size": N_VOCAB, "tie_word_embeddings": False, "attn_output_gate": True, "hidden_act": "silu",
        "bos_token_id": BOS_ID, "eos_token_id": EOS_ID,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10_000_000, "partial_rotary_factor": 0.25,
                            "mrope_section": [11, 11, 10], "mrope_interleaved": True},
    }
    config = {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
              "text_config": text_config, "tie_word_embeddings": False, "quantization_config": quant,
              "image_token_id": N_BPE + 12, "video_token_id": N_BPE + 13}
    (out / "config.json").write_text(json.dumps(config, indent=1))
    (out / "hf_quant_config.json").write_text(json.dumps(
        {"producer": {"name": "modelopt", "version": "0.37.0"}, "quantization": quant}, indent=1))
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": BOS_ID, "eos_token_id": [EOS_ID, BOS_ID], "pad_token_id": BOS_ID, "do_sample": True,
         **SAMPLING}, indent=1))
    write_tokenizer(out, llama_cpp, seed)


def write_draft(out: Path, seed: int) -> None:
    out.mkdir(parents=True, exist_ok=True)
    r, d = DRAFT, WIDTH
    w = Weights(seed + 1)
    w.bf16("fc.weight", d, len(r["target_layer_ids"]) * d)
    w.bf16("hidden_norm.weight", d, std=0.0)
    w.tensors["hidden_norm.weight"] += 1
    w.bf16("norm.weight", d, std=0.0)
    w.tensors["norm.weight"] += 1
    n_proj = 2 * r["conv_kernel"] * (d // r["conv_group"])
    for il in range(r["n_layer"]):
        p = f"layers.{il}."
        for norm in ("input_layernorm", "post_attention_layernorm"):
            w.f32(p + norm + ".weight", w.torch.ones(d))
        q_rows, kv_rows = r["n_head"] * r["head_dim"], r["n_head_kv"] * r["head_dim"]
        w.bf16(p + "self_attn.q_proj.weight", q_rows, d)
        w.bf16(p + "self_attn.k_proj.weight", kv_rows, d)
        w.bf16(p + "self_attn.v_proj.weight", kv_rows, d)
        w.bf16(p + "self_attn.o_proj.weight", d, q_rows)
        w.f32(p + "self_attn.q_norm.weight", w.torch.ones(r["head_dim"]))
        w.f32(p + "self_attn.k_norm.weight", w.torch.ones(r["head_dim"]))
        w.bf16(p + "mlp.gate_proj.weight", r["n_ff"], d)
        w.bf16(p + "mlp.up_proj.weight", r["n_ff"], d)
        w.bf16(p + "mlp.down_proj.weight", d, r["n_ff"])
        for conv in ("attention_conv", "mlp_conv"):
            base = w.normal(2, r["conv_kernel"], d, std=0.1)
            base[:, 0, :] = 1.0  # tap 0 ≈ identity
            w.f32(f"{p}{conv}.base_kernel", base)
            w.bf16(f"{p}{conv}.kernel_projection.weight", n_proj, d)
    w.bf16("candidate_selector.predecessor_codebook", N_VOCAB, r["selector_rank"], std=0.05)
    w.bf16("candidate_selector.successor_codebook", N_VOCAB, r["selector_rank"], std=0.05)
    w.bf16("candidate_selector.hidden_projection.weight", r["selector_rank"], d, std=0.05)
    w.save(out / "model.safetensors")
    config = {
        "architectures": ["DFlash2DraftModel"], "model_type": "qwen3", "hidden_size": d,
        "intermediate_size": r["n_ff"], "num_hidden_layers": r["n_layer"], "num_attention_heads": r["n_head"],
        "num_key_value_heads": r["n_head_kv"], "head_dim": r["head_dim"], "rms_norm_eps": 1e-6,
        "rope_theta": 10_000_000, "max_position_embeddings": 262144, "vocab_size": N_VOCAB,
        "tie_word_embeddings": False, "hidden_act": "silu", "attention_bias": False,
        "use_sliding_window": True, "sliding_window": r["sliding_window"],
        "layer_types": ["sliding_attention"] * r["n_layer"], "is_causal": False,
        "dflash_config": {
            "block_size": r["block_size"], "mask_token_id": MASK_ID, "target_layer_ids": r["target_layer_ids"],
            "conv_kernel_size": r["conv_kernel"], "conv_group_size": r["conv_group"],
            "selector_rank": r["selector_rank"], "selector_top_k": r["selector_top_k"],
        },
    }
    (out / "config.json").write_text(json.dumps(config, indent=1))


def convert(llama_cpp: Path, argv: list[str]) -> None:
    sys.path.insert(0, str(llama_cpp))
    sys.path.insert(1, str(llama_cpp / "gguf-py"))
    from conversion import base

    base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "qwen35"
    sys.argv = ["convert_hf_to_gguf.py", *argv]
    runpy.run_path(str(llama_cpp / "convert_hf_to_gguf.py"), run_name="__main__")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("step", choices=("write", "convert"))
    parser.add_argument("--llama-cpp", type=Path, required=True, help="the sdist's vendor/llama.cpp")
    parser.add_argument("--out", type=Path, help="write: the folder for target/ and draft/")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("rest", nargs=argparse.REMAINDER, help="convert: -- and the converter's arguments")
    args = parser.parse_args()
    if args.step == "write":
        write_target(args.out / "target", args.llama_cpp, args.seed)
        write_draft(args.out / "draft", args.seed)
    else:
        convert(args.llama_cpp, args.rest[1:] if args.rest[:1] == ["--"] else args.rest)


if __name__ == "__main__":
    main()
