"""The demo scenario, smaller, with real processes: a manager subprocess (SQLite), real agents on the
fake backend, 8 rank processes on the manager's gRPC watch stream, 2 replicas x 2 stages x TP2. A
GPU of replica 0's stage 1 fails (XID 48 through the fake backend, its process killed): that stage
runs at TP1, the other stages stay at TP2; a GPU of replica 1's stage 1 fails: the planner packs
the full groups into one replica, two groups change stage; both are repaired: TP2 everywhere.
Every step's loss equals a single-process reference on the same global batches.

The same run checks what a person sees (issue 33): the console (everything written to this
process's descriptors 1 and 2, the rank processes' and the manager's included) holds the story
and no log line; each process's log is in its own file; every table row is whole (a wrapped cell
is put back together and compared with what the API says); each timeline has its phases."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ntp_manager.demos.demo import run_demo

# a structlog line, as the console renderer or the JSON renderer writes it
LOG_LINE = re.compile(r"^\s*(\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}:\d{2}|\{.*\"event\": )"
                      r"|\[\s*(debug|info|warning|error)\s*\]")


def rich_tables(text: str) -> dict[str, list[list[str]]]:
    """The rich tables in `text` by title: each row's cells, the lines of a wrapped cell joined
    with spaces. Rows are told apart by the rules between them (`show_lines`) when the table
    has them, else a row is a line."""
    lines = text.splitlines()
    out: dict[str, list[list[str]]] = {}
    for i, line in enumerate(lines):
        if not line.lstrip().startswith("┏"):
            continue
        title = lines[i - 1].strip()
        body = []
        for row in lines[next(j for j in range(i, len(lines)) if lines[j].lstrip().startswith("┡")) + 1:]:
            if row.lstrip().startswith("└"):
                break
            body.append(row.strip())
        ruled = any(r.startswith("├") for r in body)
        rows: list[list[list[str]]] = []  # row, cell, the cell's pieces (one per line)
        parts: list[list[str]] | None = None
        for r in body:
            if r.startswith("├"):
                parts = None
                continue
            cells = [c.strip() for c in r[1:-1].split("│")]
            if parts is None or not ruled:
                parts = [[] for _ in cells]
                rows.append(parts)
            for k, c in enumerate(cells):
                if c:
                    parts[k].append(c)
        out[title] = [[" ".join(p) for p in row] for row in rows]
    return out


def squash(text: str) -> str:
    return "".join(text.split())


def test_demo_scenario_fail_then_repair(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    res = run_demo(steps_before=3, steps_degraded=3, steps_after=3, data=tmp_path / "demo", keep_up=False)
    out, err = capfd.readouterr()
    assert res.versions[:3] == [1, 2, 3] and len(res.versions) in (4, 5)  # the repairs: one replan or two
    assert res.stages_by_version[1] == [[2, 2], [2, 2]]
    assert res.stages_by_version[2] == [[2, 1], [2, 2]]  # one stage reduced, the rest unchanged
    assert res.stages_by_version[3] == [[2, 2], [1, 1]] and res.stage_changes[3] == 2  # packed across stages
    assert res.stages_by_version[res.versions[-1]] == [[2, 2], [2, 2]]
    steps = [s for s, *_ in res.losses]
    assert steps == list(range(len(steps))) and len(steps) >= 12
    assert {1, 2, 3, res.versions[-1]} <= {v for _, v, _, _ in res.losses}
    for s, _, loss, ref in res.losses:
        assert abs(loss - ref) <= 1e-5 * abs(ref), (s, loss, ref)
    # the timeline covers every stage of the failure handling, in order
    names = [what for what, _ in res.timeline]
    for stage in ("agent report received by the manager", "plan made", "layout pushed", "reshard done",
                  "first step at the new layout"):
        assert any(n.startswith(stage) for n in names), (stage, names)
    assert res.stall_s > 0 and res.stall2_s > 0
    assert set(res.split) == {"detection", "plan", "push + regroup", "reshard", "first step"}
    assert res.dashboard.startswith("http://127.0.0.1:") and "token=ntp_" in res.dashboard

    # ---- the console: the story, and no log line -------------------------------------------------
    assert not [ln for ln in (out + err).splitlines() if LOG_LINE.search(ln)], (out + err)[-4000:]
    assert "Traceback" not in out + err and "leaked" not in err, err[-4000:]
    assert "…" not in out  # nothing cut with an ellipsis
    logs = tmp_path / "demo" / "logs"
    assert f"logs in {logs}/" in out and res.logs == logs  # said at the start
    assert res.dashboard in out  # a long line (a URL with a token) stays whole
    # ... the logs are in their files: the manager's, each agent's, each rank's (named by node/GPU)
    assert "layout ack" in (logs / "manager.log").read_text()
    assert "xid=48" in (logs / "agent-node-a.log").read_text() and "xid=48" in (logs / "agent-node-b.log").read_text()
    for node in ("node-a", "node-b"):
        for i in range(4):
            text = (logs / f"rank-{node}-gpu{i}.log").read_text()
            assert f"worker={node}-gpu{i}" in text and "first step" in text, (node, i, text[-2000:])

    # ---- every table row whole -----------------------------------------------------------------
    tables = rich_tables(out)
    layouts = tables["layout versions (replica: stages x TP, local batch)"]
    assert [int(r[0]) for r in layouts] == res.versions
    for row in layouts:  # the whole reason, however it wrapped
        assert squash(row[3]) == squash(res.reasons[int(row[0])]), row
    loss_rows = next(rows for title, rows in tables.items() if title.startswith("job demo: loss per step"))
    assert [(int(r[0]), r[3]) for r in loss_rows] == [(s, f"{v:.5f}") for s, _, v, _ in res.losses]

    # ---- each timeline shows every phase with its time and duration ------------------------------
    timelines = {t.split(" (")[0]: rows for t, rows in tables.items() if t.startswith("timeline: ")}
    assert set(timelines) == {"timeline: failure", "timeline: second failure", "timeline: repair"}, list(tables)
    common = ["injected", "agent report received by the manager", "plan made", "layout pushed",
              "process group rebuilt", "reshard done", "acks at the manager", "first step at the new layout"]
    want = {"timeline: failure": [*common, "collective failed on a survivor"],
            "timeline: second failure": [*common, "collective failed on a survivor"],
            "timeline: repair": [*common, "fresh ranks have it"]}
    for title, rows in timelines.items():
        phases = [r[0] for r in rows]
        for p in want[title]:
            assert any(p in ph for ph in phases), (title, p, phases)
        for r in rows:
            assert re.fullmatch(r"\d+\.\d\d", r[1]) and re.fullmatch(r"\d+\.\d\d", r[2]), (title, r)
        times = [float(r[1]) for r in rows]
        assert times == sorted(times), (title, rows)
    # the repair's fresh processes were waiting for their place: no process start in its timeline
    assert not any("fresh process up" in r[0] for r in timelines["timeline: repair"])
