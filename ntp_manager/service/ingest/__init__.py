"""What agents and workers tell the manager, on its way in: the doors the gRPC edge comes in by
(doors.py), agent sessions and what applying a hello or a report writes (agents.py), the outbox
port (port.py: the PostgreSQL table, outbox.py, or memory for one manager on SQLite) that every
manager hands its agents' news to and that the leader applies in order (consumer.py), liveness,
agents' GPU counters and workers' acks and step reports."""
