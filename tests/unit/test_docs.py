"""The docs name only what the code has (tools/doccheck.py), and the checker does find a wrong name.

Every command line, subcommand and flag in README.md and docs/*.md is checked against the real
typer/argparse parsers, REST paths against the FastAPI app's routes, gRPC names against the stubs,
NTP_ variables against the settings classes and the code, make targets against the Makefile, and
repository paths against the tree. No network, no subprocess.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tools.doccheck import OUTSIDE_NAMES, ROOT, Checker, Reference, check_all, doc_files, outside_references

FIX = "fix the doc (or the code), then run `.venv/bin/python tools/doccheck.py` to list what is left"


@pytest.fixture(scope="module")
def checker() -> Checker:
    return Checker(Reference.load())


def test_every_doc_names_only_what_the_code_has(checker: Checker) -> None:
    found = check_all(checker.ref)
    assert not found, f"{len(found)} name(s) in the docs the code does not have ({FIX}):\n" + \
        "\n".join(map(str, found))


def test_the_reference_is_read_from_the_code(checker: Checker) -> None:
    """An introspection that came back empty would pass every doc: spot-check what it found."""
    ref = checker.ref
    assert {"plan", "serve", "simulate", "token", "db", "cluster"} <= set(ref.clis["ntp-manager"].subs)
    assert "--reason" in ref.clis["ntpctl"].subs["cordon"].options
    assert {"--url", "--token-file", "--json"} <= set(ref.clis["ntpctl"].options)
    assert "--scenario" in ref.clis["ntp-agent"].subs["probe"].options
    assert ref.clis["ntp-run"].options["--nproc"] is True and ref.clis["ntp-run"].options["--no-pin-gpus"] is False
    assert {"demo", "test", "lint", "proto", "docs"} <= ref.targets
    assert {"NTP_DATABASE_URL", "NTP_AGENT_TOKEN_FILE", "NTP_URL", "NTP_TOKEN"} <= ref.env
    assert "ntp.v1.WorkerService/WatchLayout" in ref.grpc
    assert any(tpl == "/v1/jobs/{name}/layout" for _, tpl, _ in ref.routes)
    assert len(doc_files()) >= 10


# (line added to a copy of a doc, what the finding must name)
PLANTED = [
    ("```bash\n.venv/bin/ntpctl gpus --state failed --colour\n```", "`ntpctl gpus` has no option --colour"),
    ("```bash\nntpctl status --token-file t\n```",
     "`ntpctl status` has no option --token-file (it belongs to `ntpctl`)"),
    ("```bash\nntp-manager token rotate --scope admin\n```", "`ntp-manager token` has no subcommand 'rotate'"),
    ("Run `ntp-manager plan -c c.yaml -j j.yaml --previus now.json`.", "`ntp-manager plan` has no option --previus"),
    ("```bash\nntp-agent probe --backend fake --jsn\n```", "`ntp-agent probe` has no option --jsn"),
    ("```bash\nntp-run --nproc 2 --replica 2 train.py\n```", "`ntp-run` has no option --replica"),
    ("```bash\nntp-run --nproc 2 examples/train_hf_llama.py --stepz 3\n```",
     "examples/train_hf_llama.py has no option --stepz"),
    ("```bash\npython -m ntp_manager.demos.demo_slow --factr 3\n```",
     "`ntp_manager.demos.demo_slow` has no option --factr"),
    ("```bash\nntp-manager db downgrade --data-dir d base extra\n```",
     "`ntp-manager db downgrade` takes at most 1 argument(s): 'extra' would be refused"),
    ("Then `ntpctl cordon GPU-1 GPU-2 --reason x`.", "`ntpctl cordon` takes at most 1 argument(s): 'GPU-2'"),
    ("```bash\nmake docs-html\n```", "the Makefile has no target 'docs-html'"),
    ("Pass `--no-wayt` to stop early.", "no command or script here has an option --no-wayt"),
    ("Call `GET /v1/jobs/{name}/layout/history`.", "REST path /v1/jobs/{name}/layout/history is not a route"),
    ("Then `DELETE /v1/breaker`.", "REST DELETE /v1/breaker: the route takes GET"),
    ("| POST | `/v1/nodes/{name}/drain` `{deadline, why}` | |", "REST /v1/nodes/{name}/drain body has no field 'why'"),
    ("`PATCH /v1/failslow/options` `{\"options\": {}, \"rest\": false}`", "body has no field 'rest'"),
    ("| GET / DELETE | `/v1/maintenance/{id}` | |", "REST GET /v1/maintenance/{id}: the route takes DELETE"),
    ("Read `/v1/events?gpu=&since=`.", "REST /v1/events takes no query parameter 'since'"),
    ("A new leader waits `takeover_grace_s` (default 20 s).", "takeover_grace_s defaults to 30, not 20"),
    ("Bodies up to `NTP_MAX_REQUEST_BYTES` (8 MiB).", "NTP_MAX_REQUEST_BYTES defaults to 4,194,304, not 8 MiB"),
    ("Set NTP_HEARTBEAT_S to 5.", "environment variable NTP_HEARTBEAT_S is read nowhere"),
    ("It calls `ntp.v1.WorkerService/WatchLayouts`.", "gRPC name ntp.v1.WorkerService/WatchLayouts is not"),
    ("See `ntp_manager/service/leases.py`.", "no such file or directory: ntp_manager/service/leases.py"),
    ("The manager waits `suspect_after_secs`.", "'suspect_after_secs' (in `suspect_after_secs`) is no name"),
    ("It answers `Welcome{leader_epoch, last_acked_sequence}`.",
     "'last_acked_sequence' (in `Welcome{leader_epoch, last_acked_sequence}`) is no name"),
    ("Watch `ntp_job_stage_step_seconds{job,stag}`.", "'stag' (in `ntp_job_stage_step_seconds{job,stag}`) is no"),
    ("Set `RuntimeConfig(force_stagin=True)`.", "'force_stagin' (in `RuntimeConfig(force_stagin=True)`) is no name"),
    # nothing outside the repository (the names are built here so that this file does not hold them)
    ("See [the design](../../" + "shared/" + OUTSIDE_NAMES[1] + ").", "link leaves the repository"),
    (f"As {OUTSIDE_NAMES[0]} section 1 says.", f"names {OUTSIDE_NAMES[0]}, which is not in this repository"),
    ("The runs are in `../" + "shared/gpu-runs/`.", "names a path outside this repository"),
    ("See [the sync](references.md#no-such-heading).", "link to a heading references.md does not have"),
    ("See [the plan](planer.md).", "link to a missing file: planer.md"),
]


@pytest.mark.parametrize(("planted", "expected"), PLANTED, ids=[e.split()[0] + str(i) for i, (_, e) in
                                                                   enumerate(PLANTED)])
def test_a_planted_error_is_reported_with_file_and_line(checker: Checker, tmp_path: Path, planted: str,
                                                        expected: str) -> None:
    doc = tmp_path / "manager.md"
    text = (ROOT / "docs" / "manager.md").read_text() + "\n## Planted (a section that names no command)\n\n"
    doc.write_text(text + planted + "\n")
    line = len(text.splitlines()) + 1 + (1 if planted.startswith("```") else 0)
    found = checker.check_file(doc, shown_as="docs/manager.md")
    assert [str(f) for f in found] and all(f.line == line for f in found), found
    assert any(f.path == "docs/manager.md" and expected in f.what for f in found), found


def _misspelt(checker: Checker, tmp_path: Path, rel: str, marker: str, old: str, new: str) -> tuple[list[Any], int]:
    """A copy of the real file `rel` whose first line holding `marker` has `old` replaced by `new`:
    the checker's findings on it (shown as `rel`), and that line's 0-based index."""
    src = (ROOT / rel).read_text().splitlines()
    at = next(i for i, line in enumerate(src) if marker in line)
    src[at] = src[at].replace(old, new)
    copy = tmp_path / Path(rel).name
    copy.write_text("\n".join(src) + "\n")
    return checker.check_file(copy, shown_as=rel), at


def test_a_changed_line_is_reported_where_it_is(checker: Checker, tmp_path: Path) -> None:
    """A real line of a real doc, one flag misspelt: the finding names that line."""
    found, at = _misspelt(checker, tmp_path, "docs/operations.md", "`layout JOB [--history]", "--history", "--hist")
    # the command's span, and the line's lone `--hist` span, read as an ntpctl flag (the section's command)
    assert [str(f) for f in found] == [f"docs/operations.md:{at + 1}: `ntpctl layout` has no option --hist",
                                       f"docs/operations.md:{at + 1}: ntpctl has no option --hist (in no "
                                       "subcommand either)"]


def test_the_settings_page_is_up_to_date() -> None:
    from tools import settings_doc

    assert settings_doc.PAGE.read_text() == settings_doc.render(), \
        "docs/settings.md is out of date: run `.venv/bin/python tools/settings_doc.py` (or `make docs`)"


def test_the_settings_page_has_every_field_of_both_classes() -> None:
    from ntp_agent.main import AgentSettings
    from ntp_manager.settings import Settings
    from tools import settings_doc

    text = settings_doc.render()
    for prefix, cls in (("NTP_", Settings), ("NTP_AGENT_", AgentSettings)):
        for name, info in cls.model_fields.items():
            row = next((line for line in text.splitlines() if line.startswith(f"| `{name}` | `{prefix}")), None)
            assert row is not None, name
            assert info.description and " ".join(info.description.split()) in row.replace("\\|", "|")


def _key_paths(x: object, pre: str = "") -> set[str]:
    out: set[str] = set()
    if isinstance(x, dict):
        for k, v in x.items():
            out.add(pre + k)
            if pre + k != "power_caps_w":  # keyed by GPU UUID
                out |= _key_paths(v, f"{pre}{k}.")
    elif isinstance(x, list):
        for v in x:
            out |= _key_paths(v, f"{pre}[].")
    return out


def test_plan_json_page_shows_every_field_the_cli_writes() -> None:
    """docs/plan-json.md's example has exactly the fields of `ntp-manager plan --json` (a plan made
    with a previous one, so that `moves` and `prev_*` are there)."""
    import json
    import re

    from ntp_manager.cli.manager import apply_failures
    from ntp_manager.planner import PreviousLayout, make_plan
    from ntp_manager.planner.export import plan_to_dict
    from ntp_manager.specfile import load_cluster, load_job

    text = (ROOT / "docs" / "plan-json.md").read_text()
    block = re.search(r"```json\n(.*?)```", text, re.S)
    assert block is not None
    documented = json.loads(re.sub(r"//[^\n]*", "", block.group(1)))
    cluster = load_cluster(ROOT / "examples/specs/cluster-small.yaml")
    job = load_job(ROOT / "examples/specs/job-small.yaml")
    before = plan_to_dict(make_plan(apply_failures(cluster, [], 3, 1), job))
    now = plan_to_dict(make_plan(apply_failures(cluster, [], 5, 2), job, PreviousLayout.from_dict(before)))
    assert now["dropped"] or now["idle"]
    wanted = _key_paths(now) | {f"dropped.[].{k}" for k in ("group", "domain", "usable", "spare", "reason")}
    assert _key_paths(documented) == wanted


def test_specs_page_lists_every_job_field() -> None:
    """docs/specs.md's job table names exactly the fields a job spec takes (unknown keys are errors)."""
    import re

    from ntp_manager.specfile import JobFile

    text = (ROOT / "docs" / "specs.md").read_text().split("## Job", 1)[1]
    named = {n for row in text.splitlines() if row.startswith("| `")
             for n in re.findall(r"`(\w+)`", row.split("|")[1])}
    assert named == set(JobFile.model_fields)


