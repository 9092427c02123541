"""SQLAlchemy 2 models: the manager's durable truth.

Append-only tables (health_events, audit_log, layouts) are never updated or deleted by the code.
GPU state is split in two: `health` (set by evidence: agent reports, heartbeat loss, an operator's
mark-healthy) and `admin` (set only by operators: cordoned, draining, maintenance). The effective
state is the admin state when set, else the health state, so automation can never undo a cordon.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.types import TypeDecorator


class UtcDateTime(TypeDecorator[datetime]):
    """A timestamp stored in UTC and read back time-zone aware, the same on every store.

    SQLite keeps no offset: it stored a +05:30 wall time as if it were UTC, shifting drain
    deadlines and maintenance windows. Every value is converted to UTC on the way in (a naive
    value is refused: its zone is unknown) and marked UTC on the way out."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetime: give a time zone (the store keeps UTC)")
        return value.astimezone(UTC)

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


class Base(DeclarativeBase):
    type_annotation_map = {dict[str, Any]: JSON, list[Any]: JSON, datetime: UtcDateTime}


class DomainRow(Base):
    __tablename__ = "domains"
    id: Mapped[str] = mapped_column(String(128), primary_key=True)
    power_budget_w: Mapped[float | None] = mapped_column(Float)
    created_at: Mapped[datetime] = mapped_column(UtcDateTime)


class NodeRow(Base):
    __tablename__ = "nodes"
    name: Mapped[str] = mapped_column(String(256), primary_key=True)
    domain_id: Mapped[str] = mapped_column(ForeignKey("domains.id"), index=True)
    boot_id: Mapped[str] = mapped_column(String(128), default="")
    agent_version: Mapped[str] = mapped_column(String(64), default="")
    last_seq: Mapped[int] = mapped_column(BigInteger, default=0)
    drain_deadline: Mapped[datetime | None] = mapped_column(UtcDateTime)
    drain_reason: Mapped[str | None] = mapped_column(Text)
    registered_at: Mapped[datetime] = mapped_column(UtcDateTime)


class GpuRow(Base):
    __tablename__ = "gpus"
    uuid: Mapped[str] = mapped_column(String(128), primary_key=True)
    # a stable number given at registration and never reused: layouts name GPUs by it
    pos: Mapped[int] = mapped_column(Integer, unique=True, index=True)
    node: Mapped[str] = mapped_column(ForeignKey("nodes.name"), index=True)
    domain_id: Mapped[str] = mapped_column(ForeignKey("domains.id"), index=True)
    idx: Mapped[int] = mapped_column(Integer)
    model: Mapped[str] = mapped_column(String(128), default="")
    memory_bytes: Mapped[int] = mapped_column(BigInteger, default=0)
    tdp_mw: Mapped[int] = mapped_column(Integer, default=1_000_000)
    min_mw: Mapped[int] = mapped_column(Integer, default=200_000)
    max_mw: Mapped[int] = mapped_column(Integer, default=1_300_000)
    health: Mapped[str] = mapped_column(String(16), default="healthy", index=True)
    health_reason: Mapped[str] = mapped_column(Text, default="")
    health_source: Mapped[str] = mapped_column(String(16), default="agent", server_default="agent")
    health_since: Mapped[datetime] = mapped_column(UtcDateTime)
    admin: Mapped[str | None] = mapped_column(String(16))
    admin_owner: Mapped[str | None] = mapped_column(String(128))
    admin_reason: Mapped[str | None] = mapped_column(Text)
    desired_mw: Mapped[int | None] = mapped_column(Integer)
    enforced_mw: Mapped[int | None] = mapped_column(Integer)
    # a degraded GPU's measured speed factor (fail-slow detector), in (0, 1]; None: not measured
    speed: Mapped[float | None] = mapped_column(Float)

    @property
    def state(self) -> str:
        return self.admin or self.health


class HealthEventRow(Base):
    __tablename__ = "health_events"
    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True)
    at: Mapped[datetime] = mapped_column(UtcDateTime, index=True)
    gpu_uuid: Mapped[str] = mapped_column(String(128), index=True)
    node: Mapped[str] = mapped_column(String(256))
    seq: Mapped[int | None] = mapped_column(BigInteger)  # agent report seq; None for manager-made events
    source: Mapped[str] = mapped_column(String(32))  # agent | heartbeat | operator
    old_state: Mapped[str] = mapped_column(String(16))
    new_state: Mapped[str] = mapped_column(String(16))
    reasons: Mapped[list[Any]] = mapped_column(JSON, default=list)
    xids: Mapped[list[Any]] = mapped_column(JSON, default=list)


