"""A deterministic fake GPU backend driven by a scenario file (YAML), for demos, tests and load.

    seed: 7
    node: node-a            # optional defaults for the agent
    domain: nvl-0
    gpus: 4                 # or a list of {uuid, model, tdp_w, min_w, max_w}
    tdp_w: 1000
    faults:                 # timed faults, seconds after the backend starts
      - {at: 2.0, gpu: 1, kind: xid, xid: 79}
      - {at: 3.0, gpu: 2, kind: xid, xid: 13}
      - {at: 4.0, gpu: 0, kind: ecc_uncorrectable}
      - {at: 5.0, gpu: 3, kind: nvlink_down, links: 2}
      - {at: 6.0, gpu: 3, kind: thermal_throttle}
      - {at: 7.0, gpu: 2, kind: slow, factor: 0.7}
      - {at: 8.0, gpu: 1, kind: lost}
      - {at: 0.0, gpu: 0, kind: power_set_refused}
      - {at: 9.0, gpu: 1, kind: repair}
      - {at: 10.0, gpu: 3, kind: hang}         # calls about the GPU block until a repair

`gpu` is the local index. Time comes from an injectable clock, so tests can step it. The same
scenario and seed always produce the same UUIDs and the same event order.
"""

from __future__ import annotations

import threading
import time
import uuid as uuidlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import structlog
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ntp_agent.backends.base import (
    BackendError,
    BackendEvent,
    GpuLost,
    GpuRepaired,
    GpuSample,
    GpuStatic,
    NoPermission,
    XidEvent,
)

log = structlog.get_logger("ntp.agent.fake")

FaultKind = Literal[
    "xid", "lost", "ecc_uncorrectable", "ecc_correctable", "nvlink_down", "thermal_throttle", "slow",
    "power_set_refused", "repair", "hang",
]


class ScenarioError(ValueError):
    pass


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class FaultSpec(_Strict):
    at: float = Field(ge=0)
    gpu: int = Field(ge=0)
    kind: FaultKind
    xid: int | None = Field(None, ge=1, le=10_000)
    links: int = Field(1, ge=1, le=18)
    factor: float = Field(0.7, gt=0, le=1)
    count: int = Field(1000, ge=1)


class GpuSpec(_Strict):
    uuid: str | None = None
    model: str = "FakeGPU-1000W"
    tdp_w: float | None = Field(None, gt=0)
    min_w: float | None = Field(None, gt=0)
    max_w: float | None = Field(None, gt=0)


class Scenario(_Strict):
    seed: int = 0
    node: str | None = None
    domain: str | None = None
    gpus: int | list[GpuSpec] = 4
    tdp_w: float = Field(1000.0, gt=0)
    faults: list[FaultSpec] = Field(default_factory=list)

    def gpu_specs(self) -> list[GpuSpec]:
        if isinstance(self.gpus, int):
            if not 1 <= self.gpus <= 64:
                raise ScenarioError("gpus must be between 1 and 64")
            return [GpuSpec() for _ in range(self.gpus)]
        if not self.gpus:
            raise ScenarioError("gpus must not be empty")
        return self.gpus


def load_scenario(path: str | Path) -> Scenario:
    p = Path(path)
    try:
        data = yaml.safe_load(p.read_text())
    except FileNotFoundError:
        raise ScenarioError(f"{p}: no such file") from None
    except (OSError, UnicodeDecodeError) as e:  # a directory, no permission, not text
        raise ScenarioError(f"{p}: cannot read ({getattr(e, 'strerror', None) or e})") from None
    except yaml.YAMLError as e:
        raise ScenarioError(f"{p}: malformed YAML: {getattr(e, 'problem', e)}") from None
    return parse_scenario(data or {}, str(p))


def parse_scenario(data: Any, source: str = "scenario") -> Scenario:
    if not isinstance(data, dict):
        raise ScenarioError(f"{source}: expected a mapping at the top level")
    try:
        sc = Scenario.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        raise ScenarioError(f"{source}: {'.'.join(str(x) for x in first['loc'])}: {first['msg']}") from None
    n = len(sc.gpu_specs())
    for f in sc.faults:
        if f.gpu >= n:
            raise ScenarioError(f"{source}: fault at {f.at}s names GPU {f.gpu}, but there are {n}")
        if f.kind == "xid" and f.xid is None:
            raise ScenarioError(f"{source}: fault at {f.at}s of kind xid needs an 'xid' number")
    return sc


@dataclass
class _Gpu:
    static: GpuStatic
    limit_mw: int
    lost: bool = False
    dbe: int = 0
    sbe: int = 0
    nvlink_down: int = 0
    throttled: bool = False
    slow: float = 1.0
    refuse_set: bool = False
    hung: bool = False  # every call about this GPU blocks (a driver hang) until a repair


