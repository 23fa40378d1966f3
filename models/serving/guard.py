"""Who may talk to the server, and what a request body may hold before it is parsed.

``Guard`` is an ASGI middleware (wrapped in Starlette's ``Middleware``) in front of every route:

- the ``Host`` header must name this server (loopback names by default, any port; more with
  ``--allowed-host``): a web page the user visits cannot reach a loopback server by DNS rebinding,
  since its requests carry the attacker's host name;
- with an API key, every route but ``/health`` and the chat page's files needs
  ``Authorization: Bearer KEY`` (else 401);
- a POST must say ``Content-Type: application/json`` (else 415): the content types a web page may
  send cross-site without a CORS preflight (``text/plain``, forms) are refused, and the server
  answers no preflight, so a blind cross-site POST never reaches a handler.

``loads`` parses a body with bounds Python's ``json`` lacks: nesting deeper than ``MAX_DEPTH`` and
integers longer than ``MAX_INT_DIGITS`` digits are 400s naming the bound (``json.loads`` raises a
``RecursionError`` at ~1000 levels and a ``ValueError`` past 4300 digits, which were 500s).
"""

from __future__ import annotations

import json
import secrets
from typing import Iterable

from starlette.responses import JSONResponse

from models.serving.page import PAGE_FILES
from models.serving.schemas import APIError
from weights.json_depth import nesting_depth

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
# Answered without the API key: a liveness probe; the chat page, which asks for the key itself.
OPEN_PATHS = frozenset({"/health", *PAGE_FILES})
MAX_DEPTH = 64  # arrays and objects inside each other; a tool's JSON schema needs a dozen
MAX_INT_DIGITS = 40  # 2**128 has 39 digits; every integer the API takes is far smaller


def split_host(value: str) -> tuple[str, str | None]:
    """``(name, port or None)`` of a ``Host`` header or an ``--allowed-host`` value: ``[::1]:8080``
    gives ``("::1", "8080")``; names are lower-cased, a trailing dot dropped. ``ValueError`` when it
    is not a host (an empty name, a port that is not digits)."""
    value = value.strip().lower()
    if value.startswith("["):
        name, _, rest = value[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else None
        if rest and port is None:
            raise ValueError(f"{value!r} is not a host")
    elif value.count(":") == 1:
        name, port = value.split(":")
    else:
        name, port = value, None  # a bare IPv6 address (only in --allowed-host) or a name
    name = name.rstrip(".")
    if not name or (port is not None and not port.isdigit()):
        raise ValueError(f"{value!r} is not a host (NAME or NAME:PORT; an IPv6 address in brackets)")
    return name, port


class Guard:
    """The checks of the module docstring around ``app``. ``allowed_hosts``: ``NAME`` (any port) or
    ``NAME:PORT``, added to the loopback names; ``api_key``: None for no authentication."""

    def __init__(self, app, allowed_hosts: Iterable[str] = (), api_key: str | None = None):
        self.app = app
        self.hosts = {(name, None) for name in LOOPBACK_HOSTS} | {split_host(h) for h in allowed_hosts}
        self.api_key = api_key

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            refusal = self.refusal(scope)
            if refusal is not None:
                await JSONResponse(refusal.body(), status_code=refusal.status, headers=refusal.headers)(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def refusal(self, scope) -> APIError | None:
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        host = headers.get("host")
        try:
            name, port = split_host(host) if host else (None, None)
        except ValueError:
            name = port = None
        if name is None or not ({(name, None), (name, port)} & self.hosts):
            return APIError(400, f"Host {host!r} is not served here: this server answers to "
                                 f"{', '.join(sorted(self.allowed()))} (add names with --allowed-host)", None)  # fmt: skip
        if self.api_key is not None and scope["path"] not in OPEN_PATHS:
            scheme, _, key = headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not secrets.compare_digest(key.strip().encode(), self.api_key.encode()):
                return APIError(401, "this server needs an API key: send Authorization: Bearer KEY (the key of --api-key)",
                                None, "authentication_error", {"WWW-Authenticate": "Bearer"})  # fmt: skip
        if scope["method"] == "POST":
            kind = headers.get("content-type", "").partition(";")[0].strip().lower()
            if kind != "application/json":
                return APIError(415, f"Content-Type {kind or 'none'!r}: request bodies must be application/json",
                                None)  # fmt: skip
        return None

    def allowed(self) -> set[str]:
        """The allowed hosts as a Host header spells them, for the refusal's message."""
        return {(f"[{n}]" if ":" in n else n) + ("" if p is None else f":{p}") for n, p in self.hosts}


def _bounded_int(text: str) -> int:
    digits = len(text.lstrip("-"))
    if digits > MAX_INT_DIGITS:
        raise APIError(400, f"the request body has an integer of {digits} digits ({text[:12]}...); at most {MAX_INT_DIGITS}")
    return int(text)


def loads(body: bytes):
    """``body`` parsed as JSON, or an ``APIError`` (400) naming what is wrong with it."""
    depth = nesting_depth(body, MAX_DEPTH)
    if depth > MAX_DEPTH:
        raise APIError(400, f"the request body nests arrays and objects {depth} levels deep; at most {MAX_DEPTH}")
    try:
        return json.loads(body, parse_int=_bounded_int, parse_constant=_refuse_constant)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise APIError(400, f"the request body is not valid JSON: {err}") from None


def _refuse_constant(name: str):
    raise APIError(400, f"the request body is not valid JSON: {name} is not a JSON number")
