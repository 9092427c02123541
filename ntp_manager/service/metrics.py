"""Prometheus metrics of the manager (one registry per Manager, so tests can run several)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.gpus = Gauge("ntp_gpus", "GPUs by effective state", ["state"], registry=r)
        self.replicas = Gauge("ntp_job_replicas", "DP replicas in the current layout", ["job"], registry=r)
        self.replicas_by_tp = Gauge("ntp_job_replicas_by_tp", "replicas per TP degree", ["job", "tp"], registry=r)
        self.throughput = Gauge("ntp_job_relative_throughput", "plan throughput / target", ["job"], registry=r)
        self.layout_version = Gauge("ntp_job_layout_version", "current layout version", ["job"], registry=r)
        self.plan_seconds = Histogram(
            "ntp_plan_duration_seconds", "time to plan one job", registry=r,
            buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
        )
        self.pushes = Counter("ntp_layout_pushes_total", "layout messages sent to watchers", registry=r)
        self.ack_seconds = Histogram(
            "ntp_layout_ack_latency_seconds", "layout creation to worker ack", registry=r,
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
        )
        self.reports = Counter("ntp_agent_reports_total", "health reports applied", registry=r)
        self.heartbeats = Counter("ntp_agent_heartbeats_total", "heartbeats received", registry=r)
        self.breaker = Gauge("ntp_circuit_breaker_open", "1 while automatic replanning is stopped", registry=r)
        self.watchers = Gauge("ntp_layout_watchers", "open layout watch streams", registry=r)
        self.agents = Gauge("ntp_agents_connected", "connected agent streams", registry=r)
