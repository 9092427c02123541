"""`ntpctl`: the operator's command line, a thin client of the manager's REST API.

    export NTP_URL=http://127.0.0.1:8080 NTP_TOKEN=ntp_...   # or --token-file
    ntpctl status
    ntpctl gpus --state failed
    ntpctl layout llm --history
    ntpctl checkpoints llm
    ntpctl cordon GPU-... --reason "flaky NVLink"
    ntpctl drain node-7 --in 30m --reason "kernel update"
    ntpctl plan llm --dry-run --fail GPU-a --fail GPU-b
    ntpctl slow show llm
    ntpctl slow set llm --set enter_margin=0.15 --set exit_margin=0.08 --dry-run

With several managers (one leads, the others stand by), give every address:
NTP_URL=http://a:8080,http://b:8080; each request goes to whichever leads.

Every command takes `--json` (machine-readable output, the API's own JSON). Errors are one line on
stderr and a non-zero exit: 2 for usage (a bad option, value or address) and missing tokens, 1 for
requests the manager refused (401/403/404/409/422, with its message) and answers that are not its
JSON, 3 when the manager cannot be reached.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
import urllib.parse
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Annotated, Any, NoReturn, cast

import httpx
import typer
from rich.console import Console
from rich.table import Table
from tenacity import RetryCallState, wait_exponential_jitter

from ntp_manager.contract.usage import run_app

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Operate an ntp-manager cluster.")
token_app = typer.Typer(no_args_is_help=True, help="Manage API tokens (admin scope).")
app.add_typer(token_app, name="token")
slow_app = typer.Typer(no_args_is_help=True, help="Fail-slow detection: verdicts and thresholds.")
app.add_typer(slow_app, name="slow")
out = Console(soft_wrap=True)
err = Console(stderr=True, soft_wrap=True)


ROUNDS = 3  # passes over the managers' addresses before giving up (a failover takes a few seconds)


class UnexpectedAnswer(KeyError):
    """A field the command reads is not in the answer: --url names another JSON service, or a
    manager of another version."""


class _Answer(dict[str, Any]):
    """A JSON object of an answer: a field it lacks raises UnexpectedAnswer (main() says so in one
    line), not the KeyError of a bug in a command."""

    def __missing__(self, key: str) -> Any:
        raise UnexpectedAnswer(key)


class Ctx:
    def __init__(self, url: str, token_file: Path | None, as_json: bool, timeout: float) -> None:
        self.urls = [u.strip().rstrip("/") for u in url.split(",") if u.strip()] or ["http://127.0.0.1:8080"]
        for u in self.urls:
            try:
                ok = httpx.URL(u).scheme in ("http", "https") and bool(httpx.URL(u).host)
            except httpx.InvalidURL:
                ok = False
            if not ok:
                fail(f"--url / NTP_URL: {u!r} is not an http:// or https:// address (like http://127.0.0.1:8080)", 2)
        self.url = self.urls[0]
        self.token_file, self.as_json, self.timeout = token_file, as_json, timeout

    def token(self) -> str:
        if self.token_file is not None:
            try:
                tok = self.token_file.read_text().strip()
            except OSError as e:
                fail(f"{self.token_file}: cannot read the token ({e.strerror})", 2)
            except UnicodeDecodeError:
                fail(f"{self.token_file}: not a token file (not text)", 2)
            if not tok:
                fail(f"{self.token_file} is empty", 2)
            return _header_safe(tok, str(self.token_file))
        tok = os.environ.get("NTP_TOKEN", "").strip()
        if not tok:
            fail("no token: set NTP_TOKEN or pass --token-file", 2)
        return _header_safe(tok, "NTP_TOKEN")

    def call(self, method: str, path: str, **kw: Any) -> Any:
        r = self._send(method, path, {"Authorization": f"Bearer {self.token()}"}, **kw)
        try:
            doc = r.json(object_hook=_Answer)
        except ValueError:  # not the manager's API (a proxy's error page, another server at that address)
            fail(f"{r.status_code} from {self.url}{path}, and not the manager's JSON "
                 f"({r.headers.get('content-type', 'no content type')}): is --url / NTP_URL right?", 1)
        if r.status_code >= 400:
            detail = doc.get("detail", r.text) if isinstance(doc, dict) else r.text
            if isinstance(detail, list):  # validation errors
                detail = "; ".join(f"{'.'.join(str(x) for x in d.get('loc', []))}: {d.get('msg')}" for d in detail)
            fail(f"{r.status_code}: {' '.join(str(detail).split())}", 1)
        return doc

    def _send(self, method: str, path: str, headers: dict[str, str], **kw: Any) -> httpx.Response:
        """The request, made to the manager that leads. With several addresses (NTP_URL=a,b): a
        standby names the leader (307 for reads, 503 for writes, header X-NTP-Leader) and the
        request goes there; an address that does not answer is skipped; after a pass over all of
        them with no leader found, wait (exponential backoff, full jitter) and pass again."""
        wait = wait_exponential_jitter(multiplier=0.2, max=2.0, jitter=0.5)
        last: httpx.Response | None = None
        errors: list[str] = []
        for attempt in range(1, ROUNDS + 1):
            todo, tried = list(self.urls), set()
            while todo:
                url = todo.pop(0)
                if url in tried:
                    continue
                tried.add(url)
                try:
                    r = httpx.request(method, f"{url}{path}", headers=headers, timeout=self.timeout, **kw)
                except httpx.HTTPError as e:
                    errors.append(f"{url} ({type(e).__name__}: {e})")
                    continue
                leader = r.headers.get("x-ntp-leader")
                if r.status_code in (307, 503) and (leader or "leader" in _json_keys(r)):
                    last = r
                    if leader and leader not in tried:
                        todo.insert(0, leader.rstrip("/"))
                    continue
                self.url = url
                return r
            if attempt < ROUNDS:
                time.sleep(wait(cast(RetryCallState, _Attempt(attempt))))
        if last is not None:
            try:
                detail = last.json().get("detail", last.text)
            except ValueError:
                detail = last.text
            fail(f"no manager leads now ({detail})", 3)
        fail(f"cannot reach the manager at {', '.join(self.urls)} ({'; '.join(errors[-len(self.urls):])})", 3)


def _q(segment: str) -> str:
    """A name as one path segment: `a/../tokens/x` must not reach another endpoint."""
    return urllib.parse.quote(segment, safe="")


def _header_safe(token: str, source: str) -> str:
    if not token.isascii() or not token.isprintable():
        fail(f"{source}: the token holds characters an HTTP header cannot carry", 2)
    return token


class _Attempt:
    """The bit of tenacity's RetryCallState its wait strategies read."""

    def __init__(self, n: int) -> None:
        self.attempt_number = n


