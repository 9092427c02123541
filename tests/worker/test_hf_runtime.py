"""`ntp-run` runs examples/train_hf_llama.py (a Hugging Face Llama with GQA, a padding token and
tied embeddings, through the public API) as 6 real rank processes: replicas at TP4 and TP2; one
rank of the TP4 replica is SIGKILLed after step 2, the survivors go on at TP3 + TP2 (the lost
shards and their AdamW state from the peer replica), a fresh process joins after step 4 and the
replica is back at TP4. Every rank -- the fresh one too -- then trains one process on the same
global batches and checks its losses and its shards of the final parameters against it (rel.
<= 1e-5), and that the embedding and the LM head are still one Parameter."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from tests.fakes.procs import run_bounded

pytest.importorskip("transformers", reason="the Hugging Face tests need transformers (the dev extra)")

ROOT = Path(__file__).resolve().parents[2]


def test_ntp_run_trains_hf_llama_through_a_kill_tp3_and_a_rejoin() -> None:
    cmd = [sys.executable, "-m", "ntp_manager.worker.run", "--nproc", "6", "--tp", "4,2", "--fail-at", "2",
           "--repair-at", "4", "examples/train_hf_llama.py", "--steps", "7", "--check", "--report-from", "r1g0"]
    out = run_bounded(cmd, 270, cwd=ROOT)
    text = out.stdout
    assert out.returncode == 0, text[-4000:]
    checks = re.findall(r"\[(r\dg\d)\]: check ok: (\d+) steps", text)  # ntp-run prefixes each rank's lines
    assert sorted(w for w, _ in checks) == ["r0g0", "r0g1", "r0g2", "r0g3", "r1g0", "r1g1"], text[-4000:]
    assert "check FAILED" not in text
    # the rank that came back ran only the steps after it joined; the others all 7
    assert {w: int(n) for w, n in checks}["r0g0"] == 7 and 0 < {w: int(n) for w, n in checks}["r0g3"] < 7
    # layouts: TP4 + TP2, replica 0 at TP3 after the kill, back at TP4 after the repair
    published = [json.loads(line)["tp"] for line in text.splitlines()
                 if line.startswith("{") and json.loads(line)["event"] == "layout published"]  # ntp-run's JSON lines
    assert published == [[4, 2], [3, 2], [4, 2]], text[-4000:]
    steps = {int(s): int(v) for s, v in re.findall(r"step +(\d+) +layout v(\d)", text)}
    assert sorted(steps) == list(range(7)) and steps[0] == 1 and 2 in steps.values() and steps[6] == 3
    assert "[r0g3]: reshard done (v3) tp=4 stage=0 joiners=1 " in text  # the fresh process joined by resharding
    assert re.search(r"\[r0g0\]: failure detected \(v1\)", text)
