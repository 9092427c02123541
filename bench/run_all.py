"""`make bench`: run every benchmark in turn; each prints its own table. Results: bench/RESULTS.md."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
BENCHES = ["planner.py", "sim.py", "manager.py", "layouts.py", "worker.py", "pipeline.py", "pipeline_memory.py",
           "devices.py", "checkpoint.py", "e2e.py", "silent.py", "failslow.py", "failslow_decision.py"]


def main() -> int:
    failed = []
    for name in BENCHES:
        print(f"\n=== bench/{name} ===", flush=True)
        rc = subprocess.call([sys.executable, str(HERE / name)])
        if rc:
            failed.append(name)
    if failed:
        print(f"failed: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
