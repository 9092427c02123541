"""The dashboard in headless Chromium (Debian's, driven by Playwright): a real manager, real agents on
the fake backend and a job at 2 x TP4. A GPU fails through the fake backend; without a reload the
page shows the GPU failed and the replica's TP degree drop to 3. A screenshot is saved under the
test's output directory (and copied to out/browser/ for people to look at)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.integration.conftest import Service, eventually
from tests.integration.test_agent import JOB, make_agent, running

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed "
                                "(`make test` installs it when it runs as root with apt)")
ROOT = Path(__file__).resolve().parents[2]


async def test_dashboard_shows_a_failure_live(sqlite_service: Service, tmp_path: Path) -> None:
    from playwright.async_api import async_playwright, expect

    svc = sqlite_service
    a = make_agent(svc.grpc, await svc.agent_token("node-a"), "node-a", "nvl-0", [])
    b = make_agent(svc.grpc, await svc.agent_token("node-b"), "node-b", "nvl-1", [])
    async with running(a), running(b):
        await eventually(lambda: a.registered.is_set() and b.registered.is_set())
        async with svc.client() as c:
            assert (await c.post("/v1/jobs", json=dict(JOB, scheme="ntp-pw"))).status_code == 201
        async with async_playwright() as pw:
            browser = await pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
            page = await browser.new_page(viewport={"width": 1366, "height": 800})  # a laptop screen
            await page.goto(f"{svc.http}/?token={svc.tokens['viewer']}")
            await expect(page.locator("#conn")).to_have_text("live", timeout=15_000)
            await expect(page.locator(".gpu[data-state=healthy]")).to_have_count(8)
            await expect(page.locator("td.tp")).to_have_text(["4", "4"])
            # each replica drawn as its stages, each a TP group with one square per rank
            await expect(page.locator(".stage")).to_have_count(2)
            await expect(page.locator(".stage .rank")).to_have_count(8)
            # issue 41: each domain names and is coloured by the job owning it
            await expect(page.locator('.domain[data-job="llm"]')).to_have_count(2)
            await expect(page.locator('.domain[data-job="llm"] .owner').first).to_have_text("llm")
            await page.evaluate("window.__notReloaded = true")

            victim = a.statics[3].uuid
            a.backend.inject("xid", 3, xid=48)
            await expect(page.locator(f'.gpu[data-gpu="{victim}"]')).to_have_attribute("data-state", "failed",
                                                                                    timeout=15_000)
            await expect(page.locator('td.tp[data-tp="3"]')).to_have_count(1, timeout=15_000)
            await expect(page.locator('.stage.reduced[data-stage-tp="3"]')).to_have_count(1)
            await expect(page.locator(".boost")).not_to_have_count(0, timeout=15_000)  # ntp-pw raised caps
            await expect(page.locator("#events")).to_contain_text("failed")
            assert await page.evaluate("window.__notReloaded === true")
            shot = tmp_path / "dashboard.png"
            await page.screenshot(path=str(shot), full_page=True)
            await browser.close()
    assert shot.stat().st_size > 10_000
    out = ROOT / "out" / "browser"
    out.mkdir(parents=True, exist_ok=True)
    shutil.copy(shot, out / "dashboard.png")


async def test_dashboard_shows_fail_slow_live(sqlite_service: Service, tmp_path: Path) -> None:
    """Step reports over gRPC (tests/integration/test_failslow.py `Workers`): the page shows each
    rank's step time and factor; when one GPU computes at half speed it shows the verdict, the
    rank flagged, and the layout without it, all without a reload."""
    from playwright.async_api import async_playwright, expect

    from tests.integration.test_failslow import JOB as SLOW_JOB
    from tests.integration.test_failslow import Workers
    from tests.integration.test_service import start_agents

    svc = sqlite_service
    agents = await start_agents(svc)
    async with svc.client() as c:
        assert (await c.post("/v1/jobs", json=SLOW_JOB)).status_code == 201
    await eventually(lambda: svc.manager.world.jobs["llm"].layout is not None)
    lay = svc.manager.world.jobs["llm"].layout
    assert lay is not None
    victim = lay.doc.replicas[1].groups[0].gpus[2]
    w = Workers(svc)
    async with async_playwright() as pw:
        browser = await pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        page = await browser.new_page(viewport={"width": 1366, "height": 800})
        await page.goto(f"{svc.http}/?token={svc.tokens['viewer']}")
        await expect(page.locator("#conn")).to_have_text("live", timeout=15_000)
        await page.evaluate("window.__notReloaded = true")
        await w.run(30)
        rows = page.locator(".failslow tr[data-gpu]")
        await expect(rows).to_have_count(8, timeout=15_000)
        await expect(page.locator('.failslow tr[data-slow="true"]')).to_have_count(0)
        await expect(rows.first).to_contain_text("1000.0 ms")  # the step time the reports give
        await w.run(8, slow={victim: 2.0})
        flagged = page.locator(f'.failslow tr[data-slow="true"][data-gpu="{victim}"]')
        await expect(flagged).to_have_count(1, timeout=15_000)
        await expect(flagged.locator("td.factor")).to_contain_text("slow")
        await expect(page.locator('.verdicts li[data-kind="slow"]')).not_to_have_count(0)
        await expect(page.locator('td.tp[data-tp="3"]')).to_have_count(1, timeout=15_000)  # excluded
        await expect(page.locator(f'.gpu[data-gpu="{victim}"]')).to_have_attribute("data-state", "degraded")
        assert await page.evaluate("window.__notReloaded === true")
        shot = tmp_path / "dashboard-failslow.png"
        await page.screenshot(path=str(shot), full_page=True)
        await browser.close()
    await w.close()
    for a in agents:
        await a.close()
    out = ROOT / "out" / "browser"
    out.mkdir(parents=True, exist_ok=True)
    shutil.copy(shot, out / "dashboard-failslow.png")
