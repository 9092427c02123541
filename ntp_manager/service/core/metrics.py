"""Prometheus metrics of the manager (one registry per Manager, so tests can run several)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ntp_manager.service.core.steps import StepWindow

# What the step collector reads at each scrape: (job, current layout version, its window).
StepSource = Callable[[], Iterable[tuple[str, int, StepWindow]]]
# What the group-commit collector reads: (group commits made, items they carried).
CommitSource = Callable[[], tuple[int, int]]


class CommitCollector(Collector):
    """The kernel's group commits and the items (registrations, reports, ...) they carried, read at
    scrape time: items per commit says how well the work groups (one commit per item costs a
    transaction's round trips each)."""

    def __init__(self, source: CommitSource) -> None:
        self.source = source

    def collect(self) -> Iterator[Metric]:
        batches, items = self.source()
        yield CounterMetricFamily("ntp_group_commits", "group commits made", value=batches)
        yield CounterMetricFamily("ntp_group_commit_items", "items the group commits carried", value=items)


class StepCollector(Collector):
    """Step time per replica and per stage of each job's current layout, over its step window
    (service/core/steps.py), read at scrape time: the label sets follow the layout, none go stale."""

    def __init__(self, source: StepSource) -> None:
        self.source = source

    def collect(self) -> Iterator[Metric]:
        rep = GaugeMetricFamily("ntp_job_replica_step_seconds",
                                "mean step time of a replica's ranks over the step window (current layout)",
                                labels=["job", "replica"])
        rep_n = GaugeMetricFamily("ntp_job_replica_step_samples", "rank steps behind ntp_job_replica_step_seconds",
                                  labels=["job", "replica"])
        stage = GaugeMetricFamily("ntp_job_stage_step_seconds",
                                  "mean step time of a pipeline stage's ranks over the step window (current layout)",
                                  labels=["job", "stage"])
        wait = GaugeMetricFamily("ntp_job_stage_comm_wait_seconds",
                                 "mean TP communication wait of a stage's ranks over the step window",
                                 labels=["job", "stage"])
        for job, version, window in self.source():
            for r, v in window.per_replica(version).items():
                rep.add_metric([job, str(r)], v["mean_step_s"])
                rep_n.add_metric([job, str(r)], v["samples"])
            for st, v in window.per_stage(version).items():
                stage.add_metric([job, str(st)], v["mean_step_s"])
                wait.add_metric([job, str(st)], v["mean_comm_wait_s"])
        yield from (rep, rep_n, stage, wait)

    def describe(self) -> Iterator[Metric]:
        return iter(())  # families depend on the jobs: collected at scrape time only


class Metrics:
    def __init__(self, steps: StepSource | None = None, commits: CommitSource | None = None) -> None:
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
        self.pool_gpus = Gauge("ntp_pool_gpus", "GPUs of the domains no job owns (the free pool)", registry=r)
        self.pool_reserved_gpus = Gauge("ntp_pool_reserved_gpus", "GPUs of free domains held for the jobs' "
                                        "outstanding spares reservations", registry=r)
        self.pending_jobs = Gauge("ntp_jobs_pending", "jobs waiting for capacity (queue: true)", registry=r)
        self.breaker = Gauge("ntp_circuit_breaker_open", "1 while automatic replanning is stopped", registry=r)
        self.watchers = Gauge("ntp_layout_watchers", "open layout watch streams", registry=r)
        self.restores = Counter("ntp_checkpoint_restores_total",
                                "layout versions the workers applied by restoring a checkpoint", ["job"], registry=r)
        self.agents = Gauge("ntp_agents_connected", "connected agent streams", registry=r)
        if steps is not None:
            r.register(StepCollector(steps))
        if commits is not None:
            r.register(CommitCollector(commits))
