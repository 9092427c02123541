"""Manager settings: environment variables with prefix NTP_, optionally a YAML config file.

Precedence (highest first): explicit arguments, environment (NTP_...), the file named by
NTP_CONFIG_FILE, defaults. Everything binds to loopback unless told otherwise.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict, YamlConfigSettingsSource


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="NTP_", extra="forbid")

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
    unary_deadline_s: float = Field(10.0, gt=0)
    # Fleet base power cap: healthy GPUs run at this share of their maximum limit (never above their
    # default), so that reduced TP groups can be boosted up to the maximum (docs/planner.md).
    power_base_cap: float | None = Field(None, gt=0, le=1)
    log_format: str = Field("console", pattern="^(console|json)$")
    leader_id: str = Field(default_factory=lambda: f"{os.uname().nodename}:{os.getpid()}")

    @field_validator("fail_after_s")
    @classmethod
    def _fail_after_suspect(cls, v: float, info: Any) -> float:
        suspect = info.data.get("suspect_after_s")
        if suspect is not None and v <= suspect:
            raise ValueError("fail_after_s must be greater than suspect_after_s")
        return v

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
