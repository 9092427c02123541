"""Checks README.md and docs/*.md against the code: every name a reader would type must exist.

    .venv/bin/python tools/doccheck.py            # prints every finding as FILE:LINE: what; exit 1 if any

What it reads from the markdown, and what it checks each against (by introspection, not by a list
kept here):

- command lines in fenced code blocks and in code spans (`ntp-manager ...`, `ntpctl ...`,
  `ntp-agent ...`, `ntp-run ...`, `python -m ntp_manager.X ...`, `python SCRIPT.py ...`,
  `make TARGET`): subcommands and flags against the real typer/click and argparse parsers, where
  they stand (a root option after a subcommand is an error, as click sees it); an `ntp-run`
  script's own flags against the script; `make` targets against the Makefile. Under a heading that
  names a command in a code span (`## \\`ntpctl\\``), a code span that starts with one of its
  subcommands, or with a flag, is read as that command's;
- REST paths (`/v1/...`, `/healthz`, `/readyz`, `/metrics`) against the FastAPI app's routes, and
  with the method where the text says `GET /v1/...` or a table row starts with methods
  (`| GET / POST | /v1/a, /v1/b |`: each path takes each method);
- gRPC names (`ntp.v1.Service`, `Service/Method`) against the generated descriptors;
- environment variables (`NTP_...`) against the settings classes (prefix + field name) and the
  names the code, scripts and compose files spell out;
- repository paths in code spans and links (`ntp_manager/...`, `tests/...`) against the tree;
- nothing leaves the repository: a link or `../` path that resolves outside it, a link to a heading
  its target file does not have, or a file the repository does not hold but contributors might name
  from memory, is a finding in the docs and (for the paths and the names) in every other text file
  of the repository as well (`outside_references`). Such a finding cannot be silenced with
  `doccheck: ignore`.

The scripts that run these commands (deploy/*.sh, bench/*.sh, .ci/*, the systemd unit) and the
usage examples in the command-line modules' docstrings are read as code and checked the same way.

Fenced blocks tagged `text` or `console` and lines holding `doccheck: ignore` are skipped.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import importlib.util
import os
import re
import shlex
import sys
from collections.abc import Generator, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
CLIS = ("ntp-manager", "ntpctl", "ntp-agent", "ntp-run")
ENDS = {"|", "||", "&&", ";", ">", ">>", "2>", "2>&1", "<", "&"}
TOP_DIRS = ("ntp_manager", "agent", "migrations", "docs", "examples", "bench", "tests", "proto", "deploy", "tools",
            ".ci")


@dataclass(frozen=True, order=True)
class Finding:
    path: str
    line: int
    what: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.what}"


@dataclass
class Cmd:
    """A command as the docs may use it: its options (flag -> takes a value) and subcommands."""

    name: str
    options: dict[str, bool] = field(default_factory=dict)
    subs: dict[str, Cmd] = field(default_factory=dict)
    parent: Cmd | None = None
    script_after_positional: bool = False  # argparse REMAINDER (ntp-run SCRIPT ARGS...)
    max_args: int | None = None  # positional arguments it takes (None: any number)
    source: Path | None = None  # a script checked by the words in its source

    def path(self) -> str:
        return self.name if self.parent is None else f"{self.parent.path()} {self.name}"

    def add(self, sub: Cmd) -> Cmd:
        sub.parent = self
        self.subs[sub.name] = sub
        return sub


# ---- what the code has --------------------------------------------------------------------------
def _from_click(name: str, cmd: Any) -> Cmd:
    """A click command (typer's own vendored click too: read by duck typing, not isinstance)."""
    node = Cmd(name, {"--help": False}, max_args=0)
    for p in cmd.params:
        if getattr(p, "param_type_name", "") == "argument":
            if p.nargs < 0 or node.max_args is None:
                node.max_args = None
            else:
                node.max_args += p.nargs
        if getattr(p, "param_type_name", "") == "option":
            takes = not (p.is_flag or p.count)
            for o in [*p.opts, *p.secondary_opts]:
                node.options[o] = takes
    if isinstance(getattr(cmd, "commands", None), dict):
        for sub_name, sub in cmd.commands.items():
            node.add(_from_click(sub_name, sub))
    return node


def _from_typer(name: str, app: Any) -> Cmd:
    import typer.main

    return _from_click(name, typer.main.get_command(app))


def _from_function(name: str, fn: Any) -> Cmd:
    import typer

    app = typer.Typer()
    app.command()(fn)
    return _from_typer(name, app)


def _from_argparse(name: str, parser: argparse.ArgumentParser) -> Cmd:
    node = Cmd(name)
    for action in parser._actions:
        for o in action.option_strings:
            node.options[o] = action.nargs != 0
        if action.nargs == argparse.REMAINDER:
            node.script_after_positional = True
    return node


def commands() -> dict[str, Cmd]:
    """The console scripts of pyproject.toml, built from their real parsers."""
    from ntp_agent import main as agent_main
    from ntp_manager.cli import ctl, manager
    from ntp_manager.worker import run

    agent = _from_typer("ntp-agent", agent_main.app)
    agent.add(_from_typer("probe", agent_main.probe_app))  # main() sends `ntp-agent probe ...` there
    agent.add(_from_typer("health", agent_main.health_app))  # ... and `health`, `power-reset`
    agent.add(_from_typer("power-reset", agent_main.power_app))
    return {
        "ntp-manager": _from_typer("ntp-manager", manager.app),
        "ntpctl": _from_typer("ntpctl", ctl.app),
        "ntp-agent": agent,
        "ntp-run": _from_argparse("ntp-run", run.build_parser()),
    }


def module_command(module: str) -> Cmd | None:
    """`python -m MODULE`: a typer `main` function or app of one of ours, else None."""
    if not module.startswith("ntp_manager"):
        return None
    try:
        mod = importlib.import_module(module)
    except ImportError:
        return None
    if hasattr(mod, "app"):
        return _from_typer(module, mod.app)
    if callable(getattr(mod, "main", None)) and "typer.run(main)" in Path(mod.__file__ or "").read_text():
        return _from_function(module, mod.main)
    return Cmd(module, {"--help": False}, source=Path(mod.__file__ or ""))


def every_flag(clis: dict[str, Cmd]) -> set[str]:
    """Flags of the console scripts, of `python -m ntp_manager.X` (and `ntp_manager.demos.X`) commands, and those the
    example and bench scripts spell out (`"--steps"`, or a typer parameter `fail_at: ... typer.Option`)."""
    flags = {f for c in clis.values() for f in _all_flags(c)}
    for path in [*(ROOT / "ntp_manager").glob("*.py"), *(ROOT / "ntp_manager" / "demos").glob("*.py")]:
        text = path.read_text()
        if "typer.run(main)" in text or "typer.Typer(" in text:
            cmd = module_command(".".join(path.relative_to(ROOT).with_suffix("").parts))
            if cmd is not None:
                flags |= _all_flags(cmd)
    for path in [*(ROOT / "examples").glob("*.py"), *(ROOT / "bench").glob("*.py")]:
        text = path.read_text()
        flags.update(re.findall(r"[\"'](--[a-z][\w-]*)[\"']", text))
        flags.update("--" + n.replace("_", "-") for n in re.findall(r"\b(\w+): [^=\n]*= typer\.Option", text))
    return flags


def makefile_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text()
    found: set[str] = set()
    for m in re.finditer(r"^([A-Za-z0-9_.-][A-Za-z0-9_. -]*?)\s*:(?!=)", text, re.M):
        found.update(m.group(1).split())
    return {t for t in found if not t.startswith((".", "$"))}


@functools.cache
def _app() -> Any:
    """The manager's FastAPI app, built as `serve` builds it (nothing started, nothing connected)."""
    import tempfile

    from ntp_manager.api.app import create_app
    from ntp_manager.service.manager import Manager
    from ntp_manager.settings import Settings

    with tempfile.TemporaryDirectory() as d:
        return create_app(Manager(Settings(data_dir=Path(d), database_url=f"sqlite+aiosqlite:///{d}/x.db")))


def rest_routes() -> list[tuple[re.Pattern[str], str, set[str]]]:
    """(regex, template, methods) of every route the app serves, included routers too."""
    out: list[tuple[re.Pattern[str], str, set[str]]] = []

    def walk(routes: Iterable[Any]) -> None:
        for r in routes:
            build = getattr(r, "effective_candidates", None)
            if callable(build):
                walk(build())
            elif isinstance(getattr(r, "path", None), str):
                out.append((_template_regex(r.path), r.path, set(getattr(r, "methods", None) or ())))
            sub = getattr(r, "routes", None)
            if sub and not callable(build):
                walk(sub)

    walk(_app().router.routes)
    return out


def rest_bodies() -> dict[str, set[str]]:
    """The JSON body's fields of each route template that takes one, from the OpenAPI document."""
    doc = _app().openapi()
    schemas = doc.get("components", {}).get("schemas", {})
    out: dict[str, set[str]] = {}
    for path, ops in doc["paths"].items():
        for op in ops.values():
            body = op.get("requestBody", {}).get("content", {}).get("application/json", {}).get("schema", {})
            ref = body.get("$ref", "").rsplit("/", 1)[-1]
            props = schemas.get(ref, body).get("properties", {})
            if props:
                out.setdefault(path, set()).update(props)
    return out


def rest_queries() -> dict[str, set[str]]:
    """Query parameters of each route template, from the app's OpenAPI document."""
    doc = _app().openapi()
    return {path: {p["name"] for op in ops.values() for p in op.get("parameters", []) if p.get("in") == "query"}
            for path, ops in doc["paths"].items()}


def _template_regex(template: str) -> re.Pattern[str]:
    parts = re.split(r"(\{[^}]*\})", template)
    return re.compile("".join("[^/]+" if p.startswith("{") else re.escape(p) for p in parts) + "$")


def grpc_names() -> set[str]:
    """`ntp.v1.Service`, `Service`, `ntp.v1.Service/Method`, `Service/Method`, `ntp.v1.Message` of the stubs."""
    names: set[str] = set()
    for pkg in (ROOT / "ntp_manager/contract/proto/ntp/v1").glob("*_pb2.py"):
        mod = importlib.import_module(f"ntp_manager.contract.proto.ntp.v1.{pkg.stem}")
        names |= {f"ntp.v1.{m}" for m in mod.DESCRIPTOR.message_types_by_name}
        for svc in mod.DESCRIPTOR.services_by_name.values():
            names |= {svc.full_name, svc.name}
            for m in svc.methods:
                names |= {f"{svc.full_name}/{m.name}", f"{svc.name}/{m.name}"}
    return names


def setting_defaults() -> dict[str, float]:
    """Numeric defaults of the manager's and the agent's settings, by field name and by variable
    (a field both have, like heartbeat_interval_s, by the manager's)."""
    from ntp_agent.main import AgentSettings
    from ntp_manager.settings import Settings

    out: dict[str, float] = {}
    for cls, prefix in ((AgentSettings, "NTP_AGENT_"), (Settings, "NTP_")):
        for name, info in cls.model_fields.items():
            if isinstance(info.default, int | float) and not isinstance(info.default, bool):
                out[name] = out[f"{prefix}{name.upper()}"] = float(info.default)
    return out


def env_names() -> set[str]:
    """NTP_ variables: settings fields (prefix + name) and every name spelled out outside the docs."""
    from ntp_agent.main import AgentSettings
    from ntp_manager.settings import Settings

    names = {f"NTP_{f.upper()}" for f in Settings.model_fields} | {f"NTP_AGENT_{f.upper()}"
                                                                   for f in AgentSettings.model_fields}
    for path in _source_files():
        names.update(re.findall(r"\bNTP_[A-Z0-9_]*[A-Z0-9]\b", path.read_text(errors="replace")))
    return names


# names the docs quote from libraries (torch, DCP), not from this code
EXTERNAL_NAMES = {"gradient_as_bucket_view", "initial_lr", "stage_index_to_group_rank", "async_save"}
EXTERNAL_MODULES = ("torch", "numpy", "np", "grpc", "sqlalchemy", "pydantic", "typer", "fastapi", "pynvml", "os",
                    "sys", "dcp")


def code_words() -> set[str]:
    """Every identifier in the code, the proto files and the specs: what a snake_case name or a
    dotted name in a code span must be one of."""
    words: set[str] = set(EXTERNAL_NAMES)
    for path in [*_source_files(), *(ROOT / "proto").rglob("*.proto")]:
        words.update(re.findall(r"[A-Za-z_]\w*", path.read_text(errors="replace")))
    return words


STUBS = ROOT / "ntp_manager" / "contract" / "proto"  # generated: their words are protoc's


def _source_files() -> Iterator[Path]:
    for top in ("ntp_manager", "agent", "migrations", "tests", "bench", "examples", "deploy", "tools", ".ci"):
        for p in (ROOT / top).rglob("*"):
            if p.is_file() and p.suffix in (".py", ".sh", ".yml", ".yaml", ".service", ".toml", ".cfg", "") \
                    and STUBS not in p.parents and p.name not in ("doccheck.py", "test_docs.py"):
                yield p
    for name in ("Makefile", "Dockerfile", "docker-compose.yml", "pyproject.toml"):
        if (ROOT / name).is_file():
            yield ROOT / name


@dataclass
class Reference:
    """Everything the docs are checked against, read from the code once."""

    clis: dict[str, Cmd]
    targets: set[str]
    routes: list[tuple[re.Pattern[str], str, set[str]]]
    grpc: set[str]
    env: set[str]
    words: set[str]
    queries: dict[str, set[str]] = field(default_factory=dict)
    any_flags: set[str] = field(default_factory=set)  # every flag of every command, module and script of ours
    bodies: dict[str, set[str]] = field(default_factory=dict)  # route template -> its JSON body's fields
    defaults: dict[str, float] = field(default_factory=dict)  # setting (field or NTP_ name) -> numeric default
    root: Path = ROOT

    @classmethod
    def load(cls) -> Reference:
        clis = commands()
        return cls(clis, makefile_targets(), rest_routes(), grpc_names(), env_names(), code_words(),
                   rest_queries(), every_flag(clis), rest_bodies(), setting_defaults())


# ---- nothing outside the repository -------------------------------------------------------------
# Background files that live beside a checkout but not in it; spelled in halves so that this file
# does not name them itself.
OUTSIDE_NAMES = ("REFER" "ENCE.md", "DES" "IGN.md")
_OUTSIDE_RE = re.compile(r"(?<![\w/.-])(" + "|".join(map(re.escape, OUTSIDE_NAMES)) + r")(?![\w.-])")
_SHARED_RE = re.compile(r"(?:\.\./)+sha" r"red\b|/wo" r"rk/\w")  # the checkout's neighbour, the workspace
_LINK_RE = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
_UP_RE = re.compile(r"(?<![\w/.-])((?:\.\./)+[\w.-][\w./-]*)")
_SCANNED = {".py", ".md", ".sh", ".yml", ".yaml", ".toml", ".cfg", ".ini", ".service", ".txt", ".mako", ".html",
            ".proto", ".json"}
_NOT_OURS = {".git", ".venv", "node_modules", "__pycache__", ".mypy_cache", ".ruff_cache", ".pytest_cache", "build",
             "dist", ".whl"}


def heading_anchors(text: str) -> set[str]:
    """The anchors a markdown renderer gives this text's headings (lower case, punctuation dropped,
    spaces to hyphens), outside fenced blocks."""
    out: set[str] = set()
    fenced = False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        m = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m and not fenced:
            words = re.sub(r"[^\w\- ]", "", m.group(1).replace("`", "").lower())
            out.add(words.replace(" ", "-"))
    return out


def _inside(root: Path, target: Path) -> bool:
    return target.resolve().is_relative_to(root.resolve())


def outside_in_line(line: str, home: Path, root: Path, markdown: bool) -> Iterator[str]:
    """What in one line of a file whose directory is `home` names something outside the repository
    at `root` (markdown: links and `../` paths resolved from `home`, and links' heading anchors)."""
    for m in _OUTSIDE_RE.finditer(line):
        yield f"names {m.group(1)}, which is not in this repository (docs/design.md, docs/references.md are)"
    for m in _SHARED_RE.finditer(line):
        yield f"names a path outside this repository: {m.group(0)}"
    if not markdown:
        return
    for m in _LINK_RE.finditer(line):
        target = m.group(1)
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:: a public address, not a path
            continue
        where, _, anchor = target.partition("#")
        dest = (home / where) if where else None
        if dest is not None and not _inside(root, dest):
            yield f"link leaves the repository: {target}"
            continue
        if dest is not None and not dest.exists():
            yield f"link to a missing file: {target}"
            continue
        md = dest if dest is not None else None
        if anchor and md is not None and md.suffix == ".md" and anchor not in heading_anchors(md.read_text()):
            yield f"link to a heading {md.name} does not have: #{anchor}"
    for m in _UP_RE.finditer(line):
        if not _inside(root, home / m.group(1)):
            yield f"path leaves the repository: {m.group(1)}"


def _text_files(root: Path) -> Iterator[Path]:
    for here, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in _NOT_OURS and not d.endswith(".egg-info"))  # never walked into
        for name in sorted(files):
            p = Path(here) / name
            if p.suffix in _SCANNED or name in ("Makefile", "Dockerfile", "run"):
                yield p