class JobRow(Base):
    __tablename__ = "jobs"
    name: Mapped[str] = mapped_column(String(128), primary_key=True)
    spec: Mapped[dict[str, Any]] = mapped_column(JSON)
    created_at: Mapped[datetime] = mapped_column(UtcDateTime)
    created_by: Mapped[str] = mapped_column(String(128))


class LayoutRow(Base):
    """One layout version. `body` is its compact encoding (store/layout_codec.py): a keyframe when
    `base_version` is None, else a delta on version `base_version`. Rows written before the compact
    encoding that the migration could not convert keep their plan JSON in `plan` (no body); they
    read as keyframes."""

    __tablename__ = "layouts"
    __table_args__ = (UniqueConstraint("job", "version", name="uq_layout_job_version"),)
    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True)
    job: Mapped[str] = mapped_column(String(128), index=True)
    version: Mapped[int] = mapped_column(BigInteger)
    leader_epoch: Mapped[int] = mapped_column(BigInteger)
    plan: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    body: Mapped[bytes | None] = mapped_column(LargeBinary)
    base_version: Mapped[int | None] = mapped_column(BigInteger)
    reason: Mapped[str] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(UtcDateTime)


class AuditRow(Base):
    __tablename__ = "audit_log"
    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True)
    at: Mapped[datetime] = mapped_column(UtcDateTime, index=True)
    actor: Mapped[str] = mapped_column(String(128))
    action: Mapped[str] = mapped_column(String(64), index=True)
    target: Mapped[str] = mapped_column(String(256))
    before: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    after: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    reason: Mapped[str] = mapped_column(Text, default="")
    request_id: Mapped[str] = mapped_column(String(64), default="")


class FailSlowOptionsRow(Base):
    """Fail-slow detector options an operator set: per job (`scope` = its name) or for all ("*")."""

    __tablename__ = "failslow_options"
    scope: Mapped[str] = mapped_column(String(128), primary_key=True)
    options: Mapped[dict[str, Any]] = mapped_column(JSON)
    updated_at: Mapped[datetime] = mapped_column(UtcDateTime)
    updated_by: Mapped[str] = mapped_column(String(128))


class TokenRow(Base):
    __tablename__ = "api_tokens"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    public_id: Mapped[str] = mapped_column(String(16), unique=True)
    name: Mapped[str] = mapped_column(String(128))
    scope: Mapped[str] = mapped_column(String(16))
    token_hash: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(UtcDateTime)
    revoked_at: Mapped[datetime | None] = mapped_column(UtcDateTime)
    # agent tokens: the one node they may speak for, and optionally the SHA-256 of the client
    # certificate that node must present (mTLS)
    node: Mapped[str | None] = mapped_column(String(256))
    fingerprint: Mapped[str | None] = mapped_column(String(64))


class IdempotencyRow(Base):
    __tablename__ = "idempotency_keys"
    key: Mapped[str] = mapped_column(String(256), primary_key=True)
    actor: Mapped[str] = mapped_column(String(128))
    fingerprint: Mapped[str] = mapped_column(String(64))  # sha256 of method, path and body
    status: Mapped[int] = mapped_column(Integer)
    response: Mapped[dict[str, Any]] = mapped_column(JSON)
    created_at: Mapped[datetime] = mapped_column(UtcDateTime)


class MaintenanceRow(Base):
    __tablename__ = "maintenance_windows"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    target_kind: Mapped[str] = mapped_column(String(16))  # gpu | node | domain
    target: Mapped[str] = mapped_column(String(256))
    starts_at: Mapped[datetime] = mapped_column(UtcDateTime)
    ends_at: Mapped[datetime] = mapped_column(UtcDateTime)
    reason: Mapped[str] = mapped_column(Text, default="")
    owner: Mapped[str] = mapped_column(String(128))
    cancelled: Mapped[bool] = mapped_column(Boolean, default=False)


class LeaderRow(Base):
    """One row: the leader lease. `epoch` is the fencing token, bumped by every takeover and checked
    by every write transaction; the lease is held while `expires_at` (the database's clock) lies
    ahead (service/leadership/leader.py). The addresses tell clients of a standby where the leader is."""

    __tablename__ = "leader"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    epoch: Mapped[int] = mapped_column(BigInteger)
    holder: Mapped[str] = mapped_column(String(256))
    since: Mapped[datetime] = mapped_column(UtcDateTime)
    expires_at: Mapped[datetime | None] = mapped_column(UtcDateTime)
    http_address: Mapped[str] = mapped_column(String(512), default="", server_default="")
    grpc_address: Mapped[str] = mapped_column(String(512), default="", server_default="")


