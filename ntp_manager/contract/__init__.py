"""What crosses a process boundary between the manager, its agents and the workers.

Each of the three imports the others only through this package (tests/unit/test_layering.py):

- `contract.tls`: client TLS/mTLS credentials from PEM files (`TlsFiles`, `channel_credentials`).
- `contract.client`: the one manager client the agent and the worker share: channels with the
  keepalive options, TLS, the addresses of a leader and its standbys, leader hints and failover.
- `contract.ranks`: how global ranks number the GPUs (replica by replica, stage by stage), which
  the planner and the workers must agree on; standard library only (the planner imports it).
- `contract.ntp_map`: the map of a layer's units onto a TP group's ranks, and the sync groups
  between TP degrees; standard library only (the planner imports it).
- `contract.layout`: a worker's view of a layout version on the wire (`WireLayout`) and its codec
  to and from `ntp.v1.Layout`: the manager encodes with it (rpc/views.py), the workers decode with it.
- `contract.gpu`: GPU states (`GpuState`), which agents report and the manager plans with;
  standard library only (topology imports it).
- `contract.power`: the fleet base power cap's arithmetic (`base_cap_w`), which `ntp-agent
  power-reset` and the manager must agree on; standard library only (topology imports it).
- `contract.checkpoint_format`: the on-disk names and manifest of unit-addressed checkpoints,
  which the workers write and the manager lists; standard library only.
- `contract.limits`: the sizes and ranges every input is held to (what the wire and the REST
  edge accept, what ntp-run derives names within); standard library only.
- `contract.logs`: the log line format all three processes write (structlog, text or JSON).
- `contract.usage`: how the command lines answer bad input (one line, exit 2); needs typer, which
  the `[manager]` extra and the agent's distribution carry (the worker's ntp-run uses argparse).
- `contract.proto`: the generated gRPC stubs of proto/ntp/v1 (`make proto`; ntp_manager/protogen.py),
  the wire itself.

Nothing here imports FastAPI, SQLAlchemy or torch: a worker's or an agent's installation (the base
of `nonuniform-tp-manager`, from this repository's wheels: docs/install.md) has what this package needs.
"""
