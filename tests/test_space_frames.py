"""The page's streamed frames, as Gradio turns them into diffs: a refusal's notice survives frames that come in a burst.

Gradio sends each frame of a streaming handler as a diff against the frame before (`gradio.utils.diff`), and the page
applies it in place to the object the earlier frame arrived in. A frame that skips an output an update had just set
diffs into "delete the update's properties": when the page reads the earlier frame late (the frames came in one
burst), that update is lost. These tests apply the real diffs the way the page does, in place and all before reading
any frame, which is exactly the burst.
"""

from __future__ import annotations

import copy
from itertools import pairwise
from typing import Any

import gradio as gr
from gradio.utils import diff

from dflash_runtime.space.page.endpoints import ab_button, notice_line

SKIP = gr.skip()
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
    # Each value its own object, as JSON decodes them (a frame may hold one skip object in several places).
    sent = [[copy.deepcopy(value) for value in frame] for frame in frames]  # the server's side, frame by frame
    held = [copy.deepcopy(value) for value in sent[0]]  # the page: the first frame whole, the base of the diffs
    received = [list(held)]  # each frame as the page will read it: the objects it holds, changed in place later
    for before, after in pairwise(sent):
        held = [apply_in_place(held[i], diff(before[i], after[i])) for i in range(len(after))]
        received.append(list(held))
    return received


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
    """The mechanism: an update followed by a skip is undone before the page reads it (the charts' hiding here)."""
    assert last_word(burst(REFUSAL))[1] == SKIP, "Gradio's diffs no longer undo an update: notice_line may use one"
    as_update = [(gr.update(value="⚠️ **Not sent:** the message is too long"), SKIP, SKIP), *REFUSAL[2:]]
    assert last_word(burst([REFUSAL[0], *as_update]))[0] == SKIP, "a notice sent as an update would be lost"


def test_the_refusal_notice_is_plain_text_and_survives_a_burst() -> None:
    assert last_word(burst(REFUSAL))[0] == last_word(REFUSAL)[0] == "⚠️ **Not sent:** the message is too long"
    assert last_word(burst(REFUSAL))[2] == ab_button(True), "the A/B button comes back"
