"""Power caps: desired (from the manager) -> clamped -> applied -> read back; restore on release.

The agent never asks the driver for a limit outside the GPU's own constraints: a desired cap is
clamped to [min, max] first (the clamp is reported with the result), and when the constraints are
unknown (NVML answered NotSupported) nothing is set at all. After every set the enforced limit is
read back; if the driver enforces something else (another limit in force), that is reported as an
error rather than assumed away.

The manager sends a cap for every GPU when the fleet runs under a base cap (healthy GPUs at the
base, boosted GPUs above it) and only for boosted GPUs otherwise; the agent treats both the same.
The limit found before the agent first changed a GPU is remembered and restored when the manager
releases the cap and on clean shutdown. Limits revert on a driver reload (without persistence
mode), so `reconcile()` re-applies desired caps periodically and counts the drift.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ntp_agent.backends.base import BackendError, GpuBackend, GpuLost, GpuStatic, NoPermission, NotSupported
from ntp_manager.contract.power import base_cap_w


def base_target_mw(g: GpuStatic, base_cap: float | None) -> int | None:
    """The limit a GPU goes back to when no job boosts it (`ntp-agent power-reset`): the fleet
    base cap `base_cap` x its maximum, within [minimum, default] (contract/power.py
    `base_cap_w`, as the manager computes it); without a base cap, its default limit. None when
    its constraints are unknown (nothing is set then)."""
    if g.min_mw <= 0 or g.max_mw < g.min_mw or g.default_mw <= 0:
        return None
    if base_cap is None:
        return g.default_mw
    return int(base_cap_w(g.min_mw, g.default_mw, g.max_mw, base_cap))


@dataclass
class CapState:
    desired_mw: int | None = None  # what the agent set: the manager's request, clamped
    original_mw: int | None = None  # limit before the agent touched it
    enforced_mw: int | None = None  # read back after setting
    requested_mw: int | None = None  # what the manager asked for
    note: str | None = None  # e.g. the clamp applied
    error: str | None = None


@dataclass
class PowerController:
    backend: GpuBackend
    caps: dict[str, CapState] = field(default_factory=dict)
    drift_events: int = 0
    clamped_events: int = 0

    def _limits(self, uuid: str) -> tuple[int, int]:
        for g in self.backend.gpus():
            if g.uuid == uuid:
                return g.min_mw, g.max_mw
        raise BackendError(f"unknown GPU {uuid}")

    def set(self, uuid: str, mw: int) -> CapState:
        """Apply a desired cap, clamped to the GPU's constraints, and read back the enforced one.

        Never raises for a GPU-side problem: the returned state's `error` says what went wrong."""
        try:
            lo, hi = self._limits(uuid)
        except BackendError as e:
            return CapState(requested_mw=mw, error=str(e))
        st = self.caps.setdefault(uuid, CapState())
        st.requested_mw = mw
        if lo <= 0 or hi < lo:
            st.desired_mw, st.note = None, None
            st.error = f"power limit constraints of {uuid} are unknown ({lo}-{hi} mW): not setting any limit"
            return st
        want = max(lo, min(hi, int(mw)))
        st.note = None
        if want != mw:
            self.clamped_events += 1
            side = "maximum" if mw > hi else "minimum"
            st.note = f"requested {mw} mW clamped to the GPU's {side} {want} mW"
        st.desired_mw = want
        try:
            if st.original_mw is None:
                st.original_mw = self.backend.get_limit_mw(uuid)
            self.backend.set_limit_mw(uuid, want)
            st.enforced_mw = self.backend.get_limit_mw(uuid)
            st.error = None
            if st.enforced_mw != want:
                st.error = (f"set {want} mW but the driver enforces {st.enforced_mw} mW "
                            f"(another power limit is in force)")
        except NoPermission as e:
            st.error = f"no permission to set the power limit: {e} (run the agent as root)"
        except NotSupported as e:
            st.error = f"power limits not supported: {e}"
        except GpuLost as e:
            st.error = f"GPU lost: {e}"
        except BackendError as e:
            st.error = f"setting the power limit failed: {e}"
        return st

    def release(self, uuid: str) -> CapState:
        """Restore the limit found before the agent changed it."""
        st = self.caps.get(uuid)
        if st is None:
            return CapState()
        st.desired_mw = st.requested_mw = None
        st.note = None
        if st.original_mw is not None:
            try:
                self.backend.set_limit_mw(uuid, st.original_mw)
                st.enforced_mw = self.backend.get_limit_mw(uuid)
                st.error = None
            except BackendError as e:
                st.error = f"could not restore the original limit: {e}"
                return st
        del self.caps[uuid]
        return st

    def reconcile(self) -> list[str]:
        """Re-apply every desired cap whose enforced limit drifted from what was read back after it
        was set (a driver reload); returns the GPUs fixed. A limit the driver never took (reported
        when set) is not retried every period."""
        fixed = []
        for uuid, st in list(self.caps.items()):
            if st.desired_mw is None or st.requested_mw is None:
                continue
            try:
                enforced = self.backend.get_limit_mw(uuid)
            except BackendError:
                continue
            if enforced != st.enforced_mw:
                self.drift_events += 1
                self.set(uuid, st.requested_mw)
                fixed.append(uuid)
        return fixed

    def restore_all(self) -> None:
        for uuid in list(self.caps):
            self.release(uuid)
