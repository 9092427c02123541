"""API tokens: create, list, revoke, and the live table every request is checked against.

Live: tokens may be created or revoked by this manager (REST) or by anyone else writing the same
database (`ntp-manager token create/revoke` on the server's host, another manager). A poll every
`token_poll_s` (default 0.25 s) reads a three-number summary of the token table (rows, revoked
rows, highest id; rows are never deleted by the code) and reloads the table only when it changed,
so a change made any way takes effect within `token_poll_s` plus one query on SQLite and
PostgreSQL alike. Revoking a token also ends every stream opened with it (agent streams, layout
watches, dashboard event streams): each registers a callback under its token id with `watch()`.

Agent tokens name the one node they may speak for (and optionally the SHA-256 fingerprint of the
client certificate that node presents over mTLS); other scopes name none.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from typing import Any

import structlog
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from ntp_manager.auth import SCOPES, Principal, StoredToken, TokenTable, hash_token, new_token
from ntp_manager.clock import Clock
from ntp_manager.contract import limits
from ntp_manager.service.core.errors import InvalidArgument, NotFound
from ntp_manager.service.core.kernel import Tx
from ntp_manager.store import db
from ntp_manager.store.models import TokenRow

log = structlog.get_logger("ntp.tokens")


# `Tokens._read_marker` as one statement for the driver (tests/integration compare the two)
MARKER_SQL = "SELECT count(*), count(revoked_at), max(id) FROM api_tokens"


class Tokens:
    """The token table's owner: `table` is what requests are checked against; changes go through
    `mutation` (the kernel's transaction, fenced like every write)."""

    def __init__(self, sm: async_sessionmaker[AsyncSession], clock: Clock, table: TokenTable,
                 mutation: Callable[[str], AbstractAsyncContextManager[Tx]], poll_s: float) -> None:
        self.sm, self.clock, self.table, self.mutation, self.poll_s = sm, clock, table, mutation, poll_s
        self._marker: tuple[Any, ...] | None = None
        self._watchers: dict[str, dict[int, Callable[[], None]]] = {}
        self._next = 0
        self._reader: db.KeptConnection | None = None  # PostgreSQL: the poll's own connection (`_poll_marker`)

    # ---- changes ----------------------------------------------------------------------------
    async def create(self, name: str, scope: str, actor: str, node: str | None = None,
                     fingerprint: str | None = None) -> str:
        """Store a new token and return it (the only time it is shown). Raises InvalidArgument."""
        if scope not in SCOPES:
            raise InvalidArgument(f"scope: unknown scope {scope!r}; choose one of {', '.join(SCOPES)}")
        try:
            limits.text("name", name, limits.TOKEN_NAME_MAX, allow_empty=False)
            if node is not None:
                limits.node_name("node", node)
            if fingerprint is not None:
                fingerprint = limits.fingerprint("fingerprint", fingerprint)
        except limits.LimitError as e:
            raise InvalidArgument(str(e)) from None
        if scope == "agent" and node is None:
            raise InvalidArgument("node: an agent token speaks for one node: name it (--node NAME)")
        if scope != "agent" and (node is not None or fingerprint is not None):
            raise InvalidArgument("node: only agent tokens are bound to a node or a certificate")
        public_id, token = new_token()
        now = self.clock.now()
        async with self.mutation(actor) as mut:
            mut.session.add(TokenRow(public_id=public_id, name=name, scope=scope, token_hash=hash_token(token),
                                     created_at=now, node=node, fingerprint=fingerprint))
            mut.audit(now, "token.create", public_id,
                      after={"name": name, "scope": scope, "node": node, "fingerprint": fingerprint})
        await self.reload()
        return token

    async def create_agents(self, nodes: list[str], actor: str) -> dict[str, str]:
        """One agent token per node, in one transaction (provisioning a fleet): node -> token."""
        try:
            for i, n in enumerate(nodes):
                limits.node_name(f"nodes[{i}]", n)
        except limits.LimitError as e:
            raise InvalidArgument(str(e)) from None
        if len(set(nodes)) != len(nodes):
            raise InvalidArgument("nodes: a node is named twice")
        now = self.clock.now()
        made: dict[str, str] = {}
        async with self.mutation(actor) as mut:
            for n in nodes:
                public_id, token = new_token()
                mut.session.add(TokenRow(public_id=public_id, name=f"agent-{n}", scope="agent",
                                         token_hash=hash_token(token), created_at=now, node=n))
                mut.audit(now, "token.create", public_id, after={"name": f"agent-{n}", "scope": "agent", "node": n})
                made[n] = token
        await self.reload()
        return made

    async def revoke(self, public_id: str, actor: str) -> None:
        """Revoke a token (NotFound when there is none with this id); its open streams end."""
        async with self.mutation(actor) as mut:
            row = (await mut.session.scalars(select(TokenRow).where(TokenRow.public_id == public_id))).first()
            if row is None:
                raise NotFound(f"no token with id {public_id!r}")
            if row.revoked_at is None:
                row.revoked_at = self.clock.now()
                mut.audit(self.clock.now(), "token.revoke", public_id, before={"name": row.name, "scope": row.scope})
        await self.reload()

    async def list(self) -> list[dict[str, Any]]:
        async with self.sm() as s:
            rows = (await s.scalars(select(TokenRow).order_by(TokenRow.id))).all()
        return [
            {"id": r.public_id, "name": r.name, "scope": r.scope, "created_at": r.created_at.isoformat(),
             "revoked": r.revoked_at is not None, "node": r.node, "fingerprint": r.fingerprint}
            for r in rows
        ]

    # ---- the live table ---------------------------------------------------------------------
    async def reload(self) -> None:
        cols = (TokenRow.public_id, TokenRow.token_hash, TokenRow.name, TokenRow.scope, TokenRow.node,
                TokenRow.fingerprint)
        async with self.sm() as s:
            marker = await self._read_marker(s)
            rows = (await s.execute(select(*cols).where(TokenRow.revoked_at.is_(None)))).all()
        gone = self.table.replace([
            StoredToken(pid, h, Principal(name, scope, pid, node, fp)) for pid, h, name, scope, node, fp in rows
        ])
        self._marker = marker
        for tid in gone:
            self._revoked(tid)

    async def _read_marker(self, s: Any) -> tuple[Any, ...]:  # MARKER_SQL says the same
        row = (await s.execute(select(func.count(), func.count(TokenRow.revoked_at), func.max(TokenRow.id)))).one()
        return tuple(row)

    async def _poll_marker(self) -> tuple[Any, ...]:
        """`_read_marker`'s answer: on PostgreSQL through the poll's own connection (store/db.py
        `KeptConnection`: this poll runs four times a second on every manager), else in a session."""
        engine = self.sm.kw.get("bind")
        if not db.KeptConnection.usable(engine):
            async with self.sm() as s:
                return await self._read_marker(s)
        if self._reader is None:
            self._reader = db.KeptConnection(engine, max(1.0, 20 * self.poll_s), "the token marker")
        (row,) = await self._reader.fetch(MARKER_SQL)
        return tuple(row)

    async def poll_once(self) -> bool:
        """Reload when the table changed since the last look; True when it did."""
        marker = await self._poll_marker()
        if marker == self._marker:
            return False
        await self.reload()
        return True

    async def poll_forever(self) -> None:
        try:
            while True:
                await asyncio.sleep(self.poll_s)
                try:
                    await self.poll_once()
                except Exception:  # a store hiccup; the next poll tries again
                    log.exception("token poll failed")
        finally:
            if self._reader is not None:
                await self._reader.close()

    # ---- streams ----------------------------------------------------------------------------
    def watch(self, token_id: str, on_revoke: Callable[[], None]) -> Callable[[], None]:
        """Call `on_revoke` when the token stops being valid; returns the function that unregisters."""
        self._next += 1
        key = self._next
        self._watchers.setdefault(token_id, {})[key] = on_revoke

        def unwatch() -> None:
            subs = self._watchers.get(token_id)
            if subs is not None:
                subs.pop(key, None)
                if not subs:
                    del self._watchers[token_id]

        return unwatch

    def _revoked(self, token_id: str) -> None:
        subs = self._watchers.pop(token_id, {})
        if subs:
            log.info("token revoked: closing its streams", token=token_id, streams=len(subs))
        for fn in subs.values():
            try:
                fn()
            except Exception:
                log.exception("closing a stream of a revoked token failed", token=token_id)
