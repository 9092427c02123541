"""The REST edge of a manager that does not lead: a standby (PostgreSQL, another manager leads), one
still loading its world, or one that lost its lease.

It serves its probes (/healthz, /readyz, /metrics) and its API description itself; everything
else goes to the leader: reads (GET, HEAD) are redirected there (307, same path and query),
writes are refused with 503 naming the leader's address (body `leader`, header `X-NTP-Leader`),
so nothing is ever answered from a world this manager does not hold. With no leader known (the
lease has expired and nobody has taken it yet) every request is a 503 with `Retry-After`.
A plain ASGI middleware placed before authentication: a standby holds no token table, and where
the leader is is no secret from a client that already knows this manager's address.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from ntp_manager.service.leadership.leader import LeaderInfo

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]

LOCAL = frozenset({"/healthz", "/readyz", "/metrics", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"})
LEADER_HEADER = "x-ntp-leader"


def leader_doc(who: LeaderInfo | None) -> dict[str, Any] | None:
    if who is None:
        return None
    return {"epoch": who.epoch, "holder": who.holder, "http": who.http, "grpc": who.grpc}


class StandbyEdge:
    def __init__(self, app: App, acting: Callable[[], bool], leader: Callable[[], LeaderInfo | None]) -> None:
        self.app, self.acting, self.leader = app, acting, leader

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self.acting() or scope.get("path", "") in LOCAL:
            await self.app(scope, receive, send)
            return
        who = self.leader()
        method = scope.get("method", "GET")
        headers: list[tuple[bytes, bytes]] = [(b"content-type", b"application/json")]
        if who is not None and who.http:
            url = f"http://{who.http}{scope.get('path', '')}"
            if scope.get("query_string"):
                url += "?" + scope["query_string"].decode("latin-1")
            headers.append((LEADER_HEADER.encode(), f"http://{who.http}".encode()))
            if method in ("GET", "HEAD"):
                status = 307
                detail = f"this manager is a standby; the leader {who.holder} (epoch {who.epoch}) serves this"
                headers.append((b"location", url.encode("latin-1")))
            else:
                status = 503
                detail = (f"this manager is a standby and takes no writes; send it to the leader {who.holder} "
                          f"(epoch {who.epoch}) at http://{who.http}")
        else:
            status, detail = 503, "this manager does not lead and no leader is known yet; try again shortly"
            headers.append((b"retry-after", b"1"))
        body = json.dumps({"detail": detail, "leader": leader_doc(who)}).encode()
        headers.append((b"content-length", str(len(body)).encode()))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body if method != "HEAD" else b""})
