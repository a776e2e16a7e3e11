"""The /v1 routes (dflash_runtime.openai_api) on the Space's own server: the path of /chat, its HTTP connection its
reader; a /v1 answer is no conversation's (it reuses and teaches nothing). On ZeroGPU, which charges a GPU call to the
visitor of its Gradio event, they answer 503 saying where they are served."""

from __future__ import annotations

import os
import secrets
from collections.abc import AsyncIterator, Mapping
from dataclasses import replace
from functools import partial
from typing import Any

from ...errors import RequestError
from ...openai_api.errors import bad_field, busy, from_runtime, over_limit, unavailable
from ...openai_api.fields import CHAT, ApiRequest
from ...openai_api.server import Caller, Progress, V1Api
from ..requests import ChatRequest
from .calls import AdmissionError
from .clients import client_identity
from .policy import FairShare
from .service import SpaceService, WorkerError

ZERO_GPU_REFUSAL = (
    "the /v1 API is not served on a ZeroGPU Space: ZeroGPU schedules (and charges) a GPU call for the visitor of "
    "the Gradio event it runs in, and an HTTP request to /v1 is no Gradio event. Use the Space's Gradio API "
    "(gradio_client, /chat), or run the same API on dedicated hardware (duplicate the Space onto a GPU) or locally: "
    "python -m dflash_runtime serve TARGET DRAFT"
)
# A request check names the Space's fields; the API's own names for them.
API_NAMES = {"message": "messages", "history": "messages", "system_prompt": "messages", "max_tokens": "max_tokens",
             "temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
             "thinking": "chat_template_kwargs.enable_thinking", "preset": "model"}  # fmt: skip
FINAL_FIELDS = ("finish_reason", "finish_detail", "notice", "gpu_seconds_requested", "gpu_seconds_used", "preset")


def conversation(messages: tuple[dict[str, str], ...]) -> dict[str, Any]:
    """The API's messages as the Space's request holds them: the system prompt, the history and the user's message."""
    system = next((index for index, message in enumerate(messages) if message["role"] != "system"), len(messages))
    for index in range(system, len(messages)):
        if messages[index]["role"] == "system":
            raise bad_field(f"messages[{index}].role", "system messages go at the start of the conversation")
    if system == len(messages) or messages[-1]["role"] != "user":
        raise bad_field(f"messages[{len(messages) - 1}].role", "the last message must be the user's")
    return {"system_prompt": "\n\n".join(m["content"] for m in messages[:system]),
            "history": list(messages[system:-1]), "message": messages[-1]["content"]}  # fmt: skip


class SpaceBackend:
    """The Space's service as a /v1 backend."""

    def __init__(self, service: SpaceService) -> None:
        self.service = service

    def models(self) -> list[str]:
        return [self.service.config.preset.name]

    def check(self, request: ApiRequest) -> ChatRequest:
        service = self.service
        fields: dict[str, Any] = conversation(request.messages) if request.kind == CHAT else {"message": request.prompt}
        fields.update(preset=self.models()[0], max_tokens=request.max_tokens or service.defaults["max_tokens"],
                      temperature=request.temperature, top_p=request.top_p, top_k=request.top_k,
                      min_p=request.min_p, enable_thinking=bool(request.enable_thinking))  # fmt: skip
        try:
            checked = service.check(**fields)
        except RequestError as error:
            raise bad_field(API_NAMES.get(str(error).split(" ", 1)[0], "messages"), str(error)) from None
        return replace(checked, seed=request.seed, stop=request.stop, raw_prompt=request.kind != CHAT)

    async def answer(self, request: ApiRequest, caller: Caller) -> AsyncIterator[Progress]:
        if self.service.config.zero_gpu:
            raise unavailable(ZERO_GPU_REFUSAL)
        checked, calls = self.check(request), self.service.calls
        client = client_identity(caller.headers.items(), caller.address, calls.settings.trusted_proxy_hops)
        reader = calls.apply(FairShare.opened, f"v1:{secrets.token_hex(8)}")  # this connection, the call's one reader
        call = calls.apply(FairShare.admit, client.key, reader.session, 1)
        if isinstance(call, str):
            calls.apply(FairShare.closed, reader)
            raise over_limit(call.replace("this session", "this connection"))
        caller.on_write.append(partial(calls.apply, FairShare.sending, reader))
        try:  # owner "": nobody's cache; the call: abandoned with its reader
            async for reply in self.service.reply(checked, owner="", client=client, call=call):
                if (chunk := reply.last) is not None:
                    final = reply.finish_reason is not None
                    extra = {key: reply.stats.get(key) for key in FINAL_FIELDS} if final else None
                    yield Progress(chunk.delta, reply.finish_reason, reply.stats if final else {}, extra)
        except AdmissionError as error:  # its place was taken before it started
            raise over_limit(str(error)) from None
        except (RequestError, WorkerError) as error:  # the engine slot's or the GPU worker's wait ran out
            runtime = isinstance(error, WorkerError) and error.kind != "RequestError"  # or the runtime's error
            raise from_runtime(error) if runtime else busy(str(error)) from None
        finally:
            calls.apply(FairShare.closed, reader)
            calls.finish(call)


def v1_app(service: SpaceService, env: Mapping[str, str] | None = None) -> Any:
    """The /v1 routes over the service, the HTTP gate's `v1`; `DFLASH_API_KEY`: the key asked."""
    env = os.environ if env is None else env
    api = V1Api(SpaceBackend(service), api_key=env.get("DFLASH_API_KEY") or None,
                max_body_bytes=service.calls.settings.max_body_bytes)  # fmt: skip
    return api.app()