def _json_keys(r: httpx.Response) -> set[str]:
    try:
        doc = r.json()
    except ValueError:
        return set()
    return set(doc) if isinstance(doc, dict) else set()


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
    url: Annotated[str, typer.Option(
        envvar="NTP_URL", help="manager REST address; several managers (one leads): URL,URL")] = "http://127.0.0.1:8080",
    token_file: Annotated[Path | None, typer.Option(envvar="NTP_TOKEN_FILE", help="file holding the token "
                                                    "(else NTP_TOKEN)")] = None,
    as_json: JsonOpt = False,
    timeout: Annotated[float, typer.Option(min=0.1, max=3600.0, help="seconds per request")] = 10.0,
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
    d = ctx_of(c).call("GET", "/v1/jobs", params={"limit": 1000, "replicas_limit": 0})
    rows = [[j["name"], j["layout_version"], _tp_counts(j.get("counts")), j.get("global_batch"),
             j.get("pending_reason") or ""] for j in d["items"]]
    emit(c, d, as_json, table("jobs", ["job", "layout", "replicas", "global batch", "pending"], rows))


@app.command()
def alloc(c: typer.Context, limit: Annotated[int, typer.Option(min=1, max=1000, help="domains listed")] = 100,
          offset: Annotated[int, typer.Option(min=0, help="domains skipped (in id order)")] = 0,
          as_json: JsonOpt = False) -> None:
    """Who owns the cluster: each domain's job (or the free pool), then each job's priority,
    throughput beside its min_throughput, and the pending jobs."""
    d = ctx_of(c).call("GET", "/v1/cluster/allocation", params={"limit": limit, "offset": offset})
    if as_json or ctx_of(c).as_json:
        emit(c, d, True)
        return
    rows = [[x["domain"], x["job"] or "(pool)", x["kind"] or "", x["gpus"],
             ", ".join(f"{k} {v}" for k, v in sorted(x["gpus_by_state"].items()))] for x in d["items"]]
    out.print(table(f"domains {d['offset'] + 1}-{d['offset'] + len(d['items'])} of {d['total']}",
                        ["domain", "job", "kind", "GPUs", "states"], rows))
    jobs_rows = [[j["name"], j["state"], j["priority"], "yes" if j["preemptible"] else "", j["domains"],
                  _reservation(j.get("reservation")),
                  "" if j["relative_throughput"] is None else f"{j['relative_throughput']:.3f}",
                  f"{j['min_throughput']:.3f}", j["pending_reason"] or ""] for j in d["jobs"]["items"]]
    out.print(table("jobs", ["job", "state", "priority", "preemptible", "domains", "reserved (granted)",
                             "throughput", "asks", "pending"], jobs_rows))
    pool = d["pool"]
    out.print(f"pool: {pool['gpus']} GPUs in {pool['domains']} free domain(s), {pool.get('reserved_gpus', 0)} "
              f"of them held for reservations, {pool.get('unreserved_gpus', pool['gpus'])} unreserved; pending: "
              f"{', '.join(d['pending']) or 'none'}", highlight=False)


