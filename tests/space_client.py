"""Test helpers for driving the Space as its callers do: gradio_client arguments, raw HTTP calls (JSON bodies
written by hand, so NaN, Infinity or a lone surrogate can be sent), and the answers an engine of our own gives on the
same files."""

from __future__ import annotations

import concurrent.futures
import itertools
import json
import re
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from gradio_client import Client

from dflash_runtime import load_pair
from dflash_runtime.space.gpu.host import EngineHost
from dflash_runtime.space.gpu_job import GpuJob, ReplyChunk
from dflash_runtime.space.page.endpoints import API_PARAMETERS
from dflash_runtime.space.page.items import GROWING, GROWING_PER_POSITION, ITEM_OWN
from dflash_runtime.space.requests import Limits, build_request
from dflash_runtime.space.setup.presets import DEMO_PAIR, ModelSource, PairPreset, ResolvedPair
from dflash_runtime.testing.tiny_models import TinyPair, tiny_pair

Message = dict[str, str]


def demo_pair() -> TinyPair:
    """The generated pair the offline demo serves (the same cache, so the same files): 512 wide, a "phrase" head."""
    return tiny_pair(**DEMO_PAIR)


@contextmanager
def reference_engine(n_ctx: int, draft_capacity: int = 7) -> Iterator[Any]:
    """An engine of our own on the demo's files: what the server must answer, token for token."""
    pair = demo_pair()
    engine = load_pair(pair.target, pair.draft, n_ctx=n_ctx, draft_capacity=draft_capacity)
    try:
        yield engine
    finally:
        engine.close()


def expected_answer(engine: Any, messages: list[Message], max_tokens: int, thinking: bool = False) -> str:
    return engine.chat(messages, enable_thinking=thinking, max_tokens=max_tokens, temperature=0.0).text


def prompt_length(engine: Any, messages: list[Message]) -> int:
    return len(engine.chat_tokens(messages, enable_thinking=False))


def whole_reply(chunks: Iterable[ReplyChunk]) -> ReplyChunk:
    """The chunks of one reply as one (each carries what its step added): what a reader that skips none sees."""
    taken = list(chunks)
    joined = taken[0]
    for chunk in taken[1:]:
        joined = joined.then(chunk)
    return joined


def host_reply(host: EngineHost, files: ResolvedPair, message: str, *, n_ctx: int, max_tokens: int, branches: int = 0,
               **fields: Any) -> ReplyChunk:  # fmt: skip
    """The GPU worker's whole reply to one message on these local files (a preset of them, on the CPU)."""
    preset = PairPreset(name="p", label="p", target=ModelSource(local_path=files.target_path),
                        draft=ModelSource(local_path=files.draft_path), n_ctx=n_ctx, n_gpu_layers=0,
                        branches=branches)  # fmt: skip
    request = build_request(preset="p", presets=["p"], limits=Limits(), message=message, max_tokens=max_tokens,
                            **fields)  # fmt: skip
    return whole_reply(host.run(GpuJob(request, preset, files)))


def chat_args(message: str, **changes: Any) -> dict[str, Any]:
    args: dict[str, Any] = {
        "message": message,
        "history": [],
        "system_prompt": "",
        "preset": "tiny-random",
        "max_tokens": 48,
        "temperature": 0.0,
        "top_p": 1.0,
        "draft_max": None,
        "speculative": True,
        "thinking": False,
        "method": "auto",
        "draft_length": 7,
        "top_k": 40,
        "min_p": 0.0,
    }
    args.update(changes)
    return args


def trimmed(counts: list[int]) -> list[int]:
    """Counts per position without trailing zeros."""
    counts = list(counts)
    while counts and counts[-1] == 0:
        counts.pop()
    return counts


def add_up(totals: dict[str, Any], added: dict[str, Any]) -> dict[str, Any]:
    """`totals` with an item's `added` summed in: numbers (times to 3 decimals, as sent), per-position counts element
    by element."""
    out = dict(totals)
    for key, grown in added.items():
        if isinstance(grown, list):
            before = out.get(key, [])
            out[key] = [(before[i] if i < len(before) else 0) + (grown[i] if i < len(grown) else 0)
                        for i in range(max(len(before), len(grown)))]  # fmt: skip
        else:
            out[key] = round(out.get(key, 0) + grown, 3)
    return out


def rebuilt(items: list[tuple[str, dict[str, Any]]]) -> list[tuple[str, dict[str, Any]]]:
    """/chat's items as a client rebuilds them (see dflash_runtime/space/page/items.py): the text so far, and the
    statistics so far: each item's changed figures merged in, its `added` summed (per position, element by element),
    its runs (neighbours of one source joined) and draft lengths appended. On the last item the sums must equal the
    complete statistics it carries."""
    text, runs, lengths, out = "", [], [], []
    figures: dict[str, Any] = {}
    totals: dict[str, Any] = {key: 0 for key in GROWING if key != "gpu_seconds_used"}
    for delta, stats in items:
        text += delta
        totals = add_up(totals, stats["added"])
        for n, source in stats["source_runs"]:
            if runs and runs[-1][1] == source:
                runs[-1] = [runs[-1][0] + n, source]
            else:
                runs.append([n, source])
        lengths += stats["draft_lengths"]
        figures.update({key: value for key, value in stats.items() if key not in ("added", *ITEM_OWN)})
        if stats.get("finish_reason") is not None:
            for key, total in totals.items():
                complete = stats.get(key) or (0 if key not in GROWING_PER_POSITION else [])
                if key in GROWING_PER_POSITION:  # a position never accepted is a trailing 0 there
                    total, complete = trimmed(total), trimmed(complete)
                assert total == pytest.approx(complete, abs=1e-3 * len(out) + 1e-6), (key, total, complete)
        out.append((text, {**figures, **totals, **({} if stats.get("finish_reason") is None else stats),
                           "source_runs": [list(run) for run in runs], "draft_lengths": list(lengths)}))  # fmt: skip
    return out