def outside_references(root: Path = ROOT) -> list[Finding]:
    """Every text file of the repository (code, scripts, configuration, docs): the lines that name a
    file or path outside it. The docs' links are checked with the rest of each doc (`check_file`)."""
    out = []
    for p in _text_files(root):
        if p.suffix == ".md" and p in doc_files(root):
            continue  # check_file reads these, links included
        try:
            text = p.read_text()
        except UnicodeDecodeError:
            continue
        for i, line in enumerate(text.splitlines(), 1):
            for what in outside_in_line(line, p.parent, root, p.suffix == ".md"):
                out.append(Finding(str(p.relative_to(root)), i, what))
    return out


# ---- reading the markdown -----------------------------------------------------------------------
@dataclass
class Snippet:
    text: str
    line: int
    code: bool  # a fenced block's line (else a code span)
    context: str | None  # the command named by the section's heading


def snippets(text: str, script: bool = False) -> Iterator[Snippet]:
    """Lines of fenced code blocks (continuations joined) and code spans, with their line numbers;
    `script`: every line is code (a shell script, a systemd unit)."""
    if script:
        text = "```sh\n" + text.replace("ExecStart=", "") + "\n```"
    fence: str | None = None
    skip = False
    context: str | None = None
    pending: tuple[str, int] | None = None
    for i, raw in enumerate(text.splitlines(), 1):
        stripped = raw.strip()
        if stripped.startswith(("```", "~~~")):
            if fence is None:
                fence, lang = stripped[:3], stripped[3:].strip().lower()
                skip = lang in ("text", "console", "json", "yaml", "python", "proto", "toml", "ini")
            elif stripped.startswith(fence):
                fence = None
            continue
        if "doccheck: ignore" in raw:
            continue
        if fence is not None:
            if skip:
                continue
            line = raw.rstrip()
            if pending is not None:
                line, start = pending[0] + " " + line.strip(), pending[1]
            else:
                start = i
            if line.endswith("\\"):
                pending = (line[:-1], start)
                continue
            pending = None
            yield Snippet(line, start, True, context)
            continue
        if stripped.startswith("#"):
            m = re.search(r"`([a-z][a-z0-9-]*)`", stripped)
            context = m.group(1) if m and m.group(1) in CLIS else (None if stripped.startswith("# ") else context)
            if stripped.startswith("# "):
                context = m.group(1) if m and m.group(1) in CLIS else None
        for m in re.finditer(r"(`+)(.+?)\1", raw):
            yield Snippet(m.group(2).strip(), i, False, context)