def test_a_script_is_checked_like_a_code_block(checker: Checker, tmp_path: Path) -> None:
    """deploy/*.sh and the systemd unit run our commands: a wrong flag there is found at its line."""
    found, at = _misspelt(checker, tmp_path, "deploy/run-job.sh", "ntpctl jobs --json", "--json", "--jsn")
    assert [str(f) for f in found] == [f"deploy/run-job.sh:{at + 1}: `ntpctl jobs` has no option --jsn"]
    unit = tmp_path / "ntp-agent.service"
    unit.write_text((ROOT / "agent/ntp-agent.service").read_text().replace("--backend nvml", "--backnd nvml"))
    assert any("`ntp-agent` has no option --backnd" in f.what for f in checker.check_file(unit))


def test_a_command_modules_usage_example_is_checked(checker: Checker, tmp_path: Path) -> None:
    """ntpctl's docstring shows `ntpctl gpus --state failed`: misspelt, it is found at its line."""
    src = (ROOT / "ntp_manager" / "cli" / "ctl.py").read_text()
    line = src.splitlines().index("    ntpctl gpus --state failed") + 1
    copy = tmp_path / "ctl.py"
    copy.write_text(src.replace("    ntpctl gpus --state failed", "    ntpctl gpus --stat failed"))
    assert [str(f) for f in checker.check_file(copy, shown_as="ctl.py")] == \
        [f"ctl.py:{line}: `ntpctl gpus` has no option --stat"]


def test_every_ntpctl_command_takes_json(checker: Checker) -> None:
    """README.md and docs/operations.md promise it."""
    from tools.doccheck import _tree

    leaves = [c for c in _tree(checker.ref.clis["ntpctl"]) if not c.subs]
    assert len(leaves) > 15
    assert [c.path() for c in leaves if "--json" not in c.options] == []


def test_a_path_outside_the_repository_is_found_in_any_file(tmp_path: Path) -> None:
    """Code, scripts and configuration are read too: a comment citing a background file, or a path
    into the checkout's neighbour, is a finding with its file and line."""
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "mod.py").write_text(f"x = 1\n# the table of {OUTSIDE_NAMES[0]}\n")
    (tmp_path / "run.sh").write_text("cp a ../" + "shared/b\n")
    (tmp_path / "ok.py").write_text("# docs/references.md holds the sources\n")
    found = sorted(str(f) for f in outside_references(tmp_path))
    assert found == [
        f"pkg/mod.py:2: names {OUTSIDE_NAMES[0]}, which is not in this repository (docs/design.md, "
        "docs/references.md are)",
        "run.sh:1: names a path outside this repository: ../" + "shared",
    ]
