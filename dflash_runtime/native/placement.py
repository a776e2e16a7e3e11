"""Where a pair's layers go: the device list its models are opened with, and which layers landed on which device.

Without remote devices or a tensor split the models keep libllama's default device list (every local GPU). With
them, the list is explicit: the remote devices first, then the local GPUs (the order llama.cpp gives RPC servers, so
that where there is a local GPU the last layers and the output head stay on it), and `tensor_split` weights the
layers between them (one weight per device of that list; none: libllama splits by each device's free memory).
Layers below `n_gpu_layers`' reach stay on the local CPU, as always.

Which layer went where is libllama's own account: its loader logs "layer N assigned to device X" for each layer
(the output head is layer n_layer), which `pair.NativeLog` keeps for the last model opened.
"""

from __future__ import annotations

import ctypes
from collections.abc import Mapping, Sequence
from typing import Any

from llama_cpp import llama_cpp as ll

from .backends import host_memory_available, host_memory_total, offload_devices
from .rpc import RemoteDevices, device_memory


class DeviceList:
    """The devices (and weights) a pair's models are opened with, kept alive as long as the pair."""

    def __init__(self, remote: RemoteDevices | None, tensor_split: Sequence[float] | None) -> None:
        gpus_here = offload_devices()
        self.remote = remote
        self.names = [d.name for d in remote.devices] if remote else []
        handles = [d.handle for d in remote.devices] if remote else []
        self.names += [name for name, _ in gpus_here]
        handles += [handle for _, handle in gpus_here]
        self.local_gpus = [name for name, _ in gpus_here]
        self._devices = (ctypes.c_void_p * (len(handles) + 1))(*handles, None)
        self._split = None
        if tensor_split is not None:
            weights = [float(w) for w in tensor_split]
            if len(weights) != len(handles) or min(weights, default=-1.0) < 0 or sum(weights) <= 0:
                raise ValueError(f"tensor_split takes one weight ≥ 0 per device of {self.names} (remote devices "
                                 f"first), not all 0 (got {list(tensor_split)!r})")
            self._split = (ctypes.c_float * max(len(weights), int(ll.llama_max_devices())))(*weights)

    def for_draft(self) -> DeviceList:
        """The draft's list: the same devices (its graph runs the target's output head and token embeddings wherever
        they are), its layers on the local GPUs when there are some, where the output head it ends in is (remote
        devices first, so the last layers and the head are local): none of its steps then crosses the network. With
        no local GPU the head is on a remote device, and the draft follows `draft_gpu_layers` there."""
        if not (self.remote and self.local_gpus):
            return self
        draft = DeviceList.__new__(DeviceList)
        draft.remote, draft.names, draft.local_gpus, draft._devices = self.remote, self.names, self.local_gpus, \
            self._devices
        n_remote = len(self.remote.devices)
        weights = [0.0] * n_remote + [1.0] * len(self.local_gpus)
        draft._split = (ctypes.c_float * max(len(weights), int(ll.llama_max_devices())))(*weights)
        return draft

    def apply(self, params: Any) -> None:
        """Set the model parameters' device list (and tensor split)."""
        params.devices = ctypes.addressof(self._devices)
        if self._split is not None:
            params.tensor_split = self._split

    def memory(self) -> list[dict[str, Any]]:
        """Each device's memory now: the host's for the CPU, the backend's report for a GPU, the server's for a remote
        device (its free memory as read before the pair was opened)."""
        rows: list[dict[str, Any]] = [{"device": "CPU", "where": "local", "free": host_memory_available(),
                                       "total": host_memory_total()}]  # fmt: skip
        for name, handle in offload_devices():
            free, total = device_memory(handle)
            rows.append({"device": name, "where": "local", "free": free, "total": total})
        for d in self.remote.devices if self.remote else []:
            rows.append({"device": d.name, "where": d.endpoint, "free": d.free_at_load, "total": d.total})
        return rows


def layer_ranges(assigned: Mapping[int, str], n_layer: int) -> list[dict[str, str]]:
    """libllama's layer -> device account as runs of consecutive layers per device; the output head is "output"."""
    runs: list[dict[str, str]] = []
    start = 0
    for il in range(1, n_layer + 1):
        if il == n_layer or assigned.get(il) != assigned.get(start):
            device = assigned.get(start, "?")
            runs.append({"device": device, "layers": str(start) if il - 1 == start else f"{start}-{il - 1}"})
            start = il
    if n_layer in assigned:
        runs.append({"device": assigned[n_layer], "layers": "output"})
    return runs
