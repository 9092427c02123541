"""What agents send, as transport-neutral records, and the checks every one passes before it can
touch memory or the store (the limits are in `ntp_manager.contract.limits`, the same on SQLite and
PostgreSQL). A check that fails raises InvalidArgument naming the field; nothing is written then."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from ntp_manager.contract import limits
from ntp_manager.service.core.errors import InvalidArgument


@dataclass
class GpuReport:
    """One GPU's health from an agent report."""

    uuid: str
    state: str  # as received; only HEALTH_STATES values are accepted (service/ingest/agents.py)
    reasons: list[str]
    xids: list[int]
    enforced_mw: int | None = None


@dataclass
class GpuInventory:
    """One GPU of a hello's inventory."""

    uuid: str
    index: int
    model: str = ""
    memory_bytes: int = 0
    default_mw: int = 1_000_000
    min_mw: int = 200_000
    max_mw: int = 1_300_000


def _invalid(e: limits.LimitError) -> InvalidArgument:
    return InvalidArgument(str(e))


def check_hello(node: str, domain: str, gpus: list[GpuInventory], boot_id: str, agent_version: str) -> None:
    try:
        limits.node_name("hello.node", node)
        limits.ident("hello.domain", domain, limits.DOMAIN_MAX)
        limits.text("hello.boot_id", boot_id, limits.SHORT_TEXT_MAX)
        limits.text("hello.agent_version", agent_version, limits.VERSION_TEXT_MAX)
        if not gpus:
            raise InvalidArgument(f"hello.gpus: node {node!r} reports no GPUs")
        limits.integer("hello.gpus (count)", len(gpus), 1, limits.GPUS_PER_NODE_MAX)
        if not _plainly_valid(gpus):
            _check_inventory(gpus)
    except limits.LimitError as e:
        raise _invalid(e) from None
    uuids = [g.uuid for g in gpus]
    if len(set(uuids)) != len(uuids):
        raise InvalidArgument(f"hello.gpus: node {node!r}: duplicate GPU UUIDs in its inventory")


def _check_inventory(gpus: list[GpuInventory]) -> None:
    """Every field of every GPU, named when it breaks its limit (raises limits.LimitError)."""
    for i, g in enumerate(gpus):
        f = f"hello.gpus[{i}]"
        limits.ident(f"{f}.uuid", g.uuid, limits.GPU_ID_MAX)
        limits.integer(f"{f}.index", g.index, 0, limits.INT32_MAX)
        limits.text(f"{f}.model", g.model, limits.SHORT_TEXT_MAX)
        limits.integer(f"{f}.memory_bytes", g.memory_bytes, 0, limits.INT64_MAX)
        for name in ("min_mw", "default_mw", "max_mw"):
            limits.integer(f"{f}.power.{name}", getattr(g, name), 1, limits.INT32_MAX)
        if not (g.min_mw <= g.default_mw <= g.max_mw):
            raise InvalidArgument(f"{f}.power: GPU {g.uuid}: constraints must satisfy 0 < min <= default <= max")


def _plainly_valid(gpus: list[GpuInventory]) -> bool:
    """True when every GPU of an inventory passes its checks by a few cheap tests (printable ASCII
    ids and models, numbers well inside their ranges): the usual hello, and every re-hello of a
    failover's storm, without a field name built per value. False decides nothing: the full checks
    then run and name what is wrong. (Printable ASCII without a space is exactly IDENT_PATTERN;
    printable ASCII is a part of what TEXT_PATTERN allows.)"""
    for g in gpus:
        u, m = g.uuid, g.model
        if not (0 < len(u) <= limits.GPU_ID_MAX and u.isascii() and u.isprintable() and " " not in u
                and len(m) <= limits.SHORT_TEXT_MAX and m.isascii() and m.isprintable()
                and 0 <= g.index <= limits.INT32_MAX and 0 <= g.memory_bytes <= limits.INT64_MAX
                and 1 <= g.min_mw <= g.default_mw <= g.max_mw <= limits.INT32_MAX):
            return False
    return True


def check_report(seq: int, gpus: list[GpuReport]) -> None:
    try:
        limits.integer("report.seq", seq, 0, limits.INT64_MAX)
        limits.integer("report.gpus (count)", len(gpus), 0, limits.GPUS_PER_NODE_MAX)
        for i, g in enumerate(gpus):
            f = f"report.gpus[{i}]"
            limits.ident(f"{f}.uuid", g.uuid, limits.GPU_ID_MAX)
            limits.integer(f"{f}.reasons (count)", len(g.reasons), 0, limits.REASONS_PER_GPU)
            for r in g.reasons:
                limits.text(f"{f}.reasons", r, limits.REASON_MAX)
            limits.integer(f"{f}.xids (count)", len(g.xids), 0, limits.XIDS_PER_GPU)
            for x in g.xids:
                limits.integer(f"{f}.xids", x, 0, limits.INT32_MAX)
            if g.enforced_mw is not None:
                limits.integer(f"{f}.power.enforced_mw", g.enforced_mw, 0, limits.INT32_MAX)
    except limits.LimitError as e:
        raise _invalid(e) from None


def check_power_readings(readings: Iterable[tuple[str, int]]) -> None:
    try:
        for i, (u, mw) in enumerate(readings):
            if i >= limits.GPUS_PER_NODE_MAX:
                raise limits.LimitError("result.gpu_uuids (count)", f"more than {limits.GPUS_PER_NODE_MAX}")
            limits.ident(f"result.gpu_uuids[{i}]", u, limits.GPU_ID_MAX)
            limits.integer(f"result.power[{i}].enforced_mw", mw, 0, limits.INT32_MAX)
    except limits.LimitError as e:
        raise _invalid(e) from None
