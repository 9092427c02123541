"""Bearer tokens with scopes, shared by REST and gRPC.

A token reads `ntp_<id>_<secret>`: the id (8 hex characters, not secret) finds the stored row, and
the SHA-256 of the whole token is compared with the stored hash by `hmac.compare_digest`, so the
comparison takes the same time wherever the first wrong character is. Only hashes are stored.

Scopes: `viewer` (read the REST API), `operator` (viewer + every mutation), `admin` (operator +
token management), `agent` (the agent gRPC service, for the one node the token names, and only
with the client certificate it names when it names one), `worker` (the worker gRPC service).
docs/security.md has the threat model.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass

SCOPES = ("viewer", "operator", "admin", "agent", "worker")
PERMISSIONS: dict[str, frozenset[str]] = {
    "viewer": frozenset({"read"}),
    "operator": frozenset({"read", "write"}),
    "admin": frozenset({"read", "write", "admin"}),  # operator + token management
    "agent": frozenset({"agent"}),
    "worker": frozenset({"worker"}),
}


@dataclass(frozen=True)
class Principal:
    name: str
    scope: str
    token_id: str = ""
    node: str | None = None  # agent tokens: the node it may speak for
    fingerprint: str | None = None  # agent tokens: SHA-256 of the client certificate it needs

    def can(self, permission: str) -> bool:
        return permission in PERMISSIONS.get(self.scope, frozenset())


@dataclass(frozen=True)
class StoredToken:
    public_id: str
    token_hash: str
    principal: Principal


def new_token() -> tuple[str, str]:
    """(public id, token)."""
    public_id = secrets.token_hex(4)
    return public_id, f"ntp_{public_id}_{secrets.token_urlsafe(32)}"


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def token_id(token: str) -> str | None:
    parts = token.split("_", 2)
    if len(parts) != 3 or parts[0] != "ntp" or len(parts[1]) != 8:
        return None
    return parts[1]


class TokenTable:
    """In-memory view of the active tokens, refreshed from the store."""

    def __init__(self) -> None:
        self._by_id: dict[str, StoredToken] = {}

    def replace(self, tokens: list[StoredToken]) -> set[str]:
        """Install the active tokens; returns the ids that were active and are not any more."""
        new = {t.public_id: t for t in tokens}
        gone = {tid for tid, old in self._by_id.items() if new.get(tid) != old}
        self._by_id = new
        return gone

    def __len__(self) -> int:
        return len(self._by_id)

    def active(self, token_id: str) -> bool:
        """Whether the token with this id is still valid (not revoked)."""
        return token_id in self._by_id

    def verify(self, token: str) -> Principal | None:
        tid = token_id(token)
        stored = self._by_id.get(tid) if tid else None
        if stored is None:
            return None
        if hmac.compare_digest(stored.token_hash, hash_token(token)):
            return stored.principal
        return None


def parse_bearer(header: str | None) -> str | None:
    if not header:
        return None
    scheme, _, value = header.partition(" ")
    if scheme.lower() != "bearer" or not value.strip():
        return None
    return value.strip()