def _reservation(r: dict[str, Any] | None) -> str:
    """"2 (1)": TP groups a job reserves in the pool and how many of them it has been granted."""
    return "" if not r or not r.get("groups") else f"{r['groups']} ({r.get('granted_groups', 0)})"


ReplicaLimit = Annotated[int, typer.Option(min=1, max=1000, help="replicas listed (a page)")]
ReplicaOffset = Annotated[int, typer.Option(min=0, help="replicas skipped (in id order)")]


def _tp_counts(counts: dict[str, Any] | None) -> str:
    """Replicas per TP degree ("TP7 x 1, TP8 x 12499"), from an answer's `counts`."""
    if not counts:
        return ""
    return ", ".join(f"TP{t} x {n}" for t, n in sorted(counts["tp_counts"].items(), key=lambda kv: int(kv[0])))


def _page_note(d: dict[str, Any], shown: int) -> str:
    """"replicas 101-200 of 12500" when a page does not show every replica ("" when it does)."""
    total = (d.get("counts") or {}).get("replicas", shown)
    if shown >= total:
        return ""
    first = int(d.get("offset", 0))
    return f" (replicas {first + 1}-{first + shown} of {total}: --offset / --limit page them)" if shown else \
        f" (no replica at offset {first}: the layout has {total})"


@app.command()
def layout(c: typer.Context, job: str, history: Annotated[bool, typer.Option(help="every version")] = False,
           version: Annotated[int | None, typer.Option(min=1, help="a stored version instead of the current")] = None,
           limit: ReplicaLimit = 100, offset: ReplicaOffset = 0, as_json: JsonOpt = False) -> None:
    """A job's current layout (replicas, TP degrees, local batches, power), a stored version of
    it, or its history (replicas per TP degree of each version)."""
    cx = ctx_of(c)
    if history:
        d = cx.call("GET", f"/v1/jobs/{_q(job)}/layouts", params={"limit": 1000, "replicas_limit": 0})
        rows = [[x["version"], x["created_at"][:19], x["reason"], _tp_counts(x.get("counts"))] for x in d["items"]]
        emit(c, d, as_json, table(f"layouts of {job}", ["version", "created", "reason", "replicas"], rows))
        return
    path = f"/v1/jobs/{_q(job)}/layout" if version is None else f"/v1/jobs/{_q(job)}/layouts/{version}"
    d = cx.call("GET", path, params={"limit": limit, "offset": offset})
    plan = d.get("plan", d)
    rows = [[r["id"], r["tp"], r["local_batch"], ", ".join(g["domain"] for g in r["groups"]),
             ", ".join(f"{g['power_ratio']:.2f}" for g in r["groups"]), _moved_from(r)] for r in plan["replicas"]]
    title = f"{job} layout v{d.get('version', '?')}{_page_note(d, len(rows))}"
    emit(c, d, as_json, table(title, ["replica", "TP", "local batch", "domains", "power ratio", "moved here"], rows))
    if not (as_json or cx.as_json):
        out.print(f"reason: {d.get('reason', '')}", highlight=False)
        out.print(_moves_line(plan.get("moves")), highlight=False)


