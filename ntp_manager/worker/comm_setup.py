"""The worker's communication set-up decisions, before any byte moves (re-exported by
worker/comm.py, which is where the runtime reaches them).

`choose_backend` (pure) picks the backend for a device and a host's ranks and refuses, with the
reason, a combination that cannot work; `check_nccl_env` refuses NCCL error-handling settings the
runtime cannot live with. `shrink_plan` (pure) decides whether a new layout's communicator can be
shrunk from the old one (NCCL's ncclCommShrink, `dist.shrink_group`) instead of being created from
nothing; `publish_held` and `agree` are the rendezvous through which every rank reaches the same
decision. `detect_features` feature-tests the installed torch (attributes and signatures, never
version strings).
"""

from __future__ import annotations

import inspect
import itertools
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist

# NCCL error handling the runtime needs: a failed or timed-out collective must raise in the
# training thread (blocking wait) and abort the communicator without killing the process
# (async error handling 2 = "clean up only"), so the survivors can regroup.
NCCL_ENV = {"TORCH_NCCL_BLOCKING_WAIT": "1", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}
_NCCL_ENV_REFUSED = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": {"1": "tears the process down on a peer's failure",
                                                         "3": "tears the process down on a peer's failure"},
                     "TORCH_NCCL_BLOCKING_WAIT": {"0": "a hung peer's collective would never raise"}}

class BackendError(ValueError):
    """A device / backend / host combination that cannot work, refused at set-up."""


# ---- what the installed torch can do ----------------------------------------------------------
@dataclass(frozen=True)
class CommFeatures:
    gloo: bool = True
    nccl: bool = False
    cuda_devices: int = 0  # devices this process sees (0 without CUDA)
    eager_init: bool = False  # init_process_group(device_id=...): the communicator forms at once,
    #                           and new_group splits it (ncclCommSplit) instead of a fresh init
    split_group: bool = False  # dist.split_group
    shrink_group: bool = False  # dist.shrink_group (whether a group's backend can: `can_shrink`)
    local_sync: bool = False  # new_group(use_local_synchronization=...)
    abort: bool = False  # ProcessGroup.abort (NCCL: ncclCommAbort on every communicator)


def detect_features() -> CommFeatures:
    """Feature tests of the installed torch: attributes and signatures, not version strings."""
    cuda = torch.cuda.is_available()

    def accepts(fn: Any, name: str) -> bool:
        try:
            return name in inspect.signature(fn).parameters
        except (TypeError, ValueError):
            return False

    return CommFeatures(
        gloo=dist.is_available() and dist.is_gloo_available(),
        nccl=dist.is_available() and dist.is_nccl_available(),
        cuda_devices=torch.cuda.device_count() if cuda else 0,
        eager_init=accepts(dist.init_process_group, "device_id"),
        split_group=hasattr(dist, "split_group"),
        shrink_group=hasattr(dist, "shrink_group"),
        local_sync=accepts(dist.new_group, "use_local_synchronization"),
        abort=hasattr(dist.ProcessGroup, "abort"),
    )


# ---- which backend ----------------------------------------------------------------------------
@dataclass(frozen=True)
class BackendChoice:
    backend: str  # "gloo" | "nccl"
    device: str  # "cpu" | "cuda"
    staged: bool  # gloo carrying device tensors through host buffers
    reason: str


