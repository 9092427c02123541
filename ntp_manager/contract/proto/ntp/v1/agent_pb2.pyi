import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from ntp_manager.contract.proto.ntp.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class AgentMessage(_message.Message):
    __slots__ = ("hello", "report", "heartbeat", "result")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    REPORT_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    hello: Hello
    report: HealthReport
    heartbeat: Heartbeat
    result: CommandResult
    def __init__(self, hello: _Optional[_Union[Hello, _Mapping]] = ..., report: _Optional[_Union[HealthReport, _Mapping]] = ..., heartbeat: _Optional[_Union[Heartbeat, _Mapping]] = ..., result: _Optional[_Union[CommandResult, _Mapping]] = ...) -> None: ...

class Hello(_message.Message):
    __slots__ = ("node", "domain", "gpus", "agent_version", "boot_id", "next_seq")
    NODE_FIELD_NUMBER: _ClassVar[int]
    DOMAIN_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    AGENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    BOOT_ID_FIELD_NUMBER: _ClassVar[int]
    NEXT_SEQ_FIELD_NUMBER: _ClassVar[int]
    node: str
    domain: str
    gpus: _containers.RepeatedCompositeFieldContainer[_common_pb2.GpuInfo]
    agent_version: str
    boot_id: str
    next_seq: int
    def __init__(self, node: _Optional[str] = ..., domain: _Optional[str] = ..., gpus: _Optional[_Iterable[_Union[_common_pb2.GpuInfo, _Mapping]]] = ..., agent_version: _Optional[str] = ..., boot_id: _Optional[str] = ..., next_seq: _Optional[int] = ...) -> None: ...

class XidEvent(_message.Message):
    __slots__ = ("xid", "at", "detail")
    XID_FIELD_NUMBER: _ClassVar[int]
    AT_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    xid: int
    at: _timestamp_pb2.Timestamp
    detail: str
    def __init__(self, xid: _Optional[int] = ..., at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., detail: _Optional[str] = ...) -> None: ...

class PowerReading(_message.Message):
    __slots__ = ("desired_mw", "enforced_mw", "usage_mw")
    DESIRED_MW_FIELD_NUMBER: _ClassVar[int]
    ENFORCED_MW_FIELD_NUMBER: _ClassVar[int]
    USAGE_MW_FIELD_NUMBER: _ClassVar[int]
    desired_mw: int
    enforced_mw: int
    usage_mw: int
    def __init__(self, desired_mw: _Optional[int] = ..., enforced_mw: _Optional[int] = ..., usage_mw: _Optional[int] = ...) -> None: ...

class GpuHealth(_message.Message):
    __slots__ = ("uuid", "state", "reasons", "xids", "ecc_uncorrected", "ecc_corrected", "remapped_rows_pending", "clock_event_reasons", "temperature_c", "nvlink_down", "power")
    UUID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    REASONS_FIELD_NUMBER: _ClassVar[int]
    XIDS_FIELD_NUMBER: _ClassVar[int]
    ECC_UNCORRECTED_FIELD_NUMBER: _ClassVar[int]
    ECC_CORRECTED_FIELD_NUMBER: _ClassVar[int]
    REMAPPED_ROWS_PENDING_FIELD_NUMBER: _ClassVar[int]
    CLOCK_EVENT_REASONS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_C_FIELD_NUMBER: _ClassVar[int]
    NVLINK_DOWN_FIELD_NUMBER: _ClassVar[int]
    POWER_FIELD_NUMBER: _ClassVar[int]
    uuid: str
    state: _common_pb2.GpuState
    reasons: _containers.RepeatedScalarFieldContainer[str]
    xids: _containers.RepeatedCompositeFieldContainer[XidEvent]
    ecc_uncorrected: int
    ecc_corrected: int
    remapped_rows_pending: int
    clock_event_reasons: int
    temperature_c: int
    nvlink_down: int
    power: PowerReading
    def __init__(self, uuid: _Optional[str] = ..., state: _Optional[_Union[_common_pb2.GpuState, str]] = ..., reasons: _Optional[_Iterable[str]] = ..., xids: _Optional[_Iterable[_Union[XidEvent, _Mapping]]] = ..., ecc_uncorrected: _Optional[int] = ..., ecc_corrected: _Optional[int] = ..., remapped_rows_pending: _Optional[int] = ..., clock_event_reasons: _Optional[int] = ..., temperature_c: _Optional[int] = ..., nvlink_down: _Optional[int] = ..., power: _Optional[_Union[PowerReading, _Mapping]] = ...) -> None: ...

