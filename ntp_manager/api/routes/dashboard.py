"""The dashboard: its page, its snapshot, and the server-sent event stream that feeds it."""

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Header, Query, Request
from fastapi.responses import HTMLResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ntp_manager.api.dashboard import DASHBOARD_HTML, dashboard_snapshot, snapshot_events
from ntp_manager.api.edge import json_reply, require
from ntp_manager.api.tickets import TTL_S, Tickets
from ntp_manager.auth import Principal
from ntp_manager.service.manager import Manager


def router(manager: Manager) -> APIRouter:
    r = APIRouter()
    Viewer = Annotated[Principal, Depends(require(manager, "read"))]
    tickets = Tickets(manager.clock.monotonic)

    @r.get("/v1/snapshot", tags=["cluster"], response_model=dict[str, Any])
    async def snapshot(who: Viewer) -> Response:
        return await json_reply(await dashboard_snapshot(manager))

    @r.post("/v1/stream/tickets", tags=["cluster"], status_code=201)
    async def stream_ticket(who: Viewer) -> dict[str, Any]:
        """A one-time ticket (30 s) that opens `/v1/stream?ticket=...`: EventSource cannot send an
        Authorization header, and a token in a URL would end up in history and logs."""
        return {"ticket": tickets.issue(who), "expires_in_s": TTL_S}

    @r.get("/v1/stream", tags=["cluster"], response_class=StreamingResponse,
           responses={200: {"content": {"text/event-stream": {}}}})
    async def stream(
        request: Request,
        ticket: Annotated[str | None, Query(max_length=64, pattern="^[A-Za-z0-9_-]+$")] = None,
        authorization: Annotated[str | None, Header()] = None,
    ) -> StreamingResponse:
        """Server-sent events: a `snapshot` event with the whole dashboard state whenever it changes.
        Authenticate with the header, or with a ticket from `POST /v1/stream/tickets`. The stream
        ends when its token is revoked."""
        if ticket is not None and authorization is None:
            who = tickets.redeem(ticket)
            if who is None or not manager.tokens.active(who.token_id):
                raise StarletteHTTPException(401, "unknown, used or expired ticket",
                                             headers={"WWW-Authenticate": "Bearer"})
        else:
            who = await require(manager, "read")(authorization)
        return StreamingResponse(snapshot_events(manager, request, who.token_id), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    @r.get("/", include_in_schema=False, response_class=HTMLResponse)
    async def root() -> HTMLResponse:
        return HTMLResponse(DASHBOARD_HTML)

    return r