def _tokens(text: str) -> list[str]:
    try:
        lex = shlex.shlex(text, posix=True, punctuation_chars="|&;<>")
        lex.whitespace_split = True
        lex.commenters = "#"
        return list(lex)
    except ValueError:
        return text.split()


def _clean(tok: str) -> str:
    return tok.strip("[]()").rstrip(".,").removesuffix("...")


class Checker:
    def __init__(self, ref: Reference) -> None:
        self.ref = ref

    def check_file(self, path: Path, shown_as: str | None = None) -> list[Finding]:
        text = path.read_text()
        if path.suffix == ".py":  # a module's docstring: its indented example lines, at their lines in the file
            text = _docstring_examples(text)
        name = shown_as or str(path.relative_to(self.ref.root) if path.is_relative_to(self.ref.root) else path)
        out: list[Finding] = []
        script = path.suffix != ".md"
        for sn in snippets(text, script):
            for what in self.check_snippet(sn, path.parent):
                out.append(Finding(name, sn.line - (1 if script else 0), what))
        rel = Path(name)
        home = (self.ref.root / rel).parent if not rel.is_absolute() else path.parent
        for i, line in enumerate(text.splitlines(), 1):
            for what in outside_in_line(line, home, self.ref.root, path.suffix == ".md"):
                out.append(Finding(name, i, what))
            if "doccheck: ignore" in line:
                continue
            for what in self.check_prose(line):
                out.append(Finding(name, i, what))
            if line.lstrip().startswith("|"):
                for what in self.check_table_row(line):
                    out.append(Finding(name, i, what))
        return sorted(set(out))

    # -- anywhere in the text --
    def check_prose(self, line: str) -> Iterator[str]:
        for var in re.findall(r"\bNTP_[A-Z0-9_]*[A-Z0-9]\b", line):
            if var not in self.ref.env:
                yield f"environment variable {var} is read nowhere (not a setting, not in the code)"
        for m in re.finditer(r"(?<![\w./{}-])(/v1/[A-Za-z0-9_{}.:/-]*[A-Za-z0-9_}](?:\?[\w=&.,-]*)?|/healthz|/readyz"
                             r"|/metrics)(?![\w/-])", line):
            path = m.group(1)
            before = line[: m.start()].rstrip("` ")
            verb = re.search(r"\b(GET|POST|PUT|PATCH|DELETE)$", before)
            yield from self._route(path, verb.group(1) if verb else None)
            body = re.match(r"`\s*`(\{.*?\})`", line[m.end():])  # `/v1/x` `{a, b?, c: [..]}`: its body
            if body is not None:
                yield from self._body(path.partition("?")[0], body.group(1))
        # `takeover_grace_s` (default 30 s), `token_poll_s` (0.25 s), `max_request_bytes` (default 4 MiB)
        for m in re.finditer(r"`(NTP_[A-Z0-9_]+|[a-z][a-z0-9_]*)`\s*\((?:default\s+)?([0-9][0-9_,.]*)\s*(KiB|MiB|GiB)?",
                             line):
            if m.group(1) in self.ref.defaults:
                said = float(m.group(2).rstrip(".").replace(",", "").replace("_", ""))
                said *= {"KiB": 2**10, "MiB": 2**20, "GiB": 2**30}.get(m.group(3) or "", 1)
                real = self.ref.defaults[m.group(1)]
                if said != real:
                    shown = f"{real:,.0f}" if real.is_integer() else f"{real:g}"
                    yield f"{m.group(1)} defaults to {shown}, not {m.group(2)}{' ' + m.group(3) if m.group(3) else ''}"
        for m in re.finditer(r"\b(ntp\.v1\.\w+(?:/\w+)?|\w+Service/\w+)", line):
            if m.group(1) not in self.ref.grpc:
                yield f"gRPC name {m.group(1)} is not in proto/ntp/v1"

    def check_table_row(self, line: str) -> Iterator[str]:
        """`| GET / POST | /v1/jobs, ... |`: every path of the row takes every method of the row."""
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        verbs = r"GET|POST|PUT|PATCH|DELETE"
        if len(cells) < 2 or not re.fullmatch(rf"(?:{verbs})(?:\s*[/,]\s*(?:{verbs}))*", cells[0]):
            return
        methods = re.findall(verbs, cells[0])
        for m in re.finditer(r"(?<![\w./{}-])(/v1/[A-Za-z0-9_{}.:/-]*[A-Za-z0-9_}]|/healthz|/readyz|/metrics)",
                             " ".join(cells[1:])):
            for method in methods:
                yield from self._route(m.group(1), method)

    def _body(self, path: str, text: str) -> Iterator[str]:
        """`{job or spec, dry_run, fail: [uuid]}` or `{"options": {...}, "reset": false}`: each field
        named must be one of the route's request body."""
        fields: set[str] = set()
        for rx, tpl, _ in self.ref.routes:
            if rx.match(path):
                fields |= self.ref.bodies.get(tpl, set())
        if not fields:
            return
        depth, part, parts = 0, "", []
        for ch in text[1:-1]:
            depth += 1 if ch in "[{(" else -1 if ch in "]})" else 0
            if ch == "," and depth == 0:
                parts.append(part)
                part = ""
            else:
                part += ch
        parts.append(part)
        for p in parts:
            key = p.split(":", 1)[0]
            for name in re.findall(r"\w+", key):
                if name != "or" and name not in fields:
                    yield f"REST {path} body has no field {name!r} (it has: {', '.join(sorted(fields))})"

    def _route(self, path: str, method: str | None) -> Iterator[str]:
        path, _, query = path.partition("?")
        hits = [(rx, tpl, methods) for rx, tpl, methods in self.ref.routes if rx.match(path)]
        if not hits:
            yield f"REST path {path} is not a route of the app"
            return
        known: set[str] = set().union(*(self.ref.queries.get(tpl, set()) for _, tpl, _ in hits))
        for name in re.findall(r"([A-Za-z_]\w*)=", query):
            if name not in known:
                yield f"REST {path} takes no query parameter {name!r} (it takes: {', '.join(sorted(known)) or 'none'})"
        if method is not None and not any(method in methods for _, _, methods in hits):
            have = sorted({x for _, _, ms in hits for x in ms} - {"HEAD"})
            yield f"REST {method} {path}: the route takes {', '.join(have)}"

    # -- code spans and code lines --
    def check_snippet(self, sn: Snippet, doc_dir: Path) -> Iterator[str]:
        toks = _tokens(sn.text)
        if not sn.code:
            yield from self._paths(sn.text, doc_dir)
            yield from self._names(sn.text)
        i = 0
        started = False
        while i < len(toks):
            tok = toks[i]
            base = tok.rsplit("/", 1)[-1]
            if base in CLIS:
                i = yield from self._walk(self.ref.clis[base], toks, i + 1)
                started = True
            elif base == "make" and (i == 0 or toks[i - 1] in ENDS):
                i = yield from self._make(toks, i + 1)
                started = True
            elif re.fullmatch(r"python3?(\.\d+)?", base):
                i = yield from self._python(toks, i + 1)
                started = True
            else:
                i += 1
        if started or sn.code or not toks:
            return
        if sn.context not in self.ref.clis:
            # a lone flag outside a command's section: some command or script of ours must have it
            if _clean(toks[0]).startswith("--") and self.ref.any_flags:
                for flag in _flags_of(toks[0]):
                    if flag not in self.ref.any_flags:
                        yield f"no command or script here has an option {flag}"
            return
        # a span under a heading that names a command: `gpus [--state]`, `--json`
        root = self.ref.clis[sn.context]
        first = _clean(toks[0])
        if first in root.subs or (first.startswith("--") and root.subs == {}):
            yield from self._walk(root, toks, 0)
        elif first.startswith("--"):
            flags = {f for f in _all_flags(root)}
            for t in toks:
                for flag in _flags_of(t):
                    if flag not in flags:
                        yield f"{sn.context} has no option {flag} (in no subcommand either)"

    def _names(self, text: str) -> Iterator[str]:
        """`suspect_after_s`, `make_plan(...)`, `contract.ranks`, `XidPolicy.default()`: in the code."""
        # a message and its fields (`Welcome{a, b}`), a metric and its labels (`ntp_x_seconds{job}`)
        msg = re.fullmatch(r"([A-Za-z_]\w*)\{([\w\s,]*)\}", text)
        if msg is not None:
            for name in [msg.group(1), *re.findall(r"\w+", msg.group(2))]:
                # prometheus_client adds `_total` to a counter's name
                if name not in self.ref.words and name.removesuffix("_total") not in self.ref.words:
                    yield f"{name!r} (in `{text}`) is no name in the code"
            return
        m = re.fullmatch(r"([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)(?:\(.*\))?", text)
        if m is None:
            return
        parts = m.group(1).split(".")
        if parts[0] in EXTERNAL_MODULES:
            return
        called = len(text) > len(m.group(1))
        if len(parts) == 1 and not called and not re.fullmatch(r"[a-z][a-z0-9]*(?:_[a-z0-9]+)+", parts[0]):
            return  # a plain word: English as often as code
        for part in parts:
            if part not in self.ref.words and not (len(parts) == 1 and part.endswith("_total")
                                                   and part.removesuffix("_total") in self.ref.words):
                yield f"{part!r} (in `{text}`) is no name in the code"
                return
        for kw in re.findall(r"[(,]\s*([A-Za-z_]\w*)=", text[len(m.group(1)):]):  # `f(force_staging=True)`
            if kw not in self.ref.words:
                yield f"{kw!r} (in `{text}`) is no name in the code"

    def _paths(self, text: str, doc_dir: Path) -> Iterator[str]:
        tops = "|".join(map(re.escape, TOP_DIRS))
        for m in re.finditer(rf"(?<![\w./-])((?:\.\./)?(?:{tops})/[\w./*-]*[\w*/])", text):
            rel = m.group(1)
            if rel.startswith("../"):
                continue
            if "*" in rel:
                if not any(self.ref.root.glob(rel)):
                    yield f"no file matches {rel}"
            elif not (self.ref.root / rel).exists() and not (doc_dir / rel).exists():
                yield f"no such file or directory: {rel}"

    def _walk(self, cmd: Cmd, toks: list[str], i: int) -> Generator[str, None, int]:
        """Follows a command line through `cmd`'s tree from toks[i]; returns the index past it."""
        given = 0  # positional arguments given to the leaf
        while i < len(toks):
            raw = toks[i]
            if raw in ENDS or raw.endswith(";"):
                return i
            tok = _clean(raw)
            if tok.startswith("-") and len(tok) > 1 and not re.fullmatch(r"-\d.*", tok):
                flags = _flags_of(raw)
                takes = False
                for flag in flags:
                    if flag in cmd.options:
                        takes = takes or cmd.options[flag]
                    else:
                        takes = True  # an unknown flag: read the next word as its value (one finding, not two)
                        where = f"`{cmd.path()}`"
                        extra = ""
                        owners = [c.path() for c in _tree(cmd) if flag in c.options and c is not cmd]
                        if owners:
                            extra = f" (it belongs to `{owners[0]}`)"
                        yield f"{where} has no option {flag}{extra}"
                value = toks[i + 1] if i + 1 < len(toks) else ""
                # `[--state --node]`: a word that looks like a flag is read as one, not as the value
                alone = "=" in raw or raw.endswith("]") or _clean(value).startswith("--") or value in ENDS
                i += 2 if takes and not alone else 1
                continue
            if raw == "/" and cmd.parent is not None and i + 1 < len(toks) and _clean(toks[i + 1]) in cmd.parent.subs:
                cmd, given = cmd.parent, 0
                i += 1
                continue
            if cmd.subs:
                if tok in cmd.subs:
                    cmd = cmd.subs[tok]
                elif re.fullmatch(r"[a-z][a-z0-9-]*", tok):
                    yield f"`{cmd.path()}` has no subcommand {tok!r} (it has: {', '.join(sorted(cmd.subs))})"
                    return len(toks)
                i += 1
                continue
            if cmd.script_after_positional and not tok.startswith("$"):
                return (yield from self._script(toks, i)) if tok else i + 1
            if cmd.source is not None:
                return (yield from self._script_args(cmd.source, toks, i))
            if "..." not in raw and raw != "/":
                given += 1
                if cmd.max_args is not None and given > cmd.max_args:
                    limit = f"at most {cmd.max_args} argument(s)" if cmd.max_args else "no arguments"
                    yield f"`{cmd.path()}` takes {limit}: {tok!r} would be refused"
            i += 1
        return i

    def _script(self, toks: list[str], i: int) -> Generator[str, None, int]:
        """An ntp-run / python script and its arguments: its flags must appear in its source."""
        script = _clean(toks[i])
        path = self.ref.root / script
        if not path.is_file():
            # `train.py` stands for the reader's own script
            if ("/" in script or script.endswith(".py")) and script != "train.py" and not script.startswith("$"):
                yield f"no such script: {script}"
            return len(toks)
        return (yield from self._script_args(path, toks, i + 1))

    def _script_args(self, path: Path, toks: list[str], i: int) -> Generator[str, None, int]:
        source = path.read_text()
        words = set(re.findall(r"[A-Za-z_][\w-]*", source))
        while i < len(toks):
            raw = toks[i]
            if raw in ENDS:
                return i
            for flag in _flags_of(raw):
                if flag in ("--help", "-h"):
                    continue
                if f'"{flag}"' not in source and f"'{flag}'" not in source and \
                        flag.lstrip("-").replace("-", "_") not in words:
                    yield f"{path.relative_to(self.ref.root)} has no option {flag}"
            i += 1
        return i

    def _make(self, toks: list[str], i: int) -> Generator[str, None, int]:
        while i < len(toks):
            tok = toks[i]
            if tok in ENDS:
                return i
            if re.fullmatch(r"[a-z][\w.-]*", tok) and tok not in self.ref.targets:
                yield f"the Makefile has no target {tok!r}"
            elif not re.fullmatch(r"[a-z][\w.-]*|-\S+|\w+=\S*", tok):
                return i
            i += 1
        return i

    def _python(self, toks: list[str], i: int) -> Generator[str, None, int]:
        while i < len(toks) and toks[i].startswith("-") and toks[i] != "-m":
            i += 1
        if i >= len(toks):
            return i
        if toks[i] == "-m" and i + 1 < len(toks):
            module = toks[i + 1]
            if module.startswith("ntp_manager"):
                try:
                    found = importlib.util.find_spec(module) is not None
                except ImportError:
                    found = False
                if not found:
                    yield f"no module {module}"
                    return len(toks)
                cmd = module_command(module)
                if cmd is not None:
                    return (yield from self._walk(cmd, toks, i + 2))
            return len(toks)
        if toks[i].endswith(".py"):
            return (yield from self._script(toks, i))
        return i + 1


