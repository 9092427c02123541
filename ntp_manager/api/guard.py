"""The REST edge before any route: who is asking, and how much it may send.

`AuthFirst` is a plain ASGI middleware. A request to /v1/ that carries a body is authenticated
before a byte of the body is read: no valid bearer token -> 401 at once, so an anonymous client
cannot make the manager read and parse megabytes. The body is then read up to
`max_request_bytes` (the settings; default 4 MiB): a declared Content-Length past it, or a
chunked body that grows past it, is 413 and the route never runs. Routes still check the token's
scope themselves (403), after parsing.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from ntp_manager.auth import parse_bearer

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]


async def _reply(send: Send, status: int, detail: str, headers: list[tuple[bytes, bytes]] | None = None) -> None:
    body = json.dumps({"detail": detail}).encode()
    await send({"type": "http.response.start", "status": status, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
        (b"connection", b"close"), *(headers or []),
    ]})
    await send({"type": "http.response.body", "body": body})


class AuthFirst:
    def __init__(self, app: App, verify: Callable[[str], Any], max_bytes: int) -> None:
        self.app, self.verify, self.max_bytes = app, verify, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.lower(): v for k, v in scope.get("headers", [])}
        length = headers.get(b"content-length")
        chunked = b"chunked" in headers.get(b"transfer-encoding", b"").lower()
        if length in (None, b"0") and not chunked:
            await self.app(scope, receive, send)
            return
        if str(scope.get("path", "")).startswith("/v1/"):
            token = parse_bearer(headers.get(b"authorization", b"").decode("latin-1"))
            if token is None or self.verify(token) is None:
                why = "missing bearer token" if token is None else "unknown or revoked token"
                await _reply(send, 401, why, [(b"www-authenticate", b"Bearer")])
                return
        limit = self.max_bytes
        try:
            declared = int(length) if length is not None else 0
        except ValueError:
            await _reply(send, 400, "Content-Length is not a number")
            return
        if declared > limit:
            await _reply(send, 413, f"the request body is {declared} bytes; the limit is {limit} (max_request_bytes)")
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            part = msg.get("body", b"")
            size += len(part)
            if size > limit:
                await _reply(send, 413, f"the request body is over {limit} bytes (max_request_bytes)")
                return
            chunks.append(part)
            if not msg.get("more_body", False):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)