class BreakerRow(Base):
    """One row: the circuit breaker. Open = automatic replanning stopped until an operator resets."""

    __tablename__ = "breaker"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    open: Mapped[bool] = mapped_column(Boolean, default=False)
    reason: Mapped[str] = mapped_column(Text, default="")
    changed_at: Mapped[datetime] = mapped_column(UtcDateTime)


class OutboxRow(Base):
    """An agent's state change (hello, report, power read-back, liveness) that a manager took and
    stored, for the leader to apply in `seq` order (fleet mode: store/outbox.py)."""

    __tablename__ = "outbox"
    __table_args__ = (UniqueConstraint("idem_key", name="uq_outbox_idem_key"),
                      Index("ix_outbox_node_report_seq", "node", "report_seq"))
    seq: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True)
    kind: Mapped[str] = mapped_column(String(16))
    node: Mapped[str] = mapped_column(String(256), default="", server_default="")
    report_seq: Mapped[int | None] = mapped_column(BigInteger)
    payload: Mapped[dict[str, Any]] = mapped_column(JSON)
    idem_key: Mapped[str] = mapped_column(String(320))
    manager: Mapped[str] = mapped_column(String(256), default="", server_default="")
    created_at: Mapped[datetime] = mapped_column(UtcDateTime)


class OutboxStateRow(Base):
    """The last outbox `seq` a consumer applied, and the leader epoch it applied it at."""

    __tablename__ = "outbox_state"
    consumer: Mapped[str] = mapped_column(String(64), primary_key=True)
    last_seq: Mapped[int] = mapped_column(BigInteger)
    epoch: Mapped[int] = mapped_column(BigInteger)
    applied_at: Mapped[datetime] = mapped_column(UtcDateTime)


class OutboxQuarantineRow(Base):
    """An outbox row the leader could not apply, and why (it is skipped, never retried)."""

    __tablename__ = "outbox_quarantine"
    seq: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    reason: Mapped[str] = mapped_column(Text)
    epoch: Mapped[int] = mapped_column(BigInteger)
    at: Mapped[datetime] = mapped_column(UtcDateTime)


class AgentCommandRow(Base):
    """A command the leader sends to an agent whose stream another manager holds."""

    __tablename__ = "agent_commands"
    __table_args__ = (Index("ix_agent_commands_node", "node", "id"),)
    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True)
    node: Mapped[str] = mapped_column(String(256))
    payload: Mapped[dict[str, Any]] = mapped_column(JSON)
    epoch: Mapped[int] = mapped_column(BigInteger)
    created_at: Mapped[datetime] = mapped_column(UtcDateTime)


class FleetMemberRow(Base):
    """A manager in fleet mode: its gRPC address, the streams it holds and its backlog, written every
    heartbeat period (service/leadership/balance.py); one not seen lately is gone."""

    __tablename__ = "fleet_members"
    manager: Mapped[str] = mapped_column(String(256), primary_key=True)
    grpc_address: Mapped[str] = mapped_column(String(512), default="", server_default="")
    agents: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    watchers: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    # rows of work queued in it (its group commit's queue; the leader: outbox rows not applied yet)
    backlog: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    seen_at: Mapped[datetime] = mapped_column(UtcDateTime)


class WorldLogRow(Base):
    """What one of the leader's transactions changed in the world (new GPU and node values, domains
    added, jobs changed), for the other managers to follow (service/leadership/follow.py)."""

    __tablename__ = "world_log"
    seq: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True)
    epoch: Mapped[int] = mapped_column(BigInteger)
    body: Mapped[dict[str, Any]] = mapped_column(JSON)
    created_at: Mapped[datetime] = mapped_column(UtcDateTime)


class AllocationRow(Base):
    """Which job owns a scale-up domain: at most one, by the primary key, whatever managers race
    (service/planning/ownership.py). `kind`: `own` (admitted with the job), `grant` (given from
    the pool when the job's throughput fell below its `min_throughput`), `reserved` (granted against
    the job's spares reservation when it fell below full throughput) or `borrowed` (taken from a
    preemptible job). `seq` orders a job's domains (the order the planner fills them in)."""

    __tablename__ = "allocations"
    domain_id: Mapped[str] = mapped_column(ForeignKey("domains.id"), primary_key=True)
    job: Mapped[str] = mapped_column(ForeignKey("jobs.name"), index=True)
    kind: Mapped[str] = mapped_column(String(16))
    seq: Mapped[int] = mapped_column(Integer)
    at: Mapped[datetime] = mapped_column(UtcDateTime)
