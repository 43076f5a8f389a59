"""Reading a request body within limits: JSON only (415 otherwise: a web page can post text/plain or a form to a
local server without asking, never JSON), its size (413 before the whole body is in memory), its pace (408 when it
does not arrive in time), its depth (a body nested thousands deep is a 400, not a RecursionError and a 500) and its
text (a lone surrogate, valid JSON but no Unicode text, is a 400 naming the field)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from .errors import APIError, bad_request

if TYPE_CHECKING:
    from fastapi import Request

MAX_DEPTH = 32  # no field of any route nests deeper than a few levels
MAX_REQUEST_BYTES = 2 * 1024 * 1024  # default limit: a full 8k-token context is ~40 KB of text or ids
BODY_TIMEOUT = 30.0  # default seconds a body may take to arrive in full: ample for the largest allowed body


def too_large(limit: int) -> APIError:
    return APIError(413, f"the request body is larger than this server's limit of {limit} bytes "
                         "(--max-request-bytes)", code="request_too_large")


def is_json(content_type: str | None) -> bool:
    """application/json or application/<anything>+json, parameters (charset) aside."""
    kind = (content_type or "").split(";")[0].strip().lower()
    return kind == "application/json" or (kind.startswith("application/") and kind.endswith("+json"))


async def read_body(request: Request, limit: int, timeout: float = BODY_TIMEOUT) -> bytes:
    """The raw JSON body; 415 if it is not JSON, 413 as soon as it (or its announced Content-Length) passes `limit`
    bytes, 408 if it has not arrived in full within `timeout` seconds."""
    if not is_json(request.headers.get("content-type")):
        raise APIError(415, "the body must be JSON: send 'Content-Type: application/json'", param="content-type",
                       code="unsupported_media_type")
    announced = request.headers.get("content-length")
    if announced is not None and announced.isdigit() and int(announced) > limit:
        raise too_large(limit)
    chunks: list[bytes] = []
    size = 0
    deadline = time.monotonic() + timeout
    parts = request.stream().__aiter__()
    while True:
        try:
            chunk = await asyncio.wait_for(parts.__anext__(), max(0.0, deadline - time.monotonic()))
        except StopAsyncIteration:
            return b"".join(chunks)
        except TimeoutError:
            raise APIError(408, f"the request body did not arrive within {timeout:g} s", code="request_timeout",
                           headers={"Connection": "close"}) from None
        size += len(chunk)
        if size > limit:
            raise too_large(limit)
        chunks.append(chunk)


def parse_json(raw: bytes) -> object:
    """JSON, or a 400 that says what is wrong (runs in a worker thread: a large body takes a while)."""
    try:
        value = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise bad_request(f"the body is not valid JSON: {e}") from None
    except RecursionError:
        raise nested_too_deeply() from None
    if depth(value) > MAX_DEPTH:
        raise nested_too_deeply()
    return value


def nested_too_deeply() -> APIError:
    return bad_request(f"the body nests objects or arrays more than {MAX_DEPTH} levels deep")


def depth(value: object) -> int:
    """Nesting depth of parsed JSON, without recursion (a scalar is 0, `[]` is 1); a string that is not Unicode text
    (a lone surrogate such as "\\ud800", which JSON allows) is a 400 naming its top-level field."""
    deepest = 0
    stack: list[tuple[object, int, str | None]] = [(value, 0, None)]
    while stack:
        node, level, field = stack.pop()
        children: Iterable[tuple[Any, str | None]]
        if isinstance(node, dict):
            for key in node:
                check_text(key, field or key)
            children = ((child, field or key) for key, child in node.items())
        elif isinstance(node, list):
            children = ((child, field) for child in node)
        else:
            if isinstance(node, str):
                check_text(node, field)
            deepest = max(deepest, level)
            continue
        deepest = max(deepest, level + 1)
        stack.extend((child, level + 1, name) for child, name in children)
    return deepest


def check_text(text: str, field: str | None) -> None:
    try:
        text.encode()
    except UnicodeEncodeError as e:
        raise bad_request(f"{field or 'the body'}: a string holds a lone surrogate ({text[e.start]!r} at character "
                          f"{e.start}), which is not Unicode text; send each character whole (a pair of \\u escapes "
                          "for characters beyond U+FFFF)", param=field) from None
