"""Errors in OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, with the HTTP status each one gets:
a bad field 400 (naming it), a missing or wrong API key 401, an unknown model or route 404, over a limit 429, the
engine busy 503. The runtime's own errors map onto them; only the server's own failures are a 500."""

from __future__ import annotations

from typing import Any

from ..errors import DFlashError, EngineBusyError, PromptTooLongError, RequestError

INVALID = "invalid_request_error"


class ApiError(Exception):
    """An answer that is an error: its status and OpenAI's error object."""

    def __init__(self, status: int, message: str, *, type: str = INVALID, param: str | None = None,
                 code: str | None = None) -> None:  # fmt: skip
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_field(param: str, message: str) -> ApiError:
    return ApiError(400, message, param=param, code="invalid_value")


def unknown_model(model: str, served: list[str]) -> ApiError:
    return ApiError(404, f"the model {model!r} does not exist here; this server serves {', '.join(map(repr, served))}",
                    param="model", code="model_not_found")  # fmt: skip


def over_limit(message: str) -> ApiError:
    return ApiError(429, message, type="rate_limit_error", code="rate_limit_exceeded")


def busy(message: str) -> ApiError:
    return ApiError(503, message, type="server_error", code="engine_busy")


def unavailable(message: str) -> ApiError:
    """The API is not served where it was asked (e.g. a ZeroGPU Space): 503, saying where it is."""
    return ApiError(503, message, type="server_error", code="not_served_here")


def unauthorized() -> ApiError:
    return ApiError(401, "a valid API key is needed: send it as 'Authorization: Bearer <key>'",
                    code="invalid_api_key")  # fmt: skip


def from_runtime(error: DFlashError, fields: tuple[str, ...] = ()) -> ApiError:
    """A runtime error as the API answers it. A request check's message starts with the field it names; when that
    is one of `fields` (the request's own names), it becomes the error's `param`."""
    message = str(error)
    if isinstance(error, PromptTooLongError) or getattr(error, "kind", None) == PromptTooLongError.__name__:
        return ApiError(400, message, param="messages", code="context_length_exceeded")
    if isinstance(error, EngineBusyError) or getattr(error, "kind", None) == EngineBusyError.__name__:
        return busy(message)
    if isinstance(error, RequestError) or getattr(error, "kind", None) == RequestError.__name__:
        first = message.split(" ", 1)[0]
        return ApiError(400, message, param=first if first in fields else None, code="invalid_value")
    return ApiError(500, message, type="server_error", code="server_error")
