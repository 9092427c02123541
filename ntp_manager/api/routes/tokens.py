"""API tokens (admin scope): list, create (shown once), revoke."""

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Path
from pydantic import BaseModel, ConfigDict, Field

from ntp_manager.api.edge import E4, require
from ntp_manager.auth import Principal
from ntp_manager.contract import limits
from ntp_manager.service.manager import Manager
from ntp_manager.service.operations.queries import page


class TokenBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1, max_length=limits.TOKEN_NAME_MAX, pattern=limits.TEXT_PATTERN)
    scope: Literal["viewer", "operator", "admin", "agent", "worker"]
    node: str | None = Field(None, min_length=1, max_length=limits.NODE_MAX, pattern=limits.NODE_PATTERN,
                             description="agent tokens: the one node the token may speak for (required)")
    fingerprint: str | None = Field(None, pattern=r"^([0-9a-fA-F]{2}:?){31}[0-9a-fA-F]{2}$",
                                    description="agent tokens: SHA-256 of the client certificate it needs (mTLS)")


def router(manager: Manager) -> APIRouter:
    r = APIRouter(prefix="/v1", tags=["tokens"])
    Admin = Annotated[Principal, Depends(require(manager, "admin"))]

    @r.get("/tokens")
    async def list_tokens(who: Admin) -> dict[str, Any]:
        items = await manager.list_tokens()
        return page(items, len(items), len(items), 0)

    @r.post("/tokens", status_code=201, responses=E4)
    async def create_token(body: TokenBody, who: Admin) -> dict[str, Any]:
        token = await manager.create_token(body.name, body.scope, actor=who.name, node=body.node,
                                           fingerprint=body.fingerprint)
        return {"id": token.split("_")[1], "name": body.name, "scope": body.scope, "node": body.node,
                "token": token}

    @r.delete("/tokens/{token_id}", responses=E4)
    async def revoke_token(token_id: Annotated[str, Path(pattern="^[0-9a-f]{8}$")], who: Admin) -> dict[str, Any]:
        await manager.revoke_token(token_id, actor=who.name)
        return {"id": token_id, "revoked": True}

    return r
