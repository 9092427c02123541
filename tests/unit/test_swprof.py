"""bench/swprof.py: py-spy speedscope samples of a rank during a layout switch, bucketed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import swprof

# frames as py-spy --native --format speedscope writes them (name, file, line; native ones from a .so)
FRAMES = [
    {"name": "<module>", "file": "<string>", "line": 1},                                         # 0
    {"name": "Runtime.train_step", "file": "/w/ntp_manager/worker/runtime/__init__.py", "line": 98},     # 1
    {"name": "_try_step", "file": "/w/ntp_manager/worker/runtime/step.py", "line": 60},          # 2
    {"name": "wait", "file": "/w/.venv/lib/torch/distributed/distributed_c10d.py", "line": 10},  # 3
    {"name": "_Switching._recover", "file": "/w/ntp_manager/worker/runtime/switch.py", "line": 86},         # 4
    {"name": "_apply", "file": "/w/ntp_manager/worker/runtime/switch.py", "line": 337},          # 5
    {"name": "apply_reshard", "file": "/w/ntp_manager/worker/reshard.py", "line": 200},          # 6
    {"name": "reshard_moves", "file": "/w/ntp_manager/worker/reshard.py", "line": 60},           # 7
    {"name": "_cover", "file": "/w/ntp_manager/worker/reshard.py", "line": 110},                 # 8
    {"name": "start", "file": "/w/ntp_manager/worker/comm.py", "line": 780},                     # 9
    {"name": "__memmove_avx_unaligned_erms", "file": "libc.so.6", "line": 0},                    # 10
    {"name": "gloo::transport::tcp::UnboundBuffer::waitRecv", "file": "libtorch_cpu.so", "line": 0},  # 11
    {"name": "_rendezvous", "file": "/w/ntp_manager/worker/runtime/switch.py", "line": 190},     # 12
    {"name": "_forward_backward", "file": "/w/ntp_manager/worker/runtime/step.py", "line": 150},  # 13
    {"name": "at::native::addmm_out", "file": "libtorch_cpu.so", "line": 0},                     # 14
    {"name": "_copy_stretches", "file": "/w/ntp_manager/worker/reshard.py", "line": 145},        # 15
    {"name": "select", "file": "/usr/lib/python3.11/selectors.py", "line": 415},                 # 16
]

WAIT_OLD = [0, 1, 2, 3, 11]              # the failed step, blocked on the dead peer
PLAN = [0, 1, 4, 5, 7, 8]                # reshard planning (pure Python)
COPY = [0, 1, 4, 5, 6, 9, 10]            # FlatExchange staging copy
COPY2 = [0, 1, 4, 5, 6, 15]              # a slice copied in Python (no native frame below)
RECV = [0, 1, 4, 5, 6, 9, 11]            # gloo recv wait inside the exchange
RDV = [0, 1, 4, 12]                      # rendezvous, no wait frame below
STEP = [0, 1, 2, 13, 14]                 # the first step at the new layout


def doc(main: list[list[int]]) -> dict[str, object]:
    return {"$schema": "https://www.speedscope.app/file-format-schema.json",
            "shared": {"frames": FRAMES},
            "profiles": [
                {"type": "sampled", "name": "Thread 12 (idle) \"gloo\"", "unit": "none", "startValue": 0,
                 "endValue": 0.12, "samples": [[16], [16], [16]], "weights": [0.04, 0.04, 0.04]},
                {"type": "sampled", "name": "Process 7 Thread 11 \"MainThread\"", "unit": "none", "startValue": 0,
                 "endValue": 0.04 * len(main), "samples": main, "weights": [0.04] * len(main)},
            ],
            "name": "py-spy profile", "exporter": "py-spy@0.4.0"}


def test_samples_fall_into_their_stretch_and_category(tmp_path: Path) -> None:
    seq = [WAIT_OLD] * 3 + [RDV] * 2 + [PLAN] * 2 + [COPY] * 4 + [COPY2] + [RECV] * 5 + [STEP] * 6
    path = tmp_path / "w5.json"
    path.write_text(json.dumps(doc(seq)))
    p = swprof.load(path)
    assert p.rank == "w5" and p.seconds == pytest.approx(0.04 * len(seq))
    want = {"detection wait": 3, "switch other": 2, "reshard planning": 2, "copies": 5, "gloo waits": 5,
            "first step": 6}
    assert dict(p.by_category) == pytest.approx({k: 0.04 * n for k, n in want.items()})
    # the step's compute after the switch is not a copy or a wait even with a wait frame name nearby
    assert p.own["at::native::addmm_out (libtorch_cpu.so)"] == pytest.approx(0.24)
    assert p.own["gloo::transport::tcp::UnboundBuffer::waitRecv (libtorch_cpu.so)"] == pytest.approx(0.2)
    assert "gloo::transport::tcp::UnboundBuffer::waitRecv (libtorch_cpu.so)" not in swprof.classify(
        [(s, w) for s, w in swprof.main_thread_samples(doc(seq))][:3], "w5").own  # before the switch
    assert p.share("copies") == pytest.approx(5 / len(seq))


def test_weights_are_seconds_and_the_main_thread_is_picked() -> None:
    d = doc([WAIT_OLD, COPY, STEP])
    d["profiles"][1]["weights"] = [0.5, 0.25, 0.125]  # type: ignore[index]  # py-spy fell behind
    samples = swprof.main_thread_samples(d)
    assert [w for _, w in samples] == [0.5, 0.25, 0.125]
    assert samples[0][0][-1] == "gloo::transport::tcp::UnboundBuffer::waitRecv (libtorch_cpu.so)"
    p = swprof.classify(samples, "w0")
    assert dict(p.by_category) == {"detection wait": 0.5, "copies": 0.25, "first step": 0.125}


def test_no_switch_seen_is_all_detection_wait() -> None:
    names = [([swprof.frame_name(FRAMES[i]) for i in WAIT_OLD], 0.04)] * 4
    p = swprof.classify(names, "w1")
    assert dict(p.by_category) == pytest.approx({"detection wait": 0.16})
    assert p.by_category["first step"] == 0


def test_wait_under_a_copy_name_goes_by_the_leaf() -> None:
    # the staged exchange's `_finish` (a copy) waiting on its recv: the leaf-most match decides
    stack = ["<module> (<string>)", "_Switching._recover (switch.py)", "_finish (/w/ntp_manager/worker/comm.py)",
             "gloo::transport::tcp::UnboundBuffer::waitRecv (libtorch_cpu.so)"]
    assert swprof.switch_category(stack) == "gloo waits"
    assert swprof.switch_category(stack[:-1]) == "copies"
