"""What agents and workers tell the manager, on its way in: the doors the gRPC edge comes in by
(doors.py), agent sessions and their group commit (agents.py), the outbox that every manager on
PostgreSQL stores into (outbox.py) and that the leader applies in order (consumer.py), liveness,
agents' GPU counters and workers' acks and step reports."""