def choose_backend(device: str, requested: str, local_ranks: int, gpus: int, features: CommFeatures) -> BackendChoice:
    """The backend for a rank whose tensors live on `device` ("cpu" or "cuda"), when
    `local_ranks` ranks of the job run on this host and use `gpus` distinct GPUs there.
    `requested`: "auto" (NCCL on CUDA when every rank has a GPU of its own, else gloo staged
    through host memory; gloo on CPU), or "gloo" / "nccl" explicitly. Raises BackendError naming
    what cannot work and why."""
    if device not in ("cpu", "cuda"):
        raise BackendError(f"device must be 'cpu' or 'cuda', not {device!r}")
    if requested not in ("auto", "gloo", "nccl"):
        raise BackendError(f"backend must be 'auto', 'gloo' or 'nccl', not {requested!r}")
    if local_ranks < 1:
        raise BackendError(f"a host runs at least one rank, not {local_ranks}")
    if gpus < 0:
        raise BackendError(f"GPU count cannot be negative ({gpus})")
    if device == "cpu":
        if requested == "nccl":
            raise BackendError("backend 'nccl' cannot carry CPU tensors (device='cpu'): use gloo or device='cuda'")
        if not features.gloo:
            raise BackendError("device='cpu' needs gloo, and this torch was built without it")
        return BackendChoice("gloo", "cpu", False, "CPU tensors: gloo")
    if features.cuda_devices < 1 or gpus < 1:
        raise BackendError("device='cuda' but torch sees no CUDA device (a CPU-only build, no GPU, or "
                           "CUDA_VISIBLE_DEVICES empty): use device='cpu'")
    own = local_ranks <= gpus
    if requested == "nccl":
        if not features.nccl:
            raise BackendError("backend 'nccl' requested, but this torch was built without NCCL")
        if not own:
            raise BackendError(f"backend 'nccl' needs a GPU per rank, but {local_ranks} ranks share {gpus} GPU(s) "
                               "on this host (NCCL refuses two ranks on one GPU): use backend 'gloo' (staged "
                               "through host memory) or at most one rank per GPU")
        return BackendChoice("nccl", "cuda", False, f"{local_ranks} rank(s) on {gpus} GPU(s): NCCL (requested)")
    if requested == "auto" and own and features.nccl:
        return BackendChoice("nccl", "cuda", False, f"{local_ranks} rank(s) on {gpus} GPU(s), one each: NCCL")
    if not features.gloo:
        raise BackendError(f"{local_ranks} ranks share {gpus} GPU(s): NCCL cannot run them and this torch has no gloo")
    why = ("requested" if requested == "gloo" else
           "this torch has no NCCL" if not features.nccl else f"{local_ranks} ranks share {gpus} GPU(s)")
    return BackendChoice("gloo", "cuda", True, f"gloo staged through host memory ({why})")


def device_index(local_rank: int, visible: int) -> int:
    """The CUDA device a rank uses among the `visible` ones: its own when there is one per rank
    (ntp-run pins each rank to one GPU, so `visible` is then 1), else shared round-robin."""
    if visible < 1:
        raise BackendError("no CUDA device visible")
    return local_rank % visible


def check_nccl_env(environ: Mapping[str, str]) -> None:
    """Refuse NCCL error-handling settings under which a peer's failure kills the survivors or
    hangs them (the runtime must see a failed collective raise)."""
    for key, bad in _NCCL_ENV_REFUSED.items():
        value = environ.get(key)
        if value is not None and value.strip() in bad:
            raise BackendError(f"{key}={value}: {bad[value.strip()]}; the runtime needs "
                               f"{key}={NCCL_ENV[key]} (unset it to get that)")


# ---- communicators across layouts -------------------------------------------------------------
@dataclass(frozen=True)
class CommPlan:
    kind: Literal["fresh", "shrink"]
    exclude: tuple[int, ...]  # shrink: ranks of the old communicator to leave out
    old_version: str  # shrink: the version ("epoch.version") whose communicator is shrunk; "" for fresh
    reason: str


def shrink_plan(old_world: Mapping[str, int], arrivals: Mapping[int, tuple[str, int] | None],
                can_shrink: bool) -> CommPlan:
    """Whether the new version's communicator can be shrunk from an old one instead of being
    created from nothing. `old_world`: old version -> its world size, for the versions whose
    communicator the arriving ranks still hold; `arrivals`: every new rank -> (old version, old
    rank) whose communicator it holds, or None (a fresh process, or one that dropped its
    communicator). Every rank computes this from the same store entries, so all decide alike.

    Shrinking keeps the survivors in their old order (new rank = position among the old ranks
    left), so it applies only when every new rank holds the same old communicator, the new ranks
    follow the old ranks' order, and at least one old rank is gone: a pure removal (a failed or
    drained GPU). Joiners, reorderings and mixed versions get a fresh communicator."""
    if not can_shrink:
        return CommPlan("fresh", (), "", "this torch/NCCL cannot shrink a communicator")
    if not arrivals:
        return CommPlan("fresh", (), "", "no ranks")
    held = [arrivals[r] for r in sorted(arrivals)]
    if any(h is None for h in held):
        return CommPlan("fresh", (), "", "a rank joins without the old communicator")
    versions = {h[0] for h in held if h is not None}
    if len(versions) != 1:
        return CommPlan("fresh", (), "", f"ranks hold communicators of different versions {sorted(versions)}")
    (version,) = versions
    if version not in old_world:
        return CommPlan("fresh", (), "", f"the size of version {version}'s communicator is unknown")
    olds = [h[1] for h in held if h is not None]
    if any(b <= a for a, b in itertools.pairwise(olds)):
        return CommPlan("fresh", (), "", "the new ranks do not keep the old ranks' order")
    if olds[0] < 0 or olds[-1] >= old_world[version]:
        return CommPlan("fresh", (), "", "an old rank is outside the old communicator")
    exclude = tuple(sorted(set(range(old_world[version])) - set(olds)))
    if not exclude:
        return CommPlan("fresh", (), "", "nobody left: a new version gets new communicators")
    return CommPlan("shrink", exclude, version, f"version {version} without old rank(s) {list(exclude)}")


