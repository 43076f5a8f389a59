"""Errors in OpenAI's shape: {"error": {"message", "type", "param", "code"}} with the matching HTTP status."""

from __future__ import annotations


class APIError(Exception):
    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def overloaded(message: str) -> APIError:
    return APIError(503, message, type="server_overloaded", code="queue_full", headers={"Retry-After": "1"})