def stream_chat(client: Client, **args: Any) -> list[tuple[str, dict[str, Any]]]:
    """A /chat answer, its items rebuilt (see `rebuilt`)."""
    job = client.submit(**args, api_name="/chat")
    chunks = [tuple(output) for output in job]
    job.result()  # raises the server's error, if any
    return rebuilt(chunks)  # type: ignore[arg-type]


@dataclass(frozen=True)
class RawResult:
    """The outcome of a raw /gradio_api/call request: "complete" with the outputs, or "error" with the message."""

    event: str
    data: Any

    @property
    def message(self) -> str:
        return str(self.data.get("error") if isinstance(self.data, dict) else self.data)


def raw_body(args: dict[str, Any]) -> str:
    """A request body in the API's parameter order. Values that are already JSON text (see `Raw`) go in verbatim."""
    values = [args[name].text if isinstance(args[name], Raw) else json.dumps(args[name]) for name in API_PARAMETERS]
    return '{"data": [' + ", ".join(values) + "]}"


@dataclass(frozen=True)
class Raw:
    """JSON text to place in a body as is: NaN, Infinity, "\\ud800" (what gradio_client cannot send)."""

    text: str


def raw_call(url: str, api_name: str, body: str, timeout_s: float = 180.0,
             local_address: str | None = None) -> RawResult:  # fmt: skip
    """POST /gradio_api/call/<api_name> with `body`, then read its result stream to the end. `local_address` (e.g.
    "127.0.0.2": every 127.x.y.z reaches the server) makes the caller another client than the tests' 127.0.0.1."""
    base = url.rstrip("/") + "/gradio_api/call/" + api_name
    headers = {"Content-Type": "application/json"}
    transport = httpx.HTTPTransport(local_address=local_address) if local_address else None
    with httpx.Client(timeout=timeout_s, transport=transport) as http:
        started = http.post(base, content=body.encode(), headers=headers)
        started.raise_for_status()
        event_id = started.json()["event_id"]
        event, data = "", None
        with http.stream("GET", f"{base}/{event_id}") as stream:
            for line in stream.iter_lines():
                if line.startswith("event:"):
                    event = line.split(":", 1)[1].strip()
                elif line.startswith("data:") and event in ("complete", "error"):
                    data = json.loads(line.split(":", 1)[1])
                    return RawResult(event, data)
    raise AssertionError(f"the result stream of {api_name} ended without a result")


def raw_run(url: str, api_name: str, body: str, timeout_s: float = 60.0) -> httpx.Response:
    """POST /gradio_api/run/<api_name>: the REST route that would skip the queue if it were open."""
    with httpx.Client(timeout=timeout_s) as http:
        return http.post(url.rstrip("/") + "/gradio_api/run/" + api_name, content=body.encode(),
                         headers={"Content-Type": "application/json"})  # fmt: skip


def info_when(client: Client, wait_until: str, timeout_s: float = 60.0) -> dict[str, Any]:
    """/info once no answer runs ("idle") or one does ("busy"): the server waits on its engine slot, no polling."""
    info = client.predict(until=wait_until, timeout_s=timeout_s, api_name="/wait")
    assert not info["waited_out"], f"the engine was not {wait_until} within {timeout_s} s"
    return info


def take_outputs(job: Any, count: int, timeout_s: float = 60.0) -> list[Any]:
    """The first `count` streamed outputs of a gradio_client job, as they arrive (its iterator waits for them)."""
    taken: list[Any] = []
    reader = threading.Thread(target=lambda: taken.extend(itertools.islice(job, count)), daemon=True)
    reader.start()
    reader.join(timeout_s)
    assert not reader.is_alive(), f"fewer than {count} outputs within {timeout_s} s"
    return taken


def wait_done(job: Any, timeout_s: float = 60.0) -> None:
    """Until a gradio_client job has ended (finished, failed or cancelled): it is a Future."""
    done, _ = concurrent.futures.wait([job], timeout=timeout_s)
    assert done, f"the job did not end within {timeout_s} s"


SHARE = re.compile(r"(\d+) % of these")
FIGURE = re.compile(r"about (\d+\.\d+)× as fast as the main model alone \(estimate: ([\d.]+)–([\d.]+)×\)")
UNCERTAIN = ("too early to tell", "too uncertain to tell", "by how much still uncertain")


def summary_contradiction(summary: str, too_wide: float = 0.25) -> str | None:
    """What in one statistics summary contradicts itself, or None: a speed-up stated as a figure without its range,
    or with a range too wide to be the figure; a draft share above half beside a speed-up of about 1× that neither
    says the estimate is uncertain nor why drafting gained nothing. `summary`: its Markdown, or its text as the page
    shows it."""
    summary = " ".join(summary.replace("**", "").split())
    share = SHARE.search(summary)
    figures = FIGURE.findall(summary)
    if "× as fast" in summary and not figures:
        return "a speed-up figure without its range"
    for ratio, low, high in figures:
        if (float(high) - float(low)) / 2 > too_wide * float(ratio) + 0.051:  # + the last digit's rounding
            return f"{ratio}× stated as the figure of a range {low}–{high}× too wide to say it"
    if share and int(share.group(1)) > 50:
        about_one = any(abs(float(ratio) - 1) < 0.05 for ratio, _, _ in figures) or "about as fast" in summary
        if about_one and not any(word in summary for word in UNCERTAIN) and "cost about what they saved" not in summary:
            return "most of the answer from the draft, about 1× as fast, and no word of why"
    return None
