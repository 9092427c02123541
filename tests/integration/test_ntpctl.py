"""`ntpctl` as a real subprocess against a real manager (in-process, loopback) with real agents on the
fake GPU backend: every reading command, the changing ones, tokens, and the error cases."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any

from tests.fakes.procs import free_port
from tests.integration.conftest import Service, eventually
from tests.integration.test_agent import JOB, make_agent, running


async def ctl(svc_http: str, *args: str, token: str | None = None, token_file: Path | None = None,
              url: str | None = None) -> tuple[int, str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("NTP_")}
    env.update(NTP_URL=url or svc_http, COLUMNS="200")
    if token is not None:
        env["NTP_TOKEN"] = token
    pre = ["--token-file", str(token_file)] if token_file else []
    p = await asyncio.create_subprocess_exec(sys.executable, "-m", "ntp_manager.cli.ctl", *pre, *args, env=env,
                                             stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(p.communicate(), 60)
    assert p.returncode is not None
    return p.returncode, out.decode(), err.decode()


async def cj(svc: Service, *args: str, scope: str = "operator") -> Any:
    rc, out, err = await ctl(svc.http, "--json", *args, token=svc.tokens[scope])
    assert rc == 0, (args, out, err)
    return json.loads(out)


async def test_reading_and_changing_commands(sqlite_service: Service, tmp_path: Path) -> None:
    svc = sqlite_service
    a = make_agent(svc.grpc, await svc.agent_token("node-a"), "node-a", "nvl-0", [])
    b = make_agent(svc.grpc, await svc.agent_token("node-b"), "node-b", "nvl-1", [])
    async with running(a), running(b):
        await eventually(lambda: a.registered.is_set() and b.registered.is_set())
        async with svc.client() as c:
            assert (await c.post("/v1/jobs", json=dict(JOB, scheme="ntp"))).status_code == 201
        await eventually(lambda: svc.manager.world.jobs["llm"].layout is not None)
        # the fault comes after the first layout, whatever the load: the history has two versions
        a.backend.inject("xid", 3, xid=48)
        bad = a.statics[3].uuid
        await eventually(lambda: svc.manager.world.gpus[bad].health == "failed")
        await eventually(lambda: svc.manager.world.jobs["llm"].layout is not None
                         and any(r.tp == 3 for r in svc.manager.world.jobs["llm"].layout.doc.replicas))

        st = await cj(svc, "status", scope="viewer")
        assert st["gpus"] == 8 and st["gpus_by_state"]["failed"] == 1 and st["jobs"] == 1
        assert {n["name"] for n in (await cj(svc, "nodes"))["items"]} == {"node-a", "node-b"}
        failed = await cj(svc, "gpus", "--state", "failed")
        assert [g["uuid"] for g in failed["items"]] == [bad]
        assert {d["id"] for d in (await cj(svc, "domains"))["items"]} == {"nvl-0", "nvl-1"}
        assert (await cj(svc, "jobs"))["items"][0]["name"] == "llm"
        lay = await cj(svc, "layout", "llm")
        assert sorted(r["tp"] for r in lay["plan"]["replicas"]) == [3, 4]
        hist = await cj(svc, "layout", "llm", "--history")
        assert len(hist["items"]) >= 2
        v1 = await cj(svc, "layout", "llm", "--version", "1", "--limit", "1", "--offset", "1")  # a page of one
        assert v1["version"] == 1 and v1["counts"]["replicas"] == 2 and [r["id"] for r in v1["plan"]["replicas"]] == [1]
        ev = await cj(svc, "events", "--gpu", bad)
        assert ev["items"][0]["new_state"] == "failed"

        # human output: tables, states by name
        rc, out, _ = await ctl(svc.http, "gpus", "--state", "failed", token=svc.tokens["viewer"])
        assert rc == 0 and bad in out and "failed" in out

        good = b.statics[0].uuid
        await cj(svc, "cordon", good, "--reason", "flaky link")
        assert [g["uuid"] for g in (await cj(svc, "gpus", "--state", "cordoned"))["items"]] == [good]
        await cj(svc, "uncordon", good, "--reason", "fixed")
        dry = await cj(svc, "plan", "llm", "--dry-run", "--fail", good)
        assert dry["dry_run"] is True and sorted(r["tp"] for r in dry["plan"]["replicas"]) == [3, 3]
        await cj(svc, "drain", "node-b", "--in", "30m", "--reason", "kernel update")
        nodes = {n["name"]: n for n in (await cj(svc, "nodes"))["items"]}
        assert nodes["node-b"]["drain_deadline"] and nodes["node-b"]["drain_reason"] == "kernel update"
        await cj(svc, "undrain", "node-b", "--reason", "postponed")
        await cj(svc, "mark-healthy", bad, "--reason", "swapped the board")
        # fail-slow: thresholds and dry run at runtime, then the job's view
        got = await cj(svc, "slow", "set", "llm", "--set", "enter_margin=0.2", "--set", "exit_margin=0.1", "--dry-run")
        assert got["changed"] == {"enter_margin": 0.2, "exit_margin": 0.1, "dry_run": True}
        view = await cj(svc, "slow", "show", "llm", scope="viewer")
        assert view["options"]["enter_margin"] == 0.2 and view["dry_run"] is True
        rc, _, err = await ctl(svc.http, "slow", "set", "llm", "--set", "exit_margin=0.3", token=svc.tokens["operator"])
        assert rc == 1 and "exit_margin" in err  # above enter_margin: refused, named
        rc, _, err = await ctl(svc.http, "slow", "set", "llm", "--set", "enter_margin=0.3", token=svc.tokens["viewer"])
        assert rc == 1 and "403" in err
        rc, out, _ = await ctl(svc.http, "slow", "show", "llm", token=svc.tokens["viewer"])
        assert rc == 0 and "dry run" in out
        assert (await cj(svc, "slow", "set", "--defaults", "--set", "enter_count=3"))["scope"] == "*"
        actions = [x["action"] for x in (await cj(svc, "audit", "--limit", "50"))["items"]]
        assert {"gpu.cordon", "gpu.uncordon", "node.drain", "node.undrain", "gpu.mark_healthy",
                "failslow.options"} <= set(actions)

        # tokens: admin scope only; the file form of the token
        admin = await svc.manager.create_token("test-admin", "admin")
        tf = tmp_path / "admin.token"
        tf.write_text(admin + "\n")
        rc, out, err = await ctl(svc.http, "--json", "token", "create", "ci", "--scope", "viewer", token_file=tf)
        assert rc == 0, err
        made = json.loads(out)
        assert made["token"].startswith("ntp_") and made["scope"] == "viewer"
        rc, out, _ = await ctl(svc.http, "--json", "status", token=made["token"])
        assert rc == 0
        rc, out, _ = await ctl(svc.http, "--json", "token", "list", token_file=tf)
        assert made["id"] in {t["id"] for t in json.loads(out)["items"]}
        rc, _, _ = await ctl(svc.http, "token", "revoke", made["id"], token_file=tf)
        assert rc == 0
        rc, _, err = await ctl(svc.http, "status", token=made["token"])
        assert rc == 1 and "401" in err and "revoked" in err


async def test_errors_are_one_clear_line_and_a_nonzero_exit(sqlite_service: Service, tmp_path: Path) -> None:
    svc = sqlite_service
    cases = [
        (dict(), ["status"], 2, "no token: set NTP_TOKEN or pass --token-file"),
        (dict(token_file=tmp_path / "missing"), ["status"], 2, "cannot read the token"),
        (dict(token="ntp_00000000_nope"), ["status"], 1, "401: unknown or revoked token"),
        (dict(token=svc.tokens["viewer"]), ["cordon", "GPU-x", "--reason", "r"], 1,
         "403: a 'viewer' token may not change this"),
        (dict(token=svc.tokens["operator"]), ["token", "list"], 1, "403: a 'operator' token may not manage tokens"),
        (dict(token=svc.tokens["operator"]), ["cordon", "GPU-nope", "--reason", "r"], 1, "404"),
        (dict(token=svc.tokens["operator"]), ["layout", "nojob"], 1, "404"),
        (dict(token=svc.tokens["operator"]), ["drain", "node-a", "--reason", "r", "--in", "soon"], 2,
         "use a number and s, m, h or d"),
        (dict(token=svc.tokens["operator"], url=f"http://127.0.0.1:{free_port()}"), ["status"], 3,
         "cannot reach the manager"),
    ]
    for kw, args, code, message in cases:
        rc, out, err = await ctl(svc.http, *args, **kw)  # type: ignore[arg-type]
        assert rc == code, (args, rc, out, err)
        assert message in err, (args, err)
        assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
