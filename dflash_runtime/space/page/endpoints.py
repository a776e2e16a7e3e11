"""The Gradio side of the Space: the API's typed endpoints (for `gr.api`) and the page's event handlers, over a
SpaceService. The one module of the package that imports gradio; app.py only lays out the page and wires these in.

Handlers are async: Gradio cancels them at once (Stop, Clear, a closed tab, a dropped client), and leaving a
reply's loop stops the engine. Runtime errors become `gr.Error` here, in the web process, with their own message.

No `from __future__ import annotations` here: Gradio reads the endpoints' annotations as types.
"""

import inspect
import logging
import random
import re
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import aclosing, contextmanager
from dataclasses import replace
from typing import Any

import gradio as gr
import pandas as pd

from ...errors import DFlashError, PromptTooLongError, RequestError
from ...methods import compared as compared_by_default
from ...methods import runnable as registered_methods
from ..requests import AUTO, DEFAULT_SYSTEM_PROMPT, MessageTooLongError
from ..scrub import scrub_paths
from ..web.clients import ClientIdentity
from ..web.gate import call_of
from ..web.service import MODEL_DEFAULTS, Reply, SpaceService, wait_problem
from .items import item_stats
from .panel import (
    EMPTY_DETAILS,
    EMPTY_STATS,
    REFUSED_STATS,
    WAITING_STATS,
    speed_badge,
    stats_details,
    stats_summary,
)
from .session import ChatSession, typed_user_text
from .speedup import ACCEPTANCE, SPEED, LiveSpeedUp, SpeedTrace, point_every
from .views import (
    PLAIN_LABEL,
    Comparison,
    acceptance_rows,
    info_markdown,
    method_help,
    method_label,
    sharing_note,
    texts_side_by_side,
)

log = logging.getLogger(__name__)
ApiReply = tuple[str, dict[str, Any]]
# /chat's and /generate's parameters, in order (a raw HTTP call sends one value for each; see web/gate.py)
# (new ones go at the end: an old client's values keep their places; draft_max is the deprecated draft_length).
# Declared here once: make_api refuses endpoints whose signature or documented parameters differ (api_problems).
API_PARAMETERS = ("message", "history", "system_prompt", "preset", "max_tokens", "temperature", "top_p", "draft_max",
                  "speculative", "thinking", "method", "draft_length", "top_k", "min_p")  # fmt: skip
WAIT_PARAMETERS = ("until", "timeout_s")
# What the HTTP gate checks of raw calls (web/gate.py): each endpoint's parameters, and /wait's values (its /run
# route answers a handler's error HTTP 500, so they are checked before).
CHECKED_PARAMETERS = {"chat": API_PARAMETERS, "generate": API_PARAMETERS, "wait": WAIT_PARAMETERS, "info": ()}
CHECKED_VALUES: dict[str, Callable[[list[Any]], str | None]] = {"wait": lambda values: wait_problem(*values)}
MESSAGE_CHARS = 600  # of an error's message a visitor reads at most (a message may quote the caller's values)


TOO_LONG = "MessageTooLong"  # the title of a message refused for its length, by characters or by tokens


def too_long(error: Exception) -> bool:
    """Whether the message was refused for its length: here (characters) or by the GPU function (tokens)."""
    return (isinstance(error, MessageTooLongError | PromptTooLongError)
            or getattr(error, "kind", None) == PromptTooLongError.__name__)  # fmt: skip


def visitor_message(error: Exception) -> tuple[str, str]:
    """(title, message) of an error as a visitor reads it: the request checks quote the caller's own values; other
    runtime errors may name the server's files (scrubbed); anything else is the server's fault, said without detail.
    A message too long reads the same whichever check refused it."""
    if too_long(error):
        return TOO_LONG, _cut(str(error))
    if isinstance(error, DFlashError):
        title = getattr(error, "kind", type(error).__name__)
        return title, _cut(str(error) if isinstance(error, RequestError) else scrub_paths(str(error)))
    log.error("a request failed", exc_info=error)
    return "ServerError", f"the server failed ({type(error).__name__}); retry"


def _cut(message: str) -> str:
    """A message as a visitor reads it: whole, or its start (one that quotes a huge value is not sent back whole)."""
    return message if len(message) <= MESSAGE_CHARS else message[:MESSAGE_CHARS] + "… (cut short)"


@contextmanager
def visitor_errors() -> Iterator[None]:
    """Runtime errors as gr.Error, whose message reaches the caller (Gradio hides other exceptions' messages)."""
    try:
        yield
    except gr.Error:
        raise
    except Exception as error:
        title, message = visitor_message(error)
        raise gr.Error(message, title=title, print_exception=False) from error


def session_hash(request: gr.Request | None) -> str | None:
    return getattr(request, "session_hash", None) if request is not None else None


