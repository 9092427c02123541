"""`ntpctl`: the operator's command line, a thin client of the manager's REST API.

    export NTP_URL=http://127.0.0.1:8080 NTP_TOKEN=ntp_...   # or --token-file
    ntpctl status
    ntpctl gpus --state failed
    ntpctl layout llm --history
    ntpctl cordon GPU-... --reason "flaky NVLink"
    ntpctl drain node-7 --in 30m --reason "kernel update"
    ntpctl plan llm --dry-run --fail GPU-a --fail GPU-b

Every command takes `--json` (machine-readable output, the API's own JSON). Errors are one line on
stderr and a non-zero exit: 2 for usage and missing tokens, 1 for requests the manager refused
(401/403/404/409/422, with its message), 3 when the manager cannot be reached.
"""

from __future__ import annotations

import json
import os
import re
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Annotated, Any, NoReturn

import httpx
import typer
from rich.console import Console
from rich.table import Table

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Operate an ntp-manager cluster.")
token_app = typer.Typer(no_args_is_help=True, help="Manage API tokens (admin scope).")
app.add_typer(token_app, name="token")
out = Console(soft_wrap=True)
err = Console(stderr=True, soft_wrap=True)


class Ctx:
    def __init__(self, url: str, token_file: Path | None, as_json: bool, timeout: float) -> None:
        self.url, self.token_file, self.as_json, self.timeout = url.rstrip("/"), token_file, as_json, timeout

    def token(self) -> str:
        if self.token_file is not None:
            try:
                tok = self.token_file.read_text().strip()
            except OSError as e:
                fail(f"{self.token_file}: cannot read the token ({e.strerror})", 2)
            if not tok:
                fail(f"{self.token_file} is empty", 2)
            return tok
        tok = os.environ.get("NTP_TOKEN", "").strip()
        if not tok:
            fail("no token: set NTP_TOKEN or pass --token-file", 2)
        return tok

    def call(self, method: str, path: str, **kw: Any) -> Any:
        headers = {"Authorization": f"Bearer {self.token()}"}
        try:
            r = httpx.request(method, f"{self.url}{path}", headers=headers, timeout=self.timeout, **kw)
        except httpx.HTTPError as e:
            fail(f"cannot reach the manager at {self.url} ({type(e).__name__}: {e})", 3)
        if r.status_code >= 400:
            try:
                detail = r.json().get("detail", r.text)
            except ValueError:
                detail = r.text
            if isinstance(detail, list):  # validation errors
                detail = "; ".join(f"{'.'.join(str(x) for x in d.get('loc', []))}: {d.get('msg')}" for d in detail)
            fail(f"{r.status_code}: {detail}", 1)
        return r.json()


def fail(msg: str, code: int = 1) -> NoReturn:
    err.print(f"[bold red]error:[/] {msg}", highlight=False)
    raise typer.Exit(code)


def ctx_of(c: typer.Context) -> Ctx:
    obj = c.find_root().obj
    assert isinstance(obj, Ctx)
    return obj


JsonOpt = Annotated[bool, typer.Option("--json", help="print the API's JSON")]


@app.callback()
def root(
    c: typer.Context,
    url: Annotated[str, typer.Option(envvar="NTP_URL", help="manager REST address")] = "http://127.0.0.1:8080",
    token_file: Annotated[Path | None, typer.Option(envvar="NTP_TOKEN_FILE", help="file holding the token "
                                                    "(else NTP_TOKEN)")] = None,
    as_json: JsonOpt = False,
    timeout: Annotated[float, typer.Option(min=0.1, help="seconds per request")] = 10.0,
) -> None:
    c.obj = Ctx(url, token_file, as_json, timeout)


def emit(c: typer.Context, data: Any, as_json: bool, table: Table | None = None, text: str | None = None) -> None:
    if as_json or ctx_of(c).as_json:
        out.print_json(json.dumps(data))
    elif table is not None:
        out.print(table)
    elif text is not None:
        out.print(text, highlight=False)


def table(title: str, cols: list[str], rows: list[list[Any]]) -> Table:
    t = Table(title=title, title_justify="left")
    for col in cols:
        t.add_column(col)
    for r in rows:
        t.add_row(*("" if v is None else str(v) for v in r))
    return t


STATE_STYLE = {"healthy": "green", "suspect": "yellow", "degraded": "dark_orange", "failed": "red",
               "cordoned": "grey50", "draining": "blue"}


def styled(state: str) -> str:
    return f"[{STATE_STYLE.get(state, 'white')}]{state}[/]"


