import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GpuState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    GPU_STATE_UNSPECIFIED: _ClassVar[GpuState]
    GPU_STATE_HEALTHY: _ClassVar[GpuState]
    GPU_STATE_SUSPECT: _ClassVar[GpuState]
    GPU_STATE_DEGRADED: _ClassVar[GpuState]
    GPU_STATE_FAILED: _ClassVar[GpuState]
    GPU_STATE_CORDONED: _ClassVar[GpuState]
    GPU_STATE_DRAINING: _ClassVar[GpuState]
    GPU_STATE_MAINTENANCE: _ClassVar[GpuState]
GPU_STATE_UNSPECIFIED: GpuState
GPU_STATE_HEALTHY: GpuState
GPU_STATE_SUSPECT: GpuState
GPU_STATE_DEGRADED: GpuState
GPU_STATE_FAILED: GpuState
GPU_STATE_CORDONED: GpuState
GPU_STATE_DRAINING: GpuState
GPU_STATE_MAINTENANCE: GpuState

class PowerConstraints(_message.Message):
    __slots__ = ("min_mw", "max_mw", "default_mw")
    MIN_MW_FIELD_NUMBER: _ClassVar[int]
    MAX_MW_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_MW_FIELD_NUMBER: _ClassVar[int]
    min_mw: int
    max_mw: int
    default_mw: int
    def __init__(self, min_mw: _Optional[int] = ..., max_mw: _Optional[int] = ..., default_mw: _Optional[int] = ...) -> None: ...

class GpuInfo(_message.Message):
    __slots__ = ("uuid", "index", "model", "memory_bytes", "power", "pci_bus_id")
    UUID_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    POWER_FIELD_NUMBER: _ClassVar[int]
    PCI_BUS_ID_FIELD_NUMBER: _ClassVar[int]
    uuid: str
    index: int
    model: str
    memory_bytes: int
    power: PowerConstraints
    pci_bus_id: str
    def __init__(self, uuid: _Optional[str] = ..., index: _Optional[int] = ..., model: _Optional[str] = ..., memory_bytes: _Optional[int] = ..., power: _Optional[_Union[PowerConstraints, _Mapping]] = ..., pci_bus_id: _Optional[str] = ...) -> None: ...

class LayoutStamp(_message.Message):
    __slots__ = ("leader_epoch", "version", "created_at")
    LEADER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    leader_epoch: int
    version: int
    created_at: _timestamp_pb2.Timestamp
    def __init__(self, leader_epoch: _Optional[int] = ..., version: _Optional[int] = ..., created_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class TpGroup(_message.Message):
    __slots__ = ("group_id", "domain", "stage", "tp", "gpu_uuids", "global_ranks", "power_ratio")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    DOMAIN_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    TP_FIELD_NUMBER: _ClassVar[int]
    GPU_UUIDS_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_RANKS_FIELD_NUMBER: _ClassVar[int]
    POWER_RATIO_FIELD_NUMBER: _ClassVar[int]
    group_id: str
    domain: str
    stage: int
    tp: int
    gpu_uuids: _containers.RepeatedScalarFieldContainer[str]
    global_ranks: _containers.RepeatedScalarFieldContainer[int]
    power_ratio: float
    def __init__(self, group_id: _Optional[str] = ..., domain: _Optional[str] = ..., stage: _Optional[int] = ..., tp: _Optional[int] = ..., gpu_uuids: _Optional[_Iterable[str]] = ..., global_ranks: _Optional[_Iterable[int]] = ..., power_ratio: _Optional[float] = ...) -> None: ...

class ReplicaSummary(_message.Message):
    __slots__ = ("replica_id", "tp", "local_batch", "stage_tps")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    TP_FIELD_NUMBER: _ClassVar[int]
    LOCAL_BATCH_FIELD_NUMBER: _ClassVar[int]
    STAGE_TPS_FIELD_NUMBER: _ClassVar[int]
    replica_id: int
    tp: int
    local_batch: int
    stage_tps: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, replica_id: _Optional[int] = ..., tp: _Optional[int] = ..., local_batch: _Optional[int] = ..., stage_tps: _Optional[_Iterable[int]] = ...) -> None: ...

class ReplicaRun(_message.Message):
    __slots__ = ("first_id", "count", "tp", "local_batch", "stage_tps")
    FIRST_ID_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    TP_FIELD_NUMBER: _ClassVar[int]
    LOCAL_BATCH_FIELD_NUMBER: _ClassVar[int]
    STAGE_TPS_FIELD_NUMBER: _ClassVar[int]
    first_id: int
    count: int
    tp: int
    local_batch: int
    stage_tps: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, first_id: _Optional[int] = ..., count: _Optional[int] = ..., tp: _Optional[int] = ..., local_batch: _Optional[int] = ..., stage_tps: _Optional[_Iterable[int]] = ...) -> None: ...

class ReplicaDetail(_message.Message):
    __slots__ = ("replica_id", "groups")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    replica_id: int
    groups: _containers.RepeatedCompositeFieldContainer[TpGroup]
    def __init__(self, replica_id: _Optional[int] = ..., groups: _Optional[_Iterable[_Union[TpGroup, _Mapping]]] = ...) -> None: ...

class Layout(_message.Message):
    __slots__ = ("job", "stamp", "healthy_tp", "target_batch", "global_batch", "replicas", "own", "peers", "world_size", "rendezvous", "reason", "restore_step", "replica_runs")
    JOB_FIELD_NUMBER: _ClassVar[int]
    STAMP_FIELD_NUMBER: _ClassVar[int]
    HEALTHY_TP_FIELD_NUMBER: _ClassVar[int]
    TARGET_BATCH_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_BATCH_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    OWN_FIELD_NUMBER: _ClassVar[int]
    PEERS_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    RENDEZVOUS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    RESTORE_STEP_FIELD_NUMBER: _ClassVar[int]
    REPLICA_RUNS_FIELD_NUMBER: _ClassVar[int]
    job: str
    stamp: LayoutStamp
    healthy_tp: int
    target_batch: int
    global_batch: int
    replicas: _containers.RepeatedCompositeFieldContainer[ReplicaSummary]
    own: ReplicaDetail
    peers: _containers.RepeatedCompositeFieldContainer[ReplicaDetail]
    world_size: int
    rendezvous: str
    reason: str
    restore_step: int
    replica_runs: _containers.RepeatedCompositeFieldContainer[ReplicaRun]
    def __init__(self, job: _Optional[str] = ..., stamp: _Optional[_Union[LayoutStamp, _Mapping]] = ..., healthy_tp: _Optional[int] = ..., target_batch: _Optional[int] = ..., global_batch: _Optional[int] = ..., replicas: _Optional[_Iterable[_Union[ReplicaSummary, _Mapping]]] = ..., own: _Optional[_Union[ReplicaDetail, _Mapping]] = ..., peers: _Optional[_Iterable[_Union[ReplicaDetail, _Mapping]]] = ..., world_size: _Optional[int] = ..., rendezvous: _Optional[str] = ..., reason: _Optional[str] = ..., restore_step: _Optional[int] = ..., replica_runs: _Optional[_Iterable[_Union[ReplicaRun, _Mapping]]] = ...) -> None: ...
