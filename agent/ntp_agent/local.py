"""Agents on fake backends inside the calling process: the agent's entry point for demos and examples.

    fleet = FakeFleet("127.0.0.1:50051", {"node-a": token_a, "node-b": token_b},
                      [FakeNode("node-a", "nvl-0"), FakeNode("node-b", "nvl-1")])
    while not fleet.ready(): ...               # the manager welcomed every agent
    fleet.inject("node-a", "xid", 3, xid=48)   # GPU 3 of node-a reports XID 48 now
    fleet.stop()

Each node runs the real agent (`ntp_agent.core.Agent`) on a `FakeBackend`; all of them share one
event loop on a background thread. `ntp-agent --backend fake --scenario FILE` is the same agent
as a process, with faults on a schedule instead of injected live.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from ntp_agent.backends.fake import FakeBackend, FaultKind, parse_scenario
from ntp_agent.core import Agent, AgentConfig


@dataclass(frozen=True)
class FakeNode:
    name: str
    domain: str
    gpus: int = 4
    seed: int = 1  # with the node name, fixes the GPUs' UUIDs


async def _as_node(node: str, agent: Agent) -> None:
    """Run `agent` with `node` bound for its log lines: the agents share one process, and a demo
    writes each node's lines to a file of its own (ntp_manager.contract.logs.RoutedFiles). The binding is
    this task's own (gather gives each agent a task with a copy of the context), and reaches the
    tasks and threads it starts."""
    structlog.contextvars.bind_contextvars(node=node)
    await agent.run()


class FakeFleet:
    """Starts one agent per node at once; `tokens[name]` is the agent token made for that node;
    `state_file` (with `{node}` in it) gives each agent a local state file (agent/ntp_agent/state.py).
    Raises KeyError for a node without a token and ScenarioError for a GPU count out of range."""

    def __init__(self, manager: str, tokens: Mapping[str, str], nodes: Sequence[FakeNode], *,
                 heartbeat_interval_s: float = 1.0, sample_interval_s: float = 0.2, xid_wait_s: float = 0.05,
                 state_file: str | Path | None = None) -> None:
        self._backends: dict[str, FakeBackend] = {}
        self._agents: dict[str, Agent] = {}
        for n in nodes:
            backend = FakeBackend(parse_scenario({"seed": n.seed, "gpus": n.gpus, "faults": []}), node=n.name)
            cfg = AgentConfig(manager=manager, token=tokens[n.name], node=n.name, domain=n.domain,
                              heartbeat_interval_s=heartbeat_interval_s, sample_interval_s=sample_interval_s,
                              xid_wait_s=xid_wait_s, state_file=Path(state_file) if state_file else None)
            self._backends[n.name] = backend
            self._agents[n.name] = Agent(backend, cfg)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, daemon=True, name="fake-agents")
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(asyncio.gather(*(_as_node(n, a) for n, a in self._agents.items())))
        finally:
            self._loop.run_until_complete(self._loop.shutdown_asyncgens())
            self._loop.close()

    def ready(self) -> bool:
        """Whether the manager has welcomed every node's agent at least once."""
        return all(a.registered.is_set() for a in self._agents.values())

    def gpus(self, node: str) -> list[str]:
        """The UUIDs of a node's GPUs, by local index."""
        return [g.uuid for g in self._backends[node].gpus()]

    def inject(self, node: str, kind: FaultKind, gpu: int, **fields: Any) -> None:
        """A fault on GPU `gpu` (local index) of `node`, now: the fields of a scenario fault
        (`xid=48`, `links=2`, `factor=0.7`, ...); `kind="repair"` clears the GPU."""
        self._backends[node].inject(kind, gpu, **fields)

    def stop(self, timeout_s: float = 15.0) -> None:
        """Stop every agent (each restores the power limits it set) and wait for the thread."""
        for a in self._agents.values():
            with contextlib.suppress(RuntimeError):  # the loop has ended already (and is closed)
                self._loop.call_soon_threadsafe(a.stopping.set)
        self._thread.join(timeout_s)