@app.command()
def checkpoints(c: typer.Context, job: str,
                limit: Annotated[int, typer.Option(min=1, max=1000, help="newest N listed")] = 20,
                as_json: JsonOpt = False) -> None:
    """A job's checkpoints, newest first: step, time, complete / verified, size (read by the
    manager from the spec's checkpoint.dir; "verified": manifest intact and every file present at
    its recorded size, the workers hash the contents when they load)."""
    d = ctx_of(c).call("GET", f"/v1/jobs/{_q(job)}/checkpoints", params={"limit": limit})
    rows = [[x["step"], _when(x["at"]), "yes" if x["complete"] else "no", "yes" if x["verified"] else "no",
             _size(x["bytes"]), x["name"], x["problem"]] for x in d["items"]]
    more = f" (newest {len(rows)} of {d['total']})" if d["total"] > len(rows) else ""
    emit(c, d, as_json, table(f"checkpoints of {job} in {d['root']}{more}",
                              ["step", "time", "complete", "verified", "size", "directory", "problem"], rows))


def _when(at: float | None) -> str:
    return "" if at is None else datetime.fromtimestamp(at, UTC).strftime("%Y-%m-%d %H:%M:%S")


def _size(n: int) -> str:
    x = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if x < 1024 or unit == "TiB":
            return f"{x:.0f} {unit}" if unit == "B" else f"{x:.1f} {unit}"
        x /= 1024
    return str(n)


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
    d = ctx_of(c).call("POST", f"/v1/gpus/{_q(uuid)}/{op}", json={"reason": reason})
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
    d = ctx_of(c).call("POST", f"/v1/nodes/{_q(node)}/drain", json={"deadline": deadline.isoformat(), "reason": reason})
    emit(c, d, as_json, text=f"{node}: draining by {deadline.isoformat(timespec='seconds')}")


@app.command()
def undrain(c: typer.Context, node: str, reason: Reason, as_json: JsonOpt = False) -> None:
    """Cancel a node's drain."""
    d = ctx_of(c).call("POST", f"/v1/nodes/{_q(node)}/undrain", json={"reason": reason})
    emit(c, d, as_json, text=f"{node}: drain cancelled")


@app.command()
def plan(c: typer.Context, job: str,
         dry_run: Annotated[bool, typer.Option("--dry-run/--apply", help="only show (default) or replan now")] = True,
         fail_gpu: Annotated[list[str] | None, typer.Option("--fail", help="treat this GPU as failed")] = None,
         limit: ReplicaLimit = 100, offset: ReplicaOffset = 0, as_json: JsonOpt = False) -> None:
    """Show what the planner would do for a job (optionally with GPUs failed), or replan it now."""
    d = ctx_of(c).call("POST", "/v1/plans", json={"job": job, "dry_run": dry_run, "fail": fail_gpu or [],
                                                  "limit": limit, "offset": offset})
    p = d["plan"]
    rows = [[r["id"], r["tp"], r["local_batch"], ", ".join(f"{g['power_ratio']:.2f}" for g in r["groups"])]
            for r in p["replicas"]]
    title = f"{job}: {'dry run' if dry_run else 'new layout v' + str(d.get('version'))}"
    if "relative_throughput" in p:
        title += f", relative throughput {p['relative_throughput']:.4f}"
    title += _page_note(d, len(rows))
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
    except UnicodeDecodeError:
        fail(f"{spec}: not a text file (not UTF-8)", 2)
    except yaml.YAMLError as e:
        fail(f"{spec}: not YAML ({str(e).splitlines()[0]})", 2)
    body = doc.get("job", doc) if isinstance(doc, dict) else None
    if not isinstance(body, dict):
        fail(f"{spec}: expected a mapping with a `job:` section", 2)
    d = ctx_of(c).call("POST", "/v1/jobs", json=body)
    where = (f"pending ({d.get('pending_reason', '')})" if d.get("state") == "pending"
             else f"on {d.get('domain_count', 0)} domain(s): {', '.join(d.get('domains', []))}")
    emit(c, d, as_json, text=f"job {d.get('name', body.get('name'))} created, {where}")


