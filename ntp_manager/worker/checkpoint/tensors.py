"""What a checkpoint holds of a model and optimizer, and how DCP stores and reads it: every
tensor of a rank as an entry (sharded or replicated), the DCP planners that write and read chunks
of units-first global tensors, the merge of the ranks' DCP metadata and the check that its chunks
tile every tensor, and making an optimizer's state entries match a checkpoint's."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from ntp_manager.worker.checkpoint.base import CheckpointError
from ntp_manager.worker.reshard import STATE_KEYS
from ntp_manager.worker.tp import ShardedModule


@dataclass(frozen=True)
class _Shard:
    family: str
    unit_size: int
    udim: int  # the dimension the units run along in the rank's tensor (0 or 1)
    units: tuple[int, ...]  # the shard's units, in the tensor's order
    n_units: int  # the family's unit count


@dataclass(frozen=True)
class _Entry:
    key: str  # the DCP name: model/<param>, optim/<param>/<state>, buffer/<name>
    tensor: torch.Tensor  # the live tensor
    shard: _Shard | None  # None: replicated (every rank of the stage holds all of it)

    def global_shape(self) -> tuple[int, ...]:
        """The shape stored: the unsharded tensor, units first."""
        t, sh = self.tensor, self.shard
        if sh is None:
            return tuple(t.shape)
        rest = tuple(t.shape[1:]) if sh.udim == 0 else (int(t.shape[0]),)
        return (sh.n_units * sh.unit_size, *rest)


def _shards(model: nn.Module, units: Mapping[str, int], families: Mapping[str, str]) -> dict[int, _Shard]:
    """id(parameter) -> how it is sharded, for every sharded parameter of `model`."""
    out: dict[int, _Shard] = {}
    same: dict[tuple[int, ...], tuple[int, ...]] = {}
    for path, mod in model.named_modules():
        if not isinstance(mod, ShardedModule):
            continue
        for _name, p, udim in mod.sharded_params():
            fam = families.get(path)
            if fam is None or fam not in units:
                raise ValueError(f"{path}: a sharded module with no unit family in the layout ({fam!r})")
            if p.dim() > 2 or udim not in (0, 1) or (udim == 1 and p.dim() != 2):
                raise ValueError(f"{path}.{_name}: checkpoints store 1-D and 2-D shards (units along dim 0 or 1), "
                                 f"not shape {tuple(p.shape)} with units along dim {udim}")
            us = tuple(mod.units)
            us = same.setdefault(us, us)  # one tuple per distinct unit list: `_pieces` caches by identity
            out.setdefault(id(p), _Shard(fam, mod.unit_size, udim, us, units[fam]))
    return out


def _part_key(model: nn.Module) -> str:
    """Which part of the model a rank holds, the same on every rank of a pipeline stage and across
    TP layouts: its first parameter's name (stages hold disjoint parameters under the whole model's
    names)."""
    return next((n for n, _ in model.named_parameters()), "")


def _scalar(v: Any) -> torch.Tensor:
    return v.detach() if isinstance(v, torch.Tensor) else torch.tensor(float(v))


def _entries(model: nn.Module, optimizer: torch.optim.Optimizer | None, units: Mapping[str, int],
             families: Mapping[str, str]) -> list[_Entry]:
    """Every tensor a checkpoint holds for this rank, in a fixed order. Raises ValueError for
    optimizer state it cannot place (anything but SGD momentum, Adam moments and step)."""
    shards = _shards(model, units, families)
    state = optimizer.state if optimizer is not None else {}
    out: list[_Entry] = []
    for fqn, p in model.named_parameters():
        sh = shards.get(id(p))
        out.append(_Entry(f"model/{fqn}", p.detach(), sh))
        st = state.get(p, {})
        for k in sorted(st):
            v = st[k]
            if k in STATE_KEYS and isinstance(v, torch.Tensor) and v.shape == p.shape:
                out.append(_Entry(f"optim/{fqn}/{k}", v, sh))
            elif k == "step":
                out.append(_Entry(f"optim/{fqn}/step", _scalar(v), None))
            else:
                raise ValueError(f"optimizer state {k!r} of {fqn} ({type(optimizer).__name__}): checkpoints store "
                                 f"{', '.join(STATE_KEYS)} and step")
    seen: set[int] = set()
    for path, mod in model.named_modules():
        for name, b in mod._buffers.items():
            if b is None or name in mod._non_persistent_buffers_set or id(b) in seen:
                continue
            seen.add(id(b))
            out.append(_Entry(f"buffer/{path + '.' if path else ''}{name}", b.detach(), None))
    return out


# ---- DCP planners: chunks of units-first global tensors ---------------------------------------
@dataclass(frozen=True)
class _Chunk:
    key: str  # the DCP tensor it belongs to
    offsets: tuple[int, ...]
    size: tuple[int, ...]  # the global tensor's


class _PieceSavePlanner(DefaultSavePlanner):
    """DCP's default save planner, with one change: a state-dict entry may be a chunk (given
    offsets) of a larger tensor named by `chunks[entry]`; everything else is a whole tensor."""

    def __init__(self, chunks: Mapping[str, _Chunk]) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._chunks = dict(chunks)
        self._by_index: dict[tuple[str, tuple[int, ...]], str] = {}

    def create_local_plan(self) -> SavePlan:
        items = []
        for name, t in self.state_dict.items():
            c = self._chunks.get(name, _Chunk(name, (0,) * t.dim(), tuple(t.shape)))
            self._by_index[(c.key, c.offsets)] = name
            items.append(WriteItem(
                index=MetadataIndex(c.key, c.offsets),
                type=WriteItemType.SHARD if name in self._chunks else WriteItemType.TENSOR,
                tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(torch.Size(c.offsets), t.shape),
                                            properties=TensorProperties.create_from_tensor(t),
                                            size=torch.Size(c.size)),
            ))
        self.plan = SavePlan(items)
        return self.plan

    def lookup_object(self, index: MetadataIndex) -> Any:
        return self.state_dict[self._by_index[(index.fqn, tuple(index.offset or ()))]]


class _PieceLoadPlanner(LoadPlanner):
    """Reads, for every tensor named in `targets`, the listed chunks (offsets, destination) of the
    stored global tensor, from whatever chunks were saved (DCP's resharding)."""

    def __init__(self, targets: Mapping[str, list[tuple[tuple[int, ...], torch.Tensor]]]) -> None:
        self.targets = targets
        self.metadata: Metadata | None = None

    def set_up_planner(self, state_dict: Any, metadata: Metadata | None = None, is_coordinator: bool = False) -> None:
        self.metadata = metadata

    def create_local_plan(self) -> LoadPlan:
        assert self.metadata is not None
        items: list[ReadItem] = []
        for key, chunks in self.targets.items():
            md = self.metadata.state_dict_metadata[key]
            assert isinstance(md, TensorStorageMetadata)
            local = [ChunkStorageMetadata(torch.Size(off), dst.shape) for off, dst in chunks]
            items += create_read_items_for_chunk_list(key, md, local)
        return LoadPlan(items)

    def create_global_plan(self, global_plan: list[LoadPlan]) -> list[LoadPlan]:
        return global_plan

    def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:
        return central_plan

    def load_bytes(self, read_item: ReadItem, value: Any) -> None:
        raise CheckpointError(f"unexpected non-tensor entry {read_item.dest_index.fqn} in the checkpoint")

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        idx = read_item.dest_index
        assert idx.index is not None
        dst = self.targets[idx.fqn][idx.index][1]
        for d, (o, n) in enumerate(zip(read_item.dest_offsets, read_item.lengths, strict=True)):
            dst = dst.narrow(d, o, n)
        return dst

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        pass


def _match_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, saved: Mapping[str, Any]) -> None:
    """Give every parameter exactly the state entries the checkpoint has for it (zeros where new,
    shaped and placed as the optimizer's own first step would make them); the values come next."""
    for fqn, p in model.named_parameters():
        st = optimizer.state[p]
        want = [k for k in (*STATE_KEYS, "step") if f"optim/{fqn}/{k}" in saved]
        for k in list(st):
            if k not in want:
                del st[k]
        for k in want:
            if k == "step":
                if not isinstance(st.get(k), torch.Tensor):
                    grp = next((g for g in optimizer.param_groups if any(q is p for q in g["params"])), {})
                    on_dev = grp.get("capturable") or grp.get("fused")
                    st[k] = torch.zeros((), dtype=torch.float32, device=p.device if on_dev else "cpu")
            elif not isinstance(st.get(k), torch.Tensor) or st[k].shape != p.shape:
                st[k] = torch.zeros_like(p, memory_format=torch.preserve_format)
        if not st:
            del optimizer.state[p]


