"""What a new leader's load of the world costs at the seeds' scale (issue 30): `load_world` over
12,500 nodes (one NVLink domain each) and 100,000 GPUs on a scratch PostgreSQL database, four
times in one process, wall and CPU seconds each.

    .venv/bin/python bench/world_load.py [--postgres URL]   # a scratch database, dropped at the end
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import asyncpg

from bench.common import drop_postgres, fresh_postgres
from ntp_manager.service.leadership.loading import load_world
from ntp_manager.service.manager import Manager
from ntp_manager.settings import Settings
from ntp_manager.store import db


async def main(base: str) -> None:
    url = await fresh_postgres(base, "ntp_world_load")
    try:
        m = Manager(Settings(database_url=url))
        await db.upgrade(m.engine)
        await m.engine.dispose()
        c = await asyncpg.connect(url.replace("postgresql+asyncpg://", "postgresql://", 1))
        await c.execute("INSERT INTO domains (id, power_budget_w, created_at) "
                        "SELECT 'nvl-' || i, NULL, now() FROM generate_series(0, 12499) i")
        await c.execute("INSERT INTO nodes (name, domain_id, boot_id, agent_version, last_seq, registered_at) "
                        "SELECT 'f-' || i, 'nvl-' || i, 'b', '1', 0, now() FROM generate_series(0, 12499) i")
        await c.execute("INSERT INTO gpus (uuid, pos, node, domain_id, idx, model, memory_bytes, tdp_mw, min_mw, "
                        "max_mw, health, health_reason, health_source, health_since) "
                        "SELECT 'GPU-' || g, g, 'f-' || (g / 8), 'nvl-' || (g / 8), g % 8, 'H100', 85899345920, "
                        "700000, 200000, 700000, 'healthy', '', 'agent', now() FROM generate_series(0, 99999) g")
        await c.close()
        m = Manager(Settings(database_url=url))
        for _ in range(4):
            t, c0 = time.perf_counter(), time.process_time()
            async with m.sm() as s:
                w = await load_world(s, None, 0.0)
            print(f"load_world: {len(w.gpus)} GPUs, {len(w.nodes)} nodes: wall {time.perf_counter() - t:.3f} s, "
                  f"CPU {time.process_time() - c0:.3f} s", flush=True)
        await m.engine.dispose()
    finally:
        await drop_postgres(base, url)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--postgres", default=os.environ.get("NTP_TEST_POSTGRES_URL",
                                                         "postgresql+asyncpg://postgres@127.0.0.1:5432/test"))
    asyncio.run(main(ap.parse_args().postgres))
