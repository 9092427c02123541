"""Idempotency keys: a mutation made twice under the same key is made once.

The first request's status and answer are stored with its key, in the transaction of the mutation
itself; a replay with the same key and the same request (method, path, body: the fingerprint) by the
same actor gets that answer again, and anything else under that key is a Conflict."""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from sqlalchemy.exc import IntegrityError

from ntp_manager.service.core.errors import Conflict
from ntp_manager.service.core.kernel import Tx
from ntp_manager.store.models import IdempotencyRow


@dataclass(frozen=True)
class Outcome:
    status: int
    payload: Any
    replay: bool


async def idempotent(transaction: Callable[[], contextlib.AbstractAsyncContextManager[Tx]], key: str | None,
                     fingerprint: str, fn: Callable[[Tx], Awaitable[Any]], status: int) -> Outcome:
    """Run `fn` in a transaction of its own, once per `key` (None: no key, always run)."""
    try:
        async with transaction() as tx:
            if key:
                row = await tx.session.get(IdempotencyRow, key)
                if row is not None:
                    if row.fingerprint != fingerprint or row.actor != tx.actor:
                        raise Conflict("Idempotency-Key was already used for a different request")
                    return Outcome(row.status, row.response, True)
            payload = await fn(tx)
            if key:
                tx.session.add(IdempotencyRow(key=key, actor=tx.actor, fingerprint=fingerprint, status=status,
                                              response=payload, created_at=tx.now))
    except IntegrityError:
        raise Conflict("a concurrent request used the same Idempotency-Key") from None
    return Outcome(status, payload, False)
