import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from ntp_manager.contract.proto.ntp.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class AckStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ACK_STATUS_UNSPECIFIED: _ClassVar[AckStatus]
    ACK_STATUS_APPLIED: _ClassVar[AckStatus]
    ACK_STATUS_FAILED: _ClassVar[AckStatus]
ACK_STATUS_UNSPECIFIED: AckStatus
ACK_STATUS_APPLIED: AckStatus
ACK_STATUS_FAILED: AckStatus

class WatchLayoutRequest(_message.Message):
    __slots__ = ("job", "worker_id", "gpu_uuid", "known")
    JOB_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    GPU_UUID_FIELD_NUMBER: _ClassVar[int]
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    job: str
    worker_id: str
    gpu_uuid: str
    known: _common_pb2.LayoutStamp
    def __init__(self, job: _Optional[str] = ..., worker_id: _Optional[str] = ..., gpu_uuid: _Optional[str] = ..., known: _Optional[_Union[_common_pb2.LayoutStamp, _Mapping]] = ...) -> None: ...

class AckLayoutRequest(_message.Message):
    __slots__ = ("job", "worker_id", "stamp", "status", "detail", "restored")
    JOB_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    STAMP_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    RESTORED_FIELD_NUMBER: _ClassVar[int]
    job: str
    worker_id: str
    stamp: _common_pb2.LayoutStamp
    status: AckStatus
    detail: str
    restored: CheckpointRestore
    def __init__(self, job: _Optional[str] = ..., worker_id: _Optional[str] = ..., stamp: _Optional[_Union[_common_pb2.LayoutStamp, _Mapping]] = ..., status: _Optional[_Union[AckStatus, str]] = ..., detail: _Optional[str] = ..., restored: _Optional[_Union[CheckpointRestore, _Mapping]] = ...) -> None: ...

class CheckpointRestore(_message.Message):
    __slots__ = ("step", "checkpoint", "reason", "skipped")
    STEP_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_FIELD_NUMBER: _ClassVar[int]
    step: int
    checkpoint: str
    reason: str
    skipped: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, step: _Optional[int] = ..., checkpoint: _Optional[str] = ..., reason: _Optional[str] = ..., skipped: _Optional[_Iterable[str]] = ...) -> None: ...

class AckLayoutResponse(_message.Message):
    __slots__ = ("current",)
    CURRENT_FIELD_NUMBER: _ClassVar[int]
    current: _common_pb2.LayoutStamp
    def __init__(self, current: _Optional[_Union[_common_pb2.LayoutStamp, _Mapping]] = ...) -> None: ...

class RankStep(_message.Message):
    __slots__ = ("rank", "gpu_uuid", "step_time_s", "tokens", "sequence_lengths", "compute_s", "comm_wait_s", "sequence_sq_sum", "stage", "tp_group_id", "tp", "replica_id")
    RANK_FIELD_NUMBER: _ClassVar[int]
    GPU_UUID_FIELD_NUMBER: _ClassVar[int]
    STEP_TIME_S_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_LENGTHS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    COMM_WAIT_S_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_SQ_SUM_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    TP_GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    TP_FIELD_NUMBER: _ClassVar[int]
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    rank: int
    gpu_uuid: str
    step_time_s: float
    tokens: int
    sequence_lengths: _containers.RepeatedScalarFieldContainer[int]
    compute_s: float
    comm_wait_s: float
    sequence_sq_sum: int
    stage: int
    tp_group_id: str
    tp: int
    replica_id: int
    def __init__(self, rank: _Optional[int] = ..., gpu_uuid: _Optional[str] = ..., step_time_s: _Optional[float] = ..., tokens: _Optional[int] = ..., sequence_lengths: _Optional[_Iterable[int]] = ..., compute_s: _Optional[float] = ..., comm_wait_s: _Optional[float] = ..., sequence_sq_sum: _Optional[int] = ..., stage: _Optional[int] = ..., tp_group_id: _Optional[str] = ..., tp: _Optional[int] = ..., replica_id: _Optional[int] = ...) -> None: ...

class StepReport(_message.Message):
    __slots__ = ("job", "worker_id", "stamp", "step", "at", "ranks")
    JOB_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    STAMP_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    AT_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    job: str
    worker_id: str
    stamp: _common_pb2.LayoutStamp
    step: int
    at: _timestamp_pb2.Timestamp
    ranks: _containers.RepeatedCompositeFieldContainer[RankStep]
    def __init__(self, job: _Optional[str] = ..., worker_id: _Optional[str] = ..., stamp: _Optional[_Union[_common_pb2.LayoutStamp, _Mapping]] = ..., step: _Optional[int] = ..., at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., ranks: _Optional[_Iterable[_Union[RankStep, _Mapping]]] = ...) -> None: ...

class StepReportResponse(_message.Message):
    __slots__ = ("accepted",)
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    def __init__(self, accepted: _Optional[bool] = ...) -> None: ...