def publish_held(store: Any, prefix: str, rank: int, held: tuple[str, int, int] | None, backend: str) -> None:
    """Before counting itself in at a version's `prefix`: which old communicator this rank (new
    rank `rank`) still holds -- (version key, old rank, old world) or None -- and its backend.
    Keyed by rank, so a rank that comes to the same prefix twice (a restarted process that read
    the same version again) overwrites its record instead of being counted twice."""
    store.set(f"{prefix}/held/{rank}", json.dumps(list(held) if held is not None else None))
    store.set(f"{prefix}/backend/{rank}", backend)


def arrival_keys(prefix: str, world: int) -> list[str]:
    """The keys whose presence says each of `world` ranks counted itself in at `prefix`."""
    return [f"{prefix}/in/{r}" for r in range(world)]


OUTCOMES = ("go", "superseded", "timed out")


def settle(store: Any, prefix: str, claim: str | None) -> str | None:
    """The outcome of the rendezvous at a version's `prefix`, one for every rank that comes there:
    "go" (every rank counted itself in: build the groups), "superseded" (a newer layout came first:
    every rank moves on to it) or "timed out". The first rank to `claim` one sets it, by
    compare-and-set on the store, and every rank reads the same answer, so no rank builds a group
    the others have left (an arrival key stays after its rank moved on: counting keys alone let a
    late rank find everyone "in" and wait out its timeout alone). `claim` None only reads: None
    while nobody has decided."""
    key = f"{prefix}/outcome"
    if claim is None:
        return _text(store.get(key)) if store.check([key]) else None
    if claim not in OUTCOMES:
        raise ValueError(f"unknown rendezvous outcome {claim!r}")
    # a key that does not exist yet is set when the expected value is empty
    return _text(store.compare_set(key, "", claim))


def _text(v: Any) -> str:
    return v if isinstance(v, str) else bytes(v).decode()


def agree(store: Any, prefix: str, world: int, backend: str, shrinkable: bool) -> CommPlan:
    """After all `world` ranks counted themselves in at `prefix` (each after `publish_held`):
    check every rank chose this backend (BackendError otherwise: mixed hosts would hang in the
    first collective) and, when `shrinkable`, read every rank's record and decide with
    `shrink_plan`. Every rank reads the same entries, so every rank decides alike."""
    keys = [f"{prefix}/backend/{r}" for r in range(world)]
    raw = store.multi_get(keys) if hasattr(store, "multi_get") else [store.get(k) for k in keys]
    chosen = [_text(v) for v in raw]
    same = sum(c == backend for c in chosen)
    if same != world:
        raise BackendError(f"only {same} of {world} ranks chose backend {backend!r}: the hosts of this job differ "
                           "(GPUs per rank, CUDA or NCCL); set RuntimeConfig.backend explicitly on every rank")
    if not shrinkable:
        return CommPlan("fresh", (), "", "no communicator to shrink on this backend")
    keys = [f"{prefix}/held/{r}" for r in range(world)]
    raw = store.multi_get(keys) if hasattr(store, "multi_get") else [store.get(k) for k in keys]
    arrivals: dict[int, tuple[str, int] | None] = {}
    old_world: dict[str, int] = {}
    for r, v in enumerate(raw):
        h = json.loads(_text(v))
        arrivals[r] = None if h is None else (str(h[0]), int(h[1]))
        if h is not None:
            old_world[str(h[0])] = int(h[2])
    return shrink_plan(old_world, arrivals, can_shrink=True)


def can_shrink(group: Any = None) -> bool:
    """Whether this group's backend can shrink (NCCL >= 2.27 through torch's shrink_group)."""
    if not hasattr(dist, "shrink_group"):
        return False
    pg: Any = group if group is not None else dist.group.WORLD
    try:
        dev = getattr(pg, "bound_device_id", None) or torch.device("cuda")
        return bool(pg._get_backend(dev).supports_shrinking)
    except Exception:  # no such backend on this device, or no attribute: cannot
        return False