def _merge_metadata(parts: Mapping[int, Metadata]) -> Metadata:
    """One DCP metadata for the whole checkpoint from every rank's (`r<rank>/.metadata`): the
    chunks of each tensor side by side, every storage entry's path prefixed with its rank's
    directory. Raises CheckpointError when two ranks disagree on a tensor's size or type."""
    sd: dict[str, Any] = {}
    storage: dict[MetadataIndex, Any] = {}
    version = None
    for r, md in sorted(parts.items()):
        version = version or md.version
        for key, tmd in md.state_dict_metadata.items():
            if not isinstance(tmd, TensorStorageMetadata):
                raise CheckpointError(f"rank {r} saved a non-tensor entry {key}")
            cur = sd.get(key)
            if cur is None:
                sd[key] = TensorStorageMetadata(tmd.properties, tmd.size, list(tmd.chunks))
            elif cur.size != tmd.size or cur.properties.dtype != tmd.properties.dtype:
                raise CheckpointError(f"{key}: rank {r} saved {tuple(tmd.size)} {tmd.properties.dtype}, "
                                      f"another rank {tuple(cur.size)} {cur.properties.dtype}")
            else:
                cur.chunks.extend(tmd.chunks)
        for idx, info in md.storage_data.items():
            where = f"r{r}/{info.relative_path}"
            storage[MetadataIndex(idx.fqn, idx.offset)] = dataclasses.replace(info, relative_path=where)
    return Metadata(state_dict_metadata=sd, storage_data=storage, version=version)


def _check_tiling(md: Metadata) -> None:
    """Every tensor's chunks cover it exactly once (they are cut along dim 0 only). Raises
    CheckpointError naming the tensor otherwise: a unit written twice or by nobody."""
    for key, tmd in md.state_dict_metadata.items():
        assert isinstance(tmd, TensorStorageMetadata)
        size = tuple(tmd.size)
        if not size:
            if len(tmd.chunks) != 1:
                raise CheckpointError(f"{key}: a scalar saved {len(tmd.chunks)} times")
            continue
        at = 0
        for c in sorted(tmd.chunks, key=lambda c: c.offsets[0]):
            if (c.offsets[0] != at or tuple(c.offsets[1:]) != (0,) * (len(size) - 1)
                    or tuple(c.sizes[1:]) != size[1:]):
                raise CheckpointError(f"{key}: chunks do not tile the tensor {size} (at row {at}: a chunk at "
                                      f"{tuple(c.offsets)} of {tuple(c.sizes)})")
            at += c.sizes[0]
        if at != size[0]:
            raise CheckpointError(f"{key}: chunks cover rows [0, {at}) of {size[0]}")
