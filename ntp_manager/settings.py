"""Manager settings: environment variables with prefix NTP_, optionally a YAML config file.

Precedence (highest first): explicit arguments, environment (NTP_...), the file named by
NTP_CONFIG_FILE, defaults. Everything binds to loopback unless told otherwise.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict, YamlConfigSettingsSource


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="NTP_", extra="forbid", allow_inf_nan=False)

    data_dir: Path = Path("data")
    database_url: str | None = None  # default: SQLite file under data_dir
    http_host: str = "127.0.0.1"
    http_port: int = Field(8080, ge=0, le=65535)
    grpc_host: str = "127.0.0.1"
    grpc_port: int = Field(50051, ge=0, le=65535)
    heartbeat_interval_s: float = Field(2.0, gt=0)
    suspect_after_s: float = Field(6.0, gt=0)  # missed heartbeats -> suspect
    fail_after_s: float = Field(20.0, gt=0)  # still silent -> failed
    breaker_share: float = Field(0.2, gt=0, le=1)  # more than this share failing within the window...
    breaker_window_s: float = Field(60.0, gt=0)  # ...opens the circuit breaker
    breaker_min_gpus: int = Field(4, ge=1)  # never trip on fewer failures than this
    # Fleet base power cap: healthy GPUs run at this share of their maximum limit (never above their
    # default), so that reduced TP groups can be boosted up to the maximum (docs/planner.md).
    power_base_cap: float | None = Field(None, gt=0, le=1)
    log_format: str = Field("console", pattern="^(console|json)$")
    leader_id: str = Field(default_factory=lambda: f"{os.uname().nodename}:{os.getpid()}", min_length=1,
                           max_length=200)
    # Several managers on PostgreSQL (service/leader.py, docs/operations.md): the leader renews its
    # lease every `lease_renew_s`; a standby takes over once `lease_ttl_s` passed without a renewal
    # (the database's clock). A new leader gives agents `takeover_grace_s` to reconnect before it
    # counts any node's silence against its GPUs.
    lease_ttl_s: float = Field(10.0, gt=0, le=3600)
    lease_renew_s: float = Field(3.0, gt=0)
    takeover_grace_s: float = Field(30.0, ge=0, le=3600)
    # what clients of a standby are told (default: the bound host and port, as this manager sees them)
    advertise_http: str | None = Field(None, max_length=500)
    advertise_grpc: str | None = Field(None, max_length=500)
    # sizes: what this manager's cluster can hold; larger inventories and jobs are refused
    max_cluster_gpus: int = Field(100_000, ge=1, le=4_194_304)
    max_request_bytes: int = Field(4 * 2**20, ge=1024, le=2**30)  # REST bodies; larger -> 413
    token_poll_s: float = Field(0.25, gt=0, le=5)  # token changes made elsewhere show within this
    loop_warn_ms: float = Field(100.0, gt=0)  # event-loop watchdog warns above this
    # plan in a process of its own (service/planproc.py); off, or where none can start: a thread
    plan_process: bool = True
    # group commit: reports, heartbeat transitions and hellos queued while a commit runs go into the
    # next one; an idle committer first waits this long for more (0: commit at once)
    group_commit_window_ms: float = Field(1.0, ge=0, le=5)
    # gRPC TLS: server certificate and key (PEM); with a client CA, agents must present a
    # certificate it signed (mTLS). See docs/security.md.
    grpc_tls_host: str | None = None  # default: grpc_host
    grpc_tls_port: int = Field(50052, ge=0, le=65535)
    grpc_tls_cert: Path | None = None
    grpc_tls_key: Path | None = None
    grpc_tls_client_ca: Path | None = None

    @field_validator("fail_after_s")
    @classmethod
    def _fail_after_suspect(cls, v: float, info: Any) -> float:
        suspect = info.data.get("suspect_after_s")
        if suspect is not None and v <= suspect:
            raise ValueError("fail_after_s must be greater than suspect_after_s")
        return v

    @model_validator(mode="after")
    def _lease(self) -> Settings:
        if self.lease_renew_s * 2 > self.lease_ttl_s:
            raise ValueError(f"lease_renew_s ({self.lease_renew_s}) must be at most half of lease_ttl_s "
                             f"({self.lease_ttl_s}): a leader must get at least two tries before its lease ends")
        return self

    @model_validator(mode="after")
    def _tls_pair(self) -> Settings:
        if (self.grpc_tls_cert is None) != (self.grpc_tls_key is None):
            raise ValueError("grpc_tls_cert and grpc_tls_key go together")
        if self.grpc_tls_client_ca is not None and self.grpc_tls_cert is None:
            raise ValueError("grpc_tls_client_ca needs grpc_tls_cert and grpc_tls_key (mTLS runs over TLS)")
        return self

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        config_file = os.environ.get("NTP_CONFIG_FILE")
        if config_file:
            sources.append(YamlConfigSettingsSource(settings_cls, yaml_file=config_file))
        return tuple(sources)

    @property
    def effective_database_url(self) -> str:
        if self.database_url:
            return self.database_url
        return f"sqlite+aiosqlite:///{(self.data_dir / 'ntp-manager.db').resolve()}"
