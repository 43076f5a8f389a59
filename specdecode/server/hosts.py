"""Which Host headers the server answers (--allowed-hosts).

DNS rebinding: a web page of another site points its own name at 127.0.0.1, and the browser then lets the page read
what a local server answers under that name. A server that answers only for the names it is reached by (loopback's,
when it binds loopback) gives the page nothing. Names are matched without the port, case-insensitively; "*" allows
any host and "*.example.com" any subdomain of example.com.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable
from typing import Any

from starlette.datastructures import Headers
from starlette.responses import Response

LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")
PROTECTABLE = ("metrics", "docs")  # routes open by default (as vLLM's) that --protect puts behind the API key


def default_allowed_hosts(bind: str) -> tuple[str, ...] | None:
    """Loopback's names when the server binds a loopback address, else None (any host: the operator knows the names
    the server is reached by, and says them with --allowed-hosts)."""
    if bind == "localhost":
        return LOOPBACK_HOSTS
    try:
        return LOOPBACK_HOSTS if ipaddress.ip_address(bind).is_loopback else None
    except ValueError:  # a name
        return None


def parse_allowed_hosts(value: str) -> tuple[str, ...] | None:
    """--allowed-hosts: a comma list of names (None for "*")."""
    hosts = tuple(h.strip().lower().rstrip(".") for h in value.split(",") if h.strip())
    if not hosts:
        raise ValueError("--allowed-hosts needs at least one name (or '*' for any)")
    return None if "*" in hosts else hosts


def host_name(header: str) -> str:
    """The name of a Host header, without its port ("[::1]:8000" -> "::1", "Example.com.:80" -> "example.com")."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1:].partition("]")[0]
    if header.count(":") == 1:
        header = header.partition(":")[0]
    return header.rstrip(".")


def host_allowed(header: str | None, allowed: tuple[str, ...]) -> bool:
    if not header:
        return False
    name = host_name(header)
    return any(name == host or (host.startswith("*.") and name.endswith(host[1:])) for host in allowed)


class TrustedHosts:
    """ASGI middleware: a request whose Host is not allowed gets `refuse()`'s response (a page of another site that
    reached this server through DNS rebinding reads nothing)."""

    def __init__(self, app: Any, allowed: tuple[str, ...], refuse: Callable[[], Response]) -> None:
        self.app, self.allowed, self.refuse = app, allowed, refuse

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] == "http" and not host_allowed(Headers(scope=scope).get("host"), self.allowed):
            await self.refuse()(scope, receive, send)
            return
        await self.app(scope, receive, send)
