"""Errors of the OpenAI front end, in the OpenAI error format, and how ``llm``'s errors map to them.

Body: ``{"error": {"message", "type", "param", "code"}}``, with the HTTP status of the failure:
400 a bad request (``invalid_request_error``), 404 an unknown model or route, 503 Triton or ``llm`` not
available (not started, not ready, at its limit, or shedding load: then with ``Retry-After``, from the
error's "retry after N s"), 504 the server's own deadline, 500 anything else.
"""

from __future__ import annotations

import math
import re
from typing import Any

INVALID_REQUEST = "invalid_request_error"
SERVER_ERROR = "server_error"


class ApiError(Exception):
    """One failed request: HTTP status, client-safe message, and the OpenAI ``type``/``param``/``code``."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = INVALID_REQUEST,
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        hint = _RETRY.search(message) if status == 503 else None
        self.retry_after_s = math.ceil(float(hint.group(1))) if hint else None
        """Seconds for a ``Retry-After`` header: the server's hint, when it shed the request."""
        self.retry_after_ms = round(float(hint.group(1)) * 1000) if hint else None
        """The same hint to the millisecond (``retry-after-ms``, which OpenAI's SDKs read first)."""

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, INVALID_REQUEST, param, code)


def model_not_found(model: str) -> ApiError:
    return ApiError(404, f"The model '{model}' does not exist.", INVALID_REQUEST, "model", "model_not_found")


def unavailable(message: str) -> ApiError:
    return ApiError(503, message, SERVER_ERROR, None, "service_unavailable")


_RETRY = re.compile(r"retry after (\d+(?:\.\d+)?) s")

# ``llm`` called with ``return_error_code`` starts each error's message with its code (text_api).
_CODED = re.compile(r"^(INVALID_ARG|UNAVAILABLE|CANCELLED|DEADLINE_EXCEEDED|INTERNAL): (.*)$", re.S)
_STATUS = {
    "INVALID_ARG": (400, INVALID_REQUEST, None),
    "UNAVAILABLE": (503, SERVER_ERROR, "service_unavailable"),
    "CANCELLED": (503, SERVER_ERROR, "cancelled"),
    "DEADLINE_EXCEEDED": (504, SERVER_ERROR, "timeout"),
    "INTERNAL": (500, SERVER_ERROR, "internal_error"),
}


def from_llm(message: str) -> ApiError | None:
    """The ApiError of an error message coded by ``llm``; None for a message without a code (one of
    Triton's own, e.g. the model is not loaded: the caller decides with a readiness check)."""
    match = _CODED.match(message)
    if match is None:
        return None
    status, kind, code = _STATUS[match.group(1)]
    return ApiError(status, match.group(2), kind, None, code)
