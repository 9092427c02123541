"""A stand-in for Slurm's `sinfo` and `scontrol`, as far as service/operations/slurm.py uses them, for tests that
cannot have the real Slurm (tests/integration/test_slurm.py has it). The state -- the nodes Slurm
knows and the drained ones with their reasons -- is a JSON file; `install(bin_dir, state)` writes
`sinfo` and `scontrol` scripts into `bin_dir` that run this module as the commands, as subprocesses.

    sinfo -h -N -t drain -o "%N|%T|%E" [-n NODE]       drained nodes, NAME|drained|REASON
    scontrol update NodeName=N State=DRAIN Reason=R     (unknown N: "Invalid node name specified")
    scontrol update NodeName=N State=RESUME
"""

from __future__ import annotations

import json
import stat
import sys
from pathlib import Path
from typing import Any


def load(state: Path) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(state.read_text())
    return doc


def save(state: Path, doc: dict[str, Any]) -> None:
    tmp = state.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc))
    tmp.replace(state)


def new_state(state: Path, nodes: list[str]) -> None:
    save(state, {"nodes": nodes, "drained": {}})


def drain(state: Path, node: str, reason: str) -> None:
    doc = load(state)
    doc["drained"][node] = reason
    save(state, doc)


def resume(state: Path, node: str) -> None:
    doc = load(state)
    doc["drained"].pop(node, None)
    save(state, doc)


def drained(state: Path) -> dict[str, str]:
    out: dict[str, str] = load(state)["drained"]
    return out


def install(bin_dir: Path, state: Path) -> None:
    bin_dir.mkdir(parents=True, exist_ok=True)
    for cmd in ("sinfo", "scontrol"):
        p = bin_dir / cmd
        p.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{Path(__file__).resolve()}" "{state}" {cmd} "$@"\n')
        p.chmod(p.stat().st_mode | stat.S_IXUSR)


def main(argv: list[str]) -> int:
    state, cmd, args = Path(argv[0]), argv[1], argv[2:]
    if cmd == "sinfo":
        only = args[args.index("-n") + 1] if "-n" in args else None
        for node, reason in sorted(drained(state).items()):
            if only is None or node == only:
                print(f"{node}|drained|{reason}")
        return 0
    fields = dict(a.split("=", 1) for a in args[1:])
    node = fields["NodeName"]
    if node not in load(state)["nodes"]:
        print("slurm_update error: Invalid node name specified", file=sys.stderr)
        return 1
    if fields["State"] == "DRAIN":
        drain(state, node, fields["Reason"])
    elif fields["State"] == "RESUME":
        resume(state, node)
    else:
        print(f"unsupported State={fields['State']}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
