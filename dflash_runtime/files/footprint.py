"""What each parallel sequence costs a pair, from the GGUF headers alone (no model is loaded).

The figures follow what libllama allocates per sequence (the vendored llama.cpp: llama-kv-cache.cpp,
llama-memory-recurrent.cpp, llama-hparams.cpp, models/qwen35.cpp):
- target KV: every attention layer of the trunk holds n_ctx cells (n_ctx padded to 256) × (K width + V width), f16
  by default; a qwen35 / qwen3next hybrid has attention every `full_attention_interval`-th layer only;
- recurrent state (hybrid): every Gated DeltaNet layer holds a conv row of (d_conv − 1) × (d_inner + 2 × n_group ×
  d_state) floats and a state of d_state × d_inner floats, f32;
- rollback snapshots: n_rs_seq (the draft capacity) more copies of that recurrent state, so that a rejected draft
  rolls back;
- context checkpoints: copies of the recurrent state in host memory, up to CheckpointPolicy's count and bytes;
- draft KV: the draft's own layers (a DFlash draft's, or a draft-simple model's attention layers), n_ctx cells each
  (the draft context is as long as the target's), and a hybrid draft model's recurrent state (its host copy where
  drafting began counts with the checkpoints);
- MTP KV: the MTP context's cache holds the nextn layer(s) only.
Compute buffers and weights are shared by all sequences and are not counted here.

    python -m dflash_runtime.files.footprint TARGET.gguf [DRAFT.gguf] [--n-ctx 8192,32768] [--draft-capacity 7]
        [--fit MOST [--n-gpu-layers N] [--rpc HOST:PORT,...]]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..native.backends import FreeMemory
from .gguf_meta import GGUFInfo, read_gguf

F16, F32 = 2, 4
CTX_PAD = 256  # libllama pads n_ctx (and each sequence's share) to a multiple of 256
HYBRID_ARCHS = ("qwen35", "qwen35moe", "qwen3next")
DEVICE_PARTS = ("target_kv", "recurrent_state", "rollback_snapshots", "draft_kv", "mtp_kv")
HOST_PARTS = ("checkpoints",)
DEFAULT_CHECKPOINT_COUNT, DEFAULT_CHECKPOINT_BYTES = 8, 4 << 30  # CheckpointPolicy's defaults


def padded_ctx(n_ctx: int) -> int:
    return -(-n_ctx // CTX_PAD) * CTX_PAD


def _per_layer(info: GGUFInfo, name: str, n_layer: int, default: int) -> list[int]:
    """A key that may be one value or one per layer (head_count_kv is an array in some converters' output)."""
    value = info.key(name, default)
    if isinstance(value, list):
        return [int(v) for v in value[:n_layer]] + [int(value[-1])] * max(0, n_layer - len(value))
    return [int(value)] * n_layer


def trunk_layers(info: GGUFInfo) -> int:
    """Layers of the trunk: block_count without the nextn (MTP) blocks after it."""
    return info.n_layer - int(info.key("nextn_predict_layers", 0) or 0)


def recurrent_layers(info: GGUFInfo) -> list[bool]:
    """Per trunk layer: is it recurrent (Gated DeltaNet)? As llama.cpp's qwen35 loader reads it."""
    n = trunk_layers(info)
    if info.arch not in HYBRID_ARCHS:
        return [False] * n
    listed = info.key("attention.recurrent_layers")
    if isinstance(listed, list):
        return [bool(v) for v in listed[:n]]
    interval = int(info.key("full_attention_interval", 4))
    return [(il + 1) % interval != 0 for il in range(n)]


def kv_row_bytes(info: GGUFInfo, layers: Sequence[int], *, bytes_k: int = F16, bytes_v: int = F16) -> int:
    """Bytes one KV cell costs over the given layers: K width × bytes_k + V width × bytes_v, summed."""
    n_all = info.n_layer
    n_head = _per_layer(info, "attention.head_count", n_all, 1)
    n_head_kv = _per_layer(info, "attention.head_count_kv", n_all, n_head[0])
    head_k = int(info.key("attention.key_length", info.n_embd // max(1, n_head[0])))
    head_v = int(info.key("attention.value_length", head_k))
    return sum(n_head_kv[il] * (head_k * bytes_k + head_v * bytes_v) for il in layers)


def recurrent_cell_bytes(info: GGUFInfo) -> int:
    """One sequence's recurrent state over all recurrent layers (conv rows + delta-net states, f32)."""
    n_recurrent = sum(recurrent_layers(info))
    if not n_recurrent:
        return 0
    d_conv = int(info.key("ssm.conv_kernel"))
    d_inner = int(info.key("ssm.inner_size"))
    d_state = int(info.key("ssm.state_size"))
    n_group = int(info.key("ssm.group_count"))
    conv = max(0, d_conv - 1) * (d_inner + 2 * n_group * d_state)
    return n_recurrent * (conv + d_state * d_inner) * F32


def sequence_footprint(
    target_info: GGUFInfo,
    draft_info: GGUFInfo | None = None,
    *,
    n_ctx: int,
    draft_capacity: int = 7,
    mtp: bool | None = None,
    n_rs_seq: int | None = None,
    checkpoint_count: int = DEFAULT_CHECKPOINT_COUNT,
    checkpoint_bytes: int = DEFAULT_CHECKPOINT_BYTES,
    bytes_k: int = F16,
    bytes_v: int = F16,
) -> dict[str, int]:
    """Bytes one more sequence of n_ctx tokens costs: each part, `device` (what libllama allocates: the KV caches and
    recurrent states), `host` (checkpoints, at most) and `total`. `mtp`: None counts the MTP context when the
    target has an MTP head; `n_rs_seq` defaults to the draft capacity on a hybrid target, as LinkedPair opens it."""
    cells = padded_ctx(n_ctx)
    kv = {"bytes_k": bytes_k, "bytes_v": bytes_v}
    recurrent = recurrent_layers(target_info)
    attention = [il for il, is_recr in enumerate(recurrent) if not is_recr]
    state = recurrent_cell_bytes(target_info)
    snapshots = (draft_capacity if n_rs_seq is None else n_rs_seq) if state else 0
    n_nextn = int(target_info.key("nextn_predict_layers", 0) or 0)
    with_mtp = n_nextn > 0 and mtp is not False
    nextn = range(trunk_layers(target_info), target_info.n_layer)
    kept = min(checkpoint_count, checkpoint_bytes // state) if state else 0
    # A hybrid draft model (draft-simple): KV cells of its attention layers, its recurrent state, and on the host the
    # copy of that state where drafting began (memory.DraftSequence).
    draft_state = recurrent_cell_bytes(draft_info) if draft_info else 0
    draft_attention = [il for il, r in enumerate(recurrent_layers(draft_info)) if not r] if draft_info else []
    parts = {
        "target_kv": cells * kv_row_bytes(target_info, attention, **kv),
        "recurrent_state": state,
        "rollback_snapshots": snapshots * state,
        "draft_kv": cells * kv_row_bytes(draft_info, draft_attention, **kv) + draft_state if draft_info else 0,
        "mtp_kv": cells * kv_row_bytes(target_info, nextn, **kv) if with_mtp else 0,
        "checkpoints": kept * state + draft_state,
    }
    parts["device"] = sum(parts[k] for k in DEVICE_PARTS)
    parts["host"] = sum(parts[k] for k in HOST_PARTS)
    parts["total"] = parts["device"] + parts["host"]
    return parts


def fit_parallel(free_bytes: int, footprint: Mapping[str, int], *, reserve_bytes: int = 0,
                 free_host_bytes: int | None = None, limit: int = 256) -> int:
    """How many sequences fit: device memory after `reserve_bytes` (compute buffers, headroom) over each sequence's
    device part, and, given `free_host_bytes`, host memory over its checkpoints. 0 when not even one fits."""
    device = max(1, footprint["device"])
    n = max(0, free_bytes - reserve_bytes) // device
    if free_host_bytes is not None and footprint.get("host", 0) > 0:
        n = min(n, free_host_bytes // footprint["host"])
    return int(min(n, limit))


# Left free beside the caches and weights: the target's, draft's and MTP contexts' compute buffers (about 1 GiB for a
# 27B target at n_ubatch 512 on CUDA, growing a little with the rows a step holds) and the 1 GiB margin that
# llama.cpp's own fit (common/fit.cpp, `fit_params_target`) leaves on every device.
DEFAULT_RESERVE_BYTES = 2 << 30
NO_LIMIT = 1 << 20


@dataclass(frozen=True)
class ParallelPlan:
    """How many sequences a pair is opened with on this machine: as many as fit in the free memory where its caches
    go, after its weights and a reserve, at most `limit` and at least 1 (a pair that does not fit even once is still
    opened once: libllama's allocation then says what is missing)."""

    parallel: int
    fits: int  # sequences that fit (0: not even one), before the limit
    limit: int
    where: str  # the memory the caches go to: a GPU's name, or "host memory"
    free_bytes: int  # free there before the pair is opened
    weights_bytes: int  # the pair's weights that go there
    reserve_bytes: int
    sequence: Mapping[str, int]  # what one sequence costs (sequence_footprint)
    free_host_bytes: int | None = None  # for the checkpoints, when the caches are on a GPU
    branches_bytes: int = 0  # the spare target sequences of draft trees (`branches`), set aside first

    @property
    def sequence_bytes(self) -> int:
        """What one sequence takes of the memory planned: its device part on a GPU (the checkpoints go to host
        memory), all of it on the host."""
        return self.sequence["device" if self.free_host_bytes is not None else "total"]

    def describe(self) -> str:
        """Why `parallel`, in one line for logs and the Space's About box."""
        gib = 2**30
        room = (f"{self.where} ({self.free_bytes / gib:,.1f} GiB free − {self.weights_bytes / gib:,.1f} GiB weights "
                f"− {self.reserve_bytes / gib:,.1f} GiB reserve"
                + (f" − {self.branches_bytes / gib:,.1f} GiB tree branches" if self.branches_bytes else "")
                + f", {self.sequence_bytes / 2**20:,.0f} MiB a sequence")
        if self.free_host_bytes is not None and self.sequence["host"]:
            room += f", its checkpoints {self.sequence['host'] / 2**20:,.0f} MiB of host memory"
        if not self.fits:
            return f"not one sequence fits in {room}): opened with 1"
        text = f"{self.fits} sequence{'s' if self.fits != 1 else ''} fit in {room})"
        return f"{text}, at most {self.limit} asked" if self.fits > self.limit else text


def weights_bytes(info: GGUFInfo, n_gpu_layers: int = -1) -> int:
    """The bytes of a model file that go to the GPU with `n_gpu_layers` (-1: all of them, as on the host; libllama
    counts the output layer as one more), proportional to the layers offloaded."""
    size = info.path.stat().st_size
    if n_gpu_layers < 0 or n_gpu_layers > info.n_layer:
        return size
    return size * n_gpu_layers // (info.n_layer + 1)


def plan_parallel(target_info: GGUFInfo, draft_info: GGUFInfo | None, memory: FreeMemory, *, n_ctx: int,
                  draft_capacity: int, limit: int, n_gpu_layers: int = -1,
                  reserve_bytes: int = DEFAULT_RESERVE_BYTES, mtp: bool | None = None,
                  branches: int = 0) -> ParallelPlan:
    """How many sequences of n_ctx tokens to open the pair with, in the memory that is free before it is opened
    (`backends.free_memory(n_gpu_layers)`): on a GPU its weights and caches, the checkpoints in host memory; on the
    host all of them. `branches` spare target sequences (a draft tree's paths) are set aside first."""
    sequence = sequence_footprint(target_info, draft_info, n_ctx=n_ctx, draft_capacity=draft_capacity, mtp=mtp)
    infos = [i for i in (target_info, draft_info) if i is not None]
    weights = sum(weights_bytes(i, n_gpu_layers if memory.on_gpu else -1) for i in infos)
    branches_bytes = branches * branch_footprint(sequence)
    taken = reserve_bytes + weights + branches_bytes
    if memory.on_gpu:
        fits = fit_parallel(memory.free, sequence, reserve_bytes=taken, free_host_bytes=memory.host_free,
                            limit=NO_LIMIT)
    else:
        fits = fit_parallel(memory.free, {"device": sequence["total"]}, reserve_bytes=taken, limit=NO_LIMIT)
    return ParallelPlan(parallel=max(1, min(fits, limit)), fits=fits, limit=limit, where=memory.where,
                        free_bytes=memory.free, weights_bytes=weights, reserve_bytes=reserve_bytes,
                        sequence=sequence, free_host_bytes=memory.host_free if memory.on_gpu else None,
                        branches_bytes=branches_bytes)


def branch_footprint(sequence: Mapping[str, int]) -> int:
    """What a spare target sequence for a draft tree's path costs (`LinkedPair` branches): the target's KV cells and
    recurrent state, with its rollback snapshots; no draft, MTP or checkpoint of its own."""
    return sequence["target_kv"] + sequence["recurrent_state"] + sequence["rollback_snapshots"]


def with_remote_memory(memory: FreeMemory, remote: Sequence[tuple[str, int, int]]) -> FreeMemory:
    """The memory a pair's caches may use when RPC servers' devices (endpoint, free, total) take part of its layers:
    theirs joins the pool (an estimate: each device holds the caches of its own layers, which the split decides)."""
    if not remote:
        return memory
    free = sum(f for _, f, _ in remote)
    where = f"{memory.where} + {len(remote)} remote device{'s' if len(remote) != 1 else ''} ({free / 2**30:,.1f} GiB)"
    return FreeMemory(where, memory.free + free, True, memory.host_free)


def info_from_keys(arch: str, keys: Mapping[str, Any], path: str = "<keys>") -> GGUFInfo:
    """A GGUFInfo from header keys alone (without `arch.` prefixes), for planning without the file."""
    full = {"general.architecture": arch, **{f"{arch}.{k}": v for k, v in keys.items()}}
    return GGUFInfo(path=Path(path), arch=arch, n_embd=int(keys.get("embedding_length", 0)),
                    n_layer=int(keys.get("block_count", 0)), n_vocab=0, tokenizer_model="", special_tokens={},
                    mask_token_id=None, keys=full, tensor_shapes={})


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f}"


def main(argv: Sequence[str] | None = None) -> int:
    from ..results.tables import table

    p = argparse.ArgumentParser(prog="python -m dflash_runtime.files.footprint", description=__doc__.splitlines()[0])
    p.add_argument("target", type=Path)
    p.add_argument("draft", type=Path, nargs="?")
    p.add_argument("--n-ctx", default="8192,32768", help="comma list of context lengths per sequence")
    p.add_argument("--draft-capacity", type=int, default=7)
    p.add_argument("--no-mtp", action="store_true")
    p.add_argument("--fit", type=int, metavar="MOST",
                   help="also say how many sequences (at most MOST) fit in this machine's free memory now")
    p.add_argument("--n-gpu-layers", type=int, default=-1, help="with --fit: the layers offloaded to a GPU")
    p.add_argument("--rpc", default=None, help="with --fit: comma list of RPC servers (host:port) whose memory counts")
    args = p.parse_args(argv)
    target = read_gguf(args.target)
    draft = read_gguf(args.draft) if args.draft else None
    sizes = [int(x) for x in args.n_ctx.split(",") if x]
    prints = [sequence_footprint(target, draft, n_ctx=n, draft_capacity=args.draft_capacity,
                                 mtp=False if args.no_mtp else None) for n in sizes]
    rows = [(part, *(_mib(f[part]) for f in prints)) for part in (*DEVICE_PARTS, *HOST_PARTS, "device", "total")]
    print(table(("MiB per sequence", *(f"n_ctx {n}" for n in sizes)), rows))
    if args.fit is not None:
        from ..native.backends import free_memory

        memory = free_memory(args.n_gpu_layers)
        if args.rpc:
            from ..native.rpc import remote_memory

            memory = with_remote_memory(memory, remote_memory([e for e in args.rpc.split(",") if e.strip()]))
        for n in sizes:
            plan = plan_parallel(target, draft, memory, n_ctx=n, draft_capacity=args.draft_capacity, limit=args.fit,
                                 n_gpu_layers=args.n_gpu_layers, mtp=False if args.no_mtp else None)  # fmt: skip
            print(f"n_ctx {n}: parallel={plan.parallel} ({plan.describe()})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
