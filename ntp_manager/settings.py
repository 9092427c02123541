"""Manager settings: environment variables with prefix NTP_, optionally a YAML config file.

Precedence (highest first): explicit arguments, environment (NTP_...), the file named by
NTP_CONFIG_FILE, defaults. Everything binds to loopback unless told otherwise.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict, YamlConfigSettingsSource


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="NTP_", extra="forbid", allow_inf_nan=False)

    # Every field's description is its line in docs/settings.md (tools/settings_doc.py writes it).
    data_dir: Path = Field(Path("data"), description="directory of the SQLite file `ntp-manager.db` (and its lock)")
    database_url: str | None = Field(None, description="SQLAlchemy URL, e.g. `postgresql+asyncpg://user@host/db` "
                                     "(several managers need PostgreSQL); default: SQLite in `data_dir`")
    http_host: str = Field("127.0.0.1", description="REST and dashboard bind address (loopback unless told otherwise)")
    http_port: int = Field(8080, ge=0, le=65535, description="REST port (0: any free port)")
    grpc_host: str = Field("127.0.0.1", description="gRPC bind address (agents and workers)")
    grpc_port: int = Field(50051, ge=0, le=65535, description="plaintext gRPC port (0: any free port)")
    event_loop: Literal["uvloop", "asyncio"] = Field(
        "uvloop", description="the event loop `ntp-manager serve` runs on: `uvloop` (libuv; a tenth less CPU per agent "
        "report and per hello than the standard loop, bench/RESULTS.md) or `asyncio` (the standard library's)")
    heartbeat_interval_s: float = Field(2.0, gt=0, description="the liveness period: every open agent stream's "
                                        "connection is pinged this often (a stopped or unreachable agent's stream "
                                        "ends), its node counted as heard from, and the liveness check paced; agents "
                                        "read their GPU counters this often (told in the welcome)")
    heartbeat_max_quiet_s: float = Field(30.0, gt=0, description="an agent whose GPU counters do not change "
                                         "materially sends a heartbeat at least this often (told in the welcome; "
                                         "sooner when they change); an open stream silent for three times this is "
                                         "ended as stuck (must be at least `heartbeat_interval_s`)")
    suspect_after_s: float = Field(6.0, gt=0, description="a node silent this long makes its healthy GPUs suspect "
                                   "(still placeable)")
    fail_after_s: float = Field(20.0, gt=0, description="a node silent this long fails its GPUs "
                                "(must exceed `suspect_after_s`)")
    breaker_share: float = Field(0.2, gt=0, le=1, description="circuit breaker: more than this share of the GPUs "
                                 "failing within `breaker_window_s` stops automatic replanning")
    breaker_window_s: float = Field(60.0, gt=0, description="circuit breaker: the window failures are counted in")
    breaker_min_gpus: int = Field(4, ge=1, description="circuit breaker: never trips on fewer failures than this")
    # Fleet base power cap: healthy GPUs run at this share of their maximum limit (never above their
    # default), so that reduced TP groups can be boosted up to the maximum (docs/planner.md).
    power_base_cap: float | None = Field(None, gt=0, le=1, description="fleet base power cap as a share of each "
                                         "GPU's max limit (e.g. 0.85); boosted GPUs may go up to the max; "
                                         "unset: no base cap")
    log_format: str = Field("console", pattern="^(console|json)$", description="`console`, or `json` for production "
                            "(structlog)")
    leader_id: str = Field(default_factory=lambda: f"{os.uname().nodename}:{os.getpid()}", min_length=1,
                           max_length=200, description="this manager's name in the lease row and the database "
                           "sessions")
    # Several managers on PostgreSQL (service/leadership/leader.py, docs/operations.md): the leader renews its
    # lease every `lease_renew_s`; a standby takes over once `lease_ttl_s` passed without a renewal
    # (the database's clock). A new leader gives agents `takeover_grace_s` to reconnect before it
    # counts any node's silence against its GPUs.
    lease_ttl_s: float = Field(10.0, gt=0, le=3600, description="several managers: a standby takes over once the "
                               "lease went this long without a renewal")
    lease_renew_s: float = Field(3.0, gt=0, description="several managers: the leader renews its lease this often "
                                 "(at most half of `lease_ttl_s`)")
    takeover_grace_s: float = Field(30.0, ge=0, le=3600, description="a new leader counts every node as seen for "
                                    "this long before silence counts")
    # what clients of a standby are told (default: the bound host and port, as this manager sees them)
    advertise_http: str | None = Field(None, max_length=500, description="the REST address a standby names to "
                                       "clients; default: the bound host and port (a wildcard bind: the host name)")
    advertise_grpc: str | None = Field(None, max_length=500, description="the gRPC address a standby names to "
                                       "agents and workers; default as for `advertise_http`")
    # sizes: what this manager's cluster can hold; larger inventories and jobs are refused
    max_cluster_gpus: int = Field(100_000, ge=1, le=4_194_304, description="the most GPUs this manager holds: "
                                  "inventories and jobs past it are refused")
    max_request_bytes: int = Field(4 * 2**20, ge=1024, le=2**30, description="REST bodies past this get 413 (read "
                                   "only after the token checks out)")
    token_poll_s: float = Field(0.25, gt=0, le=5, description="tokens made or revoked elsewhere (CLI, another "
                                "manager) take effect within this")
    loop_warn_ms: float = Field(100.0, gt=0, description="the event-loop watchdog warns, with the stack, when a "
                                "callback holds the loop longer")
    # plan in a process of its own (service/planning/planproc.py); off, or where none can start: a thread
    plan_process: bool = Field(True, description="plan in a long-lived process of its own (false, or where none "
                               "can start: in a thread)")
    # group commit: reports, heartbeat transitions and hellos queued while a commit runs go into the
    # next one; an idle committer first waits this long for more (0: commit at once)
    # deprecated (one release): on PostgreSQL every manager takes agents and watches, always
    fleet_ingest: bool | None = Field(None, description="deprecated and ignored: on PostgreSQL every manager, "
                                      "standbys too, takes agent streams and layout watches and the leader "
                                      "applies the outbox (there is no other mode); to be removed")
    fleet_poll_s: float = Field(0.5, gt=0, le=10, description="fleet mode: the leader looks for outbox rows (and every "
                                "manager for agent commands) at least this often, without a notification")
    fleet_store_timeout_s: float = Field(5.0, gt=0, le=60, description="fleet mode: a manager that cannot store a "
                                         "report within this answers UNAVAILABLE (the agent goes to another)")
    fleet_balance_s: float = Field(30.0, ge=0, description="fleet mode: how often a manager compares the agent "
                                   "streams and layout watches it holds with its share (their total over the "
                                   "managers alive) and tells those over it to move to the manager holding the "
                                   "fewest (service/leadership/balance.py); 0: never")
    fleet_balance_tolerance: float = Field(0.1, ge=0, le=10, description="fleet mode: a manager moves clients only "
                                           "once it holds more than its share plus this fraction of it")
    fleet_balance_max: int = Field(500, ge=1, description="fleet mode: the most streams of each kind (agents, "
                                   "watches) a manager tells to move in one balance pass")
    fleet_balance_busy_rows: int = Field(1024, ge=0, description="fleet mode: a manager with more rows of work "
                                         "queued than this (reports and hellos waiting for its group commit; on "
                                         "the leader, outbox rows not applied yet) is sent no clients until it "
                                         "has caught up")
    fleet_apply_window_ms: float = Field(50.0, ge=0, le=1000, description="fleet mode: after applying a batch "
                                         "of outbox rows smaller than a full one, the leader waits this long for "
                                         "more before it reads again (one transaction per window under load; the "
                                         "first row after an idle period is applied at once; 0: no wait)")
    fleet_follow_max_lag_rows: int = Field(2000, ge=0, description="a manager that does not lead and whose copy "
                                           "of the world is more than this many rows of the leader's world log "
                                           "behind is given no new agents or watches (/readyz, gRPC health, the "
                                           "balance) until it has caught up")
    fleet_outbox_retention_s: float = Field(600.0, ge=10, le=30 * 86_400, description="fleet mode: the leader "
                                            "deletes outbox rows it applied longer ago than this (quarantined ones "
                                            "stay)")
    fleet_command_retention_s: float = Field(300.0, ge=10, le=86_400, description="fleet mode: the leader deletes "
                                             "agent_commands rows older than this (every manager reads new ones "
                                             "within `fleet_poll_s`; an agent that reconnects is sent its caps again)")
    group_commit_window_ms: float = Field(1.0, ge=0, le=5, description="group commit: an idle committer waits this "
                                          "long for more reports before it commits (0: at once)")
    # gRPC TLS: server certificate and key (PEM); with a client CA, agents must present a
    # certificate it signed (mTLS). See docs/security.md.
    grpc_tls_host: str | None = Field(None, description="TLS gRPC bind address; default: `grpc_host`")
    grpc_tls_port: int = Field(50052, ge=0, le=65535, description="TLS gRPC port, served beside the plaintext one "
                               "when `grpc_tls_cert` is set (0: any free port)")
    grpc_tls_cert: Path | None = Field(None, description="server certificate (PEM) for gRPC TLS; with "
                                       "`grpc_tls_key`")
    grpc_tls_key: Path | None = Field(None, description="its private key (PEM)")
    grpc_tls_client_ca: Path | None = Field(None, description="CA (PEM) that signs agents' client certificates: "
                                            "mTLS, required of agents on the TLS port")

    # Slurm (service/operations/slurm.py, docs/slurm.md): drain the nodes whose GPUs need a person, resume them
    # when repaired; only nodes ntp-manager drained itself (the reason starts with "ntp-manager:")
    slurm_drain: bool = Field(False, description="drain Slurm nodes whose GPUs need a person (failed by their agent, "
                              "in maintenance, degraded for `slurm_degraded_after_s`) and resume them when they are "
                              "fine again (docs/slurm.md)")
    slurm_dry_run: bool = Field(False, description="with `slurm_drain`: only log and audit what would be drained or "
                                "resumed (`slurm.would_drain`, `slurm.would_resume`)")
    slurm_conf: Path | None = Field(None, description="SLURM_CONF for the Slurm commands; default: Slurm's own "
                                    "(the environment, /etc/slurm/slurm.conf)")
    slurm_bin_dir: Path | None = Field(None, description="directory of `scontrol` and `sinfo`; default: the PATH")
    slurm_timeout_s: float = Field(10.0, gt=0, le=300, description="a Slurm command running longer is killed "
                                   "(and retried)")
    slurm_retries: int = Field(3, ge=0, le=10, description="retries of a failed Slurm command, with exponential "
                               "backoff and jitter")
    slurm_backoff_s: float = Field(1.0, gt=0, le=60, description="the first retry's delay; it doubles, up to 30 s")
    slurm_poll_s: float = Field(30.0, gt=0, le=3600, description="Slurm's drained nodes are read at least this often "
                                "(and whenever GPUs change)")
    slurm_max_drains: int = Field(4, ge=1, le=100_000, description="at most this many drains within "
                                  "`breaker_window_s`; more wait their turn (a rack event cannot drain a partition "
                                  "at once)")
    slurm_degraded_after_s: float = Field(3600.0, ge=0, description="a GPU degraded (fail-slow, throttling) this long "
                                          "drains its node (0: never)")
    slurm_audit_url: str | None = Field(None, max_length=500, description="base URL of the REST API in drain reasons' "
                                        "audit links; default: the advertised REST address")

    @field_validator("heartbeat_max_quiet_s")
    @classmethod
    def _quiet_at_least_the_period(cls, v: float, info: Any) -> float:
        period = info.data.get("heartbeat_interval_s")
        if period is not None and v < period:
            raise ValueError("heartbeat_max_quiet_s must be at least heartbeat_interval_s")
        return v

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
    def _slurm(self) -> Settings:
        if self.slurm_dry_run and not self.slurm_drain:
            raise ValueError("slurm_dry_run needs slurm_drain (set both to see what would be drained)")
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
            # a file that is not there is an error, not an empty configuration (pydantic-settings
            # would skip it silently, and the manager would run on defaults)
            if not Path(config_file).is_file():
                raise ValueError(f"NTP_CONFIG_FILE={config_file}: no such file")
            try:
                doc = yaml.safe_load(Path(config_file).read_text())
            except (yaml.YAMLError, UnicodeDecodeError) as e:
                raise ValueError(f"NTP_CONFIG_FILE={config_file}: not YAML ({' '.join(str(e).split())})") from None
            if doc is not None and not isinstance(doc, dict):
                raise ValueError(f"NTP_CONFIG_FILE={config_file}: expected a mapping of setting names to values")
            sources.append(YamlConfigSettingsSource(settings_cls, yaml_file=config_file))
        return tuple(sources)

    @property
    def deprecations(self) -> list[str]:
        """Lines the manager logs at start for settings that are accepted but no longer do anything."""
        out = []
        if self.fleet_ingest is not None:
            out.append("fleet_ingest (NTP_FLEET_INGEST) is deprecated and ignored: every manager on PostgreSQL "
                       "takes agent streams and layout watches; remove it from the configuration")
        return out

    @property
    def shared_store(self) -> bool:
        """PostgreSQL: several managers share the store (one leads); SQLite: one manager alone."""
        return self.effective_database_url.startswith("postgresql")

    @property
    def effective_database_url(self) -> str:
        if self.database_url:
            return self.database_url
        return f"sqlite+aiosqlite:///{(self.data_dir / 'ntp-manager.db').resolve()}"