# ---- reading -----------------------------------------------------------------------------------
@app.command()
def status(c: typer.Context, as_json: JsonOpt = False) -> None:
    """Cluster summary: GPUs by state, nodes, jobs, breaker."""
    d = ctx_of(c).call("GET", "/v1/status")
    counts = "  ".join(f"{styled(k)} {v}" for k, v in sorted(d["gpus_by_state"].items()))
    text = (f"manager {d['version']} (leader epoch {d['leader_epoch']})\n"
            f"GPUs {d['gpus']}: {counts or '-'}\nnodes {d['nodes_connected']}/{d['nodes']} connected, "
            f"domains {d['domains']}, jobs {d['jobs']}\n"
            f"breaker: {'[red]OPEN[/] ' + (d['breaker']['reason'] or '') if d['breaker']['open'] else 'closed'}")
    emit(c, d, as_json, text=text)


@app.command()
def nodes(c: typer.Context, domain: str | None = None, as_json: JsonOpt = False) -> None:
    """Nodes with their agents' connection state and drains."""
    d = ctx_of(c).call("GET", "/v1/nodes", params={"domain": domain, "limit": 1000} if domain else {"limit": 1000})
    rows = [[n["name"], n["domain"], len(n["gpus"]), "yes" if n["connected"] else "[red]no[/]", n["last_seq"],
             n["drain_deadline"] or ""] for n in d["items"]]
    emit(c, d, as_json, table("nodes", ["node", "domain", "GPUs", "connected", "last report", "drain by"], rows))


@app.command()
def gpus(c: typer.Context, state: str | None = None, node: str | None = None, domain: str | None = None,
         as_json: JsonOpt = False) -> None:
    """GPUs, optionally filtered by state, node or domain."""
    params: dict[str, Any] = {k: v for k, v in {"state": state, "node": node, "domain": domain}.items() if v}
    params["limit"] = 1000
    d = ctx_of(c).call("GET", "/v1/gpus", params=params)
    rows = [[g["uuid"], g["node"], g["domain"], styled(g["state"]), g["admin_reason"] or g["health_reason"] or "",
             f"{g['desired_w']:.0f} W" if g["desired_w"] else ""] for g in d["items"]]
    emit(c, d, as_json, table(f"GPUs ({d['total']})", ["uuid", "node", "domain", "state", "why", "power"], rows))


@app.command()
def domains(c: typer.Context, as_json: JsonOpt = False) -> None:
    """NVLink domains and how many of their GPUs are unusable."""
    d = ctx_of(c).call("GET", "/v1/domains", params={"limit": 1000})
    rows = [[x["id"], x["gpus"], x["unusable"], ", ".join(x["nodes"]), x["power_budget_w"]] for x in d["items"]]
    emit(c, d, as_json, table("domains", ["domain", "GPUs", "unusable", "nodes", "budget W"], rows))


@app.command()
def jobs(c: typer.Context, as_json: JsonOpt = False) -> None:
    """Jobs and their current layout versions."""
    d = ctx_of(c).call("GET", "/v1/jobs", params={"limit": 1000})
    rows = [[j["name"], j["layout_version"], " ".join(f"TP{r['tp']}" for r in j["replicas"]),
             sum(r["local_batch"] for r in j["replicas"]), j.get("pending_reason") or ""] for j in d["items"]]
    emit(c, d, as_json, table("jobs", ["job", "layout", "replicas", "global batch", "pending"], rows))


@app.command()
def layout(c: typer.Context, job: str, history: Annotated[bool, typer.Option(help="every version")] = False,
           as_json: JsonOpt = False) -> None:
    """A job's current layout (replicas, TP degrees, local batches, power), or its history."""
    cx = ctx_of(c)
    if history:
        d = cx.call("GET", f"/v1/jobs/{job}/layouts", params={"limit": 1000})
        rows = [[x["version"], x["created_at"][:19], x["reason"], " ".join(f"TP{r['tp']}" for r in x["replicas"])]
                for x in d["items"]]
        emit(c, d, as_json, table(f"layouts of {job}", ["version", "created", "reason", "replicas"], rows))
        return
    d = cx.call("GET", f"/v1/jobs/{job}/layout")
    plan = d.get("plan", d)
    rows = [[r["id"], r["tp"], r["local_batch"], ", ".join(g["domain"] for g in r["groups"]),
             ", ".join(f"{g['power_ratio']:.2f}" for g in r["groups"]), _moved_from(r)] for r in plan["replicas"]]
    emit(c, d, as_json, table(f"{job} layout v{d.get('version', '?')}", ["replica", "TP", "local batch", "domains",
                                                                     "power ratio", "moved here"], rows))
    if not (as_json or cx.as_json):
        out.print(f"reason: {d.get('reason', '')}", highlight=False)
        out.print(_moves_line(plan.get("moves")), highlight=False)


