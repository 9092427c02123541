"""Small readers for bench/gpu_session.sh's output files (stdlib only: it runs on the lent GPU
machine before anything else is known to work).

    python bench/gpu_report.py gpus probe.json    # how many GPUs `ntp-agent probe --json` sampled

The count is the length of the probe's "gpus" list: each GPU carries its uuid twice (inventory and
sample), so counting "uuid" in the text reported two GPUs for one (issue 32)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def gpu_count(probe: Any) -> int:
    """GPUs in a parsed `ntp-agent probe --json` document; ValueError naming what is wrong."""
    if not isinstance(probe, dict) or not isinstance(probe.get("gpus"), list):
        raise ValueError("probe JSON has no 'gpus' list")
    uuids = []
    for i, g in enumerate(probe["gpus"]):
        static = g.get("static") if isinstance(g, dict) else None
        if not isinstance(static, dict) or not isinstance(static.get("uuid"), str):
            raise ValueError(f"probe JSON gpus[{i}] has no static.uuid")
        uuids.append(static["uuid"])
    if len(set(uuids)) != len(uuids):
        raise ValueError(f"probe JSON lists a GPU twice: {sorted(u for u in set(uuids) if uuids.count(u) > 1)}")
    return len(uuids)


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] != "gpus":
        print("usage: gpu_report.py gpus PROBE.json", file=sys.stderr)
        return 2
    try:
        print(gpu_count(json.loads(Path(argv[1]).read_text())))
    except (OSError, ValueError) as e:  # json.JSONDecodeError is a ValueError
        print(f"unreadable: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
