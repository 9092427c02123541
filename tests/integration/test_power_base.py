"""Fleet base power cap through the real manager: healthy GPUs at the base, the reduced group's
survivors boosted up to (never above) their maximum, back to the base on repair."""

from __future__ import annotations

from tests.fakes.agent_client import ScriptedAgent, gpu_uuids
from tests.integration.conftest import eventually, running_service

JOB = {"name": "llm", "tp": 4, "replicas": 2, "local_batch": 8, "min_tp": 2, "heads": 16, "mlp_columns": 64,
       "scheme": "ntp-pw"}


def latest_caps(agent: ScriptedAgent) -> dict[str, int | None]:
    caps: dict[str, int | None] = {}
    for m in agent.commands:
        kind = m.WhichOneof("body")
        if kind == "set_power":
            caps[m.set_power.gpu_uuid] = m.set_power.limit_mw
        elif kind == "release_power":
            caps[m.release_power.gpu_uuid] = None
    return caps


async def test_base_cap_on_a_fleet_whose_default_is_its_maximum(tmp_path):
    # H100-like GPUs: 200-700 W, default = max = 700 W. Base cap 0.85 -> 595 W for healthy GPUs.
    async with running_service(f"sqlite+aiosqlite:///{tmp_path / 'pb.db'}", tmp_path, power_base_cap=0.85) as svc:
        agents = []
        for d in range(2):
            node = f"node-{d}"
            a = ScriptedAgent(svc.grpc, await svc.agent_token(node), node, f"nvl-{d}", gpu_uuids(node, 4),
                              tdp_mw=700_000, max_mw=700_000)
            await a.connect()
            await a.wait_for(lambda a=a: a.welcome is not None)
            agents.append(a)
        async with svc.client() as c:
            assert (await c.post("/v1/jobs", json=JOB)).status_code == 201
            for a in agents:
                await eventually(lambda a=a: latest_caps(a) == dict.fromkeys(a.gpus, 595_000))
            await agents[0].report({"GPU-node-0-3": "failed"})
            # TP4 -> TP3 needs speed 1.425 (power 1.66 x base); the GPUs' maximum is 700/595 = 1.176 x base,
            # so the survivors go to exactly 700 W (and the local batch shrinks instead of the rest).
            boosted = {f"GPU-node-0-{i}": 700_000 for i in range(3)}
            await eventually(lambda: all(latest_caps(agents[0]).get(u) == w for u, w in boosted.items()))
            assert latest_caps(agents[1]) == dict.fromkeys(agents[1].gpus, 595_000)
            assert all(m.set_power.limit_mw <= 700_000 for a in agents for m in a.commands
                       if m.WhichOneof("body") == "set_power")
            plan = (await c.get("/v1/jobs/llm")).json()
            assert plan  # the job exists; its layout lists only the boosted GPUs' caps
            g = (await c.get("/v1/gpus/GPU-node-1-0")).json()
            assert g["desired_w"] == 595.0
            await agents[0].report({"GPU-node-0-3": "healthy"})
            await eventually(lambda: latest_caps(agents[0]) == dict.fromkeys(agents[0].gpus, 595_000))
            assert not any(m.WhichOneof("body") == "release_power" for a in agents for m in a.commands)
        for a in agents:
            await a.close()


def test_base_cap_setting_is_validated():
    import pytest
    from pydantic import ValidationError

    from ntp_manager.settings import Settings

    assert Settings(power_base_cap=0.85).power_base_cap == 0.85
    for bad in (0, 1.5, -0.1):
        with pytest.raises(ValidationError, match="power_base_cap"):
            Settings(power_base_cap=bad)
