"""The layout feed's map of GPU positions (service/feed/layouts.py), which every watch on a fleet manager
checks its GPU against: a GPU not in the map is looked up alone (a burst of watches on a fresh
manager, or a watch naming a GPU nobody registered, does not read every GPU), and concurrent
reads of the whole map are one read."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from ntp_manager.service.core.inputs import GpuInventory
from ntp_manager.service.feed.layouts import LayoutFeed
from ntp_manager.service.manager import Manager
from ntp_manager.settings import Settings


@pytest.fixture
async def manager(tmp_path: Path) -> AsyncIterator[Manager]:
    m = Manager(Settings(data_dir=tmp_path, database_url=f"sqlite+aiosqlite:///{tmp_path / 'ntp.db'}"))
    await m.start()
    for n in range(3):
        await m.register_agent(f"n{n}", f"d{n}", [GpuInventory(f"G{n}-{i}", i) for i in range(4)], "boot", "v")
    try:
        yield m
    finally:
        await m.stop()


async def test_a_gpu_not_in_the_map_is_looked_up_alone(manager: Manager) -> None:
    feed = LayoutFeed(manager.sm, manager.settings, manager.clock)
    known = await asyncio.gather(*(feed.known_gpu(f"G{n}-{i}") for n in range(3) for i in range(4)))
    assert all(known)
    assert not await feed.known_gpu("GPU-nobody-registered")
    assert feed.position_reads == 0  # twelve lookups of one row, none of every GPU
    # a GPU registered after the map was filled joins it the same way
    await manager.register_agent("n9", "d9", [GpuInventory("G9-0", 0)], "boot", "v")
    assert await feed.known_gpu("G9-0") and feed.position_reads == 0


async def test_concurrent_reads_of_every_position_are_one(manager: Manager) -> None:
    feed = LayoutFeed(manager.sm, manager.settings, manager.clock)
    await asyncio.gather(*(feed._load_positions() for _ in range(20)))
    assert feed.position_reads == 1 and len(feed._uuids) == 12
    await feed._load_positions()  # a later caller reads again (GPUs may have registered since)
    assert feed.position_reads == 2