class HealthReport(_message.Message):
    __slots__ = ("seq", "observed_at", "gpus")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    OBSERVED_AT_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    seq: int
    observed_at: _timestamp_pb2.Timestamp
    gpus: _containers.RepeatedCompositeFieldContainer[GpuHealth]
    def __init__(self, seq: _Optional[int] = ..., observed_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., gpus: _Optional[_Iterable[_Union[GpuHealth, _Mapping]]] = ...) -> None: ...

class Heartbeat(_message.Message):
    __slots__ = ("sent_at", "last_seq", "gpus")
    SENT_AT_FIELD_NUMBER: _ClassVar[int]
    LAST_SEQ_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    sent_at: _timestamp_pb2.Timestamp
    last_seq: int
    gpus: _containers.RepeatedCompositeFieldContainer[GpuTelemetry]
    def __init__(self, sent_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., last_seq: _Optional[int] = ..., gpus: _Optional[_Iterable[_Union[GpuTelemetry, _Mapping]]] = ...) -> None: ...

class GpuTelemetry(_message.Message):
    __slots__ = ("uuid", "clock_event_reasons", "sm_clock_mhz", "sm_clock_max_mhz", "usage_mw", "limit_mw", "temperature_c", "ecc_corrected", "ecc_uncorrected", "nvlink_replay", "nvlink_recovery", "nvlink_crc", "nvlink_down")
    UUID_FIELD_NUMBER: _ClassVar[int]
    CLOCK_EVENT_REASONS_FIELD_NUMBER: _ClassVar[int]
    SM_CLOCK_MHZ_FIELD_NUMBER: _ClassVar[int]
    SM_CLOCK_MAX_MHZ_FIELD_NUMBER: _ClassVar[int]
    USAGE_MW_FIELD_NUMBER: _ClassVar[int]
    LIMIT_MW_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_C_FIELD_NUMBER: _ClassVar[int]
    ECC_CORRECTED_FIELD_NUMBER: _ClassVar[int]
    ECC_UNCORRECTED_FIELD_NUMBER: _ClassVar[int]
    NVLINK_REPLAY_FIELD_NUMBER: _ClassVar[int]
    NVLINK_RECOVERY_FIELD_NUMBER: _ClassVar[int]
    NVLINK_CRC_FIELD_NUMBER: _ClassVar[int]
    NVLINK_DOWN_FIELD_NUMBER: _ClassVar[int]
    uuid: str
    clock_event_reasons: int
    sm_clock_mhz: int
    sm_clock_max_mhz: int
    usage_mw: int
    limit_mw: int
    temperature_c: int
    ecc_corrected: int
    ecc_uncorrected: int
    nvlink_replay: int
    nvlink_recovery: int
    nvlink_crc: int
    nvlink_down: int
    def __init__(self, uuid: _Optional[str] = ..., clock_event_reasons: _Optional[int] = ..., sm_clock_mhz: _Optional[int] = ..., sm_clock_max_mhz: _Optional[int] = ..., usage_mw: _Optional[int] = ..., limit_mw: _Optional[int] = ..., temperature_c: _Optional[int] = ..., ecc_corrected: _Optional[int] = ..., ecc_uncorrected: _Optional[int] = ..., nvlink_replay: _Optional[int] = ..., nvlink_recovery: _Optional[int] = ..., nvlink_crc: _Optional[int] = ..., nvlink_down: _Optional[int] = ...) -> None: ...