def _docstring_examples(source: str) -> str:
    """The module docstring's example lines (indented 4+ spaces), the other lines blank, so that line
    numbers stay those of the file."""
    import ast

    doc = ast.get_docstring(ast.parse(source), clean=False) or ""
    start = source.find(doc.split("\n", 1)[0]) if doc else -1
    first = source.count("\n", 0, start) if start >= 0 else 0
    lines = [""] * len(source.splitlines())
    for i, line in enumerate(doc.splitlines()):
        if line.startswith("    ") and line.strip() and first + i < len(lines):
            lines[first + i] = line
    return "\n".join(lines)


def _flags_of(raw: str) -> list[str]:
    """`[--dry-run/--apply]` -> both; `--in=30m` -> --in; `-o` -> -o."""
    tok = _clean(raw)
    if not tok.startswith("-") or re.fullmatch(r"-\d.*", tok):
        return []
    return [p.split("=")[0].split("[")[0].rstrip("]).,:") for p in tok.split("/") if p.startswith("-")]


def _tree(cmd: Cmd) -> Iterator[Cmd]:
    root = cmd
    while root.parent is not None:
        root = root.parent
    todo = [root]
    while todo:
        c = todo.pop()
        yield c
        todo.extend(c.subs.values())


def _all_flags(cmd: Cmd) -> set[str]:
    return {f for c in _tree(cmd) for f in c.options}


def doc_files(root: Path = ROOT) -> list[Path]:
    """The docs, and the scripts that run our commands (their command lines are checked the same way)."""
    scripts = [*sorted((root / "deploy").glob("*.sh")), *sorted((root / "bench").glob("*.sh")),
               *sorted((root / "agent").glob("*.service")), *sorted((root / ".ci").glob("*")),
               # the command-line modules' docstrings (their usage examples)
               *sorted((root / "ntp_manager" / "cli").glob("*.py")), root / "agent" / "ntp_agent" / "main.py",
               root / "ntp_manager" / "worker" / "run.py"]
    return [root / "README.md", *sorted((root / "docs").glob("*.md")), *scripts]


def check_all(ref: Reference | None = None) -> list[Finding]:
    ref = ref or Reference.load()
    checker = Checker(ref)
    return [*(f for path in doc_files(ref.root) for f in checker.check_file(path)), *outside_references(ref.root)]


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args(argv)
    found = check_all()
    for f in found:
        print(f)
    print(f"{len(found)} finding(s) in {len(doc_files())} files", file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
