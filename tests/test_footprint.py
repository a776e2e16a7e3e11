"""files/footprint.py against what libllama allocates: each part of one more sequence, on generated pairs (the KV caches
and recurrent states libllama logs as it opens each context, and the recurrent state a filled sequence saves)."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest

from dflash_runtime import load_pair
from dflash_runtime.files.footprint import (
    ParallelPlan,
    branch_footprint,
    fit_parallel,
    info_from_keys,
    padded_ctx,
    plan_parallel,
    recurrent_cell_bytes,
    sequence_footprint,
)
from dflash_runtime.files.gguf_meta import read_gguf
from dflash_runtime.native.backends import FreeMemory, device_memory, free_memory
from dflash_runtime.native.states import PARTIAL_ONLY, state_size
from dflash_runtime.testing.tiny_models import TinyPair, tiny_pair

N_CTX, CAPACITY = 1024, 5
MIB = 2**20
LOGGED = 0.006  # libllama logs MiB with two decimals: half a step of rounding, and some slack
KV_LINE = re.compile(r"llama_kv_cache: size = +([\d.]+) MiB \( *(\d+) cells, +(\d+) layers")
RS_LINE = re.compile(r"llama_memory_recurrent: size = +([\d.]+) MiB")


def _hybrid_pair() -> TinyPair:
    """A qwen35 target with an MTP block and a DFlash 2 draft, wide enough for the logged MiB to resolve the parts."""
    return tiny_pair("hybrid", "dflash2", n_embd=256, dims="scaled", mtp_layers=1)


def _allocations(capfd: pytest.CaptureFixture[str], pair: TinyPair, parallel: int) -> tuple[list[float], list[float]]:
    """The MiB of every KV cache (target, draft, MTP: the order the contexts open in) and recurrent memory."""
    capfd.readouterr()
    with load_pair(pair.target, pair.draft, n_ctx=N_CTX, draft_capacity=CAPACITY, parallel=parallel, verbose=True):
        pass
    err = capfd.readouterr().err
    return [float(m.group(1)) for m in KV_LINE.finditer(err)], [float(m.group(1)) for m in RS_LINE.finditer(err)]


def test_each_part_of_a_sequence_is_what_libllama_allocates(capfd: pytest.CaptureFixture[str]) -> None:
    pair = _hybrid_pair()
    assert pair.draft is not None
    target, draft = read_gguf(pair.target), read_gguf(pair.draft)
    one = sequence_footprint(target, draft, n_ctx=N_CTX, draft_capacity=CAPACITY)
    kv1, rs1 = _allocations(capfd, pair, 1)
    kv2, rs2 = _allocations(capfd, pair, 2)
    assert len(kv1) == len(kv2) == 3 and len(rs1) == len(rs2) == 1, (kv1, rs1)
    expected_kv = [one[k] / MIB for k in ("target_kv", "draft_kv", "mtp_kv")]
    expected_rs = (one["recurrent_state"] + one["rollback_snapshots"]) / MIB
    assert all(x > 0.1 for x in [*expected_kv, expected_rs])  # every part large enough to be resolved
    # one sequence, then what the second one adds: the same figures
    assert kv1 == pytest.approx(expected_kv, abs=LOGGED)
    assert [b - a for a, b in zip(kv1, kv2, strict=True)] == pytest.approx(expected_kv, abs=2 * LOGGED)
    assert rs1[0] == pytest.approx(expected_rs, abs=LOGGED)
    assert rs2[0] - rs1[0] == pytest.approx(expected_rs, abs=2 * LOGGED)
    assert one["rollback_snapshots"] == CAPACITY * one["recurrent_state"]
    assert one["device"] == sum(one[k] for k in ("target_kv", "recurrent_state", "rollback_snapshots", "draft_kv",
                                                 "mtp_kv"))
    assert one["total"] == one["device"] + one["host"] and one["host"] == one["checkpoints"]


def test_the_recurrent_state_is_what_a_sequence_saves() -> None:
    """A checkpoint copies one sequence's recurrent state: the computed bytes, plus libllama's few header bytes."""
    pair = tiny_pair("hybrid", "dflash2", n_embd=256, dims="scaled")
    computed = recurrent_cell_bytes(read_gguf(pair.target))
    with load_pair(pair.target, pair.draft, n_ctx=512, draft_capacity=3) as engine:
        engine.generate("hello world", max_tokens=4)
        saved = state_size(engine.target_ctx, PARTIAL_ONLY)
    assert computed <= saved <= computed + 1024


def test_dense_targets_have_no_recurrent_parts_and_mtp_can_be_left_out() -> None:
    dense = tiny_pair("dense", "dflash2")
    assert dense.draft is not None
    fp = sequence_footprint(read_gguf(dense.target), read_gguf(dense.draft), n_ctx=300, draft_capacity=7)
    assert fp["recurrent_state"] == fp["rollback_snapshots"] == fp["checkpoints"] == fp["mtp_kv"] == 0
    assert fp["target_kv"] % padded_ctx(300) == 0 and padded_ctx(300) == 512
    mtp_target = read_gguf(tiny_pair("hybrid", None, mtp_layers=1).target)
    assert sequence_footprint(mtp_target, n_ctx=512)["mtp_kv"] > 0
    assert sequence_footprint(mtp_target, n_ctx=512, mtp=False)["mtp_kv"] == 0


def test_checkpoints_are_bounded_by_count_and_bytes() -> None:
    info = read_gguf(tiny_pair("hybrid", "dflash2", n_embd=256, dims="scaled").target)
    state = recurrent_cell_bytes(info)
    assert sequence_footprint(info, n_ctx=512, checkpoint_count=8)["checkpoints"] == 8 * state
    assert sequence_footprint(info, n_ctx=512, checkpoint_bytes=3 * state + 1)["checkpoints"] == 3 * state
    assert sequence_footprint(info, n_ctx=512, checkpoint_count=0)["checkpoints"] == 0


def test_fit_parallel_divides_what_is_free() -> None:
    fp = {"device": 100, "host": 40}
    assert fit_parallel(1000, fp) == 10
    assert fit_parallel(1000, fp, reserve_bytes=350) == 6
    assert fit_parallel(1000, fp, free_host_bytes=120) == 3
    assert fit_parallel(50, fp) == 0 and fit_parallel(10**9, fp, limit=8) == 8


def test_a_header_given_as_keys_reads_like_a_file() -> None:
    """Qwen3.5-27B's layout (64 layers, attention every 4th, 4 KV heads × 256; Gated DeltaNet 16 key / 48 value heads
    × 128, conv kernel 4): about 150 MB of recurrent state, 512 MiB of KV at 8192 tokens."""
    info = info_from_keys("qwen35", {
        "block_count": 65, "nextn_predict_layers": 1, "embedding_length": 5120, "attention.head_count": 24,
        "attention.head_count_kv": 4, "attention.key_length": 256, "attention.value_length": 256,
        "full_attention_interval": 4, "ssm.conv_kernel": 4, "ssm.inner_size": 6144, "ssm.state_size": 128,
        "ssm.group_count": 16, "ssm.time_step_rank": 48,
    })
    fp = sequence_footprint(info, n_ctx=8192, draft_capacity=7)
    assert fp["target_kv"] == 512 * MIB and fp["mtp_kv"] == 32 * MIB
    assert fp["recurrent_state"] == 48 * (3 * (6144 + 2 * 16 * 128) + 128 * 6144) * 4
    assert fp["rollback_snapshots"] == 7 * fp["recurrent_state"]


def test_a_pair_is_planned_to_the_memory_that_is_free() -> None:
    """plan_parallel: on a GPU the weights and the reserve come first, then whole sequences of device memory, their
    checkpoints in host memory; on the host all of it shares one memory; at most `limit`, at least 1."""
    pair = _hybrid_pair()
    assert pair.draft is not None
    target, draft = read_gguf(pair.target), read_gguf(pair.draft)
    one = sequence_footprint(target, draft, n_ctx=N_CTX, draft_capacity=CAPACITY)
    weights = pair.target.stat().st_size + pair.draft.stat().st_size
    reserve = 3 * MIB

    def plan(memory: FreeMemory, limit: int = 8, **options: int) -> ParallelPlan:
        return plan_parallel(target, draft, memory, n_ctx=N_CTX, draft_capacity=CAPACITY, limit=limit,
                             reserve_bytes=reserve, **options)  # fmt: skip

    gpu = FreeMemory("CUDA0 (a test GPU)", weights + reserve + 3 * one["device"] - 1, True, 1 << 40)
    two = plan(gpu)
    assert (two.fits, two.parallel, two.weights_bytes) == (2, 2, weights)
    assert two.describe().startswith("2 sequences fit in CUDA0 (a test GPU) (")
    capped = plan(gpu, limit=1)
    assert (capped.fits, capped.parallel) == (2, 1) and capped.describe().endswith("), at most 1 asked")
    assert plan(replace(gpu, host_free=one["host"])).fits == 1, "host memory holds one sequence's checkpoints"
    assert plan(replace(gpu, free=gpu.free + one["device"])).fits == 3
    none = plan(replace(gpu, free=weights))
    assert (none.fits, none.parallel) == (0, 1) and none.describe().startswith("not one sequence fits in CUDA0")
    assert none.describe().endswith("): opened with 1")
    half = plan(gpu, n_gpu_layers=target.n_layer // 2)  # fewer layers offloaded: fewer weights on the GPU
    assert half.weights_bytes < weights and half.fits >= two.fits
    host = FreeMemory("host memory", weights + reserve + 3 * one["total"], False, weights + reserve + 3 * one["total"])
    on_host = plan(host)
    assert (on_host.fits, on_host.free_host_bytes) == (3, None), "on the host the checkpoints count with the caches"
    assert plan(replace(host, free=host.free - 1)).fits == 2
    assert on_host.sequence == one
    # A draft tree's spare target sequences are set aside first: the target's caches and state, no draft's.
    branch = branch_footprint(one)
    assert branch == one["target_kv"] + one["recurrent_state"] + one["rollback_snapshots"] < one["device"]
    three = replace(gpu, free=weights + reserve + 3 * one["device"])
    assert plan(three).fits == 3 and plan(three, branches=1).fits == 2
    assert plan(replace(three, free=three.free + branch), branches=1).fits == 3
    assert "tree branches" in plan(three, branches=2).describe() and "tree branches" not in plan(three).describe()


def test_the_free_memory_is_read_from_the_machine() -> None:
    """On this machine (no GPU): the caches go to host memory, whatever n_gpu_layers says, and what is free is
    Linux's MemAvailable, no more than the CPU device's total."""
    cpu = [d for d in device_memory() if d.kind == "cpu"]
    assert cpu and cpu[0].total > 0
    for n_gpu_layers in (0, -1):
        memory = free_memory(n_gpu_layers)
        assert memory.where == "host memory" and not memory.on_gpu
        assert 0 < memory.free <= cpu[0].total and memory.host_free == memory.free
