"""The manager client the agent and the worker share: channels, TLS, and failover between managers.

`ManagerClient(target, tls)`: `target` is one manager's address or several ("a:1,b:2", or a list)
when managers run as a leader and standbys (docs/operations.md).

- Channels carry the keepalive options below: a manager that hangs (paused, or cut off by the
  network) keeps a connection open; HTTP/2 pings find it out (6 + 3 s: the server accepts a ping
  every 5 s at most, rpc/server.py KEEPALIVE), the call fails and the client moves on.
- TLS/mTLS with `tls` (contract/tls.py `TlsFiles`); a plaintext channel without.
- Failover: a standby answers UNAVAILABLE naming the leader (trailing metadata `ntp-leader`) and the
  client goes there at once; any other failure moves it to the next address of its own failover
  cycle. The cycle starts at the first address given and visits the others in an order each client
  draws at random, so the clients of a manager that dies spread evenly over the managers left
  (with one fixed order every one of them went to the same next manager, which took the whole
  reconnect storm alone). The leader advertises its plaintext port, so a TLS client follows a hint
  only to an address of its own list.
- Balance (fleet mode): a manager holding more than its share ends a stream with UNAVAILABLE and
  `ntp-move-to` naming the manager to go to; the client goes there at once, like to a leader hint.

How often to retry, and which refusals end a client, is the caller's: the agent retries forever
with tenacity's backoff, the worker's layout watch stops at a refusal.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Sequence
from typing import Any

import grpc

from ntp_manager.contract.tls import TlsFiles

CLIENT_KEEPALIVE = [("grpc.keepalive_time_ms", 6_000), ("grpc.keepalive_timeout_ms", 3_000),
                    ("grpc.http2.ping_timeout_ms", 3_000),  # else a ping waits a minute for its ack
                    ("grpc.keepalive_permit_without_calls", 1), ("grpc.http2.max_pings_without_data", 0)]

# how a call to a manager that is gone ends (a standby that names the leader is not one of them;
# "Internal error from Core" is how grpc reports some refusals whose status it lost)
UNREACHABLE_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN})

# what grpc's core says when a TLS handshake fails (a CA that did not sign the manager's
# certificate, a client certificate the manager refuses, TLS against a plaintext port)
_HANDSHAKE = ("handshake failed", "certificate_verify_failed", "ssl_error", "tsi_", "wrong_version_number")


def manager_addresses(target: str | Sequence[str]) -> list[str]:
    """One address or several ("a:1,b:2" or a list) -> the list, blanks dropped."""
    parts = target.split(",") if isinstance(target, str) else list(target)
    return [p.strip() for p in parts if p.strip()]


HINT_KEYS = ("ntp-leader", "ntp-move-to")  # a standby naming the leader; a manager moving a client for balance


def leader_hint(e: Any) -> str | None:
    """Where a manager sent the client in its trailing metadata: the leader a standby named
    (`ntp-leader`), or the manager one told it to move to for balance (`ntp-move-to`, fleet mode)."""
    with contextlib.suppress(Exception):
        for k, v in e.trailing_metadata() or ():
            if k in HINT_KEYS and isinstance(v, str) and v:
                return v
    return None


def code_of(e: Any) -> grpc.StatusCode | None:
    """An RPC error's status code (None for an error that has none)."""
    with contextlib.suppress(Exception):
        code = e.code()
        return code if isinstance(code, grpc.StatusCode) else None
    return None


def details_of(e: Any) -> str:
    with contextlib.suppress(Exception):
        return str(e.details() or "")
    return str(e)


def handshake_failure(e: Any) -> bool:
    """Whether an RPC error is a failed TLS handshake: no call ever ran."""
    d = details_of(e).lower()
    return code_of(e) in UNREACHABLE_CODES and any(m in d for m in _HANDSHAKE)


class ManagerClient:
    """The managers' addresses, the one in use, how to open a channel to it, and where to go next.
    Not thread-safe by itself: a client used from several threads guards `move` (the worker does)."""

    def __init__(self, target: str | Sequence[str], tls: TlsFiles | None = None,
                 rng: random.Random | None = None) -> None:
        self.targets = manager_addresses(target)
        if not self.targets:
            raise ValueError("give at least one manager address (host:port)")
        self.tls = tls or TlsFiles()
        self.target = self.targets[0]  # the manager tried now
        # the failover cycle: the first address, then the others in an order of this client's own
        others = self.targets[1:]
        self.cycle = [self.targets[0], *(rng or random).sample(others, len(others))]
        self.failovers = 0  # moves to another manager

    # ---- channels ----------------------------------------------------------------------------
    def channel(self, target: str | None = None) -> grpc.Channel:
        """A blocking channel to `target` (default: the manager in use)."""
        target = target or self.target
        if not self.tls.enabled:
            return grpc.insecure_channel(target, options=CLIENT_KEEPALIVE)
        return grpc.secure_channel(target, self.tls.credentials(), options=CLIENT_KEEPALIVE)

    def aio_channel(self, target: str | None = None) -> grpc.aio.Channel:
        """An asyncio channel to `target` (default: the manager in use)."""
        target = target or self.target
        if not self.tls.enabled:
            return grpc.aio.insecure_channel(target, options=CLIENT_KEEPALIVE)
        return grpc.aio.secure_channel(target, self.tls.credentials(), options=CLIENT_KEEPALIVE)

    # ---- failover ----------------------------------------------------------------------------
    def next_target(self, hint: str | None) -> str | None:
        """The manager to try next: the leader a standby named (a TLS client only when it is one of
        its own addresses: the leader advertises its plaintext port), else the address after the
        one in use in this client's failover cycle (the first address when the one in use is not in
        the list: a leader's hint); None: stay where it is."""
        if hint and (hint in self.targets or not self.tls.enabled):
            nxt = hint
        elif len(self.cycle) > 1:
            i = self.cycle.index(self.target) if self.target in self.cycle else -1
            nxt = self.cycle[(i + 1) % len(self.cycle)]
        else:
            return None
        return nxt if nxt != self.target else None

    def move(self, hint: str | None) -> str | None:
        """Go to `next_target(hint)`; returns the new address, None when it stays."""
        nxt = self.next_target(hint)
        if nxt is not None:
            self.target = nxt
            self.failovers += 1
        return nxt

    def failed(self, e: Any) -> str | None:
        """Note an RPC error from the manager in use; returns the manager it named to go to
        (a leader, or a balance target), if any."""
        return leader_hint(e)

    def metadata(self, token: str) -> tuple[tuple[str, str], ...]:
        """A call's metadata: the token."""
        return (("authorization", f"Bearer {token}"),)

    def refusal(self, e: Any) -> str:
        """One line for an error that ends a client's set-up, naming the manager and the TLS mode."""
        code = code_of(e)
        if handshake_failure(e):
            return (f"manager {self.target}: the TLS handshake failed ({self.tls.describe()}): the CA did not sign "
                    f"the manager's certificate, the manager refused ours, or that port does not speak "
                    f"{'TLS' if self.tls.enabled else 'plaintext'}")
        first = (details_of(e).splitlines() or [""])[0]
        return f"manager {self.target}: {code.name if code else 'error'}: {first}"