class CommandResult(_message.Message):
    __slots__ = ("command_id", "ok", "detail", "power", "gpu_uuids")
    COMMAND_ID_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    POWER_FIELD_NUMBER: _ClassVar[int]
    GPU_UUIDS_FIELD_NUMBER: _ClassVar[int]
    command_id: int
    ok: bool
    detail: str
    power: _containers.RepeatedCompositeFieldContainer[PowerReading]
    gpu_uuids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, command_id: _Optional[int] = ..., ok: _Optional[bool] = ..., detail: _Optional[str] = ..., power: _Optional[_Iterable[_Union[PowerReading, _Mapping]]] = ..., gpu_uuids: _Optional[_Iterable[str]] = ...) -> None: ...

class ManagerMessage(_message.Message):
    __slots__ = ("welcome", "ack", "set_power", "release_power", "drain", "command_id")
    WELCOME_FIELD_NUMBER: _ClassVar[int]
    ACK_FIELD_NUMBER: _ClassVar[int]
    SET_POWER_FIELD_NUMBER: _ClassVar[int]
    RELEASE_POWER_FIELD_NUMBER: _ClassVar[int]
    DRAIN_FIELD_NUMBER: _ClassVar[int]
    COMMAND_ID_FIELD_NUMBER: _ClassVar[int]
    welcome: Welcome
    ack: ReportAck
    set_power: SetPowerLimit
    release_power: ReleasePowerLimit
    drain: Drain
    command_id: int
    def __init__(self, welcome: _Optional[_Union[Welcome, _Mapping]] = ..., ack: _Optional[_Union[ReportAck, _Mapping]] = ..., set_power: _Optional[_Union[SetPowerLimit, _Mapping]] = ..., release_power: _Optional[_Union[ReleasePowerLimit, _Mapping]] = ..., drain: _Optional[_Union[Drain, _Mapping]] = ..., command_id: _Optional[int] = ...) -> None: ...

class Welcome(_message.Message):
    __slots__ = ("leader_epoch", "last_applied_seq", "heartbeat_interval_ms", "heartbeat_max_quiet_ms")
    LEADER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    LAST_APPLIED_SEQ_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_MAX_QUIET_MS_FIELD_NUMBER: _ClassVar[int]
    leader_epoch: int
    last_applied_seq: int
    heartbeat_interval_ms: int
    heartbeat_max_quiet_ms: int
    def __init__(self, leader_epoch: _Optional[int] = ..., last_applied_seq: _Optional[int] = ..., heartbeat_interval_ms: _Optional[int] = ..., heartbeat_max_quiet_ms: _Optional[int] = ...) -> None: ...

class ReportAck(_message.Message):
    __slots__ = ("seq",)
    SEQ_FIELD_NUMBER: _ClassVar[int]
    seq: int
    def __init__(self, seq: _Optional[int] = ...) -> None: ...

class SetPowerLimit(_message.Message):
    __slots__ = ("gpu_uuid", "limit_mw", "reason")
    GPU_UUID_FIELD_NUMBER: _ClassVar[int]
    LIMIT_MW_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    gpu_uuid: str
    limit_mw: int
    reason: str
    def __init__(self, gpu_uuid: _Optional[str] = ..., limit_mw: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class ReleasePowerLimit(_message.Message):
    __slots__ = ("gpu_uuid",)
    GPU_UUID_FIELD_NUMBER: _ClassVar[int]
    gpu_uuid: str
    def __init__(self, gpu_uuid: _Optional[str] = ...) -> None: ...

class Drain(_message.Message):
    __slots__ = ("deadline", "reason")
    DEADLINE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    deadline: _timestamp_pb2.Timestamp
    reason: str
    def __init__(self, deadline: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., reason: _Optional[str] = ...) -> None: ...
