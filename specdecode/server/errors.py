"""Errors in OpenAI's shape: {"error": {"message", "type", "param", "code"}} with the matching HTTP status."""

from __future__ import annotations

import logging
import uuid

log = logging.getLogger("specdecode.server")


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


def internal_error(what: str, error: BaseException | None = None) -> APIError:
    """A 500 that tells the client nothing of the server's insides: the exception goes to the log under an id,
    the client gets the id to quote."""
    error_id = uuid.uuid4().hex[:12]
    log.error("%s [error id %s]", what, error_id, exc_info=error if error is not None else True)
    return APIError(500, f"{what}; the server logged the details under error id {error_id}", type="server_error",
                    code="internal_error")
