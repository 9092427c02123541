"""What every REST route shares: the error body, the bounded input types, bearer-token checks by
permission, JSON made off the event loop, and idempotent mutations.

The edge: a body is read only after its bearer token checks out and only up to
`max_request_bytes` (api/guard.py: 401 / 413); every string is bounded and free of control
characters, every number finite and in range, every time zone-aware (contract/limits.py), so bad input is
a 4xx naming the field and never reaches the service.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Annotated, Any

from fastapi import Header, Query, Request
from fastapi.responses import Response
from pydantic import AfterValidator, AwareDatetime, BaseModel, StringConstraints
from starlette.exceptions import HTTPException as StarletteHTTPException

from ntp_manager.auth import Principal, parse_bearer
from ntp_manager.contract import limits
from ntp_manager.jsontext import StoredJson, dumps_in_pieces
from ntp_manager.service.manager import Manager, Mut

Limit = Annotated[int, Query(ge=1, le=1000, description="page size")]
Offset = Annotated[int, Query(ge=0, le=10_000_000, description="items to skip")]


def _encodable(v: str) -> str:
    try:
        v.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("is not valid Unicode (a lone surrogate)") from None
    return v


def _to_utc(v: datetime) -> datetime:
    try:
        u = v.astimezone(UTC)
    except OverflowError:
        raise ValueError("is out of range once converted to UTC") from None
    if not 1970 <= u.year <= 9000:
        raise ValueError("must lie between the years 1970 and 9000")
    return u


Reason = Annotated[str, StringConstraints(min_length=1, max_length=limits.REASON_MAX, pattern=limits.TEXT_PATTERN),
                   AfterValidator(_encodable)]
OptReason = Annotated[str, StringConstraints(max_length=limits.REASON_MAX, pattern=limits.TEXT_PATTERN),
                      AfterValidator(_encodable)]
When = Annotated[AwareDatetime, AfterValidator(_to_utc)]  # any offset in, UTC kept and returned
GpuId = Annotated[str, StringConstraints(min_length=1, max_length=limits.GPU_ID_MAX, pattern=limits.IDENT_PATTERN)]


def ident(n: int, desc: str) -> Any:
    return Query(max_length=n, pattern=limits.IDENT_PATTERN, description=desc)


class ErrorItem(BaseModel):
    loc: list[str]
    msg: str
    type: str


class Error(BaseModel):
    """Every error: `detail` says what is wrong and names the field; a 422 from request
    validation also lists up to 20 `errors`."""

    detail: str
    errors: list[ErrorItem] | None = None


NOT_FOUND: dict[int | str, dict[str, Any]] = {404: {"model": Error}}
E4: dict[int | str, dict[str, Any]] = {404: {"model": Error}, 409: {"model": Error}, 422: {"model": Error}}


def _dumps(obj: Any) -> bytes:
    if isinstance(obj, StoredJson):
        return obj.text.encode()
    return dumps_in_pieces(obj).encode()


async def json_reply(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    """JSON made in a worker thread: for answers that grow with the cluster (layouts, plans, the
    dashboard), whose encoding would otherwise hold the event loop. `obj` must not change meanwhile
    (plans never do; views are built for the answer)."""
    body = _dumps(obj) if isinstance(obj, StoredJson) else await asyncio.to_thread(_dumps, obj)
    return Response(body, status_code=status, media_type="application/json", headers=headers)


def require(manager: Manager, permission: str) -> Callable[..., Awaitable[Principal]]:
    """A dependency: the request's principal, when its token may `permission` (401 / 403 else)."""
    async def dep(authorization: Annotated[str | None, Header()] = None) -> Principal:
        token = parse_bearer(authorization)
        if token is None:
            raise StarletteHTTPException(401, "missing bearer token", headers={"WWW-Authenticate": "Bearer"})
        principal = manager.tokens.verify(token)
        if principal is None:
            raise StarletteHTTPException(401, "unknown or revoked token", headers={"WWW-Authenticate": "Bearer"})
        if not principal.can(permission):
            verb = {"write": "change", "read": "read", "admin": "manage tokens with"}.get(permission, "use")
            raise StarletteHTTPException(403, f"a {principal.scope!r} token may not {verb} this")
        return principal

    return dep


IdemKey = Annotated[str | None, Header(alias="Idempotency-Key", max_length=256)]


async def mutate(manager: Manager, request: Request, principal: Principal, key: str | None,
                 fn: Callable[[Mut], Awaitable[Any]], status: int = 200) -> Response:
    """Run a mutation in its own transaction, once per Idempotency-Key, and answer with its JSON."""
    body = await request.body()
    fp = hashlib.sha256(f"{request.method} {request.url.path}?{request.url.query}\n".encode() + body).hexdigest()
    out = await manager.idempotent(principal.name, request.state.request_id, key, fp, fn, status)
    return await json_reply(out.payload, out.status, headers={"Idempotent-Replay": "true"} if out.replay else None)