def _moved_from(replica: dict[str, Any]) -> str:
    """The replica's groups that were elsewhere in the layout before: `group (from rR/sS)`."""
    parts = []
    for g in replica["groups"]:
        if "prev_replica" not in g or (g["prev_replica"], g["prev_stage"]) == (replica["id"], g["stage"]):
            continue
        was = "new" if g["prev_replica"] is None else f"r{g['prev_replica']}/s{g['prev_stage']}"
        parts.append(f"{g['group']} s{g['stage']} (from {was})")
    return ", ".join(parts)


def _moves_line(moves: dict[str, Any] | None) -> str:
    if not moves:
        return "moves: none recorded (first layout, or planned without the previous one)"
    size = "" if moves.get("bytes") is None else f", ~{moves['bytes'] / 1e9:.1f} GB of state to load"
    return (f"moves vs the previous layout: {moves['moved']} group(s) moved ({moves['stage_changed']} change "
            f"stage, {moves['joined']} newly placed), {moves['left']} left{size}")


@app.command()
def events(c: typer.Context, gpu: str | None = None, node: str | None = None,
           limit: Annotated[int, typer.Option(min=1, max=1000)] = 30, as_json: JsonOpt = False) -> None:
    """Health events, newest first."""
    params: dict[str, Any] = {k: v for k, v in {"gpu": gpu, "node": node}.items() if v}
    params["limit"] = limit
    d = ctx_of(c).call("GET", "/v1/events", params=params)
    rows = [[e["at"][:19], e["node"], e["gpu"], f"{e['old_state']} -> {styled(e['new_state'])}", e["source"],
             "; ".join(e.get("reasons") or [])] for e in d["items"]]
    emit(c, d, as_json, table("events", ["at", "node", "GPU", "change", "source", "why"], rows))


@app.command()
def audit(c: typer.Context, limit: Annotated[int, typer.Option(min=1, max=1000)] = 30,
          as_json: JsonOpt = False) -> None:
    """Who changed what, newest first."""
    d = ctx_of(c).call("GET", "/v1/audit", params={"limit": limit})
    rows = [[a["at"][:19], a["actor"], a["action"], a["target"]] for a in d["items"]]
    emit(c, d, as_json, table("audit", ["at", "actor", "action", "target"], rows))


# ---- changing ----------------------------------------------------------------------------------
Reason = Annotated[str, typer.Option("--reason", help="why (kept in the audit log)")]


def _gpu_op(c: typer.Context, op: str, uuid: str, reason: str, as_json: bool) -> None:
    d = ctx_of(c).call("POST", f"/v1/gpus/{uuid}/{op}", json={"reason": reason})
    emit(c, d, as_json, text=f"{uuid}: {op} done")


@app.command()
def cordon(c: typer.Context, uuid: str, reason: Reason, as_json: JsonOpt = False) -> None:
    """Take a GPU out of placement (jobs are replanned around it)."""
    _gpu_op(c, "cordon", uuid, reason, as_json)


@app.command()
def uncordon(c: typer.Context, uuid: str, reason: Reason, as_json: JsonOpt = False) -> None:
    """Return a cordoned GPU to placement."""
    _gpu_op(c, "uncordon", uuid, reason, as_json)


@app.command("mark-healthy")
def mark_healthy(c: typer.Context, uuid: str, reason: Reason, as_json: JsonOpt = False) -> None:
    """Override a GPU's health to healthy (after a repair the agent cannot see)."""
    _gpu_op(c, "mark-healthy", uuid, reason, as_json)


def parse_deadline(at: str | None, within: str | None) -> datetime:
    if (at is None) == (within is None):
        fail("give exactly one of --at (ISO time) or --in (like 30m, 2h)", 2)
    if within is not None:
        m = re.fullmatch(r"(\d+)\s*([smhd])", within.strip())
        if not m:
            fail(f"--in {within!r}: use a number and s, m, h or d (like 30m)", 2)
        n, unit = int(m.group(1)), m.group(2)
        return datetime.now(UTC) + timedelta(**{{"s": "seconds", "m": "minutes", "h": "hours", "d": "days"}[unit]: n})
    assert at is not None
    try:
        t = datetime.fromisoformat(at)
    except ValueError:
        fail(f"--at {at!r} is not an ISO 8601 time", 2)
    return t if t.tzinfo else t.replace(tzinfo=UTC)


@app.command()
def drain(c: typer.Context, node: str, reason: Reason,
          at: Annotated[str | None, typer.Option("--at", help="deadline, ISO 8601")] = None,
          within: Annotated[str | None, typer.Option("--in", help="deadline from now: 30m, 2h")] = None,
          as_json: JsonOpt = False) -> None:
    """Drain a node by a deadline: jobs move off it before then."""
    deadline = parse_deadline(at, within)
    d = ctx_of(c).call("POST", f"/v1/nodes/{node}/drain", json={"deadline": deadline.isoformat(), "reason": reason})
    emit(c, d, as_json, text=f"{node}: draining by {deadline.isoformat(timespec='seconds')}")