def yields(item: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """gr.api takes an endpoint's outputs from its return annotation; a streaming endpoint's outputs are the items it
    yields, so its signature is made to say it returns one item."""

    def mark(function: Callable[..., Any]) -> Callable[..., Any]:
        function.__signature__ = inspect.signature(function).replace(return_annotation=item)  # type: ignore[attr-defined]
        return function

    return mark


def plot_frame(stats: dict[str, Any]) -> pd.DataFrame:
    # Explicit dtypes: the plot fixes its axis types from the first (empty) frame it receives.
    frame = pd.DataFrame(acceptance_rows(stats), columns=["position", "acceptance"])
    return frame.astype({"position": "string", "acceptance": "float64"})


def trace_frame(trace: SpeedTrace | None, series: str = SPEED) -> pd.DataFrame | None:
    """One chart's data: decode speed (or acceptance) so far against the tokens generated; None (an empty chart,
    without axes) before the first point."""
    rows = [{**row, "series": series} for row in trace.rows(series)] if trace else []
    if not rows:
        return None
    frame = pd.DataFrame(rows, columns=["tokens", "value", "series"])
    return frame.astype({"tokens": "int64", "value": "float64", "series": "string"})


def chart_frames(trace: SpeedTrace | None) -> tuple[pd.DataFrame | None, pd.DataFrame | None]:
    return trace_frame(trace, SPEED), trace_frame(trace, ACCEPTANCE)


def shown(frame: pd.DataFrame | None) -> Any:
    """A chart's update: shown with its data, hidden while it has none (no empty box before the first answer)."""
    return gr.update(value=frame, visible=frame is not None and not frame.empty)


def chart_updates(stats: dict[str, Any], trace: SpeedTrace | None) -> tuple[Any, Any, Any]:
    """The acceptance-by-position plot, the speed chart and the acceptance chart, each hidden while empty."""
    speed, acceptance = chart_frames(trace)
    return shown(plot_frame(stats)), shown(speed), shown(acceptance)


HIDDEN_CHARTS = (gr.update(value=None, visible=False),) * 3


def speed_up_chart(rows: list[dict[str, Any]]) -> Any:
    """The A/B chart's update: a bar per run in the table's order (plain at 1, each finished method's measured
    speed-up), on an axis from 0, hidden until a method has finished."""
    if not rows:
        return gr.update(value=None, visible=False)
    frame = pd.DataFrame(rows, columns=["method", "speed-up"]).astype({"method": "string", "speed-up": "float64"})
    top = max(row["speed-up"] for row in rows)
    return gr.update(value=frame, sort=[row["method"] for row in rows], y_lim=[0, round(top * 1.15 + 0.05, 2)],
                     visible=True)  # fmt: skip


def ab_frame(found: str, rows: list[dict[str, Any]], texts: str, button: Any) -> tuple[Any, ...]:
    """One frame of the A/B's outputs: its box, its chart (an update in every frame, made anew, never a skip after
    one: see notice_line), its texts and its button."""
    return found, speed_up_chart(rows), texts, button


def ab_cleared() -> tuple[Any, Any, Any]:
    """The A/B box, chart and texts as a new message (or a new A/B run) leaves them: empty (a new update each time:
    Gradio changes one it has sent)."""
    return "", speed_up_chart([]), ""


def notice_line(text: str) -> str:
    """The notice line under the chat ("" when it has nothing to say): its text alone, the line always mounted (an
    empty one takes no room). A plain value, never an update: Gradio streams a handler's frames as diffs against the
    frame before, and the page applies each diff in place to the previous frame's value. An update followed by a skip
    becomes "delete its properties", applied to the very object the update arrived in; when the frames reach the
    page in one burst (the result stream opened after the handler had already run, as for a refusal computed at
    once), the page reads that object only after the deletion and the update is lost. A plain value diffs into a new
    value instead, so a refusal's notice always shows."""
    return text



# -- the API --------------------------------------------------------------------------------------------------------


def own_item(reply: Reply) -> dict[str, Any]:
    """What a /chat item carries for its own text only: who wrote it, and its steps' draft lengths."""
    last = reply.last
    runs = [[n, source] for n, source in (last.source_runs if last else []) if n > 0]
    return {"source_runs": runs, "draft_lengths": list(last.draft_lengths) if last else []}


def documented_parameters(function: Callable[..., Any]) -> tuple[str, ...]:
    """The parameters a function's docstring lists under "Parameters:" (what Gradio shows of each), in order."""
    lines = (inspect.getdoc(function) or "").splitlines()
    start = lines.index("Parameters:") + 1 if "Parameters:" in lines else len(lines)
    names: list[str] = []
    for line in lines[start:]:
        if line and not line.startswith(" "):  # the next section ("Returns:")
            break
        if (found := re.match(r" {4}(\w+): ", line)) is not None:
            names.append(found.group(1))
    return tuple(names)


def api_problems(function: Callable[..., Any], parameters: tuple[str, ...] = API_PARAMETERS) -> list[str]:
    """How an endpoint's signature (but Gradio's own `request`) and documented parameters differ from `parameters`."""
    problems = []
    signature = tuple(name for name in inspect.signature(function).parameters if name != "request")
    if signature != parameters:
        problems.append(f"{function.__name__}'s signature takes {signature}, not {parameters}")
    if documented_parameters(function) != parameters:
        problems.append(f"{function.__name__}'s docstring lists {documented_parameters(function)}, not {parameters}")
    return problems


def make_api(service: SpaceService) -> tuple[Callable[..., Any], ...]:
    """The /chat, /generate, /info and /wait endpoints. Parameters keep JSON's types: integers, floats, booleans and
    strings are checked as such (service.check), never coerced."""
    preset_name = service.config.preset.name
    max_tokens_default = service.defaults["max_tokens"]

    async def answer(request: gr.Request | None, **fields: Any) -> AsyncIterator[Reply]:
        """The checked request's reply, grown chunk by chunk; the engine call ends here however the caller leaves."""
        call = call_of(request)
        try:
            with visitor_errors():
                checked = service.check(**fields)
                owner = service.owner_key(session_hash(request), call)
                async for reply in service.reply(checked, owner=owner, client=service.client(request), call=call):
                    yield reply
        finally:
            service.calls.finish(call)

    @yields(ApiReply)
    async def chat(
        message: str,
        history: list[dict[str, str]] | None = None,
        system_prompt: str = DEFAULT_SYSTEM_PROMPT,
        preset: str = preset_name,
        max_tokens: int = max_tokens_default,
        temperature: float | None = None,
        top_p: float | None = None,
        draft_max: int | None = None,
        speculative: bool = True,
        thinking: bool = False,
        method: str = AUTO,
        draft_length: int | str = AUTO,
        top_k: int | None = None,
        min_p: float | None = None,
        request: gr.Request = None,  # type: ignore[assignment] - Gradio passes the caller's, never an API parameter
    ) -> AsyncIterator[ApiReply]:
        """Stream an answer to `message`: yields (text added, statistics) after every engine step; the answer is
        the items' texts joined.

        Parameters:
            message: the new user message
            history: earlier turns, [{"role": "user" | "assistant", "content": str}, ...]; the oldest go if need be
            system_prompt: the system message (left out: the page's, "You are a helpful assistant."; "" for none)
            preset: the model pair, one of /info's presets
            max_tokens: the longest answer, in tokens (an integer in 1..limits.max_new_tokens)
            temperature: sampling temperature in [0, 2] (0 = greedy); null: the server's default (/info defaults)
            top_p: nucleus sampling in [0.01, 1]; null: the server's default
            draft_max: deprecated: use draft_length (here 0 meant "auto"); null when not used
            speculative: true for speculative decoding, false for plain decoding (same text at temperature 0)
            thinking: let the model think first (templates that support it)
            method: the draft method: "auto" (the pair's default), "dflash" or "mtp" (/info lists the pair's)
            draft_length: "auto" (adaptive) or an integer in 0..limits' capacity (0 = no draft)
            top_k: keep the k most likely tokens, 0..1000 (0 = off); null: the server's default
            min_p: drop tokens below min_p × the top probability, [0, 0.99]; null: the server's default
        Returns:
            (text added, statistics): what changed since the item before: "added" (the counts and times that
            grew, by how much), the figures whose value changed (all on the first item), source_runs and
            draft_lengths for this item's text; the last item (finish_reason set) also the complete statistics
        """
        async with aclosing(answer(
            request, message=message, history=history, system_prompt=system_prompt, preset=preset,
            max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p, method=method,
            draft_length=draft_length, draft_max=draft_max, speculative=speculative, enable_thinking=thinking,
        )) as replies:  # fmt: skip
            before: dict[str, Any] = {}  # the statistics after the item sent before
            async for reply in replies:
                yield (reply.last.delta if reply.last else "",
                       item_stats(reply.stats, before, own_item(reply), finished=reply.finish_reason is not None))
                before = reply.stats

    async def generate(
        message: str,
        history: list[dict[str, str]] | None = None,
        system_prompt: str = DEFAULT_SYSTEM_PROMPT,
        preset: str = preset_name,
        max_tokens: int = max_tokens_default,
        temperature: float | None = None,
        top_p: float | None = None,
        draft_max: int | None = None,
        speculative: bool = True,
        thinking: bool = False,
        method: str = AUTO,
        draft_length: int | str = AUTO,
        top_k: int | None = None,
        min_p: float | None = None,
        request: gr.Request = None,  # type: ignore[assignment]
    ) -> tuple[str, dict[str, Any]]:
        """The same as /chat, answered in one piece: (text, statistics).

        Parameters:
            message: the new user message
            history: earlier turns, [{"role": "user" | "assistant", "content": str}, ...]
            system_prompt: the system message (left out: the page's, "You are a helpful assistant."; "" for none)
            preset: the model pair, one of /info's presets
            max_tokens: the longest answer, in tokens
            temperature: sampling temperature in [0, 2] (0 = greedy); null: the server's default
            top_p: nucleus sampling in [0.01, 1]; null: the server's default
            draft_max: deprecated: use draft_length (here 0 meant "auto"); null when not used
            speculative: true for speculative decoding, false for plain decoding
            thinking: let the model think first (templates that support it)
            method: "auto", "dflash" or "mtp"
            draft_length: "auto" or an integer (0 = no draft)
            top_k: 0..1000 (0 = off); null: the server's default
            min_p: [0, 0.99]; null: the server's default
        """
        final: Reply | None = None
        async with aclosing(answer(
            request, message=message, history=history, system_prompt=system_prompt, preset=preset,
            max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p, method=method,
            draft_length=draft_length, draft_max=draft_max, speculative=speculative, enable_thinking=thinking,
        )) as replies:  # fmt: skip
            async for final in replies:  # noqa: B007 - the last one is the answer
                pass
        return (final.text, final.stats) if final is not None else ("", {})

    def info() -> dict[str, Any]:
        """The server: presets, defaults, limits, build, download state, run mode and any problem, the engine and the
        GPU worker as last seen, the GPU-time estimates, and what the web process has loaded."""
        return service.info()

    def wait(until: str = "idle", timeout_s: float = 60.0,
             request: gr.Request = None) -> dict[str, Any]:  # type: ignore[assignment]
        """/info, once no answer runs ("idle": e.g. a cancelled answer has stopped the engine) or one does ("busy").

        Parameters:
            until: "idle" or "busy"
            timeout_s: how long to wait, at most 120 s; `waited_out` in the reply says whether the state came
        """
        with visitor_errors():
            return service.info_when(until, timeout_s, service.client(request))

    problems = [*api_problems(chat), *api_problems(generate), *api_problems(wait, WAIT_PARAMETERS)]
    if problems:  # one declaration (API_PARAMETERS): a raw call's values are checked and placed by it
        raise TypeError("; ".join(problems))
    return chat, generate, info, wait


# -- the page -------------------------------------------------------------------------------------------------------


def page_draft_length(value: Any) -> Any:
    """The page's draft-length choice ("auto" or a digit string) as the API takes it; anything else as it came (the
    request check says what is wrong)."""
    return int(value) if isinstance(value, str) and value.isdigit() else value


def draft_length_choices(capacity: int) -> list[tuple[str, str]]:
    return [("auto (adaptive)", AUTO), ("0 (no draft)", "0"), *((str(n), str(n)) for n in range(1, capacity + 1))]


def method_choices(service: SpaceService) -> list[tuple[str, str]]:
    """The method menu: "auto" (the pair's default), then each method the pair runs (all while not known yet)."""
    methods = service.methods()
    kind = service.engine_info.get("draft_kind")
    shown = methods if methods is not None else list(registered_methods(lambda needs: True))
    default = f"auto ({method_label(methods[0], kind)})" if methods else "auto"
    return [(default, AUTO), *((method_label(m, kind), m) for m in shown)]


def method_menu_help(service: SpaceService) -> str:
    """One line for each choice of the method menu (all registered methods while the pair is not known yet)."""
    methods = service.methods()
    shown = methods if methods is not None else list(registered_methods(lambda needs: True))
    return method_help(shown, service.engine_info.get("draft_kind"), methods[0] if methods else None)


AB_MOST = 4  # draft methods one A/B compares at most: with plain, five answers, so that an A/B stays short


def ab_choices(service: SpaceService) -> tuple[list[tuple[str, str]], list[str]]:
    """The A/B's methods to pick from (each method the pair runs: label, name) and those picked before the visitor
    picks (the registry's `compared`, at most AB_MOST)."""
    methods = service.methods() or []
    kind = service.engine_info.get("draft_kind")
    return [(method_label(m, kind), m) for m in methods], ab_picked(methods, None)


def ab_picker(service: SpaceService) -> Any:
    """The A/B's method picker as the pair's methods are now known."""
    choices, picked = ab_choices(service)
    return gr.update(choices=choices, value=picked)


def ab_picked(methods: list[str], picked: list[str] | None) -> list[str]:
    """The methods an A/B compares, in the menu's order: those picked (RequestError for one the pair does not run or
    for more than AB_MOST), else those the registry compares by default."""
    if not picked:
        return [m for m in methods if compared_by_default(m)][:AB_MOST]
    if not isinstance(picked, list) or not all(isinstance(m, str) for m in picked):
        raise RequestError(f"the A/B's methods must be a list of method names, got {picked!r:.80}")
    unknown = [m for m in picked if m not in methods]
    if unknown:
        raise RequestError(f"the A/B cannot compare {', '.join(unknown)!s:.80}: the pair runs {', '.join(methods)}")
    if len(set(picked)) > AB_MOST:
        raise RequestError(f"an A/B compares at most {AB_MOST} methods with plain decoding; {len(set(picked))} were "
                           "picked")
    return [m for m in methods if m in picked]


AB_LABEL = "A/B: same prompt, plain vs draft methods"
AB_WAITS = "A/B: once this answer has finished"  # the button while the conversation's answer runs
AB_RUNNING = "A/B running: plain, then each draft method…"  # the button while its own run goes on


def ab_button(ready: bool, running: bool = False) -> Any:
    """The A/B button: usable, or greyed out saying what goes on: its own run, or an answer of the conversation (an
    A/B run then would be refused for its answers at once)."""
    label = AB_LABEL if ready else AB_RUNNING if running else AB_WAITS
    return gr.update(value=label, interactive=ready)


def engine_sharing(service: SpaceService) -> str:
    """The note on top of the settings column: how many answers run at once (a most until `auto` has sized the
    engine)."""
    return sharing_note(service.parallel, until_loaded=service.config.preset.parallel_fit and not service.engine_info)


def sampling_values(defaults: dict[str, Any]) -> str:
    return (f"temperature {defaults['temperature']:g}, top-p {defaults['top_p']:g}, top-k {defaults['top_k']}, "
            f"min-p {defaults['min_p']:g}")  # fmt: skip


def sampling_note(service: SpaceService) -> str:
    """Where the sampling controls' starting values come from, and what they are (also what an API request that
    leaves one out gets)."""
    values = sampling_values(service.defaults)
    if service.sampling_source == MODEL_DEFAULTS:
        return (f"*Sampling starts as the model recommends ({MODEL_DEFAULTS} keys of its GGUF file): {values}. An "
                "API request that leaves one out gets it too.*")
    why = ("the target's file recommends none (no `general.sampling.*` keys)" if service.file_facts
           else "the target's file is not read yet; its own recommendation, if it has one, replaces them then")
    return (f"*Sampling starts from the server's defaults: {values}; temperature 0 is greedy decoding, the same "
            f"text with or without the draft. Here {why}.*")


class PageHandlers:
    """The page's event handlers. Each returns (or yields) its outputs in the order its docstring lists.

    A message goes out in two events: `submit` (outside the queue, at once) checks it and shows it in the chat, or
    says why it is refused; `respond` (in the engine's queue) answers it. So a visitor's message shows while it
    waits for another visitor's answer, and nothing the page sends raises: a refused message or a failed answer is
    told in the notice line and a toast, the chat and the message box stay usable (Gradio would cover every output
    of an event that raised with an error overlay)."""

    def __init__(self, service: SpaceService) -> None:
        self.service = service
        self.built_defaults = dict(service.defaults)  # the values the page's controls were built with
        self.built_ab = ab_choices(service)  # the A/B's methods to pick from, and the picks, the page was built with

    def about(self) -> str:
        service = self.service
        if service.config.zero_gpu:
            device = f"ZeroGPU, {service.config.gpu_size or 'large'} slice, allocated per request"
        else:
            gpus = [d.get("name") or "GPU" for d in service.config.build.get("cuda_devices") or []]
            device = ", ".join(gpus) if gpus else "CPU"
        sampling = f"{sampling_values(service.defaults)} (from {service.sampling_source})"
        lines = {"llama.cpp build": service.config.build_status, "Device": device, "Mode": service.config.mode.reason,
                 "Sampling defaults": sampling}  # fmt: skip
        if service.draft_problem() and not service.engine_info:
            lines["⚠️ Draft"] = service.draft_problem()
        return info_markdown(service.config.preset, service.limits, lines, service.engine_info)

    def _settings(self, values: tuple[Any, ...]) -> dict[str, Any]:
        (system_prompt, max_tokens, temperature, top_p, top_k, min_p, method, draft_length, speculative,
         thinking) = values  # fmt: skip
        return {
            "preset": self.service.config.preset.name, "system_prompt": system_prompt, "max_tokens": max_tokens,
            "temperature": temperature, "top_p": top_p, "top_k": top_k, "min_p": min_p, "method": method,
            "draft_length": page_draft_length(draft_length), "speculative": speculative, "enable_thinking": thinking,
        }  # fmt: skip

    @staticmethod
    def _told(error: Exception, what: str, toast: bool = True) -> Any:
        """The notice line's update for a refused message or a failed answer, with a toast saying the same (only a
        queued event can show one: elsewhere Gradio writes it to the server's log as a Python warning)."""
        title, message = visitor_message(error)
        if toast:
            gr.Warning(f"{what}: {message}", title=title)
        return notice_line(f"⚠️ **{what}:** {message}")

    def submit(self, message: str, session: ChatSession, *settings: Any) -> tuple[Any, ...]:
        """Inputs: message, session, then the settings (system prompt, max tokens, temperature, top-p, top-k, min-p,
        method, draft length, speculative, thinking). Outputs: chatbot, message box, notice, A/B box, A/B chart, A/B
        texts, statistics, details, acceptance plot, speed chart, acceptance chart, A/B button. Shows the message at
        once and leaves it to `respond`; a refused message stays in the box, the notice says why, and the statistics
        are cleared (as for a message the GPU function refuses)."""
        return self._send(message, session, settings)

    def _send(self, message: str, session: ChatSession, settings: tuple[Any, ...],
              keep: int | None = None) -> tuple[Any, ...]:  # fmt: skip
        """A message as every message goes out (typed, an example, a retry, an edit): checked as the API checks it
        against the conversation it follows (its first `keep` messages; all by default), shown, and left to
        `respond`, which answers it in the engine's queue under the same admission as any answer."""
        skip = gr.skip()
        if session.busy():  # said in the notice line: this event is not queued, so it can show no toast
            busy = "⚠️ The previous answer is still running: wait for it, or press Stop."
            return skip, skip, notice_line(busy), *(skip,) * 9
        history = session.messages if keep is None else session.messages[:keep]
        try:
            request = self.service.check(message=message, history=history, **self._settings(settings))
        except RequestError as error:
            return (skip, skip, self._told(error, "Not sent", toast=False), skip, skip, skip, REFUSED_STATS,
                    EMPTY_DETAILS, *HIDDEN_CHARTS, skip)  # fmt: skip
        _, shown = session.start_turn(message, request, keep)
        return shown, "", notice_line(""), *ab_cleared(), skip, skip, skip, skip, skip, ab_button(False)

    def retry(self, session: ChatSession, *settings: Any) -> tuple[Any, ...]:
        """Inputs: session, then the settings. Outputs: as `submit`. The chat's retry: the last message sent again in
        place of its answer, as a new message after the turns before it (the same checks, queue and admission; at
        temperature 0 the same text as sending it anew). The message box is left as it is."""
        last = session.user_turn(-1)
        if last is None:
            return (gr.skip(),) * 12
        message, keep = last
        shown, _, *rest = self._send(message, session, settings, keep)
        return (shown, gr.skip(), *rest)

    def edit(self, data: gr.EditData, shown: list[dict[str, Any]], session: ChatSession,
             *settings: Any) -> tuple[Any, ...]:  # fmt: skip
        """Inputs: the chat (as shown), session, then the settings. Outputs: as `submit`. The chat's edit of a message
        of the visitor's: that message, edited, sent in its place as a new message after the turns before it; the
        turns after it are taken back. Refused, the chat shows the conversation as it was."""
        index = data.index[0] if isinstance(data.index, list | tuple) else data.index
        k = sum(1 for message in shown[:index] if message.get("role") == "user")
        turn = session.user_turn(k)
        if turn is None:
            return (session.shown(), *(gr.skip(),) * 11)
        sent = self._send(typed_user_text(str(data.value)), session, settings, turn[1])
        # Refused (or busy), the chat shows the conversation as it was: the page had put the edit in its own copy.
        return (sent[0] if isinstance(sent[0], list) else session.shown(), gr.skip(), *sent[2:])

    def undo(self, session: ChatSession) -> tuple[Any, ...]:
        """Inputs: session. Outputs: chatbot, message box, notice, statistics, details, acceptance plot, speed
        chart, acceptance chart. The chat's undo: the last turn taken back, its message back in the box (not while
        an answer runs: Stop first)."""
        skip = gr.skip()
        last = session.user_turn(-1)
        if session.busy() or last is None:
            busy = "⚠️ The answer is still running: press Stop first." if last is not None else ""
            return skip, skip, notice_line(busy), *(skip,) * 5
        message, keep = last
        return (session.take_back(keep), message, notice_line(""), EMPTY_STATS, EMPTY_DETAILS,
                *HIDDEN_CHARTS)  # fmt: skip

    def submit_example(self, example: list[str], session: ChatSession, *settings: Any) -> tuple[Any, ...]:
        """Inputs: the clicked example (the examples' one value), session, then the settings. Outputs: as `submit`.
        Sends the example as if typed and sent; refused, it stays in the box (as a typed message does)."""
        message = str(example[0]) if example else ""
        shown, box, *rest = self._send(message, session, settings)
        sent = box == ""  # `submit` empties the box of a message it sent, and leaves it as it is otherwise
        return (shown, box if sent else message, *rest)

    async def respond(self, session: ChatSession, request: gr.Request) -> AsyncIterator[tuple[Any, ...]]:
        """Inputs: session. Outputs: chatbot, message box, statistics, details, acceptance plot, speed chart,
        acceptance chart, notice, thinking switch, info box, A/B button. Answers the turn `submit` showed. The chat
        shows every step; the plots follow the work done: they change when the answer has grown by another stretch
        of tokens, and at its end. Stop ends the answer on the server; the statistics then say so. The A/B button
        is usable again once the answer has ended, however it ended."""
        call = call_of(request)
        try:
            async with aclosing(self._respond(session, call, self.service.client(request))) as frames:
                async for frame in frames:
                    yield (*frame, gr.skip())
            # Usable again once the answer has ended (not when this event found a turn another one answers).
            yield (gr.skip(),) * 10 + (gr.skip() if session.busy() else ab_button(True),)
        finally:
            self.service.calls.finish(call)

    async def _respond(self, session: ChatSession, call: str | None,
                       client: ClientIdentity) -> AsyncIterator[tuple[Any, ...]]:  # fmt: skip
        skip = gr.skip()
        pending = session.take_pending()
        if pending is None:  # stopped or cleared while it waited in the queue: nothing changes
            yield (skip,) * 10
            return
        epoch, request = pending
        trace = SpeedTrace(point_every(request.max_tokens))
        speed_up = LiveSpeedUp()
        yield skip, skip, WAITING_STATS, EMPTY_DETAILS, *HIDDEN_CHARTS, skip, skip, skip
        reply: Reply | None = None
        try:
            while await self.service.poll_files() is None:
                status = f"*Downloading the model pair: {self.service.config.download.status().summary()}*"
                yield skip, skip, status, skip, skip, skip, skip, skip, skip, skip
            notice, first = None, True
            async for reply in self.service.reply(request, owner=session.owner, client=client, latest_only=True,
                                                  session=session, call=call):  # fmt: skip
                done = reply.finish_reason is not None
                shown = session.show_reply(epoch, reply.text, reply.sources.chunks, done)
                if shown is None:  # cleared meanwhile: this answer belongs to no conversation
                    break
                session.last_stats = reply.stats
                speed_up.add(reply.stats)
                plot = speed = acceptance = skip
                if trace.add(reply.stats, final=reply.finish_reason is not None):
                    plot, speed, acceptance = chart_updates(reply.stats, trace)
                notice_update = skip
                if reply.notice and reply.notice != notice:
                    notice = reply.notice
                    notice_update = notice_line(f"⚠️ {notice}")
                    gr.Warning(notice)
                thinking = info = skip
                if first:  # the engine is known now: the thinking switch and the info box can say so
                    first = False
                    thinking = gr.update(visible=bool(self.service.engine_info.get("supports_thinking")))
                    info = self.about()
                estimate = speed_up.current(reply.stats)
                yield (shown, skip, stats_summary(reply.stats, estimate), stats_details(reply.stats, estimate), plot,
                       speed, acceptance, notice_update, thinking, info)  # fmt: skip
        except Exception as error:  # told, not raised: see the class doc
            restored = session.undo_turn(epoch)  # the failed turn leaves the chat; its message goes back to the box
            box = request.message if restored is not None else skip
            # A message too long for the context is not sent, as one too long in characters (see `submit`), and
            # clears the statistics the same way.
            refused = too_long(error)
            told = self._told(error, "Not sent" if refused else "No answer")
            panel = REFUSED_STATS if refused else "*No answer (the notice under the chat says why).*"
            yield restored or skip, box, panel, EMPTY_DETAILS, *HIDDEN_CHARTS, told, skip, skip
            return
        if not session.is_current(epoch):
            # Cleared: this event's last word empties what it showed (Clear's own outputs may arrive before frames
            # this event sent earlier).
            yield [], skip, EMPTY_STATS, EMPTY_DETAILS, *HIDDEN_CHARTS, skip, skip, skip
            return
        if reply is None:
            return
        final, panel = reply.stats, (skip,) * 5
        if reply.finish_reason is None and session.last_stats:  # stopped: say so, chart it
            final = {**session.last_stats, "finish_reason": "stopped", "finish_detail": "by you"}
            trace.add(final, final=True)
            estimate = speed_up.current(final)
            panel = (stats_summary(final, estimate), stats_details(final, estimate), *chart_updates(final, trace))
        ended = session.end_reply(epoch, speed_badge(final, speed_up.current(final)))  # its last word, its badge
        yield ended if ended is not None else skip, skip, *panel, skip, skip, skip

    def comparison_phases(self, picked: list[str] | None = None) -> tuple[tuple[str, ...], dict[str, str]]:
        """The A/B run's phases (plain decoding, then the draft methods picked, in the menu's order; none picked: those
        the registry compares by default) and each method's row name. RequestError for a pick the pair does not run
        or for more than AB_MOST methods."""
        methods = self.service.methods()
        if methods is None:  # not known yet (the files are still coming): the pair's default method
            return ("plain", "speculative"), {"speculative": "Speculative (default method)"}
        kind = self.service.engine_info.get("draft_kind")
        chosen = ab_picked(methods, picked)
        return ("plain", *chosen), {m: method_label(m, kind) for m in chosen}

    def comparison_weight(self) -> int:
        """How many answers an A/B run is at most (what the queue's limits count it as): plain and AB_MOST methods."""
        return 1 + min(AB_MOST, len(self.service.methods() or ["speculative"]))

    def compare_start(self, session: ChatSession, typed: str, picked: list[str] | None) -> tuple[Any, ...]:
        """Inputs: session, message box, the A/B's methods. Outputs: the A/B box, the A/B chart, the A/B texts, the
        A/B button. At once, outside the queue: what the A/B will run, under its button (the run itself may wait in
        the queue behind other visitors' answers)."""
        if session.busy():
            return (("⚠️ **A/B not started:** an answer of this conversation is still running. Wait for it to "
                     "finish (or press Stop), then click A/B again."), gr.skip(), gr.skip(), gr.skip())  # fmt: skip
        if session.last_prompt() is None and not typed.strip():
            return ("*Send a message first (or type one): the A/B run repeats a prompt.*", gr.skip(), gr.skip(),
                    gr.skip())  # fmt: skip
        try:
            _, labels = self.comparison_phases(picked)
        except RequestError as error:
            return f"⚠️ **A/B not started:** {error}", gr.skip(), gr.skip(), gr.skip()
        return (f"**A/B starting:** the prompt with plain decoding, then with {', '.join(labels.values())}, all with "
                "the same seed…", *ab_cleared()[1:], ab_button(False, running=True))  # fmt: skip

    async def compare(self, request: gr.Request, session: ChatSession, typed: str, picked: list[str] | None,
                      *settings: Any) -> AsyncIterator[tuple[Any, ...]]:  # fmt: skip
        """Inputs: session, message box, the A/B's methods, then the settings. Outputs: the A/B box, the A/B chart,
        the A/B texts, the A/B button. Repeats the last prompt (or the typed message) with plain decoding, then with
        each draft method picked, in one GPU call, all with the same seed: the findings and a table, the speed-ups
        as a chart beside them, the texts side by side once every run has finished."""
        call = call_of(request)
        found: tuple[Any, Any, Any] | None = None
        try:
            frames = self._compare(session, typed, picked, settings, call, self.service.client(request))
            async with aclosing(frames):
                async for found in frames:
                    yield ab_frame(*found, gr.skip())
            # The last frame again, made anew (Gradio changes an update it has sent): a skip after the chart's update
            # would undo it when the frames reach the page in a burst (see notice_line).
            yield ab_frame(*found, ab_button(True)) if found else (gr.skip(),) * 3 + (ab_button(True),)
        finally:
            self.service.calls.finish(call)

    async def _compare(self, session: ChatSession, typed: str, picked: list[str] | None, settings: tuple[Any, ...],
                       call: str | None,
                       client: ClientIdentity) -> AsyncIterator[tuple[str, list[dict[str, Any]], str]]:  # fmt: skip
        """The A/B's frames as plain data: its findings (Markdown), the chart's bars, the texts side by side."""
        last = session.last_prompt()
        if last is None and not typed.strip():  # compare_start said so
            return
        if session.busy():  # compare_start said so; the conversation's own answer runs
            return
        message, earlier = last if last is not None else (typed, session.messages)
        try:
            request = self.service.check(message=message, history=earlier, **self._settings(settings))
            request = replace(request, seed=random.randrange(2**31))
            phases, labels = self.comparison_phases(picked)
            yield f"**A/B running: {PLAIN_LABEL}** (1 of {len(phases)})…", [], ""
            comparison = Comparison(request.temperature, request.seed, labels)
            async for reply in self.service.reply(request, phases, owner=session.owner, client=client,
                                                  latest_only=True, session=session, call=call):  # fmt: skip
                found = comparison.add(reply)
                yield found, list(comparison.chart_rows), texts_side_by_side(comparison.texts)
        except Exception as error:  # told, not raised: see the class doc
            _, text = visitor_message(error)
            yield f"⚠️ **A/B not run:** {text}", [], ""

    def highlight(self, session: ChatSession, on: bool) -> list[dict[str, str]]:
        """Inputs: session, highlight switch. Output: chatbot. Shows the conversation with or without the draft's
        text highlighted (a running answer follows on its next step)."""
        return session.set_highlight(bool(on))

    def stop(self, session: ChatSession) -> Any:
        """Inputs: session. Output: the A/B button. Stops the running answer (it stays in the chat as far as it got;
        its statistics say it stopped), the message still waiting in the queue, or the A/B run."""
        session.stop()
        return ab_button(True)

    def clear(self, session: ChatSession) -> tuple[Any, ...]:
        """Inputs: session. Outputs: chatbot, message box, statistics, details, acceptance plot, speed chart,
        acceptance chart, notice, A/B box, A/B chart, A/B texts, A/B button. Stops the running answer and forgets
        the conversation."""
        session.clear()
        return ([], "", EMPTY_STATS, EMPTY_DETAILS, *HIDDEN_CHARTS, notice_line(""), *ab_cleared(),
                ab_button(True))  # fmt: skip

    def page_load(self) -> tuple[Any, ...]:
        """Outputs: thinking switch, info box, temperature, top-p, top-k, min-p, sampling note, method, method help,
        sharing note, the A/B's methods.
        The sampling controls start from the server's current defaults (the model's own once its header is read)."""
        service = self.service
        supports = service.engine_info.get("supports_thinking", True)
        # Only defaults learnt since the page was built are sent: an unchanged control is left to the visitor, who
        # may already have moved it.
        sampling = [gr.skip() if service.defaults[name] == self.built_defaults[name]
                    else gr.update(value=service.defaults[name])
                    for name in ("temperature", "top_p", "top_k", "min_p")]  # fmt: skip
        # The A/B's picks likewise: sent only when the methods to pick from changed (a visitor's picks stay).
        ab = gr.skip() if ab_choices(service) == self.built_ab else ab_picker(service)
        return (gr.update(visible=bool(supports)), self.about(), *sampling, sampling_note(service),
                gr.update(choices=method_choices(service)), method_menu_help(service), engine_sharing(service), ab)

    def download_tick(self) -> tuple[Any, ...]:
        """Outputs: download box, timer."""
        status = self.service.config.download.status()
        if status.state == "done":
            return gr.update(visible=False), gr.Timer(active=False)
        return gr.update(value=f"**Model download:** {scrub_paths(status.summary())}", visible=True), gr.skip()
