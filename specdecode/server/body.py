"""Reading a request body within limits: its size (413 before the whole body is in memory) and its depth
(a body nested thousands deep is a 400, not a RecursionError and a 500)."""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from .errors import APIError, bad_request

if TYPE_CHECKING:
    from fastapi import Request

MAX_DEPTH = 32  # no field of any route nests deeper than a few levels
MAX_REQUEST_BYTES = 2 * 1024 * 1024  # default limit: a full 8k-token context is ~40 KB of text or ids


def too_large(limit: int) -> APIError:
    return APIError(413, f"the request body is larger than this server's limit of {limit} bytes "
                         "(--max-request-bytes)", code="request_too_large")


async def read_body(request: Request, limit: int) -> bytes:
    """The raw body, or 413 as soon as it (or its announced Content-Length) passes `limit` bytes."""
    announced = request.headers.get("content-length")
    if announced is not None and announced.isdigit() and int(announced) > limit:
        raise too_large(limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


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
    """Nesting depth of parsed JSON, without recursion (a scalar is 0, `[]` is 1)."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        node, level = stack.pop()
        children: Iterable[Any]
        if isinstance(node, dict):
            children = node.values()
        elif isinstance(node, list):
            children = node
        else:
            deepest = max(deepest, level)
            continue
        deepest = max(deepest, level + 1)
        stack.extend((child, level + 1) for child in children)
    return deepest
