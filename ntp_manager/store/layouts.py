"""Layout versions in the layouts table: which rows to read for a range of versions, and the
layouts they hold.

A version is a keyframe or a delta on the version before it (store/layout_codec.py), so reading
versions lo..hi reads from the newest keyframe at or before lo: at most `KEYFRAME_EVERY - 1` rows
more than asked for. Rows are fetched on the event loop (`rows_for`); decoding is CPU work that
grows with the job, so `decode_rows` is plain code for a worker thread.
"""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession

from ntp_manager.planner.layout import LayoutDoc
from ntp_manager.planner.spec import PlanError
from ntp_manager.store import layout_codec as codec
from ntp_manager.store.models import LayoutRow


async def rows_for(s: AsyncSession, job: str, lo: int, hi: int) -> list[LayoutRow]:
    """The rows needed to read versions lo..hi of `job`, oldest first (from the keyframe at or
    before lo). Empty when the job has no version in that range."""
    key = await s.scalar(select(func.max(LayoutRow.version)).where(
        LayoutRow.job == job, LayoutRow.version <= lo, LayoutRow.base_version.is_(None)))
    start = lo if key is None else int(key)
    q = (select(LayoutRow).where(LayoutRow.job == job, LayoutRow.version >= start, LayoutRow.version <= hi)
         .order_by(LayoutRow.version))
    return list((await s.scalars(q)).all())


async def newest_rows(s: AsyncSession, job: str) -> list[LayoutRow]:
    """The rows needed to read the newest version of `job` (empty when it has none)."""
    newest = await s.scalar(select(func.max(LayoutRow.version)).where(LayoutRow.job == job))
    return [] if newest is None else await rows_for(s, job, int(newest), int(newest))


def decode_rows(rows: Sequence[LayoutRow], uuid_at: codec.UuidAt) -> list[LayoutDoc]:
    """The layout of every row, in order. Each delta must follow its base; a row written as plan
    JSON before the compact encoding reads as a keyframe. Raises CodecError when a chain is
    broken or a body unreadable: a layout is never guessed."""
    out: list[LayoutDoc] = []
    base: LayoutRow | None = None
    for row in rows:
        if row.base_version is not None and (base is None or base.version != row.base_version):
            have = "nothing" if base is None else f"version {base.version}"
            raise codec.CodecError(f"layout {row.job!r} v{row.version} is a delta on v{row.base_version}, "
                                   f"read after {have}")
        if row.body is not None:
            out.append(codec.decode(row.body, uuid_at, out[-1] if row.base_version is not None else None))
        elif row.plan is not None:
            try:
                out.append(LayoutDoc.from_dict(row.plan))
            except PlanError as e:
                raise codec.CodecError(f"layout {row.job!r} v{row.version}: {e}") from None
        else:
            raise codec.CodecError(f"layout {row.job!r} v{row.version} has neither a body nor a plan")
        base = row
    return out


def chain_length(rows: Sequence[LayoutRow]) -> int:
    """How many deltas the last of `rows` is from its keyframe."""
    for n, row in enumerate(reversed(rows)):
        if row.base_version is None:
            return n
    raise codec.CodecError("layout rows do not start at a keyframe")