@app.command()
def undrain(c: typer.Context, node: str, reason: Reason, as_json: JsonOpt = False) -> None:
    """Cancel a node's drain."""
    d = ctx_of(c).call("POST", f"/v1/nodes/{node}/undrain", json={"reason": reason})
    emit(c, d, as_json, text=f"{node}: drain cancelled")


@app.command()
def plan(c: typer.Context, job: str,
         dry_run: Annotated[bool, typer.Option("--dry-run/--apply", help="only show (default) or replan now")] = True,
         fail_gpu: Annotated[list[str] | None, typer.Option("--fail", help="treat this GPU as failed")] = None,
         as_json: JsonOpt = False) -> None:
    """Show what the planner would do for a job (optionally with GPUs failed), or replan it now."""
    d = ctx_of(c).call("POST", "/v1/plans", json={"job": job, "dry_run": dry_run, "fail": fail_gpu or []})
    p = d["plan"]
    rows = [[r["id"], r["tp"], r["local_batch"], ", ".join(f"{g['power_ratio']:.2f}" for g in r["groups"])]
            for r in p["replicas"]]
    title = f"{job}: {'dry run' if dry_run else 'new layout v' + str(d.get('version'))}"
    if "relative_throughput" in p:
        title += f", relative throughput {p['relative_throughput']:.4f}"
    emit(c, d, as_json, table(title, ["replica", "TP", "local batch", "power ratio"], rows))


@app.command()
def submit(c: typer.Context, spec: Annotated[Path, typer.Argument(help="job spec YAML (a `job:` mapping)")],
           as_json: JsonOpt = False) -> None:
    """Create a job from a spec file (the manager plans it at once)."""
    import yaml

    try:
        doc = yaml.safe_load(spec.read_text())
    except OSError as e:
        fail(f"{spec}: cannot read ({e.strerror})", 2)
    except yaml.YAMLError as e:
        fail(f"{spec}: not YAML ({str(e).splitlines()[0]})", 2)
    body = doc.get("job", doc) if isinstance(doc, dict) else None
    if not isinstance(body, dict):
        fail(f"{spec}: expected a mapping with a `job:` section", 2)
    d = ctx_of(c).call("POST", "/v1/jobs", json=body)
    emit(c, d, as_json, text=f"job {d.get('name', body.get('name'))} created")


@app.command("delete-job")
def delete_job(c: typer.Context, job: str, as_json: JsonOpt = False) -> None:
    """Delete a job (its workers lose their place)."""
    d = ctx_of(c).call("DELETE", f"/v1/jobs/{job}")
    emit(c, d, as_json, text=f"job {job} deleted")


# ---- tokens ------------------------------------------------------------------------------------
@token_app.command("list")
def token_list(c: typer.Context, as_json: JsonOpt = False) -> None:
    """Tokens (ids, names, scopes; never secrets)."""
    d = ctx_of(c).call("GET", "/v1/tokens")
    rows = [[t["id"], t["name"], t["scope"], t.get("node") or "", t["created_at"][:19], "yes" if t["revoked"] else ""]
            for t in d["items"]]
    emit(c, d, as_json, table("tokens", ["id", "name", "scope", "node", "created", "revoked"], rows))


@token_app.command("create")
def token_create(c: typer.Context, name: str,
                 scope: Annotated[str, typer.Option(help="viewer | operator | admin | agent | worker")],
                 node: Annotated[str | None, typer.Option(help="agent tokens: the one node it speaks for")] = None,
                 fingerprint: Annotated[str | None, typer.Option(
                     help="agent tokens: SHA-256 of the node's client certificate (mTLS)")] = None,
                 as_json: JsonOpt = False) -> None:
    """Create a token; the secret is shown once. Agent tokens need --node."""
    body = {"name": name, "scope": scope}
    if node is not None:
        body["node"] = node
    if fingerprint is not None:
        body["fingerprint"] = fingerprint
    d = ctx_of(c).call("POST", "/v1/tokens", json=body)
    emit(c, d, as_json, text=f"{d['token']}\n[dim](id {d['id']}, scope {d['scope']}; shown once)[/]")


@token_app.command("revoke")
def token_revoke(c: typer.Context, token_id: str, as_json: JsonOpt = False) -> None:
    """Revoke a token by id."""
    d = ctx_of(c).call("DELETE", f"/v1/tokens/{token_id}")
    emit(c, d, as_json, text=f"token {token_id} revoked")


def main() -> None:
    app()


if __name__ == "__main__":
    main()