@dataclass
class FakeBackend:
    scenario: Scenario
    node: str = "node-0"
    clock: Callable[[], float] = time.monotonic
    name: str = "fake"
    _gpus: dict[str, _Gpu] = field(default_factory=dict)
    _order: list[str] = field(default_factory=list)
    _pending: list[FaultSpec] = field(default_factory=list)
    _xids: list[BackendEvent] = field(default_factory=list)
    _cond: threading.Condition = field(default_factory=threading.Condition)
    _t0: float = 0.0
    _closed: bool = False
    set_calls: list[tuple[str, int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        sc = self.scenario
        for i, spec in enumerate(sc.gpu_specs()):
            uid = spec.uuid or "GPU-" + str(uuidlib.uuid5(uuidlib.NAMESPACE_URL, f"fake/{sc.seed}/{self.node}/{i}"))
            tdp = spec.tdp_w or sc.tdp_w
            static = GpuStatic(
                uid, i, spec.model, 80 << 30, int((spec.min_w or 0.2 * tdp) * 1000),
                int((spec.max_w or 1.3 * tdp) * 1000), int(tdp * 1000), f"0000:{i:02x}:00.0", sc.domain, minor=i,
            )
            self._gpus[uid] = _Gpu(static, static.default_mw)
            self._order.append(uid)
        self._pending = sorted(sc.faults, key=lambda f: (f.at, f.gpu))
        self._t0 = self.clock()

    # ---- the protocol ---------------------------------------------------------------------------
    def gpus(self) -> list[GpuStatic]:
        return [self._gpus[u].static for u in self._order]

    def sample(self, uuid: str) -> GpuSample:
        self._advance()
        g = self._gpus[uuid]
        self._block_while_hung(g)
        if g.lost:
            raise GpuLost(f"GPU {uuid} is lost")
        return GpuSample(
            uuid, sbe_total=g.sbe, dbe_total=g.dbe, throttled=g.throttled, temperature_c=97 if g.throttled else 55,
            nvlink_down=g.nvlink_down, limit_mw=g.limit_mw, usage_mw=int(g.limit_mw * 0.9), slow_factor=g.slow,
            # a throttled GPU shows HW thermal slowdown (0x40) and lower SM clocks; a slow one, clocks at its pace
            clock_event_reasons=0x40 if g.throttled else 0,
            sm_clock_mhz=int(1980 * min(g.slow, 0.7 if g.throttled else 1.0)), sm_clock_max_mhz=1980,
            nvlink_replay=0, nvlink_recovery=0, nvlink_crc=0,
        )

    def wait_xids(self, timeout_s: float) -> list[BackendEvent]:
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                self._advance_locked()
                if self._xids:
                    out, self._xids = self._xids, []
                    return out
                left = deadline - time.monotonic()
                if left <= 0:
                    return []
                self._cond.wait(min(left, 0.05))

    def get_limit_mw(self, uuid: str) -> int:
        g = self._gpus[uuid]
        self._block_while_hung(g)
        if g.lost:
            raise GpuLost(f"GPU {uuid} is lost")
        return g.limit_mw

    def set_limit_mw(self, uuid: str, mw: int) -> None:
        self._advance()
        g = self._gpus[uuid]
        self._block_while_hung(g)
        if g.lost:
            raise GpuLost(f"GPU {uuid} is lost")
        if g.refuse_set:
            raise NoPermission(f"setting the power limit of {uuid} was refused (insufficient permissions)")
        if not g.static.min_mw <= mw <= g.static.max_mw:  # as NVML: an invalid argument, nothing changes
            raise BackendError(f"{mw} mW is outside {uuid}'s constraints {g.static.min_mw}-{g.static.max_mw} mW")
        g.limit_mw = mw
        self.set_calls.append((uuid, mw))

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def _block_while_hung(self, g: _Gpu) -> None:
        """As a hung driver does: the call does not return (until a repair, or the backend closes)."""
        with self._cond:
            while True:
                self._advance_locked()
                if not g.hung or self._closed:
                    return
                self._cond.wait(0.05)

    def inject(self, kind: str, gpu: int, **fields: Any) -> None:
        """Apply a fault now, as if the scenario had scheduled it (demos and tests drive faults live)."""
        spec = FaultSpec(at=0, gpu=gpu, kind=kind, **fields)
        if spec.gpu >= len(self._order):
            raise ScenarioError(f"no GPU {gpu} on {self.node} (it has {len(self._order)})")
        with self._cond:
            self._pending.insert(0, spec)
            self._cond.notify_all()

    # ---- scenario playback ----------------------------------------------------------------------
    def _advance(self) -> None:
        with self._cond:
            self._advance_locked()

    def _advance_locked(self) -> None:
        now = self.clock() - self._t0
        while self._pending and self._pending[0].at <= now:
            f = self._pending.pop(0)
            g = self._gpus[self._order[f.gpu]]
            u = g.static.uuid
            # when it took effect (benches time from it)
            log.info("fake fault", node=self.node, kind=f.kind, gpu=u, at=f.at)
            if f.kind == "xid":
                assert f.xid is not None
                self._xids.append(XidEvent(u, f.xid, f"scenario fault at {f.at}s"))
                if f.xid == 79:
                    g.lost = True
            elif f.kind == "lost":
                g.lost = True
            elif f.kind == "ecc_uncorrectable":
                g.dbe += 1
                self._xids.append(XidEvent(u, 48, "double-bit ECC"))
            elif f.kind == "ecc_correctable":
                g.sbe += f.count
            elif f.kind == "nvlink_down":
                g.nvlink_down = f.links
            elif f.kind == "thermal_throttle":
                g.throttled = True
            elif f.kind == "slow":
                g.slow = f.factor
            elif f.kind == "power_set_refused":
                g.refuse_set = True
            elif f.kind == "hang":
                g.hung = True
            elif f.kind == "repair":
                g.lost, g.dbe, g.sbe, g.nvlink_down, g.throttled, g.slow = False, 0, 0, 0, False, 1.0
                g.hung = False
                self._xids.append(GpuRepaired(u, f"scenario repair at {f.at}s"))
            self._cond.notify_all()
