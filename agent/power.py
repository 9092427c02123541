"""Power caps: desired (from the manager) -> clamped -> applied -> read back; restore on release.

The limit found before the agent first changed a GPU is remembered and restored when the manager
releases the cap and on clean shutdown. Limits revert on a driver reload (without persistence
mode), so `reconcile()` re-applies desired caps periodically and reports drift.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from agent.backends.base import BackendError, GpuBackend, GpuLost, NoPermission, NotSupported


@dataclass
class CapState:
    desired_mw: int | None = None
    original_mw: int | None = None  # limit before the agent touched it
    enforced_mw: int | None = None
    error: str | None = None


@dataclass
class PowerController:
    backend: GpuBackend
    caps: dict[str, CapState] = field(default_factory=dict)
    drift_events: int = 0

    def _limits(self, uuid: str) -> tuple[int, int]:
        for g in self.backend.gpus():
            if g.uuid == uuid:
                return g.min_mw, g.max_mw
        raise BackendError(f"unknown GPU {uuid}")

    def set(self, uuid: str, mw: int) -> CapState:
        """Apply a desired cap (clamped to the GPU's constraints) and read back the enforced one."""
        st = self.caps.setdefault(uuid, CapState())
        lo, hi = self._limits(uuid)
        st.desired_mw = max(lo, min(hi, mw))
        try:
            if st.original_mw is None:
                st.original_mw = self.backend.get_limit_mw(uuid)
            self.backend.set_limit_mw(uuid, st.desired_mw)
            st.enforced_mw = self.backend.get_limit_mw(uuid)
            st.error = None
        except NoPermission as e:
            st.error = f"no permission to set the power limit: {e} (run the agent as root)"
        except NotSupported as e:
            st.error = f"power limits not supported: {e}"
        except GpuLost as e:
            st.error = f"GPU lost: {e}"
        return st

    def release(self, uuid: str) -> CapState:
        """Restore the limit found before the agent changed it."""
        st = self.caps.get(uuid)
        if st is None:
            return CapState()
        st.desired_mw = None
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
        """Re-apply every desired cap whose enforced limit drifted; returns the GPUs fixed."""
        fixed = []
        for uuid, st in list(self.caps.items()):
            if st.desired_mw is None:
                continue
            try:
                enforced = self.backend.get_limit_mw(uuid)
            except BackendError:
                continue
            if enforced != st.desired_mw:
                self.drift_events += 1
                self.set(uuid, st.desired_mw)
                fixed.append(uuid)
            else:
                st.enforced_mw = enforced
        return fixed

    def restore_all(self) -> None:
        for uuid in list(self.caps):
            self.release(uuid)