@app.command("delete-job")
def delete_job(c: typer.Context, job: str, as_json: JsonOpt = False) -> None:
    """Delete a job (its workers lose their place)."""
    d = ctx_of(c).call("DELETE", f"/v1/jobs/{_q(job)}")
    emit(c, d, as_json, text=f"job {job} deleted")


# ---- fail-slow ---------------------------------------------------------------------------------
@slow_app.command("show")
def slow_show(c: typer.Context, job: str, as_json: JsonOpt = False) -> None:
    """Each GPU's step factor (observed / predicted, against its peers) and the newest verdicts."""
    cx = ctx_of(c)
    d = cx.call("GET", f"/v1/jobs/{_q(job)}/slow")
    rows = [[r["gpu"], r["stage"], r["tp_group"], "" if r["factor"] is None else f"{r['factor']:.3f}",
             "[red]slow[/]" if r["slow"] else "", "" if r["since_step"] is None else r["since_step"],
             f"{r['compute_s']:.4f}", "" if r["predicted_s"] is None else f"{r['predicted_s']:.4f}"]
            for r in d["ranks"]]
    mode = " (dry run: verdicts are reported, not acted on)" if d["dry_run"] else ""
    emit(c, d, as_json, table(f"{job}: fail-slow at step {d['step']}{mode}",
                              ["GPU", "stage", "TP group", "factor", "verdict", "since", "compute s", "predicted s"],
                              rows))
    if not (as_json or cx.as_json):
        for v in d["verdicts"][:10]:
            out.print(f"step {v['step']} {v['kind']}{' (dry run)' if v['dry_run'] else ''}: {v['reason']}",
                      highlight=False)


def _option_value(text: str) -> bool | int | float:
    low = text.strip().lower()
    if low in ("true", "false"):
        return low == "true"
    try:
        return int(low)
    except ValueError:
        pass
    try:
        return float(low)
    except ValueError:
        fail(f"--set: {text!r} is not a number, true or false", 2)


@slow_app.command("set")
def slow_set(c: typer.Context,
             job: Annotated[str | None, typer.Argument(help="the job (omit with --defaults)")] = None,
             option: Annotated[list[str] | None,
                               typer.Option("--set", help="NAME=VALUE, e.g. enter_margin=0.15")] = None,
             dry_run: Annotated[bool | None,
                                typer.Option("--dry-run/--act", help="only report verdicts, or act")] = None,
             defaults: Annotated[bool, typer.Option("--defaults", help="change the defaults of every job")] = False,
             reset: Annotated[bool, typer.Option("--reset", help="start from the defaults")] = False,
             as_json: JsonOpt = False) -> None:
    """Change fail-slow thresholds, windows or dry run at runtime (operator scope; audited)."""
    if (job is None) == (not defaults):
        fail("give a job, or --defaults", 2)
    changes: dict[str, Any] = {}
    for item in option or []:
        name, sep, value = item.partition("=")
        if not sep or not name.strip():
            fail(f"--set: expected NAME=VALUE, got {item!r}", 2)
        changes[name.strip()] = _option_value(value)
    if dry_run is not None:
        changes["dry_run"] = dry_run
    if not changes and not reset:
        fail("nothing to change: give --set, --dry-run/--act or --reset", 2)
    path = "/v1/failslow/options" if defaults else f"/v1/jobs/{_q(job or '')}/slow/options"
    d = ctx_of(c).call("PATCH", path, json={"options": changes, "reset": reset})
    changed = ", ".join(f"{k}={v}" for k, v in d["changed"].items()) or "nothing changed"
    emit(c, d, as_json, text=f"fail-slow options of {job or 'every job'}: {changed}")


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
    d = ctx_of(c).call("DELETE", f"/v1/tokens/{_q(token_id)}")
    emit(c, d, as_json, text=f"token {token_id} revoked")


def main(argv: Sequence[str] | None = None) -> int:
    """The `ntpctl` console script: the exit status (usage errors are one line, ntp_manager/contract/usage.py).
    JSON that lacks what a command reads (--url names another JSON service, or a manager of another
    version) is one line too, status 1, with what was missing."""
    try:
        return run_app(app, argv, "ntpctl")
    except UnexpectedAnswer as e:
        err.print(f"[bold red]error:[/] the answer is not what ntpctl expects (no field {e}): is "
                  "--url / NTP_URL a manager of this version?", highlight=False)
        return 1


if __name__ == "__main__":
    sys.exit(main())
