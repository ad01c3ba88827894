"""OpenAI's error body: ``{"error": {"message", "type", "param", "code"}}`` with its status."""

from __future__ import annotations

from typing import Any

# OpenAI's error types by status (what its API sends and its clients expect).
TYPES: dict[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
}


class ApiError(Exception):
    """A refused request: becomes OpenAI's error body with ``status``."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        fallback = "server_error" if status >= 500 else "invalid_request_error"
        self.type = type or TYPES.get(status, fallback)
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def bad(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    """A 400 invalid_request_error."""
    return ApiError(400, message, param=param, code=code)
