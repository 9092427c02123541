"""GET /v1/slurm through the real API, with stand-ins for Slurm's commands (shell scripts run as
subprocesses, as the real ones are): its lists are bounded by `limit` like every other listing."""

from __future__ import annotations

import stat
from pathlib import Path

from ntp_manager.service.operations.slurm_policy import MARKER
from tests.integration.conftest import eventually, running_service

NODES = 30


def _script(d: Path, name: str, body: str) -> None:
    p = d / name
    p.write_text("#!/bin/sh\n" + body)
    p.chmod(p.stat().st_mode | stat.S_IXUSR)


async def test_the_slurm_view_is_bounded_by_limit(tmp_path: Path) -> None:
    # sinfo lists NODES nodes drained by ntp-manager that this manager does not know (each is both
    # "drained by ntp-manager" and "held"), and one an operator drained
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    lines = "\n".join(f"gone-{i:03d}|drained|{MARKER} GPU 0 GPU-x failed; audit /v1/audit/{i + 1}"
                      for i in reversed(range(NODES)))
    _script(bin_dir, "sinfo", f"cat <<'EOF'\n{lines}\nop-1|drained|bad DIMM\nEOF\n")
    _script(bin_dir, "scontrol", "exit 0\n")
    async with running_service(f"sqlite+aiosqlite:///{tmp_path / 'ntp.db'}", tmp_path, slurm_drain=True,
                               slurm_bin_dir=bin_dir, slurm_poll_s=0.5) as svc:
        await eventually(lambda: svc.manager.slurm.last is not None, timeout=20)
        async with svc.client("viewer") as c:
            r = await c.get("/v1/slurm")  # the default limit (100) holds them all
            assert r.status_code == 200, r.text
            body = r.json()
            assert len(body["drained_by_ntp_manager"]) == NODES and len(body["held"]) == NODES
            assert body["counts"] == {"wanted": 0, "held": NODES, "refused": 0, "drained_by_ntp_manager": NODES}

            r = await c.get("/v1/slurm", params={"limit": 5})
            assert r.status_code == 200, r.text
            body = r.json()
            first = [f"gone-{i:03d}" for i in range(5)]  # node-name order, whatever order sinfo printed
            assert [d["node"] for d in body["drained_by_ntp_manager"]] == first
            assert [h["node"] for h in body["held"]] == first
            assert all("does not know this node" in h["why"] for h in body["held"])
            assert body["counts"]["drained_by_ntp_manager"] == NODES and body["counts"]["held"] == NODES
            assert body["limit"] == 5

            for bad in (0, -1, 1001, "many"):
                r = await c.get("/v1/slurm", params={"limit": bad})
                assert r.status_code == 422 and "limit" in r.json()["detail"], (bad, r.text)
