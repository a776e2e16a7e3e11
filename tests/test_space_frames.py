"""The page's streamed frames, as Gradio turns them into diffs: no frame's update is undone by the next frame's diff.

Gradio sends each frame of a streaming handler as a diff against the frame before (`gradio.utils.diff`), and the page
applies it in place to the object the earlier frame arrived in. A frame that skips an output an update had just set
would diff into "delete the update's properties": when the page reads the earlier frame late (the frames came in one
burst), that update is lost. These tests apply the real diffs the way the page does, in place and all before reading
any frame, which is exactly the burst.
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import AsyncIterator
from itertools import pairwise
from typing import Any

import gradio as gr
from gradio.utils import diff

from dflash_runtime.space.page.endpoints import SKIP, ab_button, notice_line, steady_frames

HIDDEN = gr.update(value=None, visible=False)
SHOWN = gr.update(value="points", visible=True)


def apply_in_place(base: Any, edits: list[list[Any]]) -> Any:
    """A diff applied as the page applies it: containers changed in place, a new value only at the root."""
    for action, path, value in edits:
        if not path:
            base = value if action == "replace" else base + value
            continue
        target = base
        for key in path[:-1]:
            target = target[key]
        key = path[-1]
        if action in ("replace", "add"):
            if action == "add" and isinstance(target, list):
                target.insert(key, value)
            else:
                target[key] = value
        elif action == "append":
            target[key] += value
        elif action == "delete":
            del target[key]
    return base


def burst(frames: list[tuple[Any, ...]]) -> list[list[Any]]:
    """What the page reads for each frame when every diff was applied before it read any of them."""
    sent = [list(copy.deepcopy(frame)) for frame in frames]  # the server's side: each frame as it was yielded
    held = copy.deepcopy(sent[0])  # the page's side: the first frame comes whole and is the base of the diffs
    received = [list(held)]  # each frame as the page will read it: the objects it holds, changed in place later
    for before, after in pairwise(sent):
        held = [apply_in_place(held[i], diff(before[i], after[i])) for i in range(len(after))]
        received.append(list(held))
    return received


def steady(frames: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    async def source() -> AsyncIterator[tuple[Any, ...]]:
        for frame in frames:
            yield frame

    async def collect() -> list[tuple[Any, ...]]:
        return [frame async for frame in steady_frames(source())]

    return asyncio.run(collect())


# A refusal computed at once: the first frame, the refusal's frame (notice, charts hidden), the handler's last frame
# (the A/B button back). Outputs: notice, chart, button.
REFUSAL = [
    (SKIP, HIDDEN, SKIP),
    (notice_line("⚠️ **Not sent:** the message is too long"), SKIP, SKIP),
    (SKIP, SKIP, ab_button(True)),
]


def last_word(frames: list[Any]) -> list[Any]:
    """Each output's last value that is not a skip: what the page shows once it has read every frame."""
    return [next((frame[i] for frame in reversed(frames) if frame[i] != SKIP), SKIP) for i in range(len(frames[0]))]


def test_a_burst_loses_an_update_that_the_next_frame_skips() -> None:
    """The mechanism (why steady_frames exists): raw frames lose the charts' hiding in a burst."""
    assert last_word(burst(REFUSAL))[1] == SKIP, "Gradio's diffs no longer undo an update: revisit steady_frames"


def test_steady_frames_keep_every_update_through_a_burst() -> None:
    frames = steady(REFUSAL)
    assert last_word(burst(frames)) == last_word(REFUSAL) == [
        "⚠️ **Not sent:** the message is too long", HIDDEN, ab_button(True)]  # fmt: skip


def test_steady_frames_leave_updates_with_data_alone() -> None:
    """A chart's update carries its points: sent again, the page would draw it anew at every frame."""
    points = gr.update(value=[[1, 2.0]], visible=True)
    assert steady([(points,), (SKIP,)]) == [(points,), (SKIP,)]


def test_steady_frames_pass_plain_values_and_newer_updates_as_they_are() -> None:
    frames = [(["a"], SHOWN, "x"), (SKIP, SKIP, SKIP), (["a", "b"], HIDDEN, ""), (SKIP, SKIP, SKIP)]
    assert steady(frames) == [
        (["a"], SHOWN, "x"),
        (SKIP, SHOWN, SKIP),  # a plain value's skip stays a skip (it diffs to a new value, not into the old one)
        (["a", "b"], HIDDEN, ""),
        (SKIP, HIDDEN, SKIP),
    ]
    assert last_word(burst(steady(frames))) == [["a", "b"], HIDDEN, ""]
    assert last_word(burst(frames)) != [["a", "b"], HIDDEN, ""]
