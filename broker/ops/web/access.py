"""Who may read the dashboard: the ``Host`` check against DNS rebinding and the read
credential, applied to every request before a handler runs (:func:`guard`)."""

from __future__ import annotations

import base64
import binascii
import ipaddress
import secrets
from collections.abc import Iterable

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from broker.ops.web.pages import SECURITY_HEADERS

LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost"})
"""Host names every dashboard answers to, besides loopback addresses."""

OPEN_PATHS = frozenset({"/healthz"})
"""Paths answered whatever the ``Host`` and without the read credential: a load
balancer's probe names the address it dialled, and the answer says nothing."""


def host_allowed(header: str | None, allowed: frozenset[str]) -> bool:
    """Whether a request's ``Host`` names this dashboard: a loopback name or address, or
    one of ``allowed`` (lower case), with any port. A DNS-rebinding page's requests carry
    its own name, so they are refused; a missing ``Host`` is too."""
    if not header:
        return False
    name = header.strip().lower()
    if name.startswith("["):
        name = name[1:].partition("]")[0]
    elif name.count(":") == 1:
        name = name.partition(":")[0]
    name = name.removesuffix(".")
    if name in allowed or name in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def allowed_hosts(http_host: str, extra: Iterable[str]) -> frozenset[str]:
    """The names a dashboard answers to besides loopback: its own listen address (unless
    a wildcard) and the operator's ``--http-allowed-hosts``."""
    names = {name.strip().lower().removesuffix(".") for name in extra if name.strip()}
    if http_host not in ("", "0.0.0.0", "::"):
        names.add(http_host.lower().strip("[]"))
    return frozenset(names)


def credential(request: web.Request) -> str:
    """The secret an ``Authorization`` header carries: a bearer token, or a Basic
    password (what a browser prompts for; the user name is ignored)."""
    header = request.headers.get("Authorization", "")
    scheme, _, value = header.partition(" ")
    if scheme.lower() == "bearer":
        return value.strip()
    if scheme.lower() == "basic":
        try:
            decoded = base64.b64decode(value.strip(), validate=True).decode()
        except (binascii.Error, UnicodeDecodeError):
            return ""
        return decoded.partition(":")[2]
    return ""


def matches(given: str, secret: str | None) -> bool:
    return bool(secret) and secrets.compare_digest(given.encode(), (secret or "").encode())


def guard(hosts: frozenset[str], read_secrets: tuple[str | None, ...]) -> Middleware:
    """The middleware that refuses, before anything is read, a request for another
    host than ``hosts`` or loopback (DNS rebinding) and, when ``read_secrets`` is not
    empty, one that shows none of them. :data:`OPEN_PATHS` pass."""

    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path not in OPEN_PATHS:
            if not host_allowed(request.headers.get("Host"), hosts):
                return web.Response(
                    status=421,
                    text="refused: this dashboard does not answer to that Host (a name "
                    "it should answer to goes in --http-allowed-hosts)\n",
                )
            if read_secrets:
                given = credential(request)
                if not any(matches(given, secret) for secret in read_secrets):
                    return web.Response(
                        status=401,
                        text="refused: this dashboard needs its read token "
                        "(--http-read-token), as a bearer token or a Basic password\n",
                        headers={"WWW-Authenticate": 'Basic realm="broker", charset="UTF-8"'},
                    )
        return await handler(request)

    return check


async def secure(request: web.Request, response: web.StreamResponse) -> None:
    """Every answer's :data:`SECURITY_HEADERS`, refusals and errors included."""
    response.headers.update(SECURITY_HEADERS)
